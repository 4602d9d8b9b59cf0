"""``safelens-tl verify`` proven by mutants: every cache bug of ``tests/mutants.py``, injected
around the real code, makes the command fail in the dtype where the bug lives and name the row;
the same run without a bug passes.

The command runs in this process (``safelens_tl.cli.main``), with the mutant applied by
``monkeypatch``; the built-in models are saved once per process and shared. TransformerBridge's
mutants run where TransformerLens has no HookedTransformer (4.x, ``tl430``), HookedTransformer's
where it has one (``tl390``); each run checks only the rows of its API. The score
(caught / injected) is printed at the end of the test run.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import safelens_tl
from safelens_tl import cli
from safelens_tl.verify import runner
from tests import mutants
from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, RELEASE

pytestmark = pytest.mark.mutants

#: Which API this environment proves: HookedTransformer where it exists, else TransformerBridge.
API = "hooked" if HAS_HOOKED_TRANSFORMER else "bridge"
LABEL = {"hooked": "HookedTransformer", "bridge": "TransformerBridge"}[API]
HERE = [mutant for mutant in mutants.MUTANTS if mutant.api == API]


def _only_this_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows of :data:`API` alone (and the cache classes): where a release has both APIs, the
    other one's rows would only add time."""
    if API == "hooked":
        from safelens_tl import targets

        monkeypatch.setattr(targets, "has_bridge", lambda: False)
    else:
        monkeypatch.setattr(runner, "_has_hooked_transformer", lambda: False)


def _verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    path = tmp_path / "report.json"
    code = cli.main(["verify", "--json", str(path)])
    output = capsys.readouterr().out
    report = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return code, report, output


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    kind = "generate" if API == "hooked" else "bridge"
    return [row for row in report.get("checks", []) if row["kind"] == kind]


@pytest.fixture(autouse=True)
def _active() -> Any:
    safelens_tl.activate()
    yield
    safelens_tl.activate()


@pytest.fixture(scope="module")
def unmutated(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    """The run without a bug, once per module."""
    if not (HAS_HOOKED_TRANSFORMER or HAS_BRIDGE):
        pytest.skip(f"TransformerLens {RELEASE} has neither API")
    path = tmp_path_factory.mktemp("unmutated") / "report.json"
    safelens_tl.activate()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _only_this_api(monkeypatch)
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            code = cli.main(["verify", "--json", str(path)])
    return code, json.loads(path.read_text(encoding="utf-8")), output.getvalue()


def test_the_unmutated_run_passes(unmutated: tuple[int, dict[str, Any], str]) -> None:
    code, report, output = unmutated
    assert code == 0, output
    rows = _rows(report)
    assert len(rows) == 4 and all(row["passed"] for row in rows), output
    # Every row covers at least 64 cached positions, every step compared.
    assert all(row["cached_positions"] >= 64 for row in rows), rows


def test_a_bug_from_the_last_step_a_row_covers_fails(
    unmutated: tuple[int, dict[str, Any], str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The rows claim their ``cached_positions``: a bug that starts at the step whose cache holds
    that many positions (the last step of each run) must fail them."""
    last = min(row["cached_positions"] for row in _rows(unmutated[1]))
    mutant = mutants.from_cached_positions(API, last)
    _only_this_api(monkeypatch)
    mutant.inject(monkeypatch)
    code, report, output = _verify(tmp_path, capsys)
    assert code == 1, output
    for dtype in mutant.fails_in:
        assert any(not row["passed"] for row in _rows(report) if row["dtype"] == dtype), output


@pytest.mark.parametrize("mutant", HERE, ids=[mutant.id for mutant in HERE])
def test_verify_fails_the_mutant(
    mutant: mutants.Mutant,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _only_this_api(monkeypatch)
    mutant.inject(monkeypatch)
    caught = False
    try:
        code, report, output = _verify(tmp_path, capsys)
        rows = _rows(report)
        failing = [row for row in rows if not row["passed"]]
        assert code == 1, f"{mutant.id}: verify passed\n{output}"
        for dtype in mutant.fails_in:
            named = [
                row
                for row in failing
                if row["dtype"] == dtype
                and (mutant.models is None or row["model"] in mutant.models)
            ]
            assert named, f"{mutant.id}: no {dtype} row failed\n{output}"
            for row in named:  # the failing row is named, with the reason
                assert f"x {row['model']} {dtype} {row['device']}: " in output, output
        elsewhere = [row for row in failing if row["dtype"] not in mutant.fails_in]
        assert not elsewhere, f"{mutant.id}: rows failed where the bug does not live: {elsewhere}"
        caught = True
    finally:
        mutants.RESULTS.setdefault(f"{LABEL} (TransformerLens {RELEASE})", {})[mutant.id] = caught
