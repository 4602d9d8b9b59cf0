"""The registry: every fix safelens-tl carries, one record each, in the order they are applied.

This tuple is the only list of fixes. The plugins build their patches from it, ``status()``
reports on each record, ``docs/fixes.md``'s table is generated from it and
``tests/test_registry.py`` checks each record. Where records wrap the same method, the earlier one
is the outer wrapper (:func:`safelens_tl.registry.build`), so the order here is behaviour.
"""

from __future__ import annotations

from safelens_tl import (
    bridge_attention_mask,
    bridge_cache,
    bridge_cache_writes,
    bridge_codegen,
    bridge_cohere_rotary,
    bridge_conversion,
    bridge_gated_delta,
    bridge_generate_batch,
    bridge_hf_generate_mask,
    bridge_hybrid_cache,
    bridge_mask_dtype,
    bridge_model_call,
    bridge_rotary_dtype,
    bridge_state_mask,
    bridge_stateful_generate,
    bridge_t5_block,
    bridge_t5_legacy_block,
    bridge_uncached_media,
    generate_reserve,
    hooked_alibi,
    hooked_generate_mask,
    hooked_generate_ones_mask,
    hooked_moe_dtype,
    hooked_weight_copies,
    hooked_zeros_mask,
    kv_cache,
    registry,
)
from safelens_tl.registry import Fix

#: HookedTransformer (``import transformer_lens``). ``generate`` is wrapped by the mask fixes
#: outside the reservation, which then sees the tokens a list of prompts was turned into.
HOOKED_FIXES: tuple[Fix, ...] = (
    kv_cache.FIX,
    hooked_generate_mask.FIX,
    hooked_zeros_mask.FIX,
    hooked_generate_ones_mask.FIX,
    generate_reserve.FIX,
    hooked_alibi.FIX,
    hooked_moe_dtype.FIX,
    hooked_weight_copies.FIX,
)

#: TransformerBridge (``transformer_lens.model_bridge``, imported lazily by TransformerLens), and
#: Hugging Face's CodeGen. Contributions to one method, outermost first: ``generate`` (padded
#: batch, state-space options, media), ``hf_generate`` (state-space options, batch mask), a
#: rotary bridge's ``forward`` (Cohere's pairs, model dtype), the attention mask (saturating,
#: causal).
BRIDGE_FIXES: tuple[Fix, ...] = (
    bridge_conversion.FIX,
    bridge_generate_batch.FIX,
    bridge_stateful_generate.FIX,
    bridge_uncached_media.FIX,
    bridge_hf_generate_mask.FIX,
    bridge_cohere_rotary.FIX,
    bridge_rotary_dtype.FIX,
    bridge_codegen.FIX,
    bridge_mask_dtype.FIX,
    bridge_attention_mask.FIX,
    bridge_gated_delta.FIX,
    bridge_hybrid_cache.FIX,
    bridge_cache_writes.FIX,
    bridge_state_mask.FIX,
    bridge_model_call.FIX,
    bridge_cache.FIX,
    bridge_t5_legacy_block.FIX,
    bridge_t5_block.FIX,
)

#: Every fix, in the order its patches are built.
FIXES: tuple[Fix, ...] = HOOKED_FIXES + BRIDGE_FIXES


def main(argv: list[str] | None = None) -> int:
    """``python -m safelens_tl.fixes_registry [--markdown | --write PATH]``: print the table of
    fixes, or regenerate it in ``docs/fixes.md``."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m safelens_tl.fixes_registry")
    parser.add_argument("--markdown", action="store_true", help="print the table (the default)")
    parser.add_argument("--write", metavar="PATH", help="regenerate the table in this file")
    arguments = parser.parse_args(argv)
    if arguments.write:
        path = Path(arguments.write)
        path.write_text(registry.render_document(path.read_text(encoding="utf-8"), FIXES), "utf-8")
    else:
        print(registry.markdown(FIXES), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
