"""``safelens-tl status``: the installed console script in fresh interpreters, and its report."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import safelens_tl
from safelens_tl import _startup, targets
from safelens_tl.cli import status as status_command
from safelens_tl.kv import storage as kv_storage
from tests.conftest import HAS_BRIDGE, reads, selected
from tests.test_autoactivate import Child, Results, hook_mechanics, started

SCRIPT = Path(sys.executable).with_name("safelens-tl")


@pytest.fixture(scope="module")
def children(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Results]:
    """The installed console script, with the hook enabled, with the opt-out, piped, and with a
    fix turned off (those the selected tests read)."""
    command = (str(SCRIPT), "status", "--json")
    plan = {
        "enabled": Child(command=command),
        "opted_out": Child(command=command, env={_startup.ENV_VAR: "0"}),
        "table": Child(command=(str(SCRIPT), "status")),
        "disabled": Child(command=command, env={_startup.DISABLE_VAR: "hooked_weight_copies"}),
    }
    with started(selected(request, plan), tmp_path_factory.mktemp("status")) as futures:
        yield futures


def report_of(children: Results, name: str) -> tuple[int, Any]:
    """Exit code and parsed JSON of one console-script run."""
    completed = children[name].result()
    assert completed.stdout.strip(), completed.stderr[-4000:]
    return completed.returncode, json.loads(completed.stdout)


def test_console_script_is_installed() -> None:
    assert SCRIPT.is_file(), f"{SCRIPT} missing: is safelens-tl installed in {sys.prefix}?"


@reads("enabled")
def test_status_json_shows_the_hook_and_what_it_patched(
    children: Results, patched: safelens_tl.activation.Status
) -> None:
    code, report = report_of(children, "enabled")
    assert code == status_command.EXIT_OK, report["problems"]
    assert report["problems"] == []
    hook = report["hook"]
    assert hook["installed"] and hook["enabled"] and hook["env_value"] is None
    assert [Path(f).name for f in hook["files"]] == [status_command.PTH_NAME]
    assert hook["state"] == _startup.ACTIVATED
    assert report["transformer_lens"] == {
        "importable": True,
        "release": targets.installed_release(),
        "error": None,
    }
    # The same patches this process gets from an explicit activate(), except those waiting for
    # modules the child never imports: TransformerBridge's (TransformerLens 4.x imports it
    # lazily, 3.x at once) and Hugging Face's CodeGen (imported by a CodeGen model).
    assert report["activation"]["active"]
    pending = report["activation"]["pending"]
    if HAS_BRIDGE:
        assert pending in (
            [targets.CODEGEN_MODULE],
            [targets.BRIDGE_MODULE, targets.CODEGEN_MODULE],
        )
    else:
        assert pending == []
    assert report["activation"]["patched"] == [
        target for target in patched.patched if not target.startswith(tuple(pending))
    ]
    assert report["activation"]["plugins"] == list(patched.plugins)
    assert report["cache"] == {"in_place_appends": True}  # torch 2.13 counts a storage's tensors


@hook_mechanics
@reads("opted_out")
def test_status_json_with_the_opt_out(children: Results) -> None:
    code, report = report_of(children, "opted_out")
    assert code == status_command.EXIT_OK, report["problems"]
    assert report["hook"]["installed"] and not report["hook"]["enabled"]
    assert report["hook"]["env_value"] == "0"
    assert report["hook"]["state"] == _startup.DISABLED
    assert report["transformer_lens"]["importable"]
    assert not report["activation"]["active"] and report["activation"]["patched"] == []


def test_human_output_lists_release_state_and_every_patch(
    patched: safelens_tl.activation.Status,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # rich folds long values at the terminal width
    code = status_command.run(argparse.Namespace(json=False))
    shown = capsys.readouterr().out
    assert "hook installed" in shown and "hook enabled" in shown
    assert f"{targets.installed_release()}, importable: yes" in shown
    for target in patched.patched:
        assert target in shown
    assert ("problem:" in shown) == (code == status_command.EXIT_PROBLEM)


def test_human_output_says_when_appends_cannot_be_in_place(
    patched: safelens_tl.activation.Status,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The storage count is taken away as on CPU-only and macOS builds before torch 2.8 (which
    cannot be installed here)."""
    monkeypatch.setenv("COLUMNS", "400")
    status_command.run(argparse.Namespace(json=False))
    assert re.search(r"in-place appends\s+│ yes", capsys.readouterr().out)
    monkeypatch.setattr(kv_storage, "_storage_use_count", None)
    status_command.run(argparse.Namespace(json=False))
    # The start of the explanation: the table folds the rest over several lines.
    shown = capsys.readouterr().out
    assert re.search(r"in-place appends\s+│ no: this torch build cannot count", shown)


