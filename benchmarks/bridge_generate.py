"""TransformerBridge generate: patched cached against stock cached, uncached and Hugging Face.

One run prints one table. The model is the verifier's tiny rotary Llama with grouped-query
attention (random weights, nothing downloaded), booted with
``TransformerBridge.boot_transformers``; Hugging Face's ``generate`` runs the same checkpoint
loaded with ``AutoModelForCausalLM``, in the same dtype. Greedy, no early stop, equal-length
prompts (no padding). Rounds alternate between the four ways and the median time of each is
reported, with the ratios of medians. The last three columns count the new tokens, from the
first, on which two ways agree in every sequence.

Stock's cached generate is timed too, and its tokens compared with the uncached ones: with
transformers 5.24 and later stock attends to one position per step (docs/upstream-transformerbridge-
cache.md), so its speed is shown but its ratio is marked as wrong output.

    HF_HUB_OFFLINE=1 python benchmarks/bridge_generate.py [--rounds 5] [--dtype float32,bfloat16]
        [--device cuda]

``benchmarks/kv_cache.py`` runs the same measurement as its ``bridge`` section.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import safelens_tl
from safelens_tl.verify import bridge, models

#: (prompt tokens, new tokens, batch)
SHAPES = ((8, 48, 1), (256, 128, 2))
#: The ways a generation is run, in the order of each round.
WAYS = ("cached", "stock cached", "uncached", "hf")


def _now(device: str) -> float:
    # CUDA kernels finish after the call that queued them returns: wait for them before reading.
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed(run: Callable[[], torch.Tensor], device: str) -> tuple[float, torch.Tensor]:
    start = _now(device)
    with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):
        tokens = run()
    return _now(device) - start, tokens


def _bridge_run(model: Any, prompt: torch.Tensor, new: int, cached: bool) -> torch.Tensor:
    tokens: torch.Tensor = model.generate(
        prompt,
        max_new_tokens=new,
        do_sample=False,
        stop_at_eos=False,
        use_past_kv_cache=cached,
        verbose=False,
        return_type="tokens",
    )
    return tokens[:, -new:]


def _timed_way(
    way: str, run: Callable[[], torch.Tensor], device: str
) -> tuple[float, torch.Tensor]:
    """Time one way; stock runs with safelens-tl deactivated, outside the timed span."""
    if way != "stock cached":
        return _timed(run, device)
    safelens_tl.deactivate()
    try:
        return _timed(run, device)
    finally:
        safelens_tl.activate()


def _hf_run(model: Any, prompt: torch.Tensor, new: int) -> torch.Tensor:
    tokens: torch.Tensor = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    return tokens[:, -new:]


def leading_agreement(tokens: torch.Tensor, other: torch.Tensor) -> int:
    """New tokens, from the first, on which two greedy generations agree in every sequence.

    After a first difference the two continue from different text, so later agreement means
    nothing. In bfloat16 a near-tie between two logits can fall either way between a cached and an
    uncached forward (other sums, other rounding); ``safelens-tl verify`` compares logits instead.
    """
    differs = (tokens != other).any(dim=0).nonzero()
    return int(differs[0, 0]) if differs.numel() else int(tokens.size(1))


def measure(
    dtype_names: Sequence[str],
    shapes: Sequence[tuple[int, int, int]] = SHAPES,
    rounds: int = 5,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One row per dtype and shape: median ms per new token of each way, and token agreement.

    ``device``: where both models and the prompts live (``cpu`` or ``cuda``).

    safelens-tl is active when this returns (it activates it).
    """
    safelens_tl.activate()
    rows: list[dict[str, Any]] = []
    for dtype_name in dtype_names:
        dtype = getattr(torch, dtype_name)
        model = bridge.boot("llama-like-gqa", dtype, device)
        reference = bridge.reference_model("llama-like-gqa", dtype, device)
        # No early stop, as in the bridge's stop_at_eos=False (min_new_tokens would instead mask
        # the EOS logit, and greedy tokens would differ from the bridge's).
        reference.generation_config.eos_token_id = None
        generator = torch.Generator().manual_seed(0)
        for prompt_length, new, batch in shapes:
            prompt = torch.randint(
                4, models.vocab_size(), (batch, prompt_length), generator=generator
            ).to(device)
            ways: dict[str, Callable[[], torch.Tensor]] = {
                "cached": functools.partial(_bridge_run, model, prompt, new, True),
                "stock cached": functools.partial(_bridge_run, model, prompt, new, True),
                "uncached": functools.partial(_bridge_run, model, prompt, new, False),
                "hf": functools.partial(_hf_run, reference, prompt, new),
            }
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            # warm-up, untimed
            outputs = {way: _timed_way(way, run, device)[1] for way, run in ways.items()}
            for _ in range(rounds):
                for way, run in ways.items():
                    times[way].append(_timed_way(way, run, device)[0])
            per_token = {way: 1000 * statistics.median(t) / new for way, t in times.items()}
            rows.append(
                {
                    "dtype": dtype_name,
                    "prompt": prompt_length,
                    "new": new,
                    "batch": batch,
                    "rounds": rounds,
                    **{f"{way} ms": ms for way, ms in per_token.items()},
                    "agree uncached": leading_agreement(outputs["cached"], outputs["uncached"]),
                    "agree hf": leading_agreement(outputs["cached"], outputs["hf"]),
                    "stock agrees": leading_agreement(outputs["stock cached"], outputs["uncached"]),
                }
            )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> Table:
    """The rows of :func:`measure` as a rich table of ms per token and ratios."""
    rounds = rows[0]["rounds"] if rows else 0
    result = Table(
        title=f"TransformerBridge generate (median of {rounds} alternating rounds, ms per new "
        "token; ratios: speed of patched cached over the other)"
    )
    columns = ["dtype", "prompt+new x batch", "patched cached", "stock cached", "uncached"]
    columns += ["HF generate", "vs stock", "vs uncached", "vs HF"]
    columns += ["same as uncached", "same as HF", "stock same as uncached"]
    for column in columns:
        result.add_column(column, justify="right")
    for row in rows:
        cached = row["cached ms"]
        new = row["new"]
        vs_stock = f"{row['stock cached ms'] / cached:.2f}x"
        if row["stock agrees"] < new:
            vs_stock += " (stock wrong)"
        result.add_row(
            row["dtype"],
            f"{row['prompt']}+{row['new']} x {row['batch']}",
            f"{cached:.2f}",
            f"{row['stock cached ms']:.2f}",
            f"{row['uncached ms']:.2f}",
            f"{row['hf ms']:.2f}",
            vs_stock,
            f"{row['uncached ms'] / cached:.2f}x",
            f"{row['hf ms'] / cached:.2f}x",
            f"{row['agree uncached']}/{new}",
            f"{row['agree hf']}/{new}",
            f"{row['stock agrees']}/{new}",
        )
    return result


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="comma-separated: float32, float16, bfloat16 (default float32)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    arguments = parser.parse_args()
    dtype_names = [name.strip() for name in arguments.dtype.split(",") if name.strip()]
    for name in dtype_names:
        if name not in ("float32", "float16", "bfloat16"):
            parser.error(f"--dtype: expected float32, float16 or bfloat16; received {name!r}")
    Console(width=160).print(
        table(measure(dtype_names, SHAPES, arguments.rounds, arguments.device))
    )


if __name__ == "__main__":
    main()
