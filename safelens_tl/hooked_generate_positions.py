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

Inside a patched ``generate`` with a pad id of 0, the mask of that call (the only
``get_residual`` call made without ``tokens``) is replaced by all ones: what the release computes
for every tokenizer whose pad id is not 0. Nothing else changes; rotary and ALiBi models never
read it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

#: The model whose patched ``generate`` is running in this context, if any.
_generating: ContextVar[object | None] = ContextVar("safelens_tl_hooked_generating", default=None)


def marking_generate(generate: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``generate`` so that :func:`unpadded_placeholder_mask` knows the model generating."""

    @functools.wraps(generate)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _generating.set(self)
        try:
            return generate(self, *args, **kwargs)
        finally:
            _generating.reset(token)

    return marked


def unpadded_placeholder_mask(get_residual: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.get_residual``: the call ``generate`` makes with its placeholder
    mask (``embeds, pos_offset`` positionally, ``attention_mask`` by keyword, no ``tokens``)
    gets a mask of ones instead; every other call is the original's."""

    @functools.wraps(get_residual)
    def residual(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        if (
            mask is not None
            and len(args) <= 2
            and "tokens" not in kwargs
            # Any other pad id already gives all ones: no new tensor at each step then.
            and getattr(self.tokenizer, "pad_token_id", None) == 0
            and _generating.get() is self
        ):
            kwargs["attention_mask"] = mask.new_ones(mask.shape)
        return get_residual(self, *args, **kwargs)

    return residual
