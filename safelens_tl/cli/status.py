"""``safelens-tl status``: is the start-up hook installed and enabled, and what does it patch.

The command imports ``transformer_lens`` the way any program would, so the report shows what a
user's own ``import transformer_lens`` gets in this environment: patched by the hook, or stock.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import site
import sys
from pathlib import Path
from typing import Any

from safelens_tl import _startup

PTH_NAME = "safelens_tl.pth"
DISTRIBUTION = "safelens-tl"
EXIT_OK, EXIT_PROBLEM = 0, 1


def register(subcommands: Any) -> None:
    """Add the ``status`` subcommand to the parser."""
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "status",
        help="show whether the start-up hook is installed and enabled, and what it patches",
        description=(
            "Import transformer_lens as any program would and report what safelens-tl did. "
            "Exit code 1 when the hook should have patched TransformerLens but did not, or "
            "when something failed."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def _site_directories() -> list[Path]:
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [Path(folder) for folder in folders]


def _recorded_hook_files() -> list[Path]:
    """The hook file as the distribution's RECORD lists it (what pip uninstall removes)."""
    from importlib import metadata

    try:
        distribution = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return []
    files = distribution.files or []
    return [Path(str(distribution.locate_file(f))) for f in files if f.name == PTH_NAME]


def hook_files() -> list[str]:
    """Return the existing ``safelens_tl.pth`` files that ``site`` would process, once each."""
    candidates = [folder / PTH_NAME for folder in _site_directories()] + _recorded_hook_files()
    found: dict[str, None] = {}
    for candidate in candidates:
        if candidate.is_file():
            found.setdefault(str(candidate.resolve()), None)
    return list(found)


def _import_transformer_lens() -> tuple[bool, str | None]:
    try:
        importlib.import_module("transformer_lens")
    except Exception as error:  # report, never crash: this is what the user needs to see
        return False, f"{type(error).__name__}: {error}"
    return True, None


def collect() -> dict[str, Any]:
    """Import ``transformer_lens`` (which fires the hook when enabled) and build the report."""
    import safelens_tl
    from safelens_tl import targets

    importable, error = _import_transformer_lens()
    files = hook_files()
    activation = safelens_tl.status().to_dict()
    return {
        "hook": {
            "installed": bool(files),
            "files": files,
            "env_var": _startup.ENV_VAR,
            "env_value": os.environ.get(_startup.ENV_VAR),
            "enabled": _startup.enabled(),
            "state": _startup.state,
            "disable_var": _startup.DISABLE_VAR,
            "disable_value": os.environ.get(_startup.DISABLE_VAR),
        },
        "transformer_lens": {
            "importable": importable,
            "release": targets.installed_release(),
            "error": error,
        },
        "activation": activation,
        "changes": changes(activation["fixes"]),
        "cache": {"in_place_appends": _in_place_appends()},
    }


