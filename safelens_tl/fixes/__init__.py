"""Every fix safelens-tl carries, one record each, in the order they are applied.

A fix is one module, named after its symptom: ``fixes/hooked/<name>.py`` for HookedTransformer,
``fixes/bridge/<name>.py`` for TransformerBridge (:func:`module_name`), ending with its record,
``FIX = Fix(...)`` (:class:`safelens_tl.registry.Fix`). Helpers that are not fixes are the private
modules (``_*.py``). A fix module imports the engine, :mod:`safelens_tl.kv` and the helpers; never
this package, nor the fixes of the other API.

:data:`FIXES` is the only list of fixes. The plugins build their patches from it, ``status()``
reports on each record, ``docs/fixes.md``'s table is generated from it and
``tests/test_registry.py`` checks each record. Where records wrap the same method, the earlier one
is the outer wrapper (:func:`safelens_tl.registry.build`), so the order here is behaviour.
"""

from __future__ import annotations

from safelens_tl import registry
from safelens_tl.fixes.bridge import (
    attention_mask,
    cache,
    cache_writes,
    codegen,
    cohere_rotary,
    conversion,
    gated_delta,
    generate_batch,
    hf_generate_mask,
    hybrid_cache,
    mask_dtype,
    model_call,
    rotary_dtype,
    state_mask,
    stateful_generate,
    t5_block,
    t5_legacy_block,
    uncached_media,
)
from safelens_tl.fixes.hooked import (
    alibi,
    generate_mask,
    generate_ones_mask,
    generate_reserve,
    kv_cache,
    moe_dtype,
    weight_copies,
    zeros_mask,
)
from safelens_tl.registry import Fix

#: HookedTransformer (``import transformer_lens``). ``generate`` is wrapped by the mask fixes
#: outside the reservation, which then sees the tokens a list of prompts was turned into.
HOOKED_FIXES: tuple[Fix, ...] = (
    kv_cache.FIX,
    generate_mask.FIX,
    zeros_mask.FIX,
    generate_ones_mask.FIX,
    generate_reserve.FIX,
    alibi.FIX,
    moe_dtype.FIX,
    weight_copies.FIX,
)

#: TransformerBridge (``transformer_lens.model_bridge``, imported lazily by TransformerLens), and
#: Hugging Face's CodeGen. Contributions to one method, outermost first: ``generate`` (padded
#: batch, state-space options, media), ``hf_generate`` (state-space options, batch mask), a
#: rotary bridge's ``forward`` (Cohere's pairs, model dtype), the attention mask (saturating,
#: causal).
BRIDGE_FIXES: tuple[Fix, ...] = (
    conversion.FIX,
    generate_batch.FIX,
    stateful_generate.FIX,
    uncached_media.FIX,
    hf_generate_mask.FIX,
    cohere_rotary.FIX,
    rotary_dtype.FIX,
    codegen.FIX,
    mask_dtype.FIX,
    attention_mask.FIX,
    gated_delta.FIX,
    hybrid_cache.FIX,
    cache_writes.FIX,
    state_mask.FIX,
    model_call.FIX,
    cache.FIX,
    t5_legacy_block.FIX,
    t5_block.FIX,
)

#: Every fix, in the order its patches are built.
FIXES: tuple[Fix, ...] = HOOKED_FIXES + BRIDGE_FIXES

# What ``status()`` reports on, handed to the engine, which names no fix.
registry.publish(FIXES)


def module_name(fix: Fix) -> str:
    """The module that holds ``fix``'s record: ``safelens_tl.fixes.<api>.<name>``, where
    ``<api>`` is ``hooked`` or ``bridge`` and ``<name>`` the id without that prefix (the two
    oldest ids, ``kv_cache`` and ``generate_reserve``, have none)."""
    api = "hooked" if fix in HOOKED_FIXES else "bridge"
    return f"{__name__}.{api}.{fix.id.removeprefix(api + '_')}"


def main(argv: list[str] | None = None) -> int:
    """``python -m safelens_tl.fixes [--markdown | --write PATH]``: print the table of
    fixes, or regenerate it in ``docs/fixes.md``."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m safelens_tl.fixes")
    parser.add_argument("--markdown", action="store_true", help="print the table (the default)")
    parser.add_argument("--write", metavar="PATH", help="regenerate the table in this file")
    arguments = parser.parse_args(argv)
    if arguments.write:
        path = Path(arguments.write)
        path.write_text(registry.render_document(path.read_text(encoding="utf-8"), FIXES), "utf-8")
    else:
        print(registry.markdown(FIXES), end="")
    return 0
