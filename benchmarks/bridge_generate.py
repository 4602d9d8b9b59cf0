"""TransformerBridge generate, patched: cached against uncached, and against Hugging Face generate.

One run prints one table. The model is the verifier's tiny rotary Llama with grouped-query
attention (random weights, nothing downloaded), booted with ``TransformerBridge.boot_transformers``;
Hugging Face's ``generate`` runs the same checkpoint loaded with ``AutoModelForCausalLM``. Greedy,
no early stop, equal-length prompts (no padding). Rounds alternate between the three ways and the
median time of each is reported, with the ratios of medians.

    HF_HUB_OFFLINE=1 python benchmarks/bridge_generate.py [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import safelens_tl
from safelens_tl.verify import bridge, models

#: (prompt tokens, new tokens, batch)
SHAPES = ((8, 48, 1), (256, 128, 2))


def _timed(run: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):
        tokens = run()
    return time.perf_counter() - start, tokens


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


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    arguments = parser.parse_args()
    dtype = getattr(torch, arguments.dtype)
    safelens_tl.activate()
    model = bridge.boot("llama-like-gqa", dtype)
    reference = bridge.reference_model("llama-like-gqa", dtype)
    # No early stop, as in the bridge's stop_at_eos=False (min_new_tokens would instead mask the
    # EOS logit, and greedy tokens would differ from the bridge's).
    reference.generation_config.eos_token_id = None
    table = Table(
        title=f"TransformerBridge generate, patched ({arguments.dtype}, median of "
        f"{arguments.rounds} alternating rounds, ms per new token)"
    )
    for column in (
        "prompt+new x batch",
        "bridge cached",
        "bridge uncached",
        "HF generate",
        "cached speed-up",
        "HF / bridge cached",
        "same tokens",
    ):
        table.add_column(column, justify="right")
    generator = torch.Generator().manual_seed(0)
    for prompt_length, new, batch in SHAPES:
        prompt = torch.randint(4, models.vocab_size(), (batch, prompt_length), generator=generator)
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "cached": functools.partial(_bridge_run, model, prompt, new, True),
            "uncached": functools.partial(_bridge_run, model, prompt, new, False),
            "hf": functools.partial(_hf_run, reference, prompt, new),
        }
        times: dict[str, list[float]] = {way: [] for way in ways}
        outputs: dict[str, torch.Tensor] = {}
        for way, run in ways.items():  # warm-up, untimed
            outputs[way] = _timed(run)[1]
        for _ in range(arguments.rounds):
            for way, run in ways.items():
                times[way].append(_timed(run)[0])
        per_token = {way: 1000 * statistics.median(t) / new for way, t in times.items()}
        same = torch.equal(outputs["cached"], outputs["hf"]) and torch.equal(
            outputs["cached"], outputs["uncached"]
        )
        table.add_row(
            f"{prompt_length}+{new} x {batch}",
            f"{per_token['cached']:.2f}",
            f"{per_token['uncached']:.2f}",
            f"{per_token['hf']:.2f}",
            f"{per_token['uncached'] / per_token['cached']:.2f}x",
            f"{per_token['hf'] / per_token['cached']:.2f}x",
            "yes" if same else "NO",
        )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
