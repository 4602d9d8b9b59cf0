"""The start-up hook, tested in fresh interpreters against the installed package.

Every check runs in a child ``python`` started from a scratch folder, so it sees safelens-tl as it
is installed (editable in the dev venvs, a wheel under tox) and its ``safelens_tl.pth`` runs the
way it does for users. No child imports safelens-tl before ``transformer_lens``: user code does not.
The children that import TransformerLens (those of the selected tests) start together with the
module, two at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from safelens_tl import _startup, targets
from safelens_tl.fixes import FIXES
from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, LAYOUT, reads, selected

pytestmark = pytest.mark.startup

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pluggy", "importlib.metadata", "transformer_lens")
#: What the hook may import before transformer_lens: its own modules and ``__future__``.
STARTUP_MODULES = {"safelens_tl", "safelens_tl._startup", "safelens_tl._import_hooks", "__future__"}
MARK = "RESULT:"
ENTRY_MODULE = LAYOUT.known.entry_path.rpartition(".")[0]


@dataclass(frozen=True)
class Child:
    """A fresh interpreter to start: the script, extra environment, interpreter flags, arguments.

    ``command``, when given, is run instead of ``python <flags> <script> <args>``.
    """

    code: str = ""
    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()


def run_child(child: Child, folder: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``child`` in ``folder`` with the opt-out and the fixes' switches unset unless the
    child sets them."""
    env = {k: v for k, v in os.environ.items() if k not in (_startup.ENV_VAR, _startup.DISABLE_VAR)}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(child.env)
    script = folder / "child.py"
    script.write_text(textwrap.dedent(child.code))
    command = child.command or (sys.executable, *child.flags, str(script), *child.args)
    return subprocess.run(
        command,
        cwd=folder,  # not the repository: the child must import the installed package
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


Results = dict[str, "Future[subprocess.CompletedProcess[str]]"]


@contextlib.contextmanager
def started(children: dict[str, Child], base: Path) -> Iterator[Results]:
    """Start the children two at a time (each imports torch and TransformerLens: seconds of CPU).

    Each test waits only for its own child; children not started when the module ends (their
    tests deselected) are cancelled.
    """
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures: Results = {}
        for name, child in children.items():
            folder = base / name
            folder.mkdir()
            futures[name] = pool.submit(run_child, child, folder)
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()


def result_of(completed: subprocess.CompletedProcess[str]) -> Any:
    """The JSON the child printed after ``RESULT:``; fail with its output when there is none."""
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line.removeprefix(MARK))
    tail = completed.stderr[-4000:]
    pytest.fail(f"child exited {completed.returncode} without a result:\n{tail}")


def installed_hook() -> Path:
    """The ``safelens_tl.pth`` of the installed distribution, as its RECORD lists it."""
    distribution = metadata.distribution("safelens-tl")
    hooks = [f for f in distribution.files or [] if f.name == "safelens_tl.pth"]
    assert len(hooks) == 1, f"RECORD lists {hooks}; pip uninstall would not remove the hook"
    assert str(hooks[0]) == "safelens_tl.pth", "the hook must sit at the site-packages root"
    return Path(str(distribution.locate_file(hooks[0])))


