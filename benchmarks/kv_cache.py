"""Benchmark the patched KV cache against stock TransformerLens, in one process.

Run ``python benchmarks/kv_cache.py`` (full, a few minutes on 2 cores) or ``--quick`` (seconds, tiny
sizes, for CI: checks that every measurement runs, not how fast). Stock and patched are measured in
the same process by toggling ``safelens_tl.activate()``/``deactivate()``, alternating, best of
several rounds; peak memory is measured in fresh subprocesses (see :func:`memory_child`), and so
are the short generations with ``--processes N`` (see :func:`bench_generate_in_processes`: the
switching biases them).

What is measured and how is explained in docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch

# Shared with instruction_counts.py; kv_cache.patched and kv_cache.greedy_generate stay the names
# the other benchmarks (and a spy in the tests) use.
from generation import greedy_generate as greedy_generate
from generation import patched as patched
from generation import prompt_tokens

import safelens_tl
from safelens_tl import targets
from safelens_tl.kv import entry as kv_cache
from safelens_tl.kv import storage as kv_storage

BATCH, HEADS, D_HEAD = 4, 8, 64

#: Where models, caches and tensors live: ``--device`` sets it (``cpu`` or ``cuda``).
DEVICE = "cpu"


def now() -> float:
    """``time.perf_counter()`` once the GPU's queued work is done.

    CUDA kernels run after the Python call that queued them returns: without the wait, a timer
    would measure how fast work is queued, not done.
    """
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass(frozen=True)
class Sizes:
    """Every size the benchmark uses; ``--quick`` shrinks them all."""

    append_lengths: tuple[int, ...]
    rounds: int
    stock_appends: int
    patched_appends: int
    # Per-token overhead on the short generation's own shapes: cached lengths, appends, rounds.
    step_lengths: tuple[int, ...]
    step_appends: int
    step_rounds: int
    # Instruction counts (valgrind): (prompt, new tokens) at batch 1, rounds.
    instruction_generations: tuple[tuple[int, int], ...]
    instruction_rounds: int
    # label, prompt, new tokens, batch, rounds; "long" runs on the long model, the rest on the
    # verifier's tiny GPT-2-like model (a generation is short, and noisy on 2 cores).
    generations: tuple[tuple[str, int, int, int, int], ...]
    long_n_ctx: int
    memory_runs: int  # fresh processes per variant; 0: measure in this process (quick)
    # label, prompt, new tokens (max_new_tokens), batch, EOS after this many tokens (0: none)
    memory: tuple[tuple[str, int, int, int, int], ...]
    # Cache bytes per token: label, prompt, max_new_tokens, batch, EOS after (0: none); n_ctx.
    trace: tuple[tuple[str, int, int, int, int], ...]
    trace_n_ctx: int
    # TransformerBridge: (prompt, new, batch) shapes, dtypes, rounds.
    bridge_shapes: tuple[tuple[int, int, int], ...]
    bridge_dtypes: tuple[str, ...]
    bridge_rounds: int


FULL = Sizes(
    (256, 1024, 4096, 8192),
    5,
    4,
    64,
    (8, 32, 128, 512, 2048),
    16,
    15,
    ((8, 48), (1, 16)),
    5,
    (("short", 8, 48, 1, 41), ("shortest", 1, 16, 1, 61), ("long", 640, 160, 4, 9)),
    1024,
    5,
    # The long context's peak is its prompt's attention; the long generation's is the cache.
    # Early EOS: max_new_tokens 960, EOS at the 3rd token; what was planned must not be held.
    (
        ("long context", 640, 160, 4, 0),
        ("long generation", 32, 480, 8, 0),
        ("early EOS", 32, 960, 1, 3),
    ),
    (("normal", 32, 400, 1, 0), ("early EOS", 32, 2000, 1, 3), ("second generate", 32, 400, 1, 0)),
    2048,
    ((8, 48, 1), (256, 128, 2)),
    ("float32", "bfloat16"),
    5,
)
QUICK = Sizes(
    (32, 128),
    1,
    2,
    8,
    (8, 32),
    4,
    1,
    ((1, 2),),
    1,
    (("short", 4, 6, 1, 1), ("shortest", 1, 4, 1, 1), ("long", 24, 8, 2, 1)),
    64,
    0,
    (("long context", 24, 8, 2, 0), ("early EOS", 8, 48, 1, 3)),
    (("normal", 8, 80, 1, 0), ("early EOS", 8, 200, 1, 3), ("second generate", 8, 80, 1, 0)),
    256,
    ((4, 6, 1),),
    ("float32",),
    1,
)


def with_short_rounds(sizes: Sizes, rounds: int) -> Sizes:
    """``sizes`` with ``rounds`` paired rounds for every generation but the long one."""
    generations = tuple(
        (label, prompt, new, batch, old if label == "long" else rounds)
        for label, prompt, new, batch, old in sizes.generations
    )
    return replace(sizes, generations=generations)


#: The measurements, in the order they run; ``--only`` picks some of them.
SECTIONS = (
    "append",
    "step",
    "instructions",
    "generate",
    "memory",
    "trace",
    "autocast",
    "bridge",
)


@dataclass
class Results:
    """Everything measured, in plain numbers (also written as JSON with ``--json``)."""

    machine: dict[str, str] = field(default_factory=dict)
    append: list[dict[str, float]] = field(default_factory=list)
    step: list[dict[str, Any]] = field(default_factory=list)
    instructions: list[dict[str, Any]] = field(default_factory=list)
    generate: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)
    autocast: dict[str, Any] = field(default_factory=dict)
    bridge: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def best_of(
    rounds: int,
    variants: dict[str, Callable[[], float]],
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Run each variant once per round, in turn, and keep each one's smallest result.

    The order changes every round so that each variant runs in each place equally often (see
    :func:`round_order`): none gains from always running first, or always between the others.
    ``samples``, when given, receives every result, in round order.
    """
    best = {name: float("inf") for name in variants}
    for index in range(rounds):
        for name in round_order(list(variants), index):
            run = variants[name]
            gc.collect()
            result = run()
            best[name] = min(best[name], result)
            if samples is not None:
                samples.setdefault(name, []).append(result)
    return best


