"""HookedTransformer forward passes with safelens-tl against stock: where reading the weights in
place pays (``safelens_tl.fixes.hooked.weight_copies``), and that it costs nothing elsewhere.

Three sections, each a table; ratios are stock / patched (above 1: patched is faster):

* ``crossover``: one query/key/value projection (``simple_attn_linear``) and one linear layer
  (an MLP's ``F.linear(x, W.T.contiguous())``), the release's copy-and-product against the
  in-place product, by dtype and rows (batch x positions). These are the figures behind
  ``PROJECTION_MAX_ROWS`` and ``IN_PLACE_DTYPES``: the in-place forms are called directly here,
  whatever the fix would choose.
* ``forward``: whole-model forwards, stock and safelens-tl alternating in one process (the same
  machine load for both), float32 and bfloat16, a decoding step's rows and batched prompts,
  without gradients and forward + backward; each with its peak memory (torch's profiler counts
  every allocation: deterministic). The model is SmolLM2-135M converted by
  ``generate_vs_hf.py`` where that checkpoint exists (``--checkpoint``), else the built-in tiny
  Llama.
* ``rounding``: float32 logits of stock and of safelens-tl against the same model's float64
  forward (the largest difference relative to the largest logit), for single-row forwards (a
  decoding step at batch 1, where the in-place product rounds in another order) and a batch.
* ``decisions`` (on demand): what deciding at every call costs where the release's code runs.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 SAFELENS_TL_AUTOPATCH=0 \\
        python benchmarks/forward_in_place.py [--section crossover,forward,rounding] [--rounds 7]
    python benchmarks/forward_in_place.py --section crossover --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

#: (d_model, heads) of the crossover section: SmolLM2-135M's and a 2048-wide model's.
WIDTHS: tuple[tuple[int, int], ...] = ((576, 9), (2048, 16))
CROSSOVER_ROWS: tuple[int, ...] = (1, 4, 16, 64, 256, 512, 1024)
DTYPES = ("float32", "bfloat16", "float16")
#: Half precision's rows stop here: both in-place forms are 2-30x slower than stock's from 4 rows
#: on (so the fix never takes them on the CPU), and a 2048-wide linear layer read in place takes
#: seconds per call beyond.
HALF_MAX_ROWS = 256
#: (label, batch, positions) of the forward section.
FORWARD_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("1 x 1", 1, 1),
    ("4 x 16", 4, 16),
    ("32 x 32", 32, 32),
)


def median_ratio(
    first: Callable[[], Any],
    second: Callable[[], Any],
    rounds: int,
    sync: Callable[[], Any] = lambda: None,
    switch: Callable[[bool], Any] = lambda second: None,
) -> float:
    """The median over ``rounds`` of ``first``'s time / ``second``'s, alternating which runs
    first; each time is the mean of enough calls to last about 20 ms (``sync`` waits for a
    device's queued work before a clock is read; ``switch(is_second)`` runs before each timed
    series, outside the clock: safelens-tl activated for the second, deactivated for the first)."""
    switch(False)
    first()  # warm-up
    switch(True)
    second()
    sync()
    switch(False)
    start = time.perf_counter()
    first()
    sync()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))

    def timed(call: Callable[[], Any]) -> float:
        switch(call is second)
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        return (time.perf_counter() - begin) / calls

    ratios = []
    for round_ in range(rounds):
        if round_ % 2:
            b, a = timed(second), timed(first)
        else:
            a, b = timed(first), timed(second)
        ratios.append(a / b)
    switch(False)
    return statistics.median(ratios)


def crossover(rounds: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Stock / in-place time of one projection and one linear layer, by dtype and rows, on
    ``device``."""
    import einops  # type: ignore[import-not-found]  # TransformerLens's dependency

    from safelens_tl.fixes.hooked import weight_copies

    def stock_projection(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # TransformerLens 2.x/3.x utilities.attention.simple_attn_linear
        flat = einops.rearrange(w, "head_index d_model d_head -> (head_index d_head) d_model")
        bias = einops.rearrange(b, "head_index d_head -> (head_index d_head)")
        return F.linear(x, flat, bias).reshape(x.shape[0], x.shape[1], b.shape[0], b.shape[1])

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows_found = []
    with torch.no_grad():
        for d_model, heads in WIDTHS:
            for dtype_name in DTYPES:
                dtype = getattr(torch, dtype_name)
                w = torch.randn(heads, d_model, d_model // heads, dtype=dtype, device=device)
                b = torch.randn(heads, d_model // heads, dtype=dtype, device=device)
                mlp = torch.randn(
                    d_model, 4 * d_model, dtype=dtype, device=device
                )  # [d_model, d_mlp]
                for rows in CROSSOVER_ROWS:
                    if dtype_name != "float32" and rows > HALF_MAX_ROWS:
                        continue
                    x = torch.randn(1, rows, d_model, dtype=dtype, device=device)
                    projection = median_ratio(
                        functools.partial(stock_projection, x, w, b),
                        functools.partial(weight_copies.in_place_projection, x, w, b),
                        rounds,
                        sync,
                    )
                    linear = median_ratio(
                        functools.partial(F.linear, x, mlp.T.contiguous()),
                        functools.partial(F.linear, x, mlp.T),
                        rounds,
                        sync,
                    )
                    rows_found.append(
                        {
                            "d_model": d_model,
                            "dtype": dtype_name,
                            "rows": rows,
                            "projection": projection,
                            "linear": linear,
                        }
                    )
                    print(
                        f"  crossover d_model {d_model} {dtype_name:8} rows {rows:5}: "
                        f"projection {projection:.2f}x, linear {linear:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
    return rows_found


def load_model(checkpoint: str | None, dtype: torch.dtype) -> tuple[str, Any]:
    """SmolLM2-135M from ``generate_vs_hf.py``'s checkpoint, else the built-in tiny Llama."""
    import generate_vs_hf

    folder = Path(checkpoint) if checkpoint else generate_vs_hf.default_checkpoint_dir()
    if (folder / "config.json").is_file():
        model = generate_vs_hf.load_tl("hooked", folder, dtype)
        name = "SmolLM2-135M"
    else:
        from safelens_tl.verify import models

        model = models.build_model("llama-like-gqa", dtype)
        name = "tiny Llama"
    model.tokenizer = None  # a forward of tokens needs none
    return name, model


def peak_bytes(call: Callable[[], Any]) -> int:
    """The most CPU memory ``call()`` held at once (torch's profiler, every allocation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    held = peak = 0
    for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
        held += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def one_pass(model: Any, tokens: torch.Tensor, backward: bool) -> None:
    """One forward (and backward) of ``model``, as safelens-tl is now (active or not)."""
    if backward:
        model.zero_grad(set_to_none=True)
        model(tokens).float().mean().backward()
    else:
        with torch.no_grad():
            model(tokens)


def set_active(active: bool) -> None:
    """safelens-tl activated (``True``) or stock (``False``)."""
    import safelens_tl

    if active:
        safelens_tl.activate()
    else:
        safelens_tl.deactivate()


def as_active(active: bool, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with safelens-tl activated or not, and stock afterwards."""

    def run() -> Any:
        set_active(active)
        try:
            return call()
        finally:
            set_active(False)

    return run


def forward_section(checkpoint: str | None, rounds: int) -> list[dict[str, Any]]:
    """Whole-model forwards, stock against safelens-tl, alternating in one process."""
    found = []
    for dtype_name in ("float32", "bfloat16"):
        name, model = load_model(checkpoint, getattr(torch, dtype_name))
        for label, batch, positions in FORWARD_SHAPES:
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(
                10, int(model.cfg.d_vocab), (batch, positions), generator=generator
            )
            for backward in (False, True):
                if backward and batch * positions > 256:
                    continue  # a minute per round on a CPU; both run the release's code anyway

                # Two callables, so that median_ratio tells them apart; it activates
                # safelens-tl for the second outside the clock.
                stock = functools.partial(one_pass, model, tokens, backward)
                patched = functools.partial(one_pass, model, tokens, backward)
                ratio = median_ratio(stock, patched, rounds, switch=set_active)
                model.zero_grad(set_to_none=True)
                stock_peak = peak_bytes(as_active(False, stock))
                model.zero_grad(set_to_none=True)
                patched_peak = peak_bytes(as_active(True, patched))
                model.zero_grad(set_to_none=True)
                row = {
                    "model": name,
                    "dtype": dtype_name,
                    "shape": label,
                    "pass": "forward + backward" if backward else "forward",
                    "ratio": ratio,
                    "stock MB": stock_peak / 2**20,
                    "patched MB": patched_peak / 2**20,
                }
                found.append(row)
                print(f"  forward {row}", file=sys.stderr, flush=True)
    return found


#: (label, batch, positions, forwards) of the rounding section: single rows are ``forwards``
#: forwards of one token each.
ROUNDING_SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("1 x 1, 32 forwards", 1, 1, 32),
    ("4 x 16", 4, 16, 1),
)


def decisions_section(checkpoint: str | None) -> None:
    """What deciding costs where the release's code runs: how many calls of
    ``weight_copies.reads_in_place`` one forward makes, and the time of one such call (timeit),
    for a bfloat16 forward (the dtype rejects) and a float32 one that autograd records."""
    print("\n## decisions: what choosing the release's code costs per forward\n")
    print(
        "| model | dtype | gradients | decisions per forward | µs per decision | ms per forward |"
    )
    print("|---|---|---|---|---|---|")
    for dtype_name, grad in (("bfloat16", False), ("float32", True)):
        name, model = load_model(checkpoint, getattr(torch, dtype_name))
        count, seconds, forward = decision_cost(model, grad)
        print(
            f"| {name} | {dtype_name} | {'recorded' if grad else 'no'} | {count} "
            f"| {seconds * 1e6:.2f} | {forward * 1e3:.1f} |"
        )


def decision_cost(model: Any, grad: bool) -> tuple[int, float, float]:
    """Decisions in one decoding-step forward of ``model``, seconds per decision, and seconds of
    the forward, with safelens-tl active."""
    import timeit

    import safelens_tl
    from safelens_tl.fixes.hooked import weight_copies

    tokens = torch.randint(10, int(model.cfg.d_vocab), (1, 1))
    decide = weight_copies.reads_in_place
    seen: list[tuple[Any, ...]] = []

    def counting(
        x: torch.Tensor, weights: tuple[torch.Tensor, ...], max_rows: int | None = None
    ) -> bool:
        seen.append((x, weights, max_rows))
        return decide(x, weights, max_rows)

    safelens_tl.activate()
    try:
        with torch.set_grad_enabled(grad):
            weight_copies.reads_in_place = counting  # the wrappers look it up at each call
            try:
                model(tokens)
            finally:
                weight_copies.reads_in_place = decide
            calls = 20000
            seconds = timeit.timeit(lambda: decide(*seen[0]), number=calls) / calls
            begin = time.perf_counter()
            model(tokens)
            forward = time.perf_counter() - begin
    finally:
        safelens_tl.deactivate()
    return len(seen), seconds, forward


def rounding_section(checkpoint: str | None) -> list[dict[str, Any]]:
    """float32 logits of stock and of safelens-tl against float64, relative to the largest."""
    import safelens_tl

    name, model = load_model(checkpoint, torch.float32)
    exact_model = load_model(checkpoint, torch.float64)[1]
    found = []
    for label, batch, positions, forwards in ROUNDING_SHAPES:
        generator = torch.Generator().manual_seed(1)
        shape = (forwards, batch, positions)
        inputs = torch.randint(10, int(model.cfg.d_vocab), shape, generator=generator)
        with torch.no_grad():
            exact = torch.cat([exact_model(tokens) for tokens in inputs])
            errors = {}
            for active in (False, True):
                if active:
                    safelens_tl.activate()
                else:
                    safelens_tl.deactivate()
                try:
                    logits = torch.cat([model(tokens) for tokens in inputs]).double()
                finally:
                    safelens_tl.deactivate()
                scale = float(exact.abs().max())
                errors[active] = float((logits - exact).abs().max()) / scale
        found.append(
            {"model": name, "shape": label, "stock": errors[False], "patched": errors[True]}
        )
        print(f"  rounding {found[-1]}", file=sys.stderr, flush=True)
    return found


def print_tables(
    crossover_rows: list[dict[str, Any]],
    forward_rows: list[dict[str, Any]],
    rounding_rows: list[dict[str, Any]] | None = None,
) -> None:
    if crossover_rows:
        print("\n## crossover: stock time / in-place time (above 1: in place is faster)\n")
        print("| d_model | dtype | " + " | ".join(f"{r} rows" for r in CROSSOVER_ROWS) + " |")
        print("|---|---|" + "---|" * len(CROSSOVER_ROWS))
        for d_model, _ in WIDTHS:
            for dtype_name in DTYPES:
                for kind in ("projection", "linear"):
                    measured = {
                        row["rows"]: f"{row[kind]:.2f}"
                        for row in crossover_rows
                        if row["d_model"] == d_model and row["dtype"] == dtype_name
                    }
                    cells = [measured.get(rows, "-") for rows in CROSSOVER_ROWS]
                    print(f"| {d_model} {kind} | {dtype_name} | " + " | ".join(cells) + " |")
    if forward_rows:
        print("\n## forward: stock time / safelens-tl time, and peak memory\n")
        print(
            "| model | dtype | batch x positions | pass | stock / patched "
            "| peak MB stock | peak MB patched |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in forward_rows:
            print(
                f"| {row['model']} | {row['dtype']} | {row['shape']} | {row['pass']} | "
                f"{row['ratio']:.2f}x | {row['stock MB']:.1f} | {row['patched MB']:.1f} |"
            )

    if rounding_rows:
        print("\n## rounding: float32 against float64, relative to the largest logit\n")
        print("| model | batch x positions | stock | patched | patched / stock |")
        print("|---|---|---|---|---|")
        for row in rounding_rows:
            print(
                f"| {row['model']} | {row['shape']} | {row['stock']:.1e} | {row['patched']:.1e} "
                f"| {row['patched'] / row['stock']:.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--section",
        default="crossover,forward,rounding",
        help="crossover, forward, rounding, decisions",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per ratio")
    parser.add_argument(
        "--device", default="cpu", help="where the crossover section runs (cpu, cuda)"
    )
    parser.add_argument("--checkpoint", help="a converted checkpoint folder (generate_vs_hf.py)")
    parser.add_argument(
        "--quick", action="store_true", help="seconds: tiny shapes, one round (a smoke test)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        global WIDTHS, CROSSOVER_ROWS, FORWARD_SHAPES, ROUNDING_SHAPES
        WIDTHS, CROSSOVER_ROWS = ((64, 4),), (1, 64)
        FORWARD_SHAPES = (("1 x 1", 1, 1), ("2 x 8", 2, 8))
        ROUNDING_SHAPES = (("1 x 1, 4 forwards", 1, 1, 4), ("2 x 8", 2, 8, 1))
        args.rounds = 1
    sections = {name.strip() for name in args.section.split(",")}
    unknown = sections - {"crossover", "forward", "rounding", "decisions"}
    if unknown:
        choices = "crossover, forward, rounding, decisions"
        parser.error(f"unknown section {sorted(unknown)}; choose from {choices}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}", flush=True
    )
    crossover_rows = crossover(args.rounds, args.device) if "crossover" in sections else []
    forward_rows = forward_section(args.checkpoint, args.rounds) if "forward" in sections else []
    rounding_rows = rounding_section(args.checkpoint) if "rounding" in sections else []
    print_tables(crossover_rows, forward_rows, rounding_rows)
    if "decisions" in sections:
        decisions_section(args.checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