# A plain `import transformer_lens`, then a report; with generate=True an fp16 cached generate on
# a tiny model (its builder is imported after transformer_lens, as user code would).
PLAIN_IMPORT = """
import json, sys
before = sorted(m for m in sys.modules if m in {heavy!r} or m.startswith("safelens_tl"))
import transformer_lens
from safelens_tl import _startup, targets
from safelens_tl.kv import entry as kv_cache
import safelens_tl

entry = targets.locate().entry_class
out = {{
    "before": before,
    "state": _startup.state,
    "append_patched": entry.append is kv_cache.append,
    "watcher_left": any(type(f).__name__ == "_Watcher" for f in sys.meta_path),
    "loader": type(transformer_lens.__loader__).__name__,
    "spec_loader": type(transformer_lens.__spec__.loader).__name__,
    "status": safelens_tl.status().to_dict(),
}}
if {generate!r}:
    import torch
    from safelens_tl.verify.models import build_model

    model = build_model("gpt2-like", torch.float16)
    out["entry_dtype"] = str(entry.init_cache_entry(model.cfg, "cpu", 1).past_keys.dtype)
    try:
        tokens = model.generate("the cat runs", max_new_tokens=4, use_past_kv_cache=True,
                                do_sample=False, verbose=False, return_type="tokens",
                                stop_at_eos=False)
        prompt = model.to_tokens("the cat runs")
        out["generate"] = {{"ok": True, "shape": list(tokens.shape), "prompt": prompt.shape[1]}}
    except RuntimeError as error:
        out["generate"] = {{"ok": False, "error": str(error)}}
print("{mark}" + json.dumps(out))
"""


def plain_import(generate: bool) -> str:
    """Child code for a plain ``import transformer_lens``, optionally followed by generation."""
    return PLAIN_IMPORT.format(heavy=HEAVY, generate=generate, mark=MARK)


OPT_OUT_AFTER_START_UP = f"""
import json, os
os.environ[{_startup.ENV_VAR!r}] = "0"  # as a notebook would, before its first import
import {ENTRY_MODULE}
from safelens_tl import _startup, targets
from safelens_tl.kv import entry as kv_cache
patched = targets.locate().entry_class.append is kv_cache.append
print({MARK!r} + json.dumps([_startup.state, patched]))
"""

SPAWN_SUBMODULE_FIRST = f"""
import json, multiprocessing, os, sys

def probe(module_name):
    import importlib
    before = "transformer_lens" in sys.modules
    importlib.import_module(module_name)  # a submodule first: the package is imported on the way
    from safelens_tl import _startup, targets
    from safelens_tl.kv import entry as kv_cache
    patched = targets.locate().entry_class.append is kv_cache.append
    return {{"before": before, "state": _startup.state, "patched": patched, "pid": os.getpid()}}

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(probe, (sys.argv[1],))
    parent = {{"pid": os.getpid(), "has_tl": "transformer_lens" in sys.modules}}
    print({MARK!r} + json.dumps({{"parent": parent, "child": child}}))
"""

# The explicit spelling first, hook enabled: `import safelens_tl.patch` imports transformer_lens,
# which fires the hook inside the explicit activate(); the two must not patch twice.
EXPLICIT_FIRST = f"""
import json
import safelens_tl.patch
import safelens_tl
from safelens_tl import _startup
explicit = safelens_tl.patch.STATUS.patched
report = safelens_tl.deactivate()
from safelens_tl import targets
from safelens_tl.kv import entry as kv_cache
restored = targets.locate().entry_class.append is not kv_cache.append
print({MARK!r} + json.dumps([_startup.state, explicit, restored, report.failures]))
"""

# python -S skips .pth files; site.addsitedir() later processes ours after transformer_lens.
TRANSFORMER_LENS_FIRST = f"""
import json, site, sys
site_packages = sys.argv[1]
sys.path.append(site_packages)
import transformer_lens
hook_ran_before = "safelens_tl._startup" in sys.modules
site.addsitedir(site_packages)
from safelens_tl import _startup, targets
from safelens_tl.kv import entry as kv_cache
patched = targets.locate().entry_class.append is kv_cache.append
print({MARK!r} + json.dumps([hook_ran_before, _startup.state, patched]))
"""


