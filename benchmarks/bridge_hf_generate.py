"""Hugging Face's own generate loop through TransformerBridge (``hf_generate``), per architecture.

``TransformerBridge.hf_generate`` hands generation to Hugging Face's ``generate`` over the
bridge's modules, so the KV cache (or recurrent state) reaches each module the way Hugging Face
passes it, not the way ``TransformerBridge.generate`` does. For each architecture of
``benchmarks/bridge_architectures.py`` (the same tiny checkpoints), two left-padded prompts are
generated greedily for 8 tokens with the cache and without it (``use_past_kv_cache=False`` and
``use_cache=False``: TransformerLens 4.3 leaves the model's own ``use_cache=True`` in force when
only the first is given), first with safelens-tl active, then stock. Right means the same tokens.
The encoder-decoder checkpoints (``bridge_architectures.ENCODER_DECODER``: T5, mT5, LongT5, BART,
mBART, Pegasus, Blenderbot, M2M100, T5Gemma) come last; their 8 tokens are the decoder's.

    HF_HUB_OFFLINE=1 python benchmarks/bridge_hf_generate.py [--architectures A,B] [--json PATH]
"""

from __future__ import annotations

import argparse
from typing import Any

import bridge_architectures as architectures
import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl.verify import checks

NEW_TOKENS = 8
PROMPTS = list(checks.PROMPTS)[:2]


def generate(model: Any, cached: bool, **options: Any) -> Any:
    """Greedy ``hf_generate`` of :data:`PROMPTS`, with or without the cache: the tokens, or what
    Hugging Face returns for ``options`` such as ``output_logits=True``."""
    return model.hf_generate(
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        stop_at_eos=False,
        return_type="tokens",
        use_past_kv_cache=cached,
        use_cache=cached,
        **options,
    )


def run(folder: str, active: bool) -> str:
    """``"right"``, how many generated tokens differ, or the error; stock when not ``active``."""
    try:
        with patched(active), architectures.quietly():
            model = architectures.boot(folder)
            cached, uncached = generate(model, True), generate(model, False)
    except Exception as error:  # a row saying why, not a crash
        return f"fails: {architectures.last_line(error)}"
    if torch.equal(cached, uncached):
        return "right"
    if cached.shape != uncached.shape:
        return f"wrong: {tuple(cached.shape)} tokens against {tuple(uncached.shape)} uncached"
    differing = int((cached[:, -NEW_TOKENS:] != uncached[:, -NEW_TOKENS:]).sum())
    return f"wrong: {differing} of {cached.shape[0] * NEW_TOKENS} tokens differ"


def verdict(patched: str, stock: str) -> str:
    """What safelens-tl changes for this architecture."""
    if patched == "right":
        return "right in both" if stock == "right" else "[green]fixed by safelens-tl[/green]"
    if patched == stock:
        return "the same in both"
    return "[red]worse with safelens-tl[/red]" if stock == "right" else "[red]differs[/red]"


def main(argv: list[str] | None = None) -> int:
    """Run every architecture asked for and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = (*architectures.ALL_ARCHITECTURES, *architectures.ENCODER_DECODER)
    parser.add_argument(
        "--architectures",
        default=",".join(names),
        help="comma-separated, from: " + ", ".join(names),
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    arguments = parser.parse_args(argv)
    chosen = [name.strip() for name in arguments.architectures.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        parser.error(f"--architectures: unknown {unknown}; expected some of {list(names)}")
    table = Table(title="TransformerBridge.hf_generate, cached against uncached, float32")
    for column in ("architecture", "patched", "stock", "verdict"):
        table.add_column(column)
    results: dict[str, dict[str, str]] = {}
    # Piped or logged, rich's default 80 columns would fold every cell.
    console = Console(width=None if Console().is_terminal else 160)
    for architecture in chosen:
        console.print(f"[dim]{architecture}...[/dim]")
        try:
            folder = architectures.build(architecture)
        except Exception as error:  # the row says why
            results[architecture] = {"build_error": architectures.last_line(error)}
            table.add_row(architecture, results[architecture]["build_error"], "", "cannot build")
            continue
        patched, stock = run(folder, True), run(folder, False)
        results[architecture] = {"patched": patched, "stock": stock}
        table.add_row(architecture, patched, stock, verdict(patched, stock))
        architectures.write_json(arguments.json, results)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
