"""``HookedTransformer.generate``'s positions where its placeholder mask is all padding.

TransformerLens 2.13 to 3.0.0's ``generate`` computes, at every step, an attention mask from a
tensor of zeros that stands in for the tokens
(:func:`safelens_tl.targets.hooked_generate_masks_no_padding`) and passes it to
``get_residual``, which takes learned positions (``positional_embedding_type`` ``"standard"`` or
``"shortformer"``, as GPT-2's) from it. When the tokenizer's pad token id is 0, every zero counts
as padding: each position gets position 0's embedding and then has it zeroed as padding, so the
model generates without any position, cached or not, a single prompt as well as a batch. With
any other pad id the same mask is all ones, and positions are right. (TransformerLens makes the
end-of-text token the pad token of a tokenizer that has none; GPT-NeoX's vocabulary numbers it 0.)

A patched ``generate`` on such a model (learned positions, pad id 0) marks it, and the mask of
``generate``'s own ``get_residual`` call (the only one made without ``tokens``) is filled with
ones: what the release computes for every tokenizer whose pad id is not 0. Other models, and
every other ``get_residual`` call, are left as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

#: The model whose patched ``generate`` is running in this context and whose positions that
#: ``generate`` would lose (learned positions, pad token id 0); ``None`` otherwise.
_generating: ContextVar[object | None] = ContextVar("safelens_tl_hooked_generating", default=None)

#: The ``positional_embedding_type`` values ``get_residual`` takes from the mask.
LEARNED_POSITIONS = ("standard", "shortformer")


def loses_positions(model: Any) -> bool:
    """Whether this release's ``generate`` would drop ``model``'s positions: learned positions
    and a tokenizer whose pad token id is 0."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "positional_embedding_type", None) not in LEARNED_POSITIONS:
        return False
    # A tokenizer's pad_token_id is a property that looks the token up (tens of thousands of
    # instructions): read once per generate, not at every step.
    return getattr(getattr(model, "tokenizer", None), "pad_token_id", None) == 0


def marking_generate(generate: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``generate`` so that :func:`unpadded_placeholder_mask` knows the model generating,
    when it is one whose positions the release's ``generate`` loses."""

    @functools.wraps(generate)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not loses_positions(self):
            return generate(self, *args, **kwargs)
        token = _generating.set(self)
        try:
            return generate(self, *args, **kwargs)
        finally:
            _generating.reset(token)

    return marked


def unpadded_placeholder_mask(get_residual: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.get_residual``: the call ``generate`` makes with its placeholder
    mask (``embeds, pos_offset`` positionally, ``attention_mask`` by keyword, no ``tokens``) on a
    model marked by :func:`marking_generate` has that mask filled with ones; every other call is
    the original's."""

    @functools.wraps(get_residual)
    def residual(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _generating.get() is self and len(args) <= 2 and "tokens" not in kwargs:
            mask = kwargs.get("attention_mask")
            if mask is not None:
                # In place: generate builds this mask afresh at each step and reads it nowhere
                # else, and fill_ costs a third of a new tensor (0.8 against 2.2 us).
                mask.fill_(1)
        return get_residual(self, *args, **kwargs)

    return residual
