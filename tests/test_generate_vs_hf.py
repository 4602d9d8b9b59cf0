"""``benchmarks/generate_vs_hf.py`` runs end to end on a tiny Llama (no timings asserted)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BENCHMARKS, HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, benchmark_module
from tests.warm_python import run_python

pytestmark = pytest.mark.benchmark

SCRIPT = BENCHMARKS / "generate_vs_hf.py"


def run_benchmark(*arguments: str) -> subprocess.CompletedProcess[str]:
    """The benchmark, offline, with one thread."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return run_python([str(SCRIPT), *arguments], env=env, timeout=600)


def test_quick_run_on_a_tiny_llama_reports_every_api(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    done = run_benchmark(
        "--model",
        "tiny",
        "--quick",
        "--rounds",
        "1",
        "--reps",
        "1",
        "--forward-shapes",
        "1x16,2x32",
        "--checkpoint-dir",
        str(tmp_path / "checkpoint"),
        "--json",
        str(output),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    apis = [*(["hooked"] if HAS_HOOKED_TRANSFORMER else []), *(["bridge"] if HAS_BRIDGE else [])]
    assert [row["api"] for row in results["generate"]] == apis
    for row in results["generate"]:
        assert (row["dtype"], row["prompt"], row["new"]) == ("float32", 16, 32)
        assert all(row[k] > 0 for k in ("stock_ms", "patched_ms", "hf_ms", "speedup"))
        # Patched TransformerLens picks Hugging Face's greedy tokens, in float32.
        assert row["patched_same_tokens"], row
    (stock_round,) = [r["stock"] for r in results["rounds"]]
    (patched_round,) = [r["patched"] for r in results["rounds"]]
    assert stock_round["active"] is False and patched_round["active"] is True
    if HAS_HOOKED_TRANSFORMER:
        hooked = results["generate"][0]
        assert hooked["stock_equals_patched"]
        shapes = [(row["batch"], row["tokens"]) for row in results["forward"]]
        assert shapes == [(1, 16), (2, 32)]
        assert all(row["stock_ms"] > 0 and row["patched_ms"] > 0 for row in results["forward"])
        assert "forward, ms per call" in done.stdout
    else:
        assert results["forward"] == []
    assert "generate, ms per new token" in done.stdout


def test_an_unknown_dtype_is_refused() -> None:
    done = run_benchmark("--model", "tiny", "--dtypes", "float32,int8")
    assert done.returncode == 2
    assert "unknown dtypes ['int8']" in done.stderr


def _round(stock_ms: float, patched_ms: float, hf_ms: float, same: bool) -> dict[str, Any]:
    def rows(tl_ms: float) -> dict[str, Any]:
        row = {"api": "hooked", "dtype": "float32", "prompt": 16, "new": 32}
        tokens = [1, 2, 3] if same else [1, 2, 4]
        return {
            "generate": [
                {**row, "tl_ms": tl_ms, "hf_ms": hf_ms, "same_tokens": same, "tl_tokens": tokens}
            ]
        }

    return {"stock": rows(stock_ms), "patched": rows(patched_ms)}


def test_ratios_are_medians_of_the_paired_rounds() -> None:
    generate_vs_hf = benchmark_module("generate_vs_hf")
    rounds = [_round(300, 100, 50, True), _round(400, 100, 100, True), _round(90, 30, 60, False)]
    (row,) = generate_vs_hf.summarise(rounds, "generate")
    assert row["stock_ms"] == 300 and row["patched_ms"] == 100
    assert row["speedup"] == 3.0  # per round 3.0, 4.0, 3.0
    assert row["stock_vs_hf"] == 4.0  # per round 6.0, 4.0, 1.5
    assert row["patched_vs_hf"] == 1.0  # per round 2.0, 1.0, 0.5
    assert row["hf_ms"] == 60.0  # median of 50, 100, 60 (stock) and 50, 100, 60 (patched)
    assert not row["patched_same_tokens"]
    assert row["stock_equals_patched"]  # the rounds disagree with HF alike


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="the forward is HookedTransformer's")
def test_forward_alternating_prints_the_ratio(tmp_path: Path) -> None:
    generate_vs_hf = benchmark_module("generate_vs_hf")
    folder = generate_vs_hf.build_checkpoint("tiny", None, tmp_path / "checkpoint")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = run_python(
        [
            str(BENCHMARKS / "forward_alternating.py"),
            "--checkpoint",
            str(folder),
            "--batch",
            "2",
            "--tokens",
            "8",
            "--pairs",
            "2",
        ],
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("2x8 float32: stock ")]
    assert "median" in line
