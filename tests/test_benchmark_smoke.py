"""``benchmarks/kv_cache.py --quick`` runs end to end and reports every measurement (no timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HAS_HOOKED_TRANSFORMER

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "kv_cache.py"


def test_quick_benchmark_runs_and_reports_everything(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAFELENS_TL_AUTOPATCH": "0"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--json", str(output)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "append (batch" in done.stdout and ", ratios" in done.stdout
    results = json.loads(output.read_text())
    assert [row["cached"] for row in results["append"]] == [32, 128]
    for row in results["append"]:
        assert all(row[k] > 0 for k in ("stock", "patched", "amortized", "raw", "floor"))
        assert row["floor"] > row["raw"]  # the floor is the raw write plus a regrowth share
    if HAS_HOOKED_TRANSFORMER:
        assert [row["context"] for row in results["generate"]] == ["short", "long"]
        assert all(row["stock"] > 0 and row["patched"] > 0 for row in results["generate"])
        assert all(row["paired"] > 0 for row in results["generate"])
        assert [row["shape"] for row in results["memory"]] == ["long context", "early EOS"]
        assert {"stock", "patched", "cache_bytes"} <= set(results["memory"][0])
        assert results["autocast"]["stock"]["dtype"] == "float32"
        assert results["autocast"]["patched"]["dtype"] == "bfloat16"
        assert "generate, greedy, cached" in done.stdout
    else:
        assert results["generate"] == []
        assert any("no HookedTransformer" in note for note in results["notes"])


def test_fresh_memory_copy_prints_its_table() -> None:
    script = BENCHMARK.parent / "fresh_memory_copy.py"
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "into fresh memory" in done.stdout
    assert all(str(cached) in done.stdout for cached in (1024, 4096, 8192))
