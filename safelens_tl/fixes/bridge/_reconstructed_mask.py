"""What the two fixes of the attention bridge's mask share (``bridge_mask_dtype``,
``bridge_attention_mask``): both wrap ``_apply_reconstruct_attention_mask``, which every release
with TransformerBridge has.
"""

from __future__ import annotations

from safelens_tl.registry import Context, PatchBuilder, Wrapper, wrapping

METHOD = "_apply_reconstruct_attention_mask"


def applies(context: Context) -> tuple[bool, str]:
    """The records' detector: every attention bridge masks reconstructed attention."""
    return True, "the attention bridge masks reconstructed attention"


def wrapping_the_mask(wrapper: Wrapper, consequence: str) -> PatchBuilder:
    """A record's ``patches``: the attention bridge's :data:`METHOD` wrapped by ``wrapper``."""
    return wrapping(
        lambda context: context.bridge.attention_class,
        METHOD,
        wrapper,
        "attention masks",
        consequence,
    )
