"""What a batch of text prompts of different lengths costs, stock against safelens-tl.

On TransformerLens 2.13 to 3.0.0, ``HookedTransformer.generate`` masks no padding, so safelens-tl
generates such a batch one call per token count (``safelens_tl/hooked_generate_batch.py``); other
releases run the batch as stock does. This prints, per number of distinct prompt lengths, the
median time of one cached greedy ``generate`` of 8 prompts on the verifier's tiny Llama-like
model (CPU, float32, one torch thread), stock and patched in the same process, and their ratio,
with whether each variant's rows equal the prompts generated alone.

    HF_HUB_OFFLINE=1 SAFELENS_TL_AUTOPATCH=0 python benchmarks/hooked_batch_lengths.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl import targets

PROMPTS = 8
NEW_TOKENS = 16
WORDS = [
    "the",
    "cat",
    "runs",
    "a",
    "big",
    "old",
    "dog",
    "sleeps",
    "in",
    "the",
    "quiet",
    "house",
    "and",
    "a",
    "red",
    "bird",
    "sings",
]


def prompts_of(distinct: int) -> list[str]:
    """``PROMPTS`` prompts with ``distinct`` token counts (two words apart), in turn."""
    return [" ".join(WORDS[: 3 + 2 * (index % distinct)]) for index in range(PROMPTS)]


def median_seconds(model: Any, prompts: list[str], rounds: int) -> tuple[float, list[str]]:
    """Median seconds of one ``generate`` of ``prompts`` (after one untimed call), and its texts."""
    options = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "stop_at_eos": False,
        "verbose": False,
        "use_past_kv_cache": True,
    }
    texts = model.generate(prompts, **options)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.generate(prompts, **options)
        times.append(time.perf_counter() - start)
    return statistics.median(times), texts


def main(argv: list[str] | None = None) -> int:
    """Print the table; 0 unless this TransformerLens has no HookedTransformer."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per cell")
    parser.add_argument("--distinct", default="1,2,4,8", help="numbers of distinct lengths")
    arguments = parser.parse_args(argv)
    if arguments.rounds < 1:
        parser.error("--rounds must be at least 1")
    console = Console(width=None if Console().is_terminal else 140)
    layout = targets.locate()
    if not layout.known.has_hooked_transformer:
        console.print(f"TransformerLens {layout.release} has no HookedTransformer: nothing to run")
        return 0
    from safelens_tl.verify.models import build_model

    warnings.simplefilter("ignore")  # TransformerLens's advice while building
    torch.set_num_threads(1)
    model = build_model("llama-like-gqa", torch.float32)
    masks_nothing = targets.hooked_generate_masks_no_padding(layout.release)
    table = Table(
        title=f"{PROMPTS} prompts + {NEW_TOKENS} tokens, TransformerLens {layout.release} "
        f"({'masks no padding' if masks_nothing else 'masks padding'})"
    )
    for column in ("distinct lengths", "stock ms", "patched ms", "patched/stock", "rows right"):
        table.add_column(column)
    for distinct in (int(value) for value in arguments.distinct.split(",")):
        prompts = prompts_of(distinct)
        with patched(True):
            alone = [
                model.generate(
                    p, max_new_tokens=NEW_TOKENS, do_sample=False, stop_at_eos=False, verbose=False
                )
                for p in prompts
            ]
        times, right = {}, {}
        for active in (False, True):
            with patched(active):
                times[active], texts = median_seconds(model, prompts, arguments.rounds)
            right[active] = sum(a == b for a, b in zip(texts, alone, strict=True))
        table.add_row(
            str(distinct),
            f"{1000 * times[False]:.1f}",
            f"{1000 * times[True]:.1f}",
            f"{times[True] / times[False]:.2f}x",
            f"stock {right[False]}/{PROMPTS}, patched {right[True]}/{PROMPTS}",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
