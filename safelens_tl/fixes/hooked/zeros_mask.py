"""The mask of zeros that ``HookedTransformer.generate`` of TransformerLens 2.13 to 3.0.0 computes
at every step, computed once per ``generate``.

Those releases build each step's mask by calling ``transformer_lens.utils.get_attention_mask`` on
a tensor of zeros the size of the sequence so far (:mod:`safelens_tl.fixes.hooked.generate_mask`
says what that mask gets wrong and how a patched ``generate`` fixes it). Each call reads the
tokenizer's ``pad_token_id`` and ``bos_token_id`` (properties that look the tokens up in the
vocabulary) and runs half a dozen small tensor operations, a boolean index among them: 4-6% of a
short generation on a small model (docs/performance.md).

For a tensor of zeros the answer depends on the tokenizer, ``prepend_bos`` and the shape only, and
holds one value throughout (every zero is padding or none is) except where a BOS that is also the
pad token was prepended: then the last leading pad is kept (1) and the rest masked (0). So
:func:`remembering_generate` opens a record for each ``generate`` call, and
:func:`answering_zeros` wraps ``get_attention_mask``: inside a ``generate``, a call on zeros of
two or more positions runs the original, and when that answer holds one value, later calls on
zeros with the same tokenizer and ``prepend_bos`` get a new tensor of that value, in their shape,
dtype and device, as the original would have built it. (A one-token prompt's first call is
answered from two positions of zeros: one position cannot show a kept BOS.) Every other call,
and every call outside a patched ``generate``, runs the original. The tokenizer's pad and BOS
tokens are taken to stay what they were at the first step for the rest of that ``generate``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, Wrap, frozen


@dataclass
class ZerosAnswer:
    """What ``get_attention_mask`` answered for zeros in one ``generate``, once it is known to
    hold one value."""

    tokenizer: object = None
    prepend_bos: object = None
    #: The one value of the answer; ``None`` until an answer of two or more positions shows it.
    value: int | None = None

    def answer(
        self,
        get_attention_mask: Callable[..., torch.Tensor],
        tokenizer: Any,
        tokens: torch.Tensor,
        prepend_bos: Any,
    ) -> torch.Tensor:
        """``get_attention_mask(tokenizer, tokens, prepend_bos)``, built from the record where
        ``tokens`` are zeros that an earlier answer in this ``generate`` covers."""
        # count_nonzero: half the time of any() on a small integer tensor (1.8 against 3.9 us).
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or bool(tokens.count_nonzero()):
            return get_attention_mask(tokenizer, tokens, prepend_bos)
        if self.value is not None:
            if tokenizer is self.tokenizer and prepend_bos is self.prepend_bos:
                # Laid out as the original's ones_like(tokens).
                return torch.full_like(tokens, self.value)
            return get_attention_mask(tokenizer, tokens, prepend_bos)
        # One position cannot tell a kept BOS from an answer of one value: a one-token prompt's
        # first step asks about two positions instead (what its second step would ask).
        probe = tokens if tokens.shape[1] >= 2 else tokens.new_zeros((tokens.shape[0], 2))
        mask = get_attention_mask(tokenizer, probe, prepend_bos)
        if mask.shape == probe.shape and mask.numel() and bool(mask.eq(mask[0, 0]).all()):
            self.tokenizer, self.prepend_bos, self.value = tokenizer, prepend_bos, int(mask[0, 0])
        if probe is tokens:
            return mask
        # A one-token prompt: its own answer, built from the probe's or asked for.
        if self.value is None:
            return get_attention_mask(tokenizer, tokens, prepend_bos)
        return torch.full_like(tokens, self.value)


#: The record of the patched ``generate`` running in this context; ``None`` outside one.
_answers: ContextVar[ZerosAnswer | None] = ContextVar("safelens_tl_zeros_mask", default=None)


def remembering_generate(generate_with: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.generate`` (or a wrapper of it): each call gets its own record of
    the mask of zeros, which :func:`answering_zeros` fills and reads."""

    @functools.wraps(generate_with)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _answers.set(ZerosAnswer())
        try:
            return generate_with(self, *args, **kwargs)
        finally:
            _answers.reset(token)

    return generate


def answering_zeros(get_attention_mask: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap ``transformer_lens.utils.get_attention_mask``: inside a patched ``generate`` its calls
    on zeros are answered from the record of that ``generate`` (see the module docstring); every
    other call is the original's."""

    @functools.wraps(get_attention_mask)
    def attention_mask(tokenizer: Any, tokens: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        record = _answers.get()
        # generate's own call: (tokenizer, tokens, prepend_bos), positionally.
        if record is None or kwargs or len(args) != 1:
            return get_attention_mask(tokenizer, tokens, *args, **kwargs)
        return record.answer(get_attention_mask, tokenizer, tokens, args[0])

    return attention_mask


def _applies(context: Context) -> tuple[bool, str]:
    if not targets.hooked_generate_masks_no_padding(context.release):
        return False, f"TransformerLens {context.release} computes no mask of zeros"
    return True, f"TransformerLens {context.release} computes a mask of zeros at every step"


def _patches(context: Context) -> list[Patch | Wrap]:
    patches: list[Patch | Wrap] = []
    model = context.layout.model_class()
    if model is not None:
        patches.append(Wrap(model, "generate", remembering_generate))
    utils = targets.optional_module(targets.HOOKED_UTILS_MODULE)
    original_mask = None if utils is None else utils.__dict__.get("get_attention_mask")
    if utils is not None and callable(original_mask):
        patches.append(Patch(utils, "get_attention_mask", answering_zeros(original_mask)))
    return patches


FIX = Fix(
    id="hooked_zeros_mask",
    symptom="HookedTransformer.generate recomputes a mask of zeros at every step (4-6% of a "
    "short generation)",
    affects=frozen({"transformer-lens": ">=2.13,<3.1"}),
    remedy="the mask of zeros is computed once per generate",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_zeros_mask.py",
    changes=("generate", "forward"),
    detector="release",
    fixed_in="3.1.0",
)
