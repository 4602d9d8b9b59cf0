"""``safelens-tl verify`` end to end: ``python -m safelens_tl verify`` in child processes, forked
from a warm interpreter (``tests/warm_python.py``).

The children that import TransformerLens start together when the module is loaded, two at a time,
so their imports overlap; the usage errors that never import it run on their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from safelens_tl.fixes.bridge import cache as bridge_cache
from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, RELEASE, reads, selected
from tests.warm_python import run_python

#: Whether stock TransformerBridge's cached generation is broken here (transformers >= 5.24).
BRIDGE_BROKEN = HAS_BRIDGE and bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """A finished child: exit code, output and the JSON report when one was asked for."""

    code: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None


def _environment(
    quiet_warnings: bool, scratch: Path | None = None, hub_cache: Path | None = None
) -> dict[str, str]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if hub_cache is not None:
        environment["HF_HUB_CACHE"] = str(hub_cache)
    if scratch is not None:
        environment["TMPDIR"] = str(scratch)
    if quiet_warnings:
        # The usage-error tests count lines on stderr: third-party warnings at import time are
        # not the verifier's message.
        environment["PYTHONWARNINGS"] = "ignore"
    return environment


#: ``verify(json_path=STDOUT)``: ``--json`` alone, the report read from the child's stdout.
STDOUT = Path("-")


def verify(
    *arguments: str,
    json_path: Path | None = None,
    quiet_warnings: bool = False,
    scratch: Path | None = None,
    hub_cache: Path | None = None,
) -> Run:
    """Run ``python -m safelens_tl verify ARGUMENTS`` (a warm child: ``tests/warm_python.py``)
    and collect what it left.

    ``scratch``: the child's temporary-files folder (``TMPDIR``); ``hub_cache``: its Hugging Face
    Hub cache (``HF_HUB_CACHE``).
    """
    command = ["-m", "safelens_tl", "verify", *arguments]
    if json_path == STDOUT:
        command += ["--json"]
    elif json_path is not None:
        command += ["--json", str(json_path)]
    done = run_python(
        command, timeout=300, cwd=REPO, env=_environment(quiet_warnings, scratch, hub_cache)
    )
    report = None
    if json_path == STDOUT:
        report = json.loads(done.stdout) if done.returncode in (0, 1) else None
    elif json_path is not None and json_path.is_file():
        report = json.loads(json_path.read_text(encoding="utf-8"))
    return Run(done.returncode, done.stdout, done.stderr, report)


def _local_checkpoint(destination: Path) -> Path:
    """A tiny Llama checkpoint folder (config, weights, tokenizer), as a user would have one. Its
    name contains "llama", which trips TransformerLens's own config conversion of local folders."""
    import shutil

    from safelens_tl.verify import bridge

    shutil.copytree(bridge.model_folder("llama-like-gqa"), destination)
    return destination


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary-files folder of the default run."""
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, scratch: Path
) -> dict[str, Future[Run]]:
    """Start the children that import TransformerLens and a selected test :func:`reads`, two at
    a time."""
    folder = tmp_path_factory.mktemp("verify")
    plan: dict[str, Callable[[], Run]] = {
        "default": lambda: verify(json_path=folder / "default.json", scratch=scratch),
        "unknown model": lambda: verify(
            "--model", "no-such-org/no-such-model", quiet_warnings=True
        ),
        "folder": lambda: verify(
            "--model", str(_local_checkpoint(folder / "my-llama-checkpoint")), json_path=STDOUT
        ),
    }
    if RELEASE == "3.0.0" or BRIDGE_BROKEN:
        plan["no patch"] = lambda: verify("--no-patch", json_path=folder / "stock.json")
    pool = ThreadPoolExecutor(max_workers=2)
    started = {name: pool.submit(start) for name, start in selected(request, plan).items()}
    pool.shutdown(wait=False)
    return started


@reads("default")
def test_default_run_writes_a_valid_report(runs: dict[str, Future[Run]]) -> None:
    run = runs["default"].result()
    report = run.report
    assert report is not None, run.stderr
    for key in ("passed", "patched", "transformer_lens", "torch", "checks"):
        assert key in report
    assert report["patched"] is True
    assert report["transformer_lens"] == RELEASE
    assert report["checks"], "no check ran"
    for check in report["checks"]:
        for key in ("model", "dtype", "device", "passed", "max_rel_err"):
            assert key in check
        assert check["dtype"] in ("float16", "bfloat16")
        assert check["device"] == "cpu" or check["device"].startswith("cuda")
        assert check["passed"] == ("error" not in check)
    assert {c["dtype"] for c in report["checks"]} == {"float16", "bfloat16"}
    # Exit code and report agree, and the summary line says the same.
    assert run.code == (0 if report["passed"] else 1)
    assert ("PASSED" if report["passed"] else "FAILED") in run.stdout
    assert "cached against uncached" in run.stdout  # the table's title
    assert report["transformers"]  # its version: the TransformerBridge result depends on it
    if report["control"] is not None:  # the control runs in float32: its tolerance is float32's
        assert report["control"]["dtype"] == "float32"
        assert report["control"]["tolerance"] == report["tolerances"]["float32"]
        assert report["control"]["loosest_tolerance"] == report["tolerances"]["bfloat16"]


@reads("default")
def test_default_run_leaves_no_temporary_folders(
    runs: dict[str, Future[Run]], scratch: Path
) -> None:
    run = runs["default"].result()
    assert run.report is not None  # it ran, and built its tokenizer (and models) under scratch
    # Importing transformers 5.24's modeling code imports torch._dynamo, which makes torch's
    # compile cache folder (torchinductor_<user>) in the temporary folder: torch's, not ours, and
    # made only when the parent process has not already set TORCHINDUCTOR_CACHE_DIR.
    left = [path for path in scratch.iterdir() if not path.name.startswith("torchinductor_")]
    assert left == [], "verify left its model or tokenizer folders behind"


@pytest.mark.skipif(not HAS_BRIDGE, reason=f"TransformerLens {RELEASE} has no TransformerBridge")
@reads("default")
def test_default_run_checks_transformer_bridge_and_passes(runs: dict[str, Future[Run]]) -> None:
    run = runs["default"].result()
    assert run.code == 0, run.stdout + run.stderr
    assert run.report is not None
    bridge = [c for c in run.report["checks"] if c["kind"] == "bridge"]
    assert {c["architecture"] for c in bridge} == {"LlamaForCausalLM", "GPT2LMHeadModel"}
    assert {c["dtype"] for c in bridge} == {"float16", "bfloat16"}
    for check in bridge:
        assert check["passed"], check
        assert check["max_rel_err"] <= check["tolerance"]
        assert check["reference_rel_err"] <= check["reference_tolerance"]
        assert check["hf_generate_rel_err"] <= check["tolerance"]
        assert check["cache_dtype"] == check["dtype"]
        assert check["cache_heads"] == check["expected_cache_heads"]


@pytest.mark.skipif(
    not BRIDGE_BROKEN, reason="stock TransformerBridge is right with this transformers"
)
@reads("no patch")
def test_no_patch_fails_the_bridge_and_says_why(runs: dict[str, Future[Run]]) -> None:
    run = runs["no patch"].result()
    assert run.code == 1, run.stdout + run.stderr
    assert run.report is not None and run.report["patched"] is False
    bridge = [c for c in run.report["checks"] if c["kind"] == "bridge"]
    assert bridge and not any(c["passed"] for c in bridge)
    for check in bridge:
        assert "passes the KV cache to attention modules as `cache`" in check["error"]
        # Hugging Face's loop through the bridge is checked on its own, and is wrong as well.
        assert "hf_generate's cached logits differ" in check["error"]
        assert not check["hf_generate_rel_err"] <= check["tolerance"]  # NaN too


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="no HookedTransformer to generate with")
@reads("default")
def test_default_run_passes_where_hooked_transformer_exists(runs: dict[str, Future[Run]]) -> None:
    run = runs["default"].result()
    assert run.code == 0, run.stdout + run.stderr
    assert run.report is not None and run.report["passed"] is True
    generate = [c for c in run.report["checks"] if c["kind"] == "generate"]
    assert {c["model"] for c in generate} == {"gpt2-like", "llama-like-gqa"}
    for check in generate:
        assert check["max_rel_err"] <= check["tolerance"]
        assert check["cache_dtype"] == check["dtype"]
        assert check["cache_heads"] == check["expected_cache_heads"]
        assert 0.0 <= check["greedy_agreement"] <= 1.0
        assert check["speedup"] > 0


@pytest.mark.skipif(HAS_HOOKED_TRANSFORMER, reason="only releases without HookedTransformer")
@reads("default")
def test_without_hooked_transformer_the_cache_classes_pass_and_gaps_are_named(
    runs: dict[str, Future[Run]],
) -> None:
    report = runs["default"].result().report
    assert report is not None
    cache_checks = [c for c in report["checks"] if c["kind"] == "cache-class"]
    assert cache_checks and all(c["passed"] for c in cache_checks)
    assert any("no HookedTransformer" in note for note in report["not_checked"])


@pytest.mark.skipif(RELEASE != "3.0.0", reason="the dtype regression is TransformerLens 3.0.0's")
@reads("no patch")
def test_no_patch_on_300_fails_in_float16_and_bfloat16(runs: dict[str, Future[Run]]) -> None:
    run = runs["no patch"].result()
    assert run.code == 1, run.stdout + run.stderr
    assert run.report is not None and run.report["patched"] is False
    failed = [c for c in run.report["checks"] if c["kind"] == "generate" and not c["passed"]]
    assert {c["dtype"] for c in failed} == {"float16", "bfloat16"}
    assert all("expected scalar type Float" in c["error"] for c in failed)


def _assert_one_clear_line(run: Run, *words: str) -> None:
    assert run.code == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("safelens-tl verify: error:")
    for word in words:
        assert word in lines[0]


@reads("unknown model")
def test_unknown_offline_model_is_one_line_and_exit_2(runs: dict[str, Future[Run]]) -> None:
    run = runs["unknown model"].result()
    _assert_one_clear_line(run, "no-such-org/no-such-model", "offline")


def test_a_hub_model_name_is_verified(tmp_path: Path) -> None:
    """``--model org/name`` as a user passes a fine-tune from the Hub: not one of TransformerLens's
    official names, so on 2.x/3.x TransformerLens's loader takes it as a checkpoint (before, it
    was refused: "not found. Valid official model names"), and on 4.x it boots through
    TransformerBridge (before: "has no HookedTransformer"). Nothing can be downloaded here, so the
    tiny checkpoint is put in a Hugging Face Hub cache (the layout the Hub's own downloads leave:
    ``models--org--name/snapshots/<commit>``, ``refs/main``), and Hugging Face loads it from
    there offline, by name, as it would after a download. The name holds "llama", which
    TransformerLens's config conversion would take for a Llama name."""
    import shutil

    from safelens_tl.verify import bridge

    commit = "0" * 40
    repository = tmp_path / "hub" / "models--safelens-test--tiny-llama"
    shutil.copytree(bridge.model_folder("llama-like-gqa"), repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    run = verify(
        "--model",
        "safelens-test/tiny-llama",
        json_path=tmp_path / "name.json",
        hub_cache=tmp_path / "hub",
    )
    assert run.code == 0, run.stdout + run.stderr
    assert run.report is not None and run.report["passed"]
    kind = "generate" if HAS_HOOKED_TRANSFORMER else "bridge"
    assert {check["kind"] for check in run.report["checks"]} == {kind}
    assert {check["dtype"] for check in run.report["checks"]} == {"float16", "bfloat16"}
    for check in run.report["checks"]:
        assert check["model"].startswith("safelens-test/tiny-llama")
        assert check["cache_dtype"] == check["dtype"]
        assert check["cache_heads"] == 2


def test_bad_dtype_is_one_line_and_exit_2() -> None:
    # Other bad values (empty, mixed lists) are covered in-process in test_verify_api.py.
    run = verify("--dtype", "float16,float8", quiet_warnings=True)
    _assert_one_clear_line(run, "--dtype", "'float8'", "float16, bfloat16, float32")


def test_an_indexed_cpu_is_a_usage_error() -> None:
    run = verify("--device", "cpu:3", quiet_warnings=True)
    _assert_one_clear_line(run, "--device", "'cpu:3'", "use cpu")


def test_a_json_link_into_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    link = tmp_path / "report.json"
    link.symlink_to(tmp_path / "gone" / "report.json")
    run = verify(json_path=link, quiet_warnings=True)
    _assert_one_clear_line(run, "--json", "symbolic link", "does not exist")


def test_unwritable_json_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing_folder = tmp_path / "no" / "such" / "folder" / "report.json"
    run = verify(json_path=missing_folder, quiet_warnings=True)
    _assert_one_clear_line(run, "--json", str(missing_folder), "does not exist")
    assert not missing_folder.exists()


def test_a_usage_error_comes_before_torch_is_imported() -> None:
    """A typo answers at once: nothing heavy is imported to refuse it."""
    code = (
        "import sys\n"
        "from safelens_tl.cli import main\n"
        "code = main(['verify', '--dtype', 'float8', '--device', 'cpu'])\n"
        "print(code, 'torch' in sys.modules, 'transformer_lens' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "unknown dtype 'float8'" in done.stderr


@reads("default")
def test_the_timing_columns_are_labelled_indicative(runs: dict[str, Future[Run]]) -> None:
    run = runs["default"].result()
    assert "speed-up*" in run.stdout
    assert "* indicative only" in run.stdout


@reads("folder")
def test_a_local_checkpoint_folder_is_verified(runs: dict[str, Future[Run]]) -> None:
    """``--model FOLDER``: converted to a HookedTransformer on 2.x/3.x, booted through
    TransformerBridge where there is no HookedTransformer (4.x)."""
    run = runs["folder"].result()
    assert run.code == 0, run.stdout + run.stderr
    # --json alone: stdout is the JSON report and nothing else; the verdict is on stderr.
    assert run.report is not None and run.report["passed"]
    assert "PASSED" in run.stderr and "PASSED" not in run.stdout
    kinds = {check["kind"] for check in run.report["checks"]}
    assert kinds == ({"generate"} if HAS_HOOKED_TRANSFORMER else {"bridge"})
    for check in run.report["checks"]:
        assert check["model"].startswith("my-llama-checkpoint")
        assert check["max_rel_err"] <= check["tolerance"]
        assert check["cache_heads"] == check["expected_cache_heads"] == 2


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="conversion is for 2.x/3.x")
def test_an_unsupported_checkpoint_architecture_is_one_line_and_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    run = verify("--model", str(folder), quiet_warnings=True)
    _assert_one_clear_line(run, "BertForMaskedLM", "LlamaForCausalLM, GPT2LMHeadModel")


def _docs_sample(release: str | None) -> list[str] | None:
    """The sample output in docs/verify.md whose summary line names TransformerLens
    ``release``, as lines; ``None`` where there is none."""
    text = (REPO / "docs" / "verify.md").read_text(encoding="utf-8")
    for block in text.split("```text\n")[1:]:
        lines = block.split("```")[0].splitlines()
        if lines and f"(TransformerLens {release}," in lines[-1]:
            return lines
    return None


def _shape(lines: list[str]) -> str:
    """What a run's output shows that no machine changes: the table's headers, each row's
    model, dtype, device, verdict and cache, the notes, and the summary without its seconds;
    numbers read as N, and every run of blanks or line breaks as one blank."""
    import re

    numbers = re.sub(r"\d+(\.\d+)?(e[+-]\d+)?", "N", "\n".join(lines))
    return re.sub(r"\s+", " ", numbers).strip()


@pytest.mark.docs
@reads("default")
def test_the_documented_sample_output_is_what_this_release_prints(
    runs: dict[str, Future[Run]],
) -> None:
    """docs/verify.md's sample for this TransformerLens is this run's output, numbers aside: the
    same columns, rows, verdicts, notes and versions (transformers, torch)."""
    sample = _docs_sample(RELEASE)
    if sample is None:
        pytest.skip(f"docs/verify.md shows no sample for TransformerLens {RELEASE}")
    run = runs["default"].result()
    printed = run.stdout.split("safelens-tl verify: cached against uncached generation")[-1]
    expected = "safelens-tl verify: cached against uncached generation" + printed
    assert _shape(sample) == _shape(expected.splitlines())
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.split(" in ")[0] == sample[-1].split(" in ")[0]  # the versions, exactly


def _report_of_four() -> Any:
    from safelens_tl.verify.report import CheckResult, Report

    report = Report(patched=True, transformer_lens=RELEASE, torch="2", safelens_tl="0")
    for model in ("llama-like-gqa [bridge]", "gpt2-like [bridge]"):
        for dtype in ("float16", "bfloat16"):
            report.checks.append(
                CheckResult(
                    model=model,
                    dtype=dtype,
                    device="cpu",
                    passed=dtype == "float16",
                    max_rel_err=9.1e-4,
                    tolerance=2e-3,
                    order_rel_err=9.1e-4,
                    greedy_agreement=1.0,
                    cached_positions=72,
                    cache_dtype=dtype,
                    cache_device="cpu",
                    cache_heads=2,
                    ms_per_token_cached=4,
                    ms_per_token_uncached=7,
                    speedup=1.53,
                )
            )
    return report


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_table_fits_the_terminal_and_keeps_every_verdict(width: int) -> None:
    """In an 80-column terminal the full table would cut its cells to "dty…" and "PA…": a
    compact table fits instead, with every row's model, dtype, verdict and error."""
    import io

    from rich.console import Console

    from safelens_tl.verify import report as report_module

    out = io.StringIO()
    report_module.render(_report_of_four(), Console(file=out, width=width, color_system=None))
    text = out.getvalue()
    assert "\u2026" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    rows = [line for line in text.splitlines() if " cpu " in line]
    assert len(rows) == 4
    assert [("PASS" in row, "FAIL" in row) for row in rows] == [(True, False), (False, True)] * 2
    assert all("9.1e-04 <= 2e-03" in row and "[bridge]" in row for row in rows)
    assert ("ms/tok" in text) == (width >= 160)  # the full table where it fits
