"""What a batch of text prompts of different lengths costs, stock against safelens-tl.

On TransformerLens 2.13 to 3.0.0, ``HookedTransformer.generate`` masks no padding: safelens-tl
masks it within the batch (``safelens_tl/fixes/hooked/generate_mask.py``). On 3.0 to 3.7
``TransformerBridge.generate`` uses no attention mask: safelens-tl generates such a batch one call
per token count (``safelens_tl/fixes/bridge/generate_batch.py``). Other releases run the batch as
stock does. This
prints, per number of distinct prompt lengths, the median time of one cached greedy ``generate``
of 8 prompts (CPU, float32, one torch thread), stock and patched in the same process, and their
ratio, with how many of each variant's rows equal its own generation of the prompt alone.
``--api hooked``: the verifier's tiny Llama-like ``HookedTransformer``; ``--api bridge``: the
sweep's tiny Llama checkpoint through ``TransformerBridge`` (the default where there is no
``HookedTransformer``).

    HF_HUB_OFFLINE=1 SAFELENS_TL_AUTOPATCH=0 python benchmarks/batch_lengths.py [--api bridge]
"""

from __future__ import annotations

import argparse
import inspect
import shutil
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
from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask

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


OPTIONS = {
    "max_new_tokens": NEW_TOKENS,
    "do_sample": False,
    "stop_at_eos": False,
    "verbose": False,
    "use_past_kv_cache": True,
}


def median_seconds(model: Any, prompts: list[str], rounds: int) -> tuple[float, list[str]]:
    """Median seconds of one ``generate`` of ``prompts`` (after one untimed call), and its texts."""
    texts = model.generate(prompts, **OPTIONS)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.generate(prompts, **OPTIONS)
        times.append(time.perf_counter() - start)
    return statistics.median(times), texts


def _hooked_models() -> dict[bool, Any]:
    """The verifier's tiny Llama-like ``HookedTransformer``, one model for both variants."""
    from safelens_tl.verify.models import build_model

    model = build_model("llama-like-gqa", torch.float32)
    return {False: model, True: model}


def _bridge_models(folder: str) -> dict[bool, Any]:
    """The sweep's tiny Llama in ``folder`` through ``TransformerBridge``, booted under each
    variant."""
    import bridge_architectures

    models = {}
    for active in (False, True):
        with patched(active):
            models[active] = bridge_architectures.boot(folder)
    return models


def _masks_nothing(api: str, layout: targets.Layout) -> bool:
    """Whether this release's ``generate`` of ``api`` leaves a batch's padding unmasked."""
    if api == "hooked":
        return targets.hooked_generate_masks_no_padding(layout.release)
    generate = targets.locate_bridge().bridge_class.__dict__["generate"]
    return bridge_hf_generate_mask.drops_the_attention_mask(inspect.unwrap(generate))


def main(argv: list[str] | None = None) -> int:
    """Print the table; 0 unless the arguments are refused."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per cell")
    parser.add_argument("--distinct", default="1,2,4,8", help="numbers of distinct lengths")
    parser.add_argument(
        "--api",
        choices=("hooked", "bridge"),
        help="HookedTransformer or TransformerBridge (default: HookedTransformer where it exists)",
    )
    arguments = parser.parse_args(argv)
    if arguments.rounds < 1:
        parser.error("--rounds must be at least 1")
    console = Console(width=None if Console().is_terminal else 140)
    layout = targets.locate()
    api = arguments.api or ("hooked" if layout.known.has_hooked_transformer else "bridge")
    if api == "hooked" and not layout.known.has_hooked_transformer:
        console.print(f"TransformerLens {layout.release} has no HookedTransformer: nothing to run")
        return 0
    if api == "bridge" and not targets.has_bridge():
        console.print(f"TransformerLens {layout.release} has no TransformerBridge: nothing to run")
        return 0
    warnings.simplefilter("ignore")  # TransformerLens's advice while building
    torch.set_num_threads(1)
    if api == "hooked":
        models = _hooked_models()
    else:
        import bridge_architectures

        folder = bridge_architectures.build("LlamaForCausalLM")
        try:
            models = _bridge_models(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # booted models keep their weights
    masks_nothing = _masks_nothing(api, layout)
    name = "HookedTransformer" if api == "hooked" else "TransformerBridge"
    table = Table(
        title=f"{name}: {PROMPTS} prompts + {NEW_TOKENS} tokens, TransformerLens "
        f"{layout.release} ({'masks no padding' if masks_nothing else 'masks padding'})"
    )
    for column in ("distinct lengths", "stock ms", "patched ms", "patched/stock", "rows right"):
        table.add_column(column)
    for distinct in (int(value) for value in arguments.distinct.split(",")):
        prompts = prompts_of(distinct)
        times, right = {}, {}
        for active in (False, True):
            with patched(active):
                # Each variant against itself alone: stock TransformerBridge's cache is wrong on
                # some releases whatever the batch (docs/reliability.md), not what this measures.
                alone = [models[active].generate(prompt, **OPTIONS) for prompt in prompts]
                times[active], texts = median_seconds(models[active], prompts, arguments.rounds)
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