def changes(fixes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the fixes change here, by kind (:data:`safelens_tl.registry.CHANGES`): the kind in
    words, the fixes that change it (installed, or waiting for their module's import), and
    those of that kind turned off."""
    from safelens_tl import registry

    found = {}
    for kind, words in registry.CHANGES.items():
        ours = [fix for fix in fixes if kind in fix["changes"]]
        found[kind] = {
            "words": words,
            "fixes": [fix["id"] for fix in ours if fix["state"] in ("installed", "pending")],
            "disabled": [fix["id"] for fix in ours if fix["state"] == "disabled"],
        }
    return found


def _in_place_appends() -> bool:
    # Imported here: kv_storage imports torch, which a report without TransformerLens may lack.
    try:
        from safelens_tl.kv import storage as kv_storage
    except ImportError:
        return False
    return kv_storage.in_place_appends()


def problems(report: dict[str, Any]) -> list[str]:
    """Return what is wrong in ``report``, each with what to do about it; empty when all is well."""
    hook, tl, activation = report["hook"], report["transformer_lens"], report["activation"]
    found: list[str] = []
    if not hook["installed"]:
        found.append(
            f"the start-up hook {PTH_NAME} is not in any site-packages folder: reinstall "
            "safelens-tl (pip install safelens-tl), or put `import safelens_tl.patch` in your code"
        )
    if not tl["importable"]:
        found.append(f"transformer_lens cannot be imported ({tl['error']})")
    expected = hook["installed"] and hook["enabled"] and tl["importable"]
    if expected and hook["state"] == _startup.INACTIVE:
        found.append(
            "the hook did not run in this interpreter (started with python -S, or site-packages "
            ".pth files were skipped): put `import safelens_tl.patch` in your code"
        )
    elif expected and not activation["active"]:
        found.append("TransformerLens was imported but nothing was patched; see the failures")
    found.extend(f"{f['source']} ({f['stage']}): {f['message']}" for f in activation["failures"])
    return found


#: Why a torch build may not allow in-place appends, and what that costs (see kv_storage).
NO_IN_PLACE_APPENDS = (
    "no: this torch build cannot count the tensors sharing a storage (torch._C._storage_Use_Count, "
    "in CUDA builds and every build from torch 2.8), so caches are appended with torch.cat, as "
    "stock does: still in the keys' dtype and device, but O(length) per token"
)


def _in_place_text(value: bool) -> str:
    return "[green]yes[/green]" if value else f"[yellow]{NO_IN_PLACE_APPENDS}[/yellow]"


def _yes_no(value: bool) -> str:
    return "[green]yes[/green]" if value else "[red]no[/red]"


def render(report: dict[str, Any]) -> None:
    """Print ``report`` as a table with rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    hook, tl, activation = report["hook"], report["transformer_lens"], report["activation"]
    table = Table(title="safelens-tl status", show_header=False, title_justify="left")
    table.add_column("item", style="bold")
    table.add_column("value", overflow="fold")
    files = ", ".join(hook["files"]) or "none found"
    table.add_row("hook installed", f"{_yes_no(hook['installed'])} ({escape(files)})")
    setting = hook["env_value"]
    shown = "unset" if setting is None else repr(setting)
    table.add_row("hook enabled", f"{_yes_no(hook['enabled'])} ({hook['env_var']}={escape(shown)})")
    table.add_row("hook in this process", hook["state"])
    turned_off = hook["disable_value"]
    shown = "unset" if turned_off is None else repr(turned_off)
    table.add_row("fixes turned off", f"{hook['disable_var']}={escape(shown)}")
    release = tl["release"] or "not installed"
    table.add_row("TransformerLens", f"{escape(release)}, importable: {_yes_no(tl['importable'])}")
    table.add_row("layout", escape(activation["layout"] or "-"))
    table.add_row("active", _yes_no(activation["active"]))
    table.add_row("plugins", escape(", ".join(activation["plugins"]) or "-"))
    table.add_row("patched attributes", escape("\n".join(activation["patched"]) or "nothing"))
    table.add_row("in-place appends", _in_place_text(report["cache"]["in_place_appends"]))
    if activation["pending"]:
        # TransformerLens imports these lazily; their patches apply at that first import.
        waiting = ", ".join(activation["pending"])
        table.add_row("patched when imported", escape(waiting))
    # Piped or logged, a table at rich's default 80 columns would split class paths mid-word.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200)
    console.print(table)
    if activation.get("fixes"):
        if activation["active"]:
            console.print(_changes_table(report["changes"]))
        console.print(_fixes_table(activation["fixes"]))
    for note in activation["notes"]:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    for problem in problems(report):
        console.print(f"[red]problem:[/red] {escape(problem)}")


#: How each state of a fix is coloured in the table.
_STATE_STYLES = {
    "installed": "green",
    "pending": "cyan",
    "failed": "red",
    "not applicable": "dim",
    "disabled": "magenta",
}


def _label(words: str) -> str:
    """The name of a kind of change: its words up to the colon (``the forward pass``)."""
    return words.split(":")[0]


def _changes_table(found: dict[str, dict[str, Any]]) -> Any:
    """What safelens-tl changes here, one row per kind of change, in words."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="what it changes here (fixes installed, or at the import they wait for)",
        title_justify="left",
    )
    table.add_column("what", style="bold")
    table.add_column("by which fixes", overflow="fold")
    table.add_column("turned off", overflow="fold")
    for kind in found.values():
        table.add_row(
            escape(kind["words"]),
            escape(", ".join(kind["fixes"]) or "nothing"),
            escape(", ".join(kind["disabled"]) or "-"),
        )
    return table


def _fixes_table(fixes: list[dict[str, Any]]) -> Any:
    """Every fix of the registry, grouped by the first thing it changes: installed, pending on
    an import, disabled (and by what), failed, or not needed here."""
    from rich.markup import escape
    from rich.table import Table

    from safelens_tl import registry

    table = Table(title="fixes, by what they change", title_justify="left")
    table.add_column("fix", style="bold")
    table.add_column("changes")
    table.add_column("state")
    table.add_column("why", overflow="fold")
    for kind, words in registry.CHANGES.items():
        group = [fix for fix in fixes if fix["changes"][:1] == [kind]]
        if not group:
            continue
        table.add_section()
        table.add_row(f"[italic]{escape(_label(words))}[/italic]", "", "", "")
        for fix in group:
            style = _STATE_STYLES.get(fix["state"], "yellow")
            state = escape(fix["state"])
            if fix["disabled_by"]:
                state += f" by {escape(fix['disabled_by'])}"
            kinds = ", ".join(_label(registry.CHANGES[k]) for k in fix["changes"])
            table.add_row(
                fix["id"], escape(kinds), f"[{style}]{state}[/{style}]", escape(fix["reason"])
            )
    return table


def run(arguments: argparse.Namespace) -> int:
    """Print the report (``--json`` for JSON); exit 1 when :func:`problems` finds any.

    Importing TransformerLens takes seconds: on a terminal a spinner on stderr says so.
    """
    from rich.console import Console

    progress = Console(stderr=True)
    if progress.is_terminal:
        with progress.status("importing transformer_lens, as any program of yours would"):
            report = collect()
    else:
        report = collect()
    found = problems(report)
    if arguments.json:
        print(json.dumps({**report, "problems": found}, indent=2))
    else:
        render(report)
    return EXIT_PROBLEM if found else EXIT_OK
