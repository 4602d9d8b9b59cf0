"""Hugging Face's own generate loop through TransformerBridge (``hf_generate``), per architecture.

``TransformerBridge.hf_generate`` hands generation to Hugging Face's ``generate`` over the
bridge's modules, so the KV cache (or recurrent state) reaches each module the way Hugging Face
passes it, not the way ``TransformerBridge.generate`` does. For each architecture of
``benchmarks/bridge_architectures.py`` (the same tiny checkpoints), two left-padded prompts are
generated greedily for 8 tokens with the cache and without it (``use_past_kv_cache=False`` and
``use_cache=False``: TransformerLens 4.3 leaves the model's own ``use_cache=True`` in force when
only the first is given), first with safelens-tl active, then stock. Right means the same tokens.
The encoder-decoder checkpoints (``bridge_architectures.ENCODER_DECODER``: T5, mT5, LongT5, BART,
mBART, Pegasus, Blenderbot, Marian, LED, M2M100, Switch Transformers, T5Gemma, T5Gemma 2,
Florence-2) come last; their 8 tokens are the decoder's.

``--decoding`` picks Hugging Face's decoding strategy (:data:`DECODING`): greedy by default; beam
search, which reorders the cache between steps; sampling under a fixed seed; prompt-lookup
decoding, which feeds several candidate tokens in one cached step and crops the cache back where
they are rejected (one prompt: Hugging Face's assisted generation takes one sequence; compared
with greedy decoding without a cache, which it cannot run itself and whose tokens it keeps).
Where prompt lookup through the bridge gives other tokens than without the cache, the same prompt
tokens go through Hugging Face's own model (no TransformerLens) with the same options: when it
picks exactly the bridge's tokens, the row says "as Hugging Face's own". transformers 5.25 crops
the recurrent states of state-space and hybrid models for assisted decoding, and its own Mamba,
Mamba-2, Bamba and Zamba2 then pick other tokens than without a cache on the CPU.

    HF_HUB_OFFLINE=1 python benchmarks/bridge_hf_generate.py [--architectures A,B] [--json PATH]
        [--decoding greedy|beam|sample|lookup]
"""

from __future__ import annotations

import argparse
from typing import Any

import bridge_architectures as architectures
import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl.verify import bridge, checks

NEW_TOKENS = 8
PROMPTS = list(checks.PROMPTS)[:2]


#: Hugging Face decoding strategies (``--decoding``): options of ``hf_generate`` over greedy's.
DECODING: dict[str, dict[str, Any]] = {
    "greedy": {},
    "beam": {"num_beams": 3},
    "sample": {"do_sample": True, "top_k": 5},
    "lookup": {"prompt_lookup_num_tokens": 3},
}


def generate(model: Any, cached: bool, prompts: list[str] = PROMPTS, **options: Any) -> Any:
    """``hf_generate`` of ``prompts`` (greedy unless ``options`` say otherwise, seeded), with or
    without the cache: the tokens, or what Hugging Face returns for ``options`` such as
    ``output_logits=True``."""
    arguments = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "stop_at_eos": False,
        "return_type": "tokens",
        "use_past_kv_cache": cached,
        "use_cache": cached,
        **options,
    }
    torch.manual_seed(0)
    return model.hf_generate(prompts, **arguments)


def decode(model: Any, decoding: str, cached: bool) -> Any:
    """The tokens of the strategy ``decoding`` of :data:`DECODING`, with or without the cache.
    Prompt lookup takes one prompt, and without a cache it decodes greedily (see above)."""
    options = dict(DECODING[decoding])
    prompts = PROMPTS[1:] if "prompt_lookup_num_tokens" in options else PROMPTS
    if not cached:
        options.pop("prompt_lookup_num_tokens", None)
    return generate(model, cached, prompts, **options)


def hugging_face_decode(folder: str, tokens: torch.Tensor, decoding: str, cached: bool) -> Any:
    """The tokens Hugging Face's own model of ``folder`` (no TransformerLens) generates from the
    prompt ``tokens`` (one unpadded sequence, as the bridge tokenized it) with the strategy
    ``decoding``, with or without the cache, as :func:`decode` asks the bridge."""
    options = dict(DECODING[decoding])
    if not cached:
        options.pop("prompt_lookup_num_tokens", None)
    model = bridge.reference_from(folder, torch.float32)
    torch.manual_seed(0)
    return model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=cached,
        **options,
    )


def as_hugging_face_s_own(folder: str, cached: torch.Tensor, decoding: str) -> bool:
    """Whether Hugging Face's own model picks exactly the bridge's ``cached`` tokens of prompt
    lookup (one decoder-only sequence) from the same prompt, cached."""
    if decoding != "lookup" or cached.shape[0] != 1:
        return False
    own = hugging_face_decode(folder, cached[:, :-NEW_TOKENS], decoding, cached=True)
    return torch.equal(own, cached)


def run(folder: str, active: bool, decoding: str = "greedy") -> str:
    """``"right"``, how many generated tokens differ, or the error; stock when not ``active``."""
    try:
        with patched(active), architectures.quietly():
            model = architectures.boot(folder)
            cached, uncached = decode(model, decoding, True), decode(model, decoding, False)
            same = torch.equal(cached, uncached)
            encoder_decoder = bool(getattr(model.cfg, "is_encoder_decoder", False))
            own = not (same or encoder_decoder) and as_hugging_face_s_own(folder, cached, decoding)
    except Exception as error:  # a row saying why, not a crash
        return f"fails: {architectures.last_line(error)}"
    if same:
        return "right"
    if cached.shape != uncached.shape:
        return f"wrong: {tuple(cached.shape)} tokens against {tuple(uncached.shape)} uncached"
    differing = int((cached[:, -NEW_TOKENS:] != uncached[:, -NEW_TOKENS:]).sum())
    mark = AS_OWN if own else ""
    return f"wrong: {differing} of {cached.shape[0] * NEW_TOKENS} tokens differ{mark}"


#: Ends the row of a result that Hugging Face's own model gives too (:func:`as_hugging_face_s_own`).
AS_OWN = ", as Hugging Face's own"


def verdict(patched: str, stock: str) -> str:
    """What safelens-tl changes for this architecture."""
    if patched.endswith(AS_OWN) and patched != stock:
        return "[green]fixed by safelens-tl[/green] (to Hugging Face's own tokens)"
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
    parser.add_argument("--decoding", choices=list(DECODING), default="greedy")
    arguments = parser.parse_args(argv)
    chosen = [name.strip() for name in arguments.architectures.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        parser.error(f"--architectures: unknown {unknown}; expected some of {list(names)}")
    table = Table(
        title=f"TransformerBridge.hf_generate, {arguments.decoding}, cached against uncached, "
        "float32"
    )
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
        patched = run(folder, True, arguments.decoding)
        stock = run(folder, False, arguments.decoding)
        results[architecture] = {"patched": patched, "stock": stock}
        table.add_row(architecture, patched, stock, verdict(patched, stock))
        architectures.write_json(arguments.json, results)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