# deactivate() before the first import of transformer_lens: the hook must not undo it at that
# import; an explicit activate() afterwards still works. (This child imports safelens-tl first,
# on purpose.)
DEACTIVATE_FIRST = f"""
import json, sys
import safelens_tl
safelens_tl.deactivate()
import transformer_lens
from safelens_tl import _startup, targets
from safelens_tl.kv import entry as kv_cache
entry = targets.locate().entry_class
out = {{
    "state": _startup.state,
    "active": safelens_tl.is_active(),
    "append_patched": entry.append is kv_cache.append,
    "watcher_left": any(type(f).__name__ == "_Watcher" for f in sys.meta_path),
}}
safelens_tl.activate()
out["explicit"] = [safelens_tl.is_active(), entry.append is kv_cache.append]
print({MARK!r} + json.dumps(out))
"""

#: Fixes named in SAFELENS_TL_DISABLE for the child that turns fixes off through the hook: one
#: id, one kind of change (in another case), one unknown name.
DISABLED_THROUGH_THE_HOOK = "kv_cache, Forward,not_a_fix"


def broken_plugin_site(folder: Path) -> Path:
    """A real installed distribution whose ``safelens_tl`` entry point raises on import."""
    site_folder = folder / "broken-site"
    dist_info = site_folder / "broken_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    metadata_text = "Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n"
    (dist_info / "METADATA").write_text(metadata_text)
    (dist_info / "entry_points.txt").write_text("[safelens_tl]\nbroken = broken_plugin_module\n")
    module = site_folder / "broken_plugin_module.py"
    module.write_text("raise RuntimeError('broken on purpose')\n")
    return site_folder


#: The children whose checks are the same for every release (the import machinery and the
#: switches): their tests carry the ``release_independent`` mark, and run in ``tl430`` and the
#: Python 3.12 environment; the others (the fixes installed, stock's behaviour) everywhere.
hook_mechanics = pytest.mark.release_independent


@pytest.fixture(scope="module")
def children(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Results]:
    """The children of this module's selected tests that import TransformerLens, started in test
    order."""
    base = tmp_path_factory.mktemp("autoactivate")
    plan = {
        "plain": Child(plain_import(generate=HAS_HOOKED_TRANSFORMER)),
        "opt_out": Child(plain_import(HAS_HOOKED_TRANSFORMER), env={_startup.ENV_VAR: "off"}),
        "opt_out_later": Child(OPT_OUT_AFTER_START_UP),
        "spawn": Child(SPAWN_SUBMODULE_FIRST, args=(ENTRY_MODULE,)),
        "broken_plugin": Child(
            plain_import(generate=False), env={"PYTHONPATH": str(broken_plugin_site(base))}
        ),
        "explicit_first": Child(EXPLICIT_FIRST),
        "deactivate_first": Child(DEACTIVATE_FIRST),
        "disabled": Child(
            plain_import(generate=HAS_HOOKED_TRANSFORMER),
            env={_startup.DISABLE_VAR: DISABLED_THROUGH_THE_HOOK},
        ),
        "tl_first": Child(
            TRANSFORMER_LENS_FIRST, flags=("-S",), args=(str(installed_hook().parent),)
        ),
    }
    with started(selected(request, plan), base) as futures:
        yield futures


def test_opt_out_values_are_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "false", "No", " OFF "):
        monkeypatch.setenv(_startup.ENV_VAR, value)
        assert not _startup.enabled(), value
    for value in ("1", "true", "yes", "on", ""):
        monkeypatch.setenv(_startup.ENV_VAR, value)
        assert _startup.enabled(), value
    monkeypatch.delenv(_startup.ENV_VAR)
    assert _startup.enabled()


