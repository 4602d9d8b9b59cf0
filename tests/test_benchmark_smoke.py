"""``benchmarks/kv_cache.py --quick`` runs end to end and reports every measurement (no timings)."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import os
import random
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.verify import bridge, checks
from tests.conftest import (
    BENCHMARKS,
    HAS_BRIDGE,
    HAS_HOOKED_TRANSFORMER,
    RELEASE,
    architecture_folder,
    benchmark_module,
    requires_hooked_transformer,
)
from tests.warm_python import run_python

pytestmark = pytest.mark.benchmark

BENCHMARK = BENCHMARKS / "kv_cache.py"


def run_script(name: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<name>`` offline, with auto-activation off, and capture its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAFELENS_TL_AUTOPATCH": "0"}
    return run_python([str(BENCHMARK.parent / name), *arguments], env=env, timeout=300)


def refusal(script: str, *arguments: str) -> str:
    """Run ``benchmarks/<script>.py``'s ``main`` here, with arguments it must refuse: it exits 2
    before measuring anything. Returns what it wrote on stderr. (In this process: a fresh
    interpreter only to read the arguments costs the import of TransformerLens, seconds.)"""
    main = benchmark_module(script).main
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_request, contextlib.redirect_stderr(stderr):
        main(list(arguments))
    assert exit_request.value.code == 2, stderr.getvalue()
    return stderr.getvalue()


def test_quick_benchmark_runs_and_reports_everything(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    # Every section but the instruction counts, which run under valgrind (the test below).
    sections = "append,step,generate,memory,trace,autocast,bridge"
    done = run_script(
        "kv_cache.py", "--quick", "--only", sections, "--short-rounds", "3", "--json", str(output)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "append (batch" in done.stdout and ", ratios" in done.stdout
    results = json.loads(output.read_text())
    assert results["machine"]["device"] == "cpu"
    assert [row["cached"] for row in results["append"]] == [32, 128]
    for row in results["append"]:
        assert all(row[k] > 0 for k in ("stock", "patched", "amortized", "raw", "floor"))
        assert row["floor"] > row["raw"]  # the floor is the raw write plus a regrowth share
    in_generate = [-1] if HAS_HOOKED_TRANSFORMER else []
    assert [row["cached"] for row in results["step"]] == [8, 32, *in_generate]
    assert all(row[k] > 0 for row in results["step"] for k in ("stock", "patched", "buffer"))
    assert "per-token append" in done.stdout
    if HAS_HOOKED_TRANSFORMER:
        assert [row["context"] for row in results["generate"]] == ["short", "shortest", "long"]
        assert all(row["stock"] > 0 and row["patched"] > 0 for row in results["generate"])
        assert [row["rounds"] for row in results["generate"]] == [3, 3, 1]  # long: as it was
        for row in results["generate"]:
            for median, interval in (
                (row["paired"], row["paired_interval"]),
                (row["stock_vs_stock"], row["stock_vs_stock_interval"]),
            ):
                assert 0 < interval[0] <= median <= interval[1], row
        assert "median of pairs (95% CI)" in done.stdout
        assert [row["shape"] for row in results["memory"]] == ["long context", "early EOS"]
        assert {"stock", "patched", "cache_bytes"} <= set(results["memory"][0])
        assert results["autocast"]["stock"]["dtype"] == "float32"
        assert results["autocast"]["patched"]["dtype"] == "bfloat16"
        assert "generate, greedy, cached" in done.stdout
        _assert_cache_bytes_stay_within_the_bound(results["trace"])
    else:
        assert results["generate"] == results["trace"] == []
        assert any("no HookedTransformer" in note for note in results["notes"])
    if HAS_BRIDGE:
        (row,) = results["bridge"]
        # float32: patched cached, uncached and Hugging Face agree on every token.
        assert row["agree uncached"] == row["agree hf"] == row["new"]
        assert all(row[f"{way} ms"] > 0 for way in ("cached", "stock cached", "uncached", "hf"))
        assert "TransformerBridge generate" in done.stdout
    else:
        assert results["bridge"] == []


def _assert_cache_bytes_stay_within_the_bound(trace: list[dict[str, Any]]) -> None:
    """Bytes, not time: the memory bound (docs/performance.md), checked after every pass of a
    real generate.

    Patched never holds more than max(stock x 1.25, stock + one growth step) at any token, an
    early stop holds what it generated (not max_new_tokens), and a second generate holds nothing
    of the first.
    """
    assert [row["case"] for row in trace] == ["normal", "early EOS", "second generate"]
    for row in trace:
        assert row["within_bound"], row["case"]
        assert len(row["stock"]) == len(row["patched"]) > 0
        step = row["growth_step_bytes"]
        for stock, ours in zip(row["stock"], row["patched"], strict=True):
            assert ours <= max(stock * 5 // 4, stock + step)
    normal, early, second = trace
    assert normal["stock"][-1] == normal["patched"][-1]  # the plan ends exactly at the end
    assert len(early["stock"]) <= early["stop_after"] < early["max_new"]
    assert second["patched"] == normal["patched"]
    assert second["stock_earlier"] == second["patched_earlier"] == 0


def test_benchmark_refuses_an_unknown_section() -> None:
    error = refusal("kv_cache", "--quick", "--only", "append,speed")
    assert "--only: expected some of append" in error and "'append,speed'" in error


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device: expected cpu or cuda; received 'tpu'"),
        ("meta", "--device: expected cpu or cuda; received 'meta'"),
        pytest.param(
            "cuda",
            "--device cuda: torch sees no GPU here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"),
        ),
    ],
)
def test_benchmark_refuses_a_device_it_cannot_use(device: str, message: str) -> None:
    assert message in refusal("kv_cache", "--quick", "--only", "append", "--device", device)


def test_benchmark_refuses_zero_rounds() -> None:
    error = refusal("kv_cache", "--quick", "--only", "generate", "--short-rounds", "0")
    assert "--short-rounds: expected at least 1; received 0" in error


@pytest.fixture(scope="module")
def generate_in_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``--only generate --processes 2 --short-model llama-like-gqa``, run once for the tests
    below (the children must get the short model too): its ``generate`` rows by context."""
    output = tmp_path_factory.mktemp("generate") / "generate.json"
    done = run_script(
        "kv_cache.py", "--quick", "--only", "generate", "--short-rounds", "2",
        "--processes", "2", "--short-model", "llama-like-gqa", "--json", str(output),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "medians over 2 pairs of fresh processes" in done.stdout
    return {row["context"]: row for row in json.loads(output.read_text())["generate"]}


@requires_hooked_transformer
def test_the_short_generations_run_on_the_chosen_model(
    generate_in_processes: dict[str, dict[str, Any]],
) -> None:
    """``--short-model llama-like-gqa``: the short rows name the rotary model, in the processes of
    ``--processes`` too; the long row keeps its own model."""
    contexts = list(generate_in_processes)
    assert "short, llama-like-gqa" in contexts and "long" in contexts, contexts
    assert "--short-model" in refusal("kv_cache", "--quick", "--short-model", "gpt9")


def test_benchmark_refuses_zero_processes() -> None:
    error = refusal("kv_cache", "--quick", "--only", "generate", "--processes", "0")
    assert "--processes: expected at least 1; received 0" in error


@requires_hooked_transformer
def test_processes_measure_the_short_generations_in_fresh_processes(
    generate_in_processes: dict[str, dict[str, Any]],
) -> None:
    """``--processes 2``: each short row is the median over two pairs of fresh processes; the
    long row is measured once, in this process, as without the option."""
    rows = generate_in_processes
    assert list(rows) == ["short, llama-like-gqa", "shortest, llama-like-gqa", "long"], list(rows)
    for label in ("short, llama-like-gqa", "shortest, llama-like-gqa"):
        row = rows[label]
        assert row["processes"] == 2 and row["rounds"] == 2
        low, high = sorted(row["process_paired"])
        assert row["paired"] == pytest.approx((low + high) / 2)
        assert row["paired_interval"] == [low, high]
    assert "processes" not in rows["long"]


@requires_hooked_transformer
@pytest.mark.parametrize("variant", ["stock", "patched"])
def test_a_generate_child_runs_one_variant_throughout(
    variant: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process of ``--processes`` (``--generate-child``) times every short generation with
    safelens-tl active throughout (patched) or never (stock), whatever the state it starts in:
    here it starts in the other one. (In this process: that ``--processes`` starts the children as
    fresh processes, the test above shows.)"""
    kv_cache = benchmark_module("kv_cache")
    seen: list[bool] = []
    original = kv_cache.greedy_generate

    def spy(model: Any, tokens: torch.Tensor, new: int) -> Any:
        seen.append(safelens_tl.status().active)
        return original(model, tokens, new)

    monkeypatch.setattr(kv_cache, "greedy_generate", spy)
    if variant == "stock":
        assert safelens_tl.activate().active
    else:
        safelens_tl.deactivate()
    assert kv_cache.main(["--quick", "--short-rounds", "3", "--generate-child", variant]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["context"] for row in rows] == ["short", "shortest"]
    assert all(0 < row["best"] <= row["median"] for row in rows)
    # Warm-ups and rounds of both generations, every one in the same state.
    assert seen == [variant == "patched"] * 2 * (kv_cache.PROCESS_WARM_UPS + 3)
    assert not safelens_tl.status().active  # and it leaves safelens-tl off


def _child_rows(context: str, median: float) -> list[dict[str, Any]]:
    row = {"context": context, "prompt": 1, "new": 16, "batch": 1}
    return [{**row, "best": median * 0.9, "median": median}]


def test_pairs_of_processes_combine_into_the_median_over_pairs() -> None:
    kv_cache = benchmark_module("kv_cache")
    patched = [1.0, 0.5, 2.0, 1.0, 0.8]
    per_pair = [
        {
            "stock": _child_rows("shortest", 1.0),
            "patched": _child_rows("shortest", seconds),
            "stock again": _child_rows("shortest", 1.0 + index / 10),
        }
        for index, seconds in enumerate(patched)
    ]
    (row,) = kv_cache.combine_processes(per_pair, {"shortest": 7}, "cpu")
    # stock/patched per pair: 1.0, 2.0, 0.5, 1.0, 1.25
    assert row["process_paired"] == [1.0, 2.0, 0.5, 1.0, 1.25]
    assert row["paired"] == 1.0 and row["paired_interval"] == (0.5, 2.0)
    assert row["stock_vs_stock"] == pytest.approx(1 / 1.2)
    assert row["stock"] == pytest.approx(16 / 0.9) and row["patched"] == pytest.approx(16 / 0.45)
    assert (row["processes"], row["rounds"], row["clock"]) == (5, 7, "cpu")
    per_pair[1]["patched"] = _child_rows("short", 1.0)
    with pytest.raises(ValueError, match="expected every process to measure 'shortest'"):
        kv_cache.combine_processes(per_pair, {"shortest": 7}, "cpu")
    with pytest.raises(ValueError, match="expected at least one pair of processes"):
        kv_cache.combine_processes([], {}, "cpu")


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_rounds_give_every_variant_every_place_equally_often(count: int) -> None:
    kv_cache = benchmark_module("kv_cache")
    names = [chr(ord("A") + n) for n in range(count)]
    orders = [kv_cache.round_order(names, index) for index in range(2 * count)]
    assert all(sorted(order) == names for order in orders)
    for place in range(count):
        assert sorted(order[place] for order in orders) == sorted(names * 2)
    for first in names:
        for second in names:
            if first != second:
                ahead = sum(order.index(first) < order.index(second) for order in orders)
                assert ahead == count, (first, second, orders)


def _coverage(count: int, j: int) -> Fraction:
    """Chance that the j-th smallest and j-th largest of ``count`` values enclose the median."""
    return 1 - 2 * Fraction(sum(math.comb(count, below) for below in range(j)), 2**count)


@pytest.mark.parametrize("count", [6, 7, 10, 20, 61, 1000])
def test_the_median_interval_is_the_narrowest_that_keeps_95_percent(count: int) -> None:
    kv_cache = benchmark_module("kv_cache")
    ranks = list(range(1, count + 1))
    random.Random(count).shuffle(ranks)
    low, high = kv_cache.median_interval(ranks)
    j = low  # the values are their own ranks
    assert high == count + 1 - j
    assert _coverage(count, j) >= Fraction(95, 100)
    assert j == (count + 1) // 2 or _coverage(count, j + 1) < Fraction(95, 100)


def test_the_median_interval_of_few_values_is_their_range() -> None:
    kv_cache = benchmark_module("kv_cache")
    assert kv_cache.median_interval([3.0]) == (3.0, 3.0)
    assert kv_cache.median_interval([2.0, 5.0, 1.0, 4.0, 3.0]) == (1.0, 5.0)
    with pytest.raises(ValueError, match="expected at least one value"):
        kv_cache.median_interval([])
    with pytest.raises(ValueError, match="expected 0 < confidence < 1; received 1"):
        kv_cache.median_interval([1.0, 2.0], confidence=1)


def test_fresh_memory_copy_prints_its_table() -> None:
    done = run_script("fresh_memory_copy.py", "--rounds", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "into fresh memory" in done.stdout
    assert all(str(cached) in done.stdout for cached in (1024, 4096, 8192))


def test_append_floor_prints_its_table() -> None:
    done = run_script("append_floor.py", "--cached", "8,32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch calls of one append" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["8", "32"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
@requires_hooked_transformer
def test_instruction_counts_grow_by_the_same_count_with_each_pair_of_tokens() -> None:
    """One callgrind child (patched) runs and counts generations of 2, 4 and 6 new tokens after a
    one-token prompt: each token one forward of one position, so every two more tokens add the
    same instructions (measured: within 1%), millions of them. A count of the wrong region, or of
    nothing, fails. One child, not one per variant: under valgrind its imports of torch and
    TransformerLens take ~40 s of CPU; the stock child runs the same code in the other state
    (``test_an_instruction_count_child_keeps_one_state_throughout`` covers both)."""
    instruction_counts = benchmark_module("instruction_counts")
    shapes = [(1, 2), (1, 4), (1, 6)]
    counts, reason = instruction_counts.count_in_children(
        ["patched"], shapes, rounds=1, model=instruction_counts.MODEL
    )
    assert reason is None, reason
    (two,), (four,), (six,) = (counts[("patched", f"{p}+{n}")] for p, n in shapes)
    first, second = four - two, six - four
    assert first > 1_000_000 and two > 0.9 * first, counts  # 1+2 holds two forwards too
    assert abs(second - first) < 0.1 * first, counts


class _StateRecorder:
    """Stands in for the callgrind helper, which exists only under valgrind: records whether
    safelens-tl was active at each count's start, and each count's label."""

    def __init__(self) -> None:
        self.counted: list[tuple[bool, bytes]] = []
        self.active_at_start: bool | None = None

    def safelens_count_start(self) -> None:
        self.active_at_start = safelens_tl.status().active

    def safelens_count_stop(self, label: bytes) -> None:
        assert self.active_at_start is not None, "stop without start"
        self.counted.append((self.active_at_start, label))
        self.active_at_start = None


@requires_hooked_transformer
@pytest.mark.parametrize("variant", ["stock", "patched"])
def test_an_instruction_count_child_keeps_one_state_throughout(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each child counts one variant, never switching: every warm-up and counted generation
    runs in the same state, with the model built in it (switching biased the counts)."""
    generation = benchmark_module("generation")
    instruction_counts = benchmark_module("instruction_counts")
    seen: list[bool] = []
    original = generation.greedy_generate

    def spy(model: Any, tokens: torch.Tensor, new: int) -> torch.Tensor:
        seen.append(safelens_tl.status().active)
        return original(model, tokens, new)

    monkeypatch.setattr(generation, "greedy_generate", spy)
    recorder = _StateRecorder()
    instruction_counts.count_generations(recorder, variant, [(1, 2), (2, 1)], rounds=2)
    on = variant == "patched"
    assert seen == [on] * 2 * (instruction_counts.WARM_UPS + 2)
    labels = [f"{variant}|{shape}".encode() for shape in ("1+2", "1+2", "2+1", "2+1")]
    assert recorder.counted == [(on, label) for label in labels]


def test_an_instruction_count_child_refuses_an_unknown_variant() -> None:
    instruction_counts = benchmark_module("instruction_counts")
    with pytest.raises(ValueError, match="expected a variant in"):
        instruction_counts.count_generations(_StateRecorder(), "both", [(1, 2)], rounds=1)


def test_spin_instructions_are_read_from_a_callgrind_dump() -> None:
    """What is left out of each count: a function's own cost lines, not the calls it makes."""
    instruction_counts = benchmark_module("instruction_counts")
    dump = "\n".join(
        [
            "fn=(1) main",
            "0 500",
            "cfn=(2) pthread_cond_signal@@GLIBC_2.3.2",
            "calls=1 0",
            "0 300",
            "fn=(2)",
            "0 300",
            "fn=(3) pthread_cond_wait",
            "12 40",
            "+1 2",
        ]
    )
    assert instruction_counts.spin_instructions(dump) == 342


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_architectures_reports_patched_and_stock(tmp_path: Path) -> None:
    """Llama (the attention bridges) and Qwen3-Next (its GatedDeltaNet linear attention too):
    patched cached generation agrees with uncached; stock is reported beside it."""
    path = tmp_path / "architectures.json"
    names = "LlamaForCausalLM,Qwen3NextForCausalLM"
    done = run_script("bridge_architectures.py", "--architectures", names, "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cached TransformerBridge generate" in done.stdout
    results = json.loads(path.read_text())
    assert list(results) == names.split(",")
    for name, result in results.items():
        if "build_error" in result:  # an architecture this release does not have
            assert name != "LlamaForCausalLM", result
            continue
        patched = result["patched"]
        assert patched["error"] is None and patched["tokens_equal"], (name, patched)
        assert patched["max_rel_err"] <= 1e-4, (name, patched)
        assert set(result["stock"]) == {
            "max_rel_err",
            "tokens_equal",
            "error",
            "hugging_face_rel_err",
            "dtype",
            "cache_dtype",
            "cache_heads",
            "expected_heads",
            "autocast",
        }
        assert patched["dtype"] == patched["cache_dtype"] == "float32", (name, patched)
        assert patched["cache_heads"] == patched["expected_heads"] == 2, (name, patched)
        assert patched["hugging_face_rel_err"] <= 1e-4, (name, patched)


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_hf_generate_reports_patched_and_stock(tmp_path: Path) -> None:
    """Hugging Face's loop through the bridge: patched, cached gives the uncached tokens; stock
    is reported beside it (wrong with transformers 5.24 and later, which pass the cache under a
    name the stock attention bridges do not read; right before, from TransformerLens 3.9 on),
    and an unknown architecture is refused."""
    path = tmp_path / "hf_generate.json"
    done = run_script(
        "bridge_hf_generate.py", "--architectures", "LlamaForCausalLM", "--json", str(path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TransformerBridge.hf_generate" in done.stdout
    result = json.loads(path.read_text())["LlamaForCausalLM"]
    assert result["patched"] == "right", result
    import transformers

    hugging_face = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    release = tuple(int(part) for part in RELEASE.split(".")[:2])
    if hugging_face >= (5, 24):
        assert result["stock"].startswith("wrong: "), result
    elif release >= (3, 9):
        assert result["stock"] == "right", result
    else:  # 3.0-3.8 also drop a batch's attention mask in hf_generate
        assert result["stock"] == "right" or result["stock"].startswith("wrong: "), result
    refused = refusal("bridge_hf_generate", "--architectures", "NoSuchForCausalLM")
    assert "unknown ['NoSuchForCausalLM']" in refused


def test_bridge_hf_generate_verdicts() -> None:
    verdict = benchmark_module("bridge_hf_generate").verdict
    assert verdict("right", "right") == "right in both"
    assert "fixed" in verdict("right", "wrong: 3 of 16 tokens differ")
    assert "worse" in verdict("wrong: 3 of 16 tokens differ", "right")
    assert verdict("fails: X", "fails: X") == "the same in both"
    assert "differs" in verdict("wrong: 3 of 16 tokens differ", "fails: X")


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_architectures_checks_compatibility_mode(tmp_path: Path) -> None:
    """``--compatibility-mode``: the sweep processes the weights before generating, and Llama's
    cached generation still agrees with the processed bridge's uncached forward."""
    path = tmp_path / "architectures.json"
    done = run_script(
        "bridge_architectures.py", "--architectures", "LlamaForCausalLM", "--compatibility-mode",
        "--json", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compatibility mode" in done.stdout
    patched = json.loads(path.read_text())["LlamaForCausalLM"]["patched"]
    assert patched["error"] is None and patched["tokens_equal"], patched
    assert patched["max_rel_err"] <= checks.TOLERANCES[torch.float32], patched


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_architectures_under_autocast_holds_bfloat16_rounding(tmp_path: Path) -> None:
    """``--autocast bfloat16``: a float32 Llama generating under autocast is held to bfloat16's
    tolerance, its padded batch included (NaN there before safelens-tl's mask fix)."""
    path = tmp_path / "architectures.json"
    done = run_script(
        "bridge_architectures.py", "--architectures", "LlamaForCausalLM", "--autocast",
        "bfloat16", "--json", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "under autocast to bfloat16" in done.stdout
    patched = json.loads(path.read_text())["LlamaForCausalLM"]["patched"]
    assert patched["autocast"] == "bfloat16" and patched["dtype"] == "float32", patched
    assert patched["error"] is None and patched["tokens_equal"], patched
    assert patched["max_rel_err"] <= checks.TOLERANCES[torch.bfloat16], patched


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_architectures_in_bfloat16_checks_the_cache_dtype(tmp_path: Path) -> None:
    """``--dtype bfloat16``: Llama's cache holds bfloat16 keys and its cached logits are within
    the verifier's bfloat16 tolerance; Mamba keeps no keys, and is held to twice Hugging Face's
    own rounding."""
    path = tmp_path / "architectures.json"
    names = "LlamaForCausalLM,MambaForCausalLM"
    done = run_script(
        "bridge_architectures.py", "--architectures", names, "--dtype", "bfloat16",
        "--json", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bfloat16" in done.stdout
    results = json.loads(path.read_text())
    llama = results["LlamaForCausalLM"]["patched"]
    assert llama["dtype"] == "bfloat16" and llama["cache_dtype"] == "bfloat16", llama
    assert llama["max_rel_err"] <= checks.TOLERANCES[torch.bfloat16], llama
    mamba = results["MambaForCausalLM"]
    if "build_error" in mamba:
        pytest.skip(f"this transformers cannot build Mamba: {mamba['build_error']}")
    if mamba["patched"]["error"]:
        # TransformerLens before 3.9 has no Mamba bridge: stock fails alike. From 3.9 on, an
        # error is a failure.
        assert mamba["stock"]["error"] == mamba["patched"]["error"], mamba
        assert tuple(int(part) for part in RELEASE.split(".")[:2]) < (3, 9), mamba
        pytest.skip(f"TransformerLens cannot run Mamba here: {mamba['patched']['error']}")
    assert mamba["patched"]["cache_dtype"] is None, mamba
    own = mamba["patched"]["hugging_face_rel_err"]
    assert mamba["patched"]["max_rel_err"] <= max(2 * own, 8e-3), mamba


@requires_hooked_transformer
def test_hooked_architectures_reports_patched_and_stock(tmp_path: Path) -> None:
    """The script's table and JSON: Bloom in bfloat16 is right with safelens-tl, Llama in float32
    in both where the release's generate masks padding (stock 2.13-3.0.0 does not); on
    TransformerLens 4.x it says there is nothing to run."""
    path = tmp_path / "hooked.json"
    done = run_script(
        "hooked_architectures.py", "--architectures", "BloomForCausalLM,LlamaForCausalLM",
        "--dtypes", "float32,bfloat16", "--json", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BloomForCausalLM" in done.stdout
    results = json.loads(path.read_text())
    for architecture in ("BloomForCausalLM", "LlamaForCausalLM"):
        for dtype in ("float32", "bfloat16"):
            patched = results[architecture][dtype]["patched"]
            assert patched["passed"], (architecture, dtype, patched)
            assert patched["cache_dtype"] == dtype
    stock = results["LlamaForCausalLM"]["float32"]["stock"]
    if targets.hooked_generate_masks_no_padding(RELEASE):
        # Stock generate lets the shorter prompt attend to its padding, cached and uncached alike:
        # only the verifier's check against each prompt alone sees it.
        assert not stock["passed"] and "each prompt alone" in stock["problem"], stock
    else:
        assert stock["passed"], stock


def _batch_lengths_rows(*options: str) -> list[list[str]] | None:
    """The table rows of ``benchmarks/batch_lengths.py`` at 1 and 2 distinct lengths; ``None``
    where the API is absent (which the script must say)."""
    done = run_script("batch_lengths.py", "--rounds", "1", "--distinct", "1,2", *options)
    assert done.returncode == 0, done.stderr[-3000:]
    if "nothing to run" in done.stdout:
        return None
    rows = [line.split("│") for line in done.stdout.splitlines() if line.startswith("│")]
    assert [row[1].strip() for row in rows] == ["1", "2"]
    assert all("patched 8/8" in row[5] for row in rows)
    return rows


def test_batch_lengths_prints_its_table_for_hooked_transformer() -> None:
    """One row per number of distinct lengths; with safelens-tl every row is right, in stock
    only where the release masks the padding (or nothing is padded); on 4.x nothing to run."""
    rows = _batch_lengths_rows("--api", "hooked")
    assert (rows is None) == (not HAS_HOOKED_TRANSFORMER)
    if rows is not None:
        masks_nothing = targets.hooked_generate_masks_no_padding(RELEASE)
        assert ("stock 8/8" in rows[1][5]) != masks_nothing


def test_batch_lengths_prints_its_table_for_transformer_bridge() -> None:
    """The same through ``TransformerBridge``: stock's shorter rows are wrong exactly where its
    ``generate`` uses no attention mask (3.0 to 3.7); nothing to run before 3.0."""
    rows = _batch_lengths_rows("--api", "bridge")
    assert (rows is None) == (not HAS_BRIDGE)
    if rows is not None:
        from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask

        generate = targets.locate_bridge().bridge_class.__dict__["generate"]
        maskless = bridge_hf_generate_mask.drops_the_attention_mask(inspect.unwrap(generate))
        assert ("stock 8/8" in rows[1][5]) != maskless


@pytest.mark.skipif(HAS_HOOKED_TRANSFORMER, reason="TransformerLens 4.x only")
def test_hooked_architectures_says_4x_has_nothing_to_run() -> None:
    done = run_script("hooked_architectures.py", "--architectures", "LlamaForCausalLM")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "has no HookedTransformer" in done.stdout


def test_hooked_architectures_refuses_an_unknown_architecture() -> None:
    error = refusal("hooked_architectures", "--architectures", "NoSuchForCausalLM")
    assert "NoSuchForCausalLM" in error


def test_half_precision_tolerates_greedy_ties_but_not_a_cache_in_another_dtype() -> None:
    """The architectures benchmark's verdicts: in bfloat16 other tokens within rounding are
    right (a tie between two logits may go either way); in float32 they are not; a cache in
    another dtype than the model's, or with other heads than the config's, is never right;
    far-off logits are wrong."""
    architectures = benchmark_module("bridge_architectures")
    outcome = architectures.Outcome
    tie = outcome(max_rel_err=5e-3, tokens_equal=False, hugging_face_rel_err=0.0, dtype="bfloat16")
    assert tie.right() and not tie.wrong()
    in_float32 = outcome(max_rel_err=5e-5, tokens_equal=False, hugging_face_rel_err=0.0)
    assert not in_float32.right() and not in_float32.wrong()
    widened = outcome(
        max_rel_err=5e-3, tokens_equal=True, hugging_face_rel_err=0.0, dtype="bfloat16",
        cache_dtype="float32",
    )  # fmt: skip
    assert not widened.right()
    stock = outcome(max_rel_err=1.2, tokens_equal=False, hugging_face_rel_err=0.0, dtype="float16")
    assert stock.wrong() and not stock.right()
    assert "cache in float32" in architectures.verdict(widened, stock)
    assert "fixed" in architectures.verdict(tie, stock)
    assert "right in both" in architectures.verdict(tie, tie)
    assert "wrong" in architectures.verdict(stock, stock)
    # Hugging Face's own cached path off by more than WRONG (HRM in bfloat16): within twice
    # that is rounding, not a lost cache; beyond it is wrong.
    chaotic = outcome(
        max_rel_err=0.8, tokens_equal=False, hugging_face_rel_err=1.2, dtype="bfloat16"
    )
    assert chaotic.right() and not chaotic.wrong()
    beyond = outcome(
        max_rel_err=3.0, tokens_equal=False, hugging_face_rel_err=1.2, dtype="bfloat16"
    )
    assert beyond.wrong() and not beyond.right()
    ungrouped = outcome(max_rel_err=0.0, tokens_equal=True, cache_heads=4, expected_heads=2)
    assert not ungrouped.right()
    assert "4 cached heads, 2 expected" in architectures.verdict(ungrouped, stock)
    # NaN logits (a padded row under autocast, stock) with the same, meaningless, tokens.
    nan = outcome(max_rel_err=math.nan, tokens_equal=True, hugging_face_rel_err=0.0)
    assert nan.wrong() and not nan.right()


def test_the_worst_error_of_several_runs_is_nan_when_any_is() -> None:
    """Python's ``max`` keeps a number that comes before a NaN: the sweep reported a padded
    batch's NaN logits as right because the single prompt ran first."""
    assert math.isnan(bridge.worst_error([0.0, math.nan]))
    assert math.isnan(bridge.worst_error([math.nan, 0.0]))
    assert bridge.worst_error([1e-6, 3e-6, 2e-6]) == 3e-6


@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_bridge_architectures_reads_every_prompt_word_by_word() -> None:
    """transformers 5 loads a Qwen2 checkpoint's tokenizer as Qwen2's own class whatever the
    folder says, and that class read each prompt of the tiny word-level tokenizer as a single
    token: the Qwen2 rows checked one-token prompts of equal length, no padding at all."""
    architectures = benchmark_module("bridge_architectures")
    model = architectures.boot(architecture_folder("Qwen2ForCausalLM"))
    tokens = model.to_tokens(list(checks.PROMPTS), padding_side="left")
    assert tokens.shape[1] >= 9, tokens  # "a big old dog sleeps in the quiet house"
    assert (tokens[0] == model.tokenizer.pad_token_id).any(), tokens  # the shorter is padded


def test_bridge_architectures_refuses_an_unknown_architecture() -> None:
    error = refusal("bridge_architectures", "--architectures", "NoSuchForCausalLM")
    assert "unknown ['NoSuchForCausalLM']" in error


#: The largest a tiny checkpoint may be. Every test run saves each one or more times, two test
#: environments at once on CI: Gemma 4's default per-layer embeddings (1.1 GB with its vision
#: tower) filled CI's disk. The largest now is DeepSeek-V4's, 41 MB.
TINY_CHECKPOINT_BYTES = 64 * 2**20

#: The fewest architectures the sweep below must build and compare: with transformers 5.25, 107
#: of the 108 build (Gemma 3n's tower needs PIL); older transformers lack some. Fewer than this
#: means building broke, not that the architectures are missing.
MINIMUM_ARCHITECTURES_CHECKED = 60


@pytest.mark.sweep
@pytest.mark.skipif(not HAS_BRIDGE, reason="needs TransformerBridge")
def test_no_architecture_generates_worse_patched_than_stock() -> None:
    """Every architecture of ``benchmarks/bridge_architectures.py``: cached generation with
    safelens-tl agrees with uncached, or fails exactly as stock does (a TransformerLens problem
    of its own, e.g. Falcon on 3.0). Never wrong where stock is right. (That a fix is kept, where
    stock is wrong, is tested per fix: the Llama and GPT-2 tests, and
    ``test_attention_that_reads_the_cache_in_its_own_forward_generates_right``.) No checkpoint
    is larger than :data:`TINY_CHECKPOINT_BYTES`."""
    architectures = benchmark_module("bridge_architectures")
    oversized = {}
    checked, not_built = [], {}
    for name in architectures.ALL_ARCHITECTURES:
        try:
            folder = architectures.build(name)
        except Exception as error:  # an architecture this transformers lacks, or cannot build
            not_built[name] = architectures.last_line(error)
            continue
        size = sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())
        if size > TINY_CHECKPOINT_BYTES:
            oversized[name] = size
        try:
            patched = architectures.run(folder, active=True)
            stock = patched if patched.right() else architectures.run(folder, active=False)
        finally:
            # A hundred checkpoints, kept to the end of the run, filled CI's disk.
            shutil.rmtree(folder)
        assert stock == patched, (name, patched, stock)
        checked.append(name)
    assert len(checked) >= MINIMUM_ARCHITECTURES_CHECKED, (
        f"{len(checked)} architectures compared; not built: {not_built}"
    )
    assert not oversized, f"checkpoints over {TINY_CHECKPOINT_BYTES} bytes: {oversized}"


def test_a_benchmark_refuses_to_call_stock_patched_when_safelens_tl_does_not_activate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run from a source tree that was never installed, safelens-tl finds no plugin and only
    warns; the sweeps hide warnings, so they reported stock TransformerLens as "patched" (every
    architecture "wrong in both"). The entry points are taken away as that tree has none."""
    from safelens_tl import plugins

    kv_cache = benchmark_module("kv_cache")
    monkeypatch.setattr(plugins, "_sources", lambda: ())
    refused = pytest.raises(RuntimeError, match=r"did not activate.*entry-point")
    with pytest.warns(Warning), refused, kv_cache.patched(True):
        pytest.fail("the block ran although nothing was patched")
    monkeypatch.undo()
    with kv_cache.patched(True):
        assert safelens_tl.status().active


@requires_hooked_transformer
def test_the_patched_generate_launches_no_more_kernels_than_stock() -> None:
    """On a GPU each operation that is not a view is a kernel launch, which bounds a tiny model's
    generation there. Past the small-cache limit (64 KiB per tensor: 80 positions at batch 4
    here), patched writes each step with one ``copy_`` where stock runs one ``cat``; only the
    buffers' allocation and the prompt's write into them are extra. On TransformerLens 3.1-3.9
    the unpadded batch's all-ones mask is left out of attention
    (:mod:`safelens_tl.fixes.hooked.generate_ones_mask`), and on 2.13-3.0.0 the step mask of zeros
    is computed once per ``generate`` (:mod:`safelens_tl.fixes.hooked.zeros_mask`): each saves more
    kernels than those add."""
    operation_counts = benchmark_module("operation_counts")
    counts = operation_counts.count(80, 6, 4)
    stock, patched = counts["stock"], counts["patched"]
    assert stock["cat"] > 0 and patched["copy_"] > 0

    def kernels(ops: Any) -> int:
        return sum(n for op, n in ops.items() if op not in operation_counts.VIEWS)

    from safelens_tl.verify.models import GPT2_LIKE

    layers = int(GPT2_LIKE["n_layers"])
    assert kernels(patched) <= kernels(stock) + 8 * layers
    if targets.hooked_generate_passes_its_mask(RELEASE) or (
        targets.hooked_generate_masks_no_padding(RELEASE)
    ):
        assert kernels(patched) < kernels(stock)
    else:
        assert kernels(stock) <= kernels(patched)


def test_operation_counts_refuses_a_malformed_shape() -> None:
    assert "--shape: expected three positive integers PROMPT,NEW,BATCH; received '1,2'" in (
        refusal("operation_counts", "--shape", "1,2")
    )


@requires_hooked_transformer
def test_forward_in_place_prints_both_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The crossover, forward and rounding sections, on tiny shapes and the built-in tiny Llama
    (the folder given holds no checkpoint)."""
    main = benchmark_module("forward_in_place").main
    assert main(["--quick", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## crossover" in out and "## forward" in out and "## rounding" in out
    crossover = [line for line in out.splitlines() if line.startswith("| 64 ")]
    assert len(crossover) == 6  # projection and linear, three dtypes
    forward = out.split("## forward")[1].split("## rounding")[0].splitlines()
    forward = [line for line in forward if line.startswith("| tiny Llama |")]
    # float32 and bfloat16, two shapes, forward and forward + backward
    assert len(forward) == 8, out
    assert all(line.count("x |") == 1 for line in forward)
    rounding = out.split("## rounding")[1].splitlines()
    rounding = [line.split(" | ") for line in rounding if line.startswith("| tiny Llama | ")]
    assert len(rounding) == 2, out  # one-row forwards and a batch
    assert all(float(cells[2]) > 0 for cells in rounding), rounding  # float32 is not float64


@requires_hooked_transformer
def test_forward_in_place_counts_the_decisions_of_a_forward(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On demand: the decisions one forward of the tiny Llama makes (its query, key and value
    projections at least: two layers), and their cost, in bfloat16 and recorded float32."""
    main = benchmark_module("forward_in_place").main
    assert main(["--section", "decisions", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out.split("## decisions")[1]
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| tiny Llama | ")]
    assert [row[1] for row in rows] == ["bfloat16", "float32"], out
    assert all(int(row[3]) >= 6 and float(row[4]) > 0 for row in rows), rows


def test_forward_in_place_refuses_an_unknown_section() -> None:
    assert "unknown section ['bogus']" in refusal("forward_in_place", "--section", "bogus")


def test_verify_sensitivity_refuses_a_deep_model_without_layers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--layers`` sets the ``deep`` model's depth; below 1 it is a usage error, before any run."""
    verify_sensitivity = benchmark_module("verify_sensitivity")
    with pytest.raises(SystemExit) as exited:
        verify_sensitivity.main(["--model", "deep", "--layers", "0"])
    assert exited.value.code == 2
    assert "--layers: expected at least 1; received 0" in capsys.readouterr().err
