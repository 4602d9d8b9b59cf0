"""What converting a TransformerBridge to float16/bfloat16 does to logits at long positions.

``bridge.to(dtype)`` casts the rotary ``inv_freq`` buffers to that dtype (stock), while
``boot_transformers(..., dtype=dtype)`` keeps them float32; safelens-tl keeps them float32 on
conversion too. For each length, the last 64 positions of one random prompt through the tiny
rotary Llama of the verifier (random weights, no download) are compared with float32 logits.

    HF_HUB_OFFLINE=1 python benchmarks/rotary_precision.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl.verify import bridge, models

LAST = 64


def relative_error(model: Any, tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |logit - reference| over the last positions, relative to max |reference|."""
    with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):
        logits = model(tokens, return_type="logits")[:, -LAST:].float()
    return float((logits - reference).abs().max() / reference.abs().max())


def converted(dtype: torch.dtype, active: bool) -> Any:
    """The float32-booted bridge converted with ``.to(dtype)``, with or without safelens-tl."""
    with patched(active):
        return bridge.boot("llama-like-gqa", dtype, conversion="to")


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    arguments = parser.parse_args()
    lengths = [int(x) for x in arguments.lengths.split(",")]
    table = Table(title="relative logit error vs float32, last 64 positions")
    for column in (
        "length",
        "dtype",
        "booted in dtype",
        "stock .to(dtype)",
        "patched .to(dtype)",
        "stock / booted",
    ):
        table.add_column(column, justify="right")
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        tokens = torch.randint(4, models.vocab_size(), (1, length), generator=generator)
        reference_model = bridge.boot("llama-like-gqa", torch.float32)
        with torch.inference_mode():
            reference = reference_model(tokens, return_type="logits")[:, -LAST:].float()
        for dtype in (torch.float16, torch.bfloat16):
            booted = relative_error(bridge.boot("llama-like-gqa", dtype), tokens, reference)
            stock = relative_error(converted(dtype, active=False), tokens, reference)
            fixed = relative_error(converted(dtype, active=True), tokens, reference)
            table.add_row(
                str(length),
                str(dtype).removeprefix("torch."),
                f"{booted:.2e}",
                f"{stock:.2e}",
                f"{fixed:.2e}",
                f"{stock / booted:.1f}x",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