def test_an_error_during_auto_activation_becomes_a_warning_and_a_status_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``activate()`` reports its own failures; this is the net for an unexpected internal error.

    Such an error cannot be produced on purpose, so ``safelens_tl.activate`` (ours, not
    TransformerLens) is replaced by one that raises; the report state is restored afterwards.
    """
    import safelens_tl
    from safelens_tl import activation

    def broken() -> None:
        raise RuntimeError("internal error on purpose")

    monkeypatch.setattr(activation._state, "report", activation._state.report)
    monkeypatch.setattr(_startup, "state", _startup.WATCHING)
    monkeypatch.setattr(safelens_tl, "activate", broken)
    monkeypatch.delenv(_startup.ENV_VAR, raising=False)
    with pytest.warns(activation.SafelensWarning, match="internal error on purpose"):
        _startup.activate_now()  # must not raise
    assert _startup.state == _startup.FAILED
    failure = safelens_tl.status().failures[-1]
    assert (failure.source, failure.stage) == ("safelens_tl._startup", "auto-activate")
    assert "SAFELENS_TL_AUTOPATCH=0" in failure.message


@pytest.mark.parametrize("disabled", ["", "forward,kv_cache"], ids=["plain", "fixes-disabled"])
def test_start_up_imports_nothing_heavy(tmp_path: Path, disabled: str) -> None:
    """Also with fixes named in SAFELENS_TL_DISABLE: the hook only hands the string on."""
    code = (
        f"import sys\nloaded = sorted(sys.modules)\nimport json\n"
        f"print({MARK!r} + json.dumps(loaded))"
    )
    child = Child(code, env={_startup.DISABLE_VAR: disabled})
    loaded = set(result_of(run_child(child, tmp_path)))
    assert "safelens_tl._startup" in loaded, "the hook did not run: is safelens_tl.pth installed?"
    assert not loaded & set(HEAVY)
    assert {m for m in loaded if m.startswith("safelens_tl")} <= STARTUP_MODULES


def import_tree(importtime: str, root: str) -> list[str]:
    """Modules that ``-X importtime`` shows nested under ``root`` (children come first)."""
    rows = []
    for line in importtime.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$", line)
        if found:
            rows.append((len(found.group(1)), found.group(2)))
    index = next(i for i, (_, name) in enumerate(rows) if name == root)
    nested = []
    for depth, name in reversed(rows[:index]):
        if depth <= rows[index][0]:
            break
        nested.append(name)
    return nested


def test_hook_imports_only_its_own_modules(tmp_path: Path) -> None:
    """What ``python -X importtime -c pass`` shows under the hook; each extra module costs time."""
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "safelens_tl._startup" in completed.stderr, "the hook did not run"
    nested = set(import_tree(completed.stderr, "safelens_tl._startup"))
    assert "safelens_tl" in nested
    assert nested <= STARTUP_MODULES, (
        f"the start-up hook imported {sorted(nested - STARTUP_MODULES)}; every Python process "
        "pays for these"
    )


@reads("plain")
def test_plain_import_is_patched_and_generates_in_fp16(children: Results) -> None:
    out = result_of(children["plain"].result())
    assert set(out["before"]) <= STARTUP_MODULES, "something heavy ran before transformer_lens"
    assert out["state"] == _startup.ACTIVATED
    assert out["append_patched"]
    assert out["status"]["active"] and out["status"]["failures"] == []
    # The watcher stays only while deferred patches wait (transformer_lens.model_bridge, which
    # TransformerLens imports lazily, and Hugging Face's CodeGen, which a CodeGen model imports);
    # otherwise it removed itself once it fired.
    assert out["watcher_left"] == bool(out["status"]["pending"])
    # TransformerLens 4.x imports its bridge lazily; 3.x at once (then only CodeGen waits).
    assert out["status"]["pending"] in (
        (
            [targets.CODEGEN_MODULE],
            [targets.BRIDGE_MODULE, targets.CODEGEN_MODULE],
        )
        if HAS_BRIDGE
        else ([],)
    )
    assert out["loader"] == out["spec_loader"] != "_NotifyingLoader"
    if HAS_HOOKED_TRANSFORMER:
        assert out["entry_dtype"] == "torch.float16"
        assert out["generate"]["ok"], out["generate"]
        assert out["generate"]["shape"] == [1, out["generate"]["prompt"] + 4]


@reads("opt_out")
def test_opt_out_leaves_stock_behaviour(children: Results) -> None:
    out = result_of(children["opt_out"].result())
    assert out["state"] == _startup.DISABLED
    assert not out["append_patched"]
    assert not out["status"]["active"] and out["status"]["patched"] == []
    if HAS_HOOKED_TRANSFORMER:
        # Stock fails exactly where its cache entry ignores the model dtype (TransformerLens 3.0.0).
        if out["entry_dtype"] == "torch.float16":
            assert out["generate"]["ok"], out["generate"]
        else:
            assert not out["generate"]["ok"]
            assert "expected scalar type" in out["generate"]["error"], out["generate"]


@hook_mechanics
@reads("deactivate_first")
def test_deactivate_before_the_import_is_not_undone_by_it(children: Results) -> None:
    out = result_of(children["deactivate_first"].result())
    assert out["state"] == _startup.DEACTIVATED
    assert not out["active"] and not out["append_patched"]
    assert not out["watcher_left"]
    assert out["explicit"] == [True, True], "an explicit activate() afterwards must still work"


@hook_mechanics
@reads("disabled")
def test_fixes_named_in_the_environment_are_left_out_by_the_hook(children: Results) -> None:
    """Through the start-up hook: the named id and every fix of the named kind are ``disabled``
    by the variable, the others as usual; the unknown name is warned with the valid ones."""
    completed = children["disabled"].result()
    out = result_of(completed)
    assert set(out["before"]) <= STARTUP_MODULES, "the hook must parse nothing at start-up"
    assert out["state"] == _startup.ACTIVATED and out["status"]["active"]
    assert not out["append_patched"], "kv_cache was named: the entry must be stock's"
    states = {fix["id"]: fix for fix in out["status"]["fixes"]}
    off = {"kv_cache"} | {fix["id"] for fix in states.values() if "forward" in fix["changes"]}
    needs = {fix.id: set(fix.requires) for fix in FIXES}
    off |= {fix_id for fix_id, required in needs.items() if required & off}
    for fix_id, fix in states.items():
        if fix_id in off:
            assert (fix["state"], fix["disabled_by"]) == ("disabled", _startup.DISABLE_VAR), fix
        else:
            assert fix["state"] != "disabled", fix
    assert any(fix["state"] in ("installed", "pending") for fix in states.values())
    assert "'not_a_fix' is neither a fix nor a kind of change" in completed.stderr
    assert "hooked_weight_copies" in completed.stderr  # the valid names are listed
    if HAS_HOOKED_TRANSFORMER:
        # The cache entry is stock's: right where stock is, failing where stock fails (3.0.0).
        if out["entry_dtype"] == "torch.float16":
            assert out["generate"]["ok"], out["generate"]
        else:
            assert "expected scalar type" in out["generate"]["error"], out["generate"]


@hook_mechanics
@reads("opt_out_later")
def test_opt_out_set_after_start_up_is_honoured(children: Results) -> None:
    state, patched = result_of(children["opt_out_later"].result())
    assert state == _startup.DISABLED and not patched


@reads("spawn")
def test_spawn_child_is_patched_on_a_submodule_first_import(children: Results) -> None:
    assert ENTRY_MODULE.startswith("transformer_lens.")
    out = result_of(children["spawn"].result())
    assert out["child"]["pid"] != out["parent"]["pid"]
    assert not out["parent"]["has_tl"] and not out["child"]["before"]
    assert out["child"]["state"] == _startup.ACTIVATED
    assert out["child"]["patched"]


@hook_mechanics
@reads("broken_plugin")
def test_broken_entry_point_plugin_warns_and_the_built_in_fix_still_applies(
    children: Results,
) -> None:
    completed = children["broken_plugin"].result()
    out = result_of(completed)
    failures = out["status"]["failures"]
    assert [f["source"] for f in failures] == ["broken-plugin:broken"]
    assert "broken on purpose" in failures[0]["message"]
    assert "broken on purpose" in completed.stderr and "SafelensWarning" in completed.stderr
    assert out["append_patched"] and out["status"]["active"]


@reads("explicit_first")
def test_explicit_import_first_patches_each_attribute_once(children: Results) -> None:
    state, explicit, restored, failures = result_of(children["explicit_first"].result())
    assert state == _startup.ACTIVATED
    assert explicit, "import safelens_tl.patch patched nothing"
    assert len(explicit) == len(set(explicit)), f"patched twice: {explicit}"
    assert restored and failures == []


@hook_mechanics
@reads("tl_first")
def test_hook_activates_at_once_when_transformer_lens_came_first(children: Results) -> None:
    hook_ran_before, state, patched = result_of(children["tl_first"].result())
    assert not hook_ran_before, "python -S must not have run the hook"
    assert state == _startup.ACTIVATED and patched


def test_isolated_mode_still_runs_the_hook_from_site_packages(tmp_path: Path) -> None:
    """``-I`` skips only the user site folder (and PYTHON* variables), not site-packages."""
    code = f"import sys\nprint({MARK!r} + str(int('safelens_tl._startup' in sys.modules)))"
    assert result_of(run_child(Child(code, flags=("-I",)), tmp_path)) == 1


def test_installed_record_lists_the_hook() -> None:
    """pip uninstall removes what RECORD lists; the .pth must be among it, with our content."""
    hook = installed_hook()
    assert hook.read_text().strip() == (REPO / "safelens_tl.pth").read_text().strip()


@pytest.mark.release_independent  # import machinery, the same for every release
def test_activates_when_another_import_hook_loads_transformer_lens(tmp_path: Path) -> None:
    """jaxtyping's ``install_import_hook`` (TransformerLens's own test setup) puts its finder
    ahead of ours, so our loader never runs; activation must still come before first use."""
    pytest.importorskip("jaxtyping")
    code = f"""
        import json, sys
        from jaxtyping import install_import_hook
        with install_import_hook("transformer_lens", None):
            import transformer_lens
        from safelens_tl import _startup
        loader = type(transformer_lens.__spec__.loader).__name__  # first use: activates
        import safelens_tl
        print({MARK!r} + json.dumps([loader, _startup.state, safelens_tl.is_active()]))
    """
    loader, state, active = result_of(run_child(Child(code), tmp_path, timeout=600))
    assert loader != "_NotifyingLoader"  # the other hook's loader did the import
    assert state == _startup.ACTIVATED and active


def test_a_hook_left_behind_by_a_removed_package_is_silent(tmp_path: Path) -> None:
    """A deleted checkout leaves its .pth in site-packages; Python must start without a word."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "safelens_tl.pth").write_text((REPO / "safelens_tl.pth").read_text())
    code = f"""
        import sys
        hidden = ("", {str(REPO)!r})
        sys.path[:] = [p for p in sys.path if "site-packages" not in p and p not in hidden]
        sys.modules.pop("safelens_tl", None)
        sys.modules.pop("safelens_tl._startup", None)
        import site
        site.addsitedir({str(site)!r})
        print({MARK!r} + str(int("safelens_tl" in sys.modules)))
    """
    completed = run_child(Child(code, flags=("-S",)), tmp_path)
    assert result_of(completed) == 0
    assert completed.stderr == "", completed.stderr


def test_an_unknown_opt_out_value_is_warned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_startup, "_warned_setting", None)
    monkeypatch.setenv(_startup.ENV_VAR, "disable")
    assert _startup.enabled(), "an unknown value leaves the hook on"
    with pytest.warns(RuntimeWarning, match="SAFELENS_TL_AUTOPATCH='disable' is not a known value"):
        _startup._warn_unknown_setting()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _startup._warn_unknown_setting()  # once per value
        monkeypatch.setenv(_startup.ENV_VAR, "yes")
        _startup._warn_unknown_setting()  # a known value: silent