def round_order(names: list[str], index: int) -> list[str]:
    """The order of ``names`` in round ``index``: rotated by one each round, reversed every other
    cycle (A B C, B C A, C A B, C B A, A C B, B A C for three; A B, B A, B A, A B for two).

    Every ``2 * len(names)`` rounds each name runs in each place equally often, and each pair of
    names runs in either order equally often: with a fixed middle (A B C, C B A) the variant in
    the middle is always timed between the two others.
    """
    shift = index % len(names)
    rotated = names[shift:] + names[:shift]
    return rotated[::-1] if (index // len(names)) % 2 else rotated


def paired_median(
    numerators: list[float], denominators: list[float]
) -> tuple[float, tuple[float, float]]:
    """Median over rounds of one variant's time over the other's in the same round, and its 95%
    interval (:func:`median_interval`).

    A second estimate next to the ratio of bests: on a shared 2-core machine a round is sometimes
    twice as slow for reasons of its own, and a pair run back to back shares most of that.
    """
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return statistics.median(ratios), median_interval(ratios)


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values``.

    Between the ``j``-th smallest and the ``j``-th largest of ``n`` values lies the true median
    with probability ``1 - 2 P(B < j)``, ``B`` binomial with ``n`` trials and p = 1/2 (each value
    falls below the median with probability 1/2), whatever the distribution: round times on a
    shared machine have heavy tails, so no shape is assumed. ``j`` is the largest that keeps that
    probability at least ``confidence``. Below 6 values even the whole range holds the median
    with less than 95%; it is returned all the same.
    """
    if not values:
        raise ValueError("median_interval: expected at least one value; received none")
    if not 0 < confidence < 1:
        raise ValueError(f"median_interval: expected 0 < confidence < 1; received {confidence}")
    ordered = sorted(values)
    count = len(ordered)
    # Exact integers: 2**count overflows a float from about 1,000 rounds on.
    allowed = Fraction(1 - confidence) * 2**count  # what 2 * (ways for B < j) may reach
    j, ways_below, ways_at_j = 1, 1, count  # ways for B < 1, ways for B == 1
    while j < (count + 1) // 2 and 2 * (ways_below + ways_at_j) <= allowed:
        ways_below += ways_at_j
        ways_at_j = ways_at_j * (count - j) // (j + 1)
        j += 1
    return ordered[j - 1], ordered[count - j]


# Append -----------------------------------------------------------------------------------------


def _append_cfg(
    layout: targets.Layout, n_ctx: int, heads: int = HEADS, d_head: int = D_HEAD
) -> Any:
    return layout.config_class()(
        d_model=heads * d_head,
        d_head=d_head,
        n_heads=heads,
        n_layers=1,
        n_ctx=n_ctx,
        act_fn="relu",
        dtype=torch.float32,
    )


def _step() -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(BATCH, 1, HEADS, D_HEAD), _randn(BATCH, 1, HEADS, D_HEAD)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def _time_appends(entry: Any, count: int) -> float:
    """Seconds per append, over ``count`` consecutive one-token appends."""
    keys, values = _step()
    append = entry.append
    start = now()
    for _ in range(count):
        append(keys, values)
    return (now() - start) / count


def stock_append(layout: targets.Layout, cached: int, count: int) -> float:
    """Stock ``torch.cat`` append with ``cached`` positions already in the entry."""
    cfg = _append_cfg(layout, 2 * cached + count)
    with patched(False), torch.inference_mode():
        entry_class: Any = layout.entry_class
        entry = entry_class.init_cache_entry(cfg, DEVICE, BATCH)
        entry.past_keys = _randn(BATCH, cached, HEADS, D_HEAD)
        entry.past_values = _randn(BATCH, cached, HEADS, D_HEAD)
        return _time_appends(entry, count)


def patched_append(layout: targets.Layout, cached: int, count: int, amortized: bool) -> float:
    """Patched append with ``cached`` positions in the entry.

    Steady state (``amortized=False``): the buffer has room, as between two regrowths. Amortized:
    the buffer starts exactly full, so the timed appends include one regrowth (a copy of the whole
    past), spread over the appends of one full growth cycle (``cached // 4``).
    """
    cfg = _append_cfg(layout, 2 * cached + count)
    with patched(True), torch.inference_mode():
        entry_class: Any = layout.entry_class
        entry = entry_class.init_cache_entry(cfg, DEVICE, BATCH)
        prompt_keys = _randn(BATCH, cached, HEADS, D_HEAD)
        prompt_values = _randn(BATCH, cached, HEADS, D_HEAD)
        with kv_storage.reserve(cached if amortized else cached + count):
            entry.append(prompt_keys, prompt_values)
        return _time_appends(entry, max(cached // 4, 1) if amortized else count)


def raw_write(cached: int, count: int) -> float:
    """The lower bound: write one token's keys and values into preallocated buffers."""
    key_buffer = torch.empty(BATCH, cached + count, HEADS, D_HEAD, device=DEVICE)
    value_buffer = torch.empty(BATCH, cached + count, HEADS, D_HEAD, device=DEVICE)
    keys, values = _step()
    position = [cached]

    def write(new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        at = position[0]
        key_buffer.narrow(1, at, 1).copy_(new_keys)
        value_buffer.narrow(1, at, 1).copy_(new_values)
        position[0] = at + 1

    with torch.inference_mode():
        start = now()
        for _ in range(count):
            write(keys, values)
        return (now() - start) / count


def regrowth_floor(cached: int) -> float:
    """Per append, the least any cache with at most 25% spare capacity pays for regrowing.

    Such a cache must, once every ``cached / 4`` appends, move ``cached`` positions of keys and
    values into fresh memory 1.25 times larger: here one contiguous ``copy_`` each, the cheapest
    form of that move, spread over the growth cycle. Add the raw write to get the floor.
    """
    past_keys = _randn(BATCH, cached, HEADS, D_HEAD)
    past_values = _randn(BATCH, cached, HEADS, D_HEAD)
    capacity = kv_storage.capacity_for(cached + 1, None)
    with torch.inference_mode():
        start = now()
        for past in (past_keys, past_values):
            fresh = torch.empty(BATCH, capacity, HEADS, D_HEAD, device=DEVICE)
            fresh.narrow(1, 0, cached).copy_(past)
        return (now() - start) / max(cached // 4, 1)


def bench_append(layout: targets.Layout, sizes: Sizes, results: Results) -> None:
    """Append cost at each cached length: stock, patched (steady, amortized), raw write, floor."""
    for cached in sizes.append_lengths:
        best = best_of(
            sizes.rounds,
            {
                "stock": functools.partial(stock_append, layout, cached, sizes.stock_appends),
                "patched": functools.partial(
                    patched_append, layout, cached, sizes.patched_appends, False
                ),
                "amortized": functools.partial(patched_append, layout, cached, 0, True),
                "raw": functools.partial(raw_write, cached, sizes.patched_appends),
                "regrowth": functools.partial(regrowth_floor, cached),
            },
        )
        row = {"cached": cached, **{k: v * 1e6 for k, v in best.items()}}
        row["floor"] = row.pop("regrowth") + row["raw"]
        results.append.append(row)


# Per-token overhead -----------------------------------------------------------------------------


def _tiny_shape() -> tuple[int, int]:
    """Heads and d_head of the verifier's GPT-2-like model, the short generation's model."""
    from safelens_tl.verify import models

    return int(models.GPT2_LIKE["n_heads"]), int(models.GPT2_LIKE["d_head"])


#: The per-token variants: stock; patched as users get it (a cache up to SMALL_CACHE_BYTES is
#: appended with torch.cat, a larger one written in place); patched with every cache in a buffer.
STEP_VARIANTS: dict[str, int | None] = {
    "stock": None,
    "patched": kv_storage.SMALL_CACHE_BYTES,
    "buffer": 0,
}


def step_append(layout: targets.Layout, cached: int, count: int, variant: str) -> float:
    """Seconds per one-token append on the short generation's shape (batch 1), ``cached`` past.

    Stock appends with ``torch.cat``. Patched, the past was written as ``generate`` writes a
    prompt under its plan, under the variant's small-cache limit (:data:`STEP_VARIANTS`).
    """
    heads, d_head = _tiny_shape()
    cfg = _append_cfg(layout, cached + count, heads, d_head)
    past_keys, past_values = (
        _randn(1, cached, heads, d_head),
        _randn(1, cached, heads, d_head),
    )
    keys, values = _randn(1, 1, heads, d_head), _randn(1, 1, heads, d_head)
    limit = STEP_VARIANTS[variant]
    with patched(limit is not None), torch.inference_mode():
        entry_class: Any = layout.entry_class
        entry = entry_class.init_cache_entry(cfg, DEVICE, 1)
        if limit is not None:
            with kv_storage.reserve_ahead(count), kv_storage.small_cache_limit(limit):
                entry.append(past_keys, past_values)
        else:
            entry.past_keys, entry.past_values = past_keys, past_values
        append = entry.append
        start = now()
        for _ in range(count):
            append(keys, values)
        return (now() - start) / count


def appends_in_generate(
    layout: targets.Layout, model: Any, tokens: torch.Tensor, new: int, variant: str
) -> float:
    """Seconds per call of the entry's ``append`` inside one real ``generate`` (all layers, all
    steps, the prompt's write included).

    Unlike :func:`step_append`, whose loop keeps everything in the CPU's caches, here TL's own
    forward pass runs between two appends, as it does for users. The timer around each call
    costs about 0.1 µs, the same for every variant.
    """
    entry_class: Any = layout.entry_class
    spent = [0.0, 0]
    limit = STEP_VARIANTS[variant]
    with patched(limit is not None), kv_storage.small_cache_limit(limit or 0):
        append = entry_class.__dict__["append"]

        def timed(self: Any, new_keys: torch.Tensor, new_values: torch.Tensor) -> Any:
            start = now()
            result = append(self, new_keys, new_values)
            spent[0] += now() - start
            spent[1] += 1
            return result

        # Set and restored here, inside the activation, so deactivation sees its own function.
        entry_class.append = timed
        try:
            greedy_generate(model, tokens, new)
        finally:
            entry_class.append = append
    return spent[0] / max(int(spent[1]), 1)


def bench_step(layout: targets.Layout, sizes: Sizes, results: Results) -> None:
    """Per-token cost of one append at small cached lengths, stock ``torch.cat`` and patched
    (as users get it, and with buffers only); and per append inside a real short ``generate``
    (where the release has HookedTransformer)."""
    for cached in sizes.step_lengths:
        best = best_of(
            sizes.step_rounds,
            {
                variant: functools.partial(step_append, layout, cached, sizes.step_appends, variant)
                for variant in STEP_VARIANTS
            },
        )
        results.step.append({"cached": cached, **{k: v * 1e6 for k, v in best.items()}})
    if not layout.known.has_hooked_transformer:
        return
    from safelens_tl.verify.models import build_model

    model = build_model("gpt2-like", torch.float32, DEVICE)
    _, prompt, new, batch, rounds = sizes.generations[0]
    tokens = _tokens(model, prompt, batch)
    samples: dict[str, list[float]] = {}
    best_of(
        rounds,
        {
            variant: functools.partial(appends_in_generate, layout, model, tokens, new, variant)
            for variant in STEP_VARIANTS
        },
        samples,
    )
    results.step.append(
        {
            "cached": -1,
            "generation": f"{prompt}+{new}",
            **{k: statistics.median(v) * 1e6 for k, v in samples.items()},
        }
    )


# Instructions -----------------------------------------------------------------------------------


def bench_instructions(sizes: Sizes, results: Results) -> None:
    """Instructions per ``generate``, stock and patched, counted by valgrind (see
    ``benchmarks/instruction_counts.py``); skipped with a note where valgrind is missing."""
    import instruction_counts  # this script's own folder is on sys.path

    if DEVICE != "cpu":
        results.notes.append("instructions skipped: valgrind counts the CPU's instructions only")
        return
    rows, reason = instruction_counts.measure(
        sizes.instruction_generations, sizes.instruction_rounds
    )
    if reason is not None:
        results.notes.append(f"instructions skipped: {reason}")
    results.instructions = rows


# Generate ---------------------------------------------------------------------------------------


#: Wider than the GPT-2-like model (d_model 512): its cache (tens of MiB) dominates the noise of a
#: process's resident memory (allocator retention, library workspaces: a few MiB run to run).
MEMORY_WIDTH = {"d_model": 512, "n_heads": 8, "d_head": 64, "d_mlp": 1024}


def long_model(n_ctx: int, wide: bool = False) -> Any:
    """The GPT-2-like model of safelens_tl.verify with ``n_ctx`` tokens (``wide``: d_model 512)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from safelens_tl.verify import models

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        **{**models.GPT2_LIKE, "n_ctx": n_ctx, **(MEMORY_WIDTH if wide else {})},
        d_vocab=models.vocab_size(),
        dtype=torch.float32,
        device=DEVICE,
        seed=0,
    )
    model = HookedTransformer(cfg, tokenizer=models.load_tokenizer()).eval()
    # Padded with BOS, not id 0: TransformerLens 2.13-3.0.0's generate drops this model's learned
    # positions for a pad id of 0 and safelens-tl does not (safelens_tl.fixes.hooked.generate_mask),
    # so stock and patched would generate other tokens, and stop at EOS at other steps. (Set on
    # the model's tokenizer: TransformerLens loads its own copy of the one it is given.)
    model.tokenizer.pad_token_id = model.tokenizer.bos_token_id
    return model


def _tokens(model: Any, prompt: int, batch: int) -> torch.Tensor:
    return prompt_tokens(model, prompt, batch, DEVICE)


#: How a generation is timed: wall-clock seconds, or this process's CPU seconds (all threads),
#: which other processes on a shared machine disturb less; with ``--threads 1`` it is the
#: steadier measure of the two.
CLOCKS: dict[str, Callable[[], float]] = {"wall": now, "cpu": time.process_time}


def time_generate(
    model: Any, tokens: torch.Tensor, new: int, on: bool, clock: str = "wall", warm: bool = False
) -> float:
    """Seconds (by ``clock``) for one greedy cached generation of ``new`` tokens.

    ``warm``: run the same generation once untimed first. Switching the patches on or off
    changes TransformerLens's classes, which sends Python's specialized bytecode back to its
    generic form for a while (docs/performance.md, "Method and noise"); a user switches
    once, so only the steady state is timed. Worth it where that is a visible share: short
    generations.
    """
    with patched(on):
        if warm:
            greedy_generate(model, tokens, new)
        start = CLOCKS[clock]()
        greedy_generate(model, tokens, new)
        return CLOCKS[clock]() - start


def bench_generate(
    sizes: Sizes, results: Results, clock: str = "wall", short_model_name: str = "gpt2-like"
) -> None:
    """Tokens per second of ``generate`` at each of ``sizes.generations``, stock and patched;
    the short generations on the verifier model ``short_model_name``."""
    from safelens_tl.verify.models import build_model

    short_model = build_model(short_model_name, torch.float32, DEVICE)
    for label, prompt, new, batch, rounds in sizes.generations:
        model = long_model(sizes.long_n_ctx) if label == "long" else short_model
        tokens = _tokens(model, prompt, batch)
        time_generate(model, tokens, new, True)  # warm-up: first-call costs are no one's
        time_generate(model, tokens, new, False)
        samples: dict[str, list[float]] = {}
        warm = label != "long"
        timed = functools.partial(time_generate, model, tokens, new, clock=clock, warm=warm)
        best = best_of(
            rounds,
            {
                "stock": functools.partial(timed, on=False),
                "patched": functools.partial(timed, on=True),
                # Stock once more: stock against itself (an A/A test) is this method's noise.
                "stock again": functools.partial(timed, on=False),
            },
            samples,
        )
        paired, paired_interval = paired_median(samples["stock"], samples["patched"])
        same, same_interval = paired_median(samples["stock"], samples["stock again"])
        results.generate.append(
            {
                "context": row_context(label, short_model_name),
                "prompt": prompt,
                "new": new,
                "batch": batch,
                "stock": batch * new / best["stock"],
                "patched": batch * new / best["patched"],
                "rounds": rounds,
                "paired": paired,
                "paired_interval": paired_interval,
                "stock_vs_stock": same,
                "stock_vs_stock_interval": same_interval,
                "clock": clock,
            }
        )


def _short_only(sizes: Sizes, short: bool) -> Sizes:
    """``sizes`` with only the short generations (``short``) or only the long one."""
    chosen = tuple(size for size in sizes.generations if (size[0] != "long") == short)
    return replace(sizes, generations=chosen)


#: Untimed generations a fresh process runs first: the first call pays for lazy set-up, and
#: Python specializes its bytecode over the next few calls.
PROCESS_WARM_UPS = 3


def row_context(label: str, short_model_name: str) -> str:
    """A ``generate`` row's context: its label, and the model of a short one where it is not the
    default (``--short-model``)."""
    named = label == "long" or short_model_name == "gpt2-like"
    return label if named else f"{label}, {short_model_name}"


def generate_child(variant: str, sizes: Sizes, clock: str, short_model_name: str) -> None:
    """Print (JSON) each short generation's seconds, fewest and median of its rounds, measured in
    this fresh process with safelens-tl active throughout (``variant`` "patched") or never.

    Nothing is switched on or off while timing, as in a user's process.
    """
    from safelens_tl.verify.models import build_model

    rows = []
    with patched(variant == "patched"):
        model = build_model(short_model_name, torch.float32, DEVICE)
        for label, prompt, new, batch, rounds in _short_only(sizes, short=True).generations:
            tokens = _tokens(model, prompt, batch)
            for _ in range(PROCESS_WARM_UPS):
                greedy_generate(model, tokens, new)
            seconds = []
            for _ in range(rounds):
                gc.collect()
                start = CLOCKS[clock]()
                greedy_generate(model, tokens, new)
                seconds.append(CLOCKS[clock]() - start)
            row = {"context": label, "prompt": prompt, "new": new, "batch": batch}
            rows.append({**row, "best": min(seconds), "median": statistics.median(seconds)})
    print(json.dumps(rows))


#: The processes of one pair, in :func:`round_order`: stock against itself is the noise.
PROCESS_VARIANTS = ("stock", "patched", "stock again")


def combine_processes(
    per_pair: list[dict[str, list[dict[str, Any]]]], rounds: dict[str, int], clock: str
) -> list[dict[str, Any]]:
    """The ``generate`` rows of pairs of processes, one per variant of :data:`PROCESS_VARIANTS`
    each (:func:`generate_child`'s rows by variant, ``rounds`` by generation).

    A pair's ratio is stock's median seconds over patched's; a row gives the median over pairs
    and its 95% interval (:func:`median_interval`); tokens per second are the best seen.
    """
    if not per_pair:
        raise ValueError("combine_processes: expected at least one pair of processes")
    rows = []
    for index, row in enumerate(per_pair[0]["stock"]):
        label = row["context"]
        runs = {name: [pair[name][index] for pair in per_pair] for name in PROCESS_VARIANTS}
        if any(run["context"] != label for each in runs.values() for run in each):
            raise ValueError(f"combine_processes: expected every process to measure {label!r}")
        medians = {name: [run["median"] for run in each] for name, each in runs.items()}
        paired = [a / b for a, b in zip(medians["stock"], medians["patched"], strict=True)]
        again, again_interval = paired_median(medians["stock"], medians["stock again"])
        tokens = row["batch"] * row["new"]
        combined = {key: row[key] for key in ("context", "prompt", "new", "batch")}
        combined["stock"] = tokens / min(run["best"] for run in runs["stock"])
        combined["patched"] = tokens / min(run["best"] for run in runs["patched"])
        combined["rounds"] = rounds[label]
        combined["paired"] = statistics.median(paired)
        combined["paired_interval"] = median_interval(paired)
        combined["stock_vs_stock"] = again
        combined["stock_vs_stock_interval"] = again_interval
        combined["clock"] = clock
        combined["processes"] = len(per_pair)
        combined["process_paired"] = paired
        rows.append(combined)
    return rows


def bench_generate_in_processes(
    sizes: Sizes,
    results: Results,
    child_options: list[str],
    pairs: int,
    clock: str = "wall",
    short_model_name: str = "gpt2-like",
) -> None:
    """:func:`bench_generate`, its short generations measured in ``pairs`` of fresh processes,
    one process per variant, one process at a time (``child_options``: this run's options for
    them), combined by :func:`combine_processes`; the long generation in this process, as
    without ``--processes``.

    Why not in one process: switching the patches on or off changes TransformerLens's classes,
    and Python's specialized bytecode falls back to its generic form each time, waiting longer
    after each fall (up to 4,096 runs of an instruction in 3.11) before it specializes again.
    After many switches, whichever variant the history hurts runs slower for hundreds of
    generations: stock ran 1.4-1.9x slower after 200 switches (docs/performance.md, "Method and
    noise").
    """
    from rich.console import Console
    from rich.progress import track

    env = {**os.environ, "SAFELENS_TL_AUTOPATCH": "0", "HF_HUB_OFFLINE": "1"}
    per_pair: list[dict[str, list[dict[str, Any]]]] = []
    progress = Console(stderr=True)  # stdout holds the tables
    for index in track(range(pairs), "short generations, fresh processes", console=progress):
        pair = {}
        for name in round_order(list(PROCESS_VARIANTS), index):
            variant = "patched" if name == "patched" else "stock"
            command = [sys.executable, __file__, *child_options, "--generate-child", variant]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"a --generate-child process failed: {done.stderr[-2000:]}")
            pair[name] = json.loads(done.stdout.strip().splitlines()[-1])
        per_pair.append(pair)
    rounds = {size[0]: size[4] for size in sizes.generations}
    for row in combine_processes(per_pair, rounds, clock):
        results.generate.append({**row, "context": row_context(row["context"], short_model_name)})
    bench_generate(_short_only(sizes, short=False), results, clock, short_model_name)


# Peak memory ------------------------------------------------------------------------------------


def _proc_status(field_name: str) -> int:
    """A ``/proc/self/status`` field in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _stop_token(model: Any, tokens: torch.Tensor, after: int) -> int:
    """The token greedy generation produces at step ``after``: as EOS, it stops it there (or
    earlier, where that token came before)."""
    generated = model.generate(
        tokens, max_new_tokens=after, do_sample=False, stop_at_eos=False, verbose=False
    )
    return int(generated[0, -1])


def _stopping(stop_token: int | None) -> dict[str, Any]:
    """``generate`` keywords: stop at ``stop_token`` as EOS, or never stop early (``None``)."""
    if stop_token is None:
        return {"stop_at_eos": False}
    return {"stop_at_eos": True, "eos_token_id": stop_token}


def generation_rise(
    model: Any, tokens: torch.Tensor, new: int, on: bool, stop_after: int = 0
) -> int:
    """Bytes by which one generation raises this process's peak resident memory (Linux).

    Writing ``5`` to ``/proc/self/clear_refs`` resets the peak (``VmHWM``) to the current RSS just
    before ``generate``; the peak afterwards minus the RSS before is what the generation needed.
    ``stop_after``: make the token generated at that step the EOS token (an early stop).
    """
    stop = _stopping(_stop_token(model, tokens, stop_after) if stop_after else None)
    with patched(on):
        model.generate(tokens, max_new_tokens=2, do_sample=False, verbose=False)  # warm-up
        gc.collect()
        if DEVICE != "cpu":  # the cache is in the GPU's memory: its allocator's peak instead
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model.generate(tokens, max_new_tokens=new, do_sample=False, verbose=False, **stop)
            return torch.cuda.max_memory_allocated() - before
        before = _proc_status("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        model.generate(tokens, max_new_tokens=new, do_sample=False, verbose=False, **stop)
        return _proc_status("VmHWM") - before


def memory_child(
    variant: str, prompt: int, new: int, batch: int, n_ctx: int, stop_after: int
) -> None:
    """Print (JSON) :func:`generation_rise` for one variant, in this fresh process.

    Started with ``MALLOC_MMAP_THRESHOLD_`` low, so that freed tensor memory goes straight back to
    the system and RSS follows live memory rather than what glibc keeps for reuse.
    """
    model = long_model(n_ctx, wide=True)
    tokens = _tokens(model, prompt, batch)
    rise = generation_rise(model, tokens, new, variant == "patched", stop_after)
    print(json.dumps({"variant": variant, "rise": rise}))


def bench_memory(sizes: Sizes, results: Results) -> None:
    """Peak RSS rise of long generations, stock and patched, each in fresh subprocesses."""
    if DEVICE == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        results.notes.append("peak memory skipped: needs Linux /proc/self/clear_refs")
        return
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        # One arena, trimmed at once: the heap's own retention stays out of the measurement.
        "MALLOC_TRIM_THRESHOLD_": "0",
        "MALLOC_ARENA_MAX": "1",
        "SAFELENS_TL_AUTOPATCH": "0",
        "HF_HUB_OFFLINE": "1",
    }
    for label, prompt, new, batch, stop_after in sizes.memory:
        rises: dict[str, list[int]] = {"stock": [], "patched": []}
        if not sizes.memory_runs:  # quick: same measurement in this process, no fresh start
            model = long_model(sizes.long_n_ctx, wide=True)
            tokens = _tokens(model, prompt, batch)
            for variant in rises:
                on = variant == "patched"
                rises[variant].append(generation_rise(model, tokens, new, on, stop_after))
        for _ in range(sizes.memory_runs):
            for variant in rises:
                command = [sys.executable, __file__, "--threads", str(torch.get_num_threads())]
                command += ["--device", DEVICE]
                command += ["--memory-child", variant]
                numbers = (prompt, new, batch, sizes.long_n_ctx, stop_after)
                command += [str(number) for number in numbers]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                rises[variant].append(json.loads(done.stdout.strip().splitlines()[-1])["rise"])
        row: dict[str, Any] = {"shape": label, "prompt": prompt, "new": new, "batch": batch}
        row["stop_after"] = stop_after
        for variant, values in rises.items():
            row[variant] = float(sorted(values)[len(values) // 2])
        row["runs"] = sizes.memory_runs
        generated = stop_after or new
        row["cache_bytes"] = float(cache_bytes(prompt + generated - 1, batch))
        results.memory.append(row)


def cache_bytes(positions: int, batch: int) -> int:
    """Bytes of the whole fp32 cache of the wide long model at ``positions`` positions."""
    from safelens_tl.verify import models

    per_position = 2 * MEMORY_WIDTH["n_heads"] * MEMORY_WIDTH["d_head"] * 4
    return int(models.GPT2_LIKE["n_layers"] * batch * positions * per_position)


# Cache bytes per token --------------------------------------------------------------------------


def held_bytes(entries: list[Any]) -> int:
    """Bytes of the distinct storages behind these cache entries (spare capacity included).

    Counts what each entry's ``past_keys``/``past_values`` view and, patched, what its storage
    object keeps, so a buffer held beyond the views would be counted too.
    """
    sizes: dict[int, int] = {}
    for entry in entries:
        tensors = [entry.past_keys, entry.past_values]
        storage = entry.__dict__.get("_safelens_storage")
        if storage is not None:
            tensors += [storage.keys, storage.values]
        for tensor in tensors:
            untyped = tensor.untyped_storage()
            sizes[untyped.data_ptr()] = untyped.nbytes()
    return sum(sizes.values())


class CacheTracer:
    """Records, after every forward pass of ``generate``, the bytes its KV cache holds.

    ``generate`` calls ``forward`` directly (no module hooks there), but each block is called
    with its cache entry (``past_kv_cache_entry=``) and ``unembed`` ends every pass: the entries
    are collected by pre-hooks on the blocks and measured by a hook on ``unembed``. Entries of
    earlier generations are kept as weak references, so that anything they still hold while a
    later generation runs is measured too.
    """

    def __init__(self, model: Any) -> None:
        self.steps: list[int] = []
        self.earlier_held: list[int] = []
        self._current: list[Any] = []
        self._generation: list[Any] = []
        self._earlier: list[weakref.ref[Any]] = []
        self._handles = [
            block.register_forward_pre_hook(self._entry, with_kwargs=True) for block in model.blocks
        ]
        self._handles.append(model.unembed.register_forward_hook(self._pass_done))

    def _entry(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        entry = kwargs.get("past_kv_cache_entry")
        if entry is not None:
            self._current.append(entry)

    def _pass_done(self, module: Any, args: Any, output: Any) -> None:
        if self._current:
            earlier = [entry for ref in self._earlier if (entry := ref()) is not None]
            self.steps.append(held_bytes(self._current))
            self.earlier_held.append(held_bytes(earlier))
            self._generation = self._current
        self._current = []

    def next_generation(self) -> None:
        """Start a new trace; the entries of the last generation are only weakly referenced."""
        self._earlier += [weakref.ref(entry) for entry in self._generation]
        self._generation, self.steps, self.earlier_held = [], [], []

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()


def trace_generate(
    model: Any, tokens: torch.Tensor, new: int, on: bool, stop_token: int | None, runs: int
) -> tuple[list[int], int]:
    """Cache bytes after each forward pass of the last of ``runs`` generations, and the most
    bytes earlier generations' caches still held meanwhile."""
    stop = _stopping(stop_token)
    with patched(on):
        tracer = CacheTracer(model)
        try:
            for _ in range(runs):
                tracer.next_generation()
                model.generate(tokens, max_new_tokens=new, do_sample=False, verbose=False, **stop)
        finally:
            tracer.remove()
    return tracer.steps, max(tracer.earlier_held, default=0)


def bench_trace(sizes: Sizes, results: Results) -> None:
    """KV cache bytes after every token, stock and patched, against the memory bound
    (docs/performance.md)."""
    model = long_model(sizes.trace_n_ctx)
    cfg = model.cfg
    heads = kv_cache.key_value_heads(cfg)
    for label, prompt, new, batch, stop_after in sizes.trace:
        tokens = _tokens(model, prompt, batch)
        stop_token = _stop_token(model, tokens, stop_after) if stop_after else None
        runs = 2 if label == "second generate" else 1
        stock, stock_earlier = trace_generate(model, tokens, new, False, stop_token, runs)
        ours, our_earlier = trace_generate(model, tokens, new, True, stop_token, runs)
        position = cfg.n_layers * batch * 2 * heads * cfg.d_head * 4  # fp32 keys and values
        growth_step = kv_storage.PLAN_STEP * position
        bounds = [max(s * 5 // 4, s + growth_step) for s in stock]
        results.trace.append(
            {
                "case": label,
                "prompt": prompt,
                "max_new": new,
                "batch": batch,
                "stop_after": stop_after,
                "position_bytes": position,
                "growth_step_bytes": growth_step,
                "stock": stock,
                "patched": ours,
                "within_bound": len(stock) == len(ours)
                and all(o <= b for o, b in zip(ours, bounds, strict=True)),
                "worst_ratio": max(o / s for o, s in zip(ours, stock, strict=False) if s),
                "worst_excess_positions": max(
                    (o - s) / position for o, s in zip(ours, stock, strict=False)
                ),
                "stock_earlier": stock_earlier,
                "patched_earlier": our_earlier,
            }
        )


# Autocast ---------------------------------------------------------------------------------------


def autocast_cache(model: Any, tokens: torch.Tensor, steps: int, on: bool) -> dict[str, Any]:
    """Run cached forwards under bf16 ``torch.autocast``; report cache dtype and bytes."""
    layout = targets.locate()
    autocast = torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16)
    with patched(on), torch.inference_mode(), autocast:
        cache_class: Any = layout.cache_class
        cache = cache_class.init_cache(model.cfg, DEVICE, tokens.size(0))
        logits = model(tokens, past_kv_cache=cache)
        for _ in range(steps):
            logits = model(logits[:, -1:].argmax(-1), past_kv_cache=cache)
    used = reserved = 0
    for entry in cache.entries:
        for tensor in (entry.past_keys, entry.past_values):
            used += tensor.numel() * tensor.element_size()
        storage = entry.__dict__.get("_safelens_storage")
        reserved += storage.reserved_bytes if storage is not None else 0
    dtype = cache.entries[0].past_keys.dtype
    return {"dtype": str(dtype).removeprefix("torch."), "used": used, "reserved": reserved or used}


def bench_autocast(sizes: Sizes, results: Results) -> None:
    """Cache bytes of an fp32 model run under bf16 autocast, stock and patched."""
    prompt, new, batch = next(shape[1:4] for shape in sizes.generations if shape[0] == "long")
    model = long_model(sizes.long_n_ctx)
    tokens = _tokens(model, prompt, batch)
    results.autocast = {
        "stock": autocast_cache(model, tokens, new - 1, False),
        "patched": autocast_cache(model, tokens, new - 1, True),
    }


# TransformerBridge -------------------------------------------------------------------------------


def bench_bridge(sizes: Sizes, results: Results) -> None:
    """The ``TransformerBridge`` table of ``benchmarks/bridge_generate.py``, at these sizes."""
    import bridge_generate  # this script's own folder is on sys.path

    results.bridge = bridge_generate.measure(
        sizes.bridge_dtypes, sizes.bridge_shapes, sizes.bridge_rounds, DEVICE
    )
    safelens_tl.deactivate()


# Report -----------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """CPU model, cores, versions and date."""
    model_name = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu": model_name,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "transformer-lens": targets.installed_release() or "?",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "load average": "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
        "device": DEVICE if DEVICE == "cpu" else f"{DEVICE} ({torch.cuda.get_device_name()})",
    }


def _ratio(value: float) -> str:
    return f"{value:,.1f}x" if value >= 10 else f"{value:.2f}x"


def _with_interval(ratio: float, interval: tuple[float, float]) -> str:
    # Three decimals: the intervals of a long run are a fraction of a percent wide.
    return f"{ratio:.3f}x ({interval[0]:.3f}-{interval[1]:.3f})"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.2f}" if whole > 0 else "n/a"


def report(results: Results) -> None:
    """Print the tables with rich."""
    from rich.console import Console
    from rich.table import Table

    # Wide enough for every column when the output is a file or a pipe (CI logs, the docs).
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(" ".join(f"{k}: {v};" for k, v in results.machine.items()))
    title = f"append (batch {BATCH}, {HEADS} heads, d_head {D_HEAD}, fp32)"
    times = Table(title=f"{title}, µs")
    for column in ("cached", "stock", "patched", "amortized", "raw write", "25% floor"):
        times.add_column(column, justify="right")
    ratios = Table(title=f"{title}, ratios")
    for column in (
        "cached",
        "stock/patched",
        "stock/amortized",
        "patched/raw",
        "amortized/raw",
        "floor/raw",
        "amortized/floor",
    ):
        ratios.add_column(column, justify="right")
    for row in results.append:
        cached = str(int(row["cached"]))
        times.add_row(
            cached, *(f"{row[k]:,.1f}" for k in ("stock", "patched", "amortized", "raw", "floor"))
        )
        ratios.add_row(
            cached,
            _ratio(row["stock"] / row["patched"]),
            _ratio(row["stock"] / row["amortized"]),
            _ratio(row["patched"] / row["raw"]),
            _ratio(row["amortized"] / row["raw"]),
            _ratio(row["floor"] / row["raw"]),
            _ratio(row["amortized"] / row["floor"]),
        )
    if results.append:
        console.print(times)
        console.print(ratios)
    if results.step:
        heads, d_head = _tiny_shape()
        table = Table(
            title=f"per-token append on the short generation's shape (batch 1, {heads} heads, "
            f"d_head {d_head}, fp32), µs"
        )
        columns = ["cached", "cached KiB", "stock torch.cat", "patched", "patched - stock"]
        columns += ["stock/patched", "buffer only", "stock/buffer"]
        for column in columns:
            table.add_column(column, justify="right")
        for row in results.step:
            where, kib = str(int(row["cached"])), f"{row['cached'] * heads * d_head * 4 / 1024:g}"
            if row["cached"] < 0:  # inside generate: median of rounds, mean over its appends
                where, kib = f"in generate {row['generation']}", ""
            table.add_row(
                where,
                kib,
                f"{row['stock']:.2f}",
                f"{row['patched']:.2f}",
                f"{row['patched'] - row['stock']:+.2f}",
                _ratio(row["stock"] / row["patched"]),
                f"{row['buffer']:.2f}",
                _ratio(row["stock"] / row["buffer"]),
            )
        console.print(table)
    if results.instructions:
        import instruction_counts

        console.print(instruction_counts.table(results.instructions))
    if results.generate:
        rounds = "/".join(str(int(row["rounds"])) for row in results.generate)
        clock = "CPU time" if results.generate[0].get("clock") == "cpu" else "wall clock"
        processes = max(int(row.get("processes", 1)) for row in results.generate)
        title = f"generate, greedy, cached: tokens/s ({clock}), best of {rounds} rounds"
        if processes > 1:
            title += f"; short ones: medians over {processes} pairs of fresh processes"
        table = Table(title=title)
        for column in ("context", "prompt+new", "batch", "stock", "patched", "patched/stock"):
            table.add_column(column, justify="right")
        table.add_column("median of pairs (95% CI)", justify="right")
        table.add_column("stock/stock (noise, 95% CI)", justify="right")
        if processes > 1:
            table.add_column("pairs: lowest-highest", justify="right")
        for run in results.generate:
            cells = [
                str(run["context"]),
                f"{int(run['prompt'])}+{int(run['new'])}",
                str(int(run["batch"])),
                f"{run['stock']:,.0f}",
                f"{run['patched']:,.0f}",
                _ratio(run["patched"] / run["stock"]),
                _with_interval(run["paired"], run["paired_interval"]),
                _with_interval(run["stock_vs_stock"], run["stock_vs_stock_interval"]),
            ]
            if processes > 1:
                each = run.get("process_paired")
                cells.append(f"{min(each):.3f}x-{max(each):.3f}x" if each else "this process")
            table.add_row(*cells)
        console.print(table)
    if results.memory:
        runs = int(results.memory[0]["runs"])
        where = f"median of {runs} fresh processes" if runs else "in this process (quick)"
        measure = "peak RSS rise" if DEVICE == "cpu" else f"peak {DEVICE} memory allocated rise"
        table = Table(title=f"{measure} during generate, MiB ({where})")
        for column in ("generation", "prompt+new", "batch", "stock", "patched", "patched/stock"):
            table.add_column(column, justify="right")
        table.add_column("final cache", justify="right")
        mib = 1024 * 1024
        for row in results.memory:
            stops = f" (EOS at {row['stop_after']})" if row.get("stop_after") else ""
            table.add_row(
                str(row["shape"]),
                f"{row['prompt']}+{row['new']}{stops}",
                str(row["batch"]),
                f"{row['stock'] / mib:.2f}",
                f"{row['patched'] / mib:.2f}",
                _share(row["patched"], row["stock"]),
                f"{row['cache_bytes'] / mib:.2f}",
            )
        console.print(table)
    if results.autocast:
        stock, ours = results.autocast["stock"], results.autocast["patched"]
        console.print(
            f"cache under torch.autocast({torch.device(DEVICE).type}, bfloat16), fp32 model: "
            f"stock {stock['dtype']} "
            f"{stock['used']:,} B; patched {ours['dtype']} {ours['used']:,} B used, "
            f"{ours['reserved']:,} B reserved "
            f"(patched/stock {_share(ours['reserved'], stock['used'])})"
        )
    if results.trace:
        report_trace(console, results.trace)
    if results.bridge:
        import bridge_generate

        console.print(bridge_generate.table(results.bridge))
    for note in results.notes:
        console.print(f"note: {note}")


def report_trace(console: Any, rows: list[dict[str, Any]]) -> None:
    """The per-token cache bytes: a summary per case, then the growth points of the first."""
    from rich.table import Table

    kib = 1024
    table = Table(
        title="KV cache bytes held after each forward pass of generate (bound: patched <= "
        f"max(stock x 1.25, stock + {kv_storage.PLAN_STEP} positions) at every token)"
    )
    columns = ["case", "prompt+max new", "passes", "stock at end, KiB", "patched at end, KiB"]
    columns += ["most patched/stock", "most extra positions", "bound met", "earlier gen. held"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        stops = f" (EOS at {row['stop_after']})" if row["stop_after"] else ""
        earlier = f"{row['stock_earlier']} / {row['patched_earlier']} B"
        table.add_row(
            str(row["case"]),
            f"{row['prompt']}+{row['max_new']}{stops}",
            f"{len(row['stock'])}/{len(row['patched'])}",
            f"{row['stock'][-1] / kib:,.1f}",
            f"{row['patched'][-1] / kib:,.1f}",
            f"{row['worst_ratio']:.2f}",
            f"{row['worst_excess_positions']:.0f}",
            "yes" if row["within_bound"] else "NO",
            earlier if row["case"] == "second generate" else "",
        )
    console.print(table)
    first = rows[0]
    growth = Table(
        title=f"{first['case']}: passes where the patched cache grew ahead of stock's, "
        "first and last, KiB"
    )
    for column in ("pass", "cached positions", "stock", "patched", "patched/stock"):
        growth.add_column(column, justify="right")
    stock, ours = first["stock"], first["patched"]
    position = first["position_bytes"]
    for index, (bytes_stock, bytes_ours) in enumerate(zip(stock, ours, strict=False)):
        # A small cache grows with stock, one position per pass: only a buffer's steps are news.
        ahead = index > 0 and bytes_ours - ours[index - 1] > bytes_stock - stock[index - 1]
        if index == 0 or ahead or index == len(ours) - 1:
            growth.add_row(
                str(index + 1),
                str(bytes_stock // position),
                f"{bytes_stock / kib:,.1f}",
                f"{bytes_ours / kib:,.1f}",
                f"{bytes_ours / bytes_stock:.2f}",
            )
    console.print(growth)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run every measurement, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CI smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, the core count)"
    )
    parser.add_argument(
        "--only",
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of: {', '.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="how generations are timed: wall-clock, or this process's CPU time (default wall)",
    )
    parser.add_argument(
        "--short-rounds",
        type=int,
        metavar="N",
        help="paired rounds for the short generations (default 41 for 8+48, 61 for 1+16); "
        "more rounds narrow the interval around the median of pairs",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where models, caches and tensors live: cpu (default) or cuda (one GPU)",
    )
    parser.add_argument(
        "--short-model",
        default="gpt2-like",
        choices=("gpt2-like", "llama-like-gqa"),
        help="the verifier model of the short generations (default gpt2-like; llama-like-gqa "
        "is rotary)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="measure the short generations in N pairs of fresh processes, one variant each, "
        "never switched (default 1: in this process, switching stock and patched)",
    )
    parser.add_argument("--memory-child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--generate-child", choices=("stock", "patched"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device: expected cpu or cuda; received {args.device!r} ({error})")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda; received {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here; run on a machine with one, or cpu")
    DEVICE = str(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        variant, *numbers = args.memory_child
        memory_child(variant, *(int(n) for n in numbers))
        return 0
    if args.processes < 1:
        parser.error(f"--processes: expected at least 1; received {args.processes}")
    sections = SECTIONS
    if args.only:
        sections = tuple(name.strip() for name in args.only.split(",") if name.strip())
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown or not sections:
            parser.error(f"--only: expected some of {', '.join(SECTIONS)}; received {args.only!r}")
    sizes = QUICK if args.quick else FULL
    if args.short_rounds is not None:
        if args.short_rounds < 1:
            parser.error(f"--short-rounds: expected at least 1; received {args.short_rounds}")
        sizes = with_short_rounds(sizes, args.short_rounds)
    if args.generate_child:
        generate_child(args.generate_child, sizes, args.clock, args.short_model)
        return 0
    layout = targets.locate()
    results = Results(machine=machine())
    hooked = layout.known.has_hooked_transformer
    runners: dict[str, Callable[[], None]] = {
        "append": functools.partial(bench_append, layout, sizes, results),
        "step": functools.partial(bench_step, layout, sizes, results),
        "instructions": functools.partial(bench_instructions, sizes, results),
        "generate": functools.partial(bench_generate, sizes, results, args.clock, args.short_model),
        "memory": functools.partial(bench_memory, sizes, results),
        "trace": functools.partial(bench_trace, sizes, results),
        "autocast": functools.partial(bench_autocast, sizes, results),
        "bridge": functools.partial(bench_bridge, sizes, results),
    }
    if args.processes > 1:
        child_options = ["--clock", args.clock, "--short-model", args.short_model]
        child_options += ["--device", DEVICE, "--threads", str(torch.get_num_threads())]
        child_options += ["--quick"] if args.quick else []
        if args.short_rounds is not None:
            child_options += ["--short-rounds", str(args.short_rounds)]
        runners["generate"] = functools.partial(
            bench_generate_in_processes,
            sizes,
            results,
            child_options,
            args.processes,
            args.clock,
            args.short_model,
        )
    needs_hooked = {"instructions", "generate", "memory", "trace", "autocast"}
    skipped = [name for name in sections if name in needs_hooked and not hooked]
    if skipped:
        results.notes.append(
            f"TransformerLens {layout.release} has no HookedTransformer: {', '.join(skipped)} "
            "skipped"
        )
    if "bridge" in sections and not targets.has_bridge():
        results.notes.append(
            f"TransformerLens {layout.release} has no TransformerBridge: bridge skipped"
        )
    for name in sections:
        if name in skipped or (name == "bridge" and not targets.has_bridge()):
            continue
        runners[name]()
    report(results)
    if args.json:
        with open(args.json, "w") as output:
            json.dump(asdict(results), output, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