def real_report() -> dict[str, Any]:
    """This process's real report (TransformerLens imported and activated by the fixtures)."""
    return status_command.collect()


def test_problems_name_the_remedy_when_the_hook_is_missing(
    patched: safelens_tl.activation.Status,
) -> None:
    report = real_report()
    report["hook"] = {**report["hook"], "installed": False, "files": []}
    (problem,) = status_command.problems(report)
    assert "not in any site-packages folder" in problem and "import safelens_tl.patch" in problem


def test_problems_when_the_hook_did_not_run_in_this_interpreter() -> None:
    report = real_report()
    report["hook"] = {**report["hook"], "enabled": True, "state": _startup.INACTIVE}
    found = status_command.problems(report)
    assert any("python -S" in p for p in found), found


def test_problems_report_activation_failures(patched: safelens_tl.activation.Status) -> None:
    report = real_report()
    failure = {"source": "some-plugin:fix", "stage": "load", "message": "ImportError: gone"}
    report["activation"] = {**report["activation"], "failures": [failure]}
    assert "some-plugin:fix (load): ImportError: gone" in status_command.problems(report)


def test_hook_files_are_the_installed_pth() -> None:
    files = status_command.hook_files()
    assert files, "no safelens_tl.pth found in any site-packages folder"
    for file in files:
        assert "import safelens_tl._startup" in Path(file).read_text()


@reads("table")
def test_piped_table_keeps_each_class_path_on_one_line(
    children: Results, patched: safelens_tl.activation.Status
) -> None:
    """Piped (as in a log), the table is not cut at 80 columns in the middle of a path."""
    completed = children["table"].result()
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for target in patched.patched:
        # Those wait for the import of the bridge or of Hugging Face's CodeGen.
        if not target.startswith((targets.BRIDGE_MODULE, targets.CODEGEN_MODULE)):
            assert target in completed.stdout, target


@hook_mechanics
@reads("disabled")
def test_status_json_shows_a_fix_turned_off_and_by_what(children: Results) -> None:
    code, report = report_of(children, "disabled")
    assert code == status_command.EXIT_OK, report["problems"]
    assert report["hook"]["disable_var"] == _startup.DISABLE_VAR
    assert report["hook"]["disable_value"] == "hooked_weight_copies"
    (fix,) = [f for f in report["activation"]["fixes"] if f["id"] == "hooked_weight_copies"]
    assert (fix["state"], fix["disabled_by"]) == ("disabled", _startup.DISABLE_VAR)
    assert fix["changes"] == ["forward"]
    assert report["changes"]["forward"]["disabled"] == ["hooked_weight_copies"]
    assert "hooked_weight_copies" not in report["changes"]["forward"]["fixes"]
    others = [f for f in report["activation"]["fixes"] if f["id"] != "hooked_weight_copies"]
    assert all(f["state"] != "disabled" for f in others)


def test_human_output_groups_the_fixes_by_what_they_change_in_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safelens_tl import registry

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv(_startup.DISABLE_VAR, "hooked_alibi")
    status = safelens_tl.activate()
    status_command.run(argparse.Namespace(json=False))
    shown = capsys.readouterr().out
    assert "what it changes here" in shown and "fixes, by what they change" in shown
    flowing = " ".join(shown.replace("│", " ").split())
    for words in registry.CHANGES.values():
        assert words.split(":")[0] + ":" in flowing  # each kind in words (the table folds them)
    assert "fixes turned off" in shown and "SAFELENS_TL_DISABLE='hooked_alibi'" in shown
    assert re.search(
        r"hooked_alibi\s+│ the forward pass\s+│ disabled by SAFELENS_TL_DISABLE", shown
    )
    changes = status_command.changes(status.to_dict()["fixes"])
    installed = {f.id for f in status.fixes if f.state == "installed"}
    for kind in registry.CHANGES:
        assert (
            set(changes[kind]["fixes"])
            >= {f.id for f in status.fixes if kind in f.changes} & installed
        )
    assert changes["forward"]["disabled"] == ["hooked_alibi"]
