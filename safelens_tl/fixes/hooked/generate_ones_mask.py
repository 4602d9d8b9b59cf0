"""``HookedTransformer.generate`` without its all-ones attention mask, where nothing is padded
(TransformerLens 3.1 to 3.9).

From 3.1 on, ``generate`` builds the prompts' mask once and, at every step, passes it extended
with ones to ``get_residual`` and to ``forward``. When nothing is padded (one prompt, or prompts of
one length) that mask is all ones, and every attention layer still does the masked work at every
step: a causal mask combined with it, and for rotary models position ids recomputed from it for
queries and keys. Attention without a mask computes the same numbers bitwise (the causal mask
alone, rotary positions by offset; the releases' code read from the wheels of 3.1.0, 3.5.0, 3.8.0
and 3.9.0, and ``tests/test_hooked_generate_ones_mask.py`` compares tokens, logits and every
hook's activations with stock). So a patched ``generate`` marks the model in a
:class:`~contextvars.ContextVar`; :func:`recording_residual` notes the mask that ``generate``'s
own ``get_residual`` call gets and decides once, at the first step, whether it is all ones; and
:func:`unmasked_forward` leaves that same mask object out of the ``forward`` call that follows.
``get_residual`` keeps it: learned positions there differ without a mask at cached steps.

Any other call, a mask that is not that object (a hook calling ``forward`` with its own mask), a
padded batch, and every release outside the range keep the mask as stock passes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes.hooked._generate_steps import (
    StepMethods,
    is_generates_residual_call,
    step_wraps,
)
from safelens_tl.registry import Context, Fix, frozen


@dataclass
class Generating:
    """One patched ``generate`` call on ``model``: what its steps' masks are."""

    model: object
    #: The mask ``generate`` passed to its last ``get_residual`` call.
    mask: torch.Tensor | None = field(default=None, repr=False)
    #: Whether the prompts' mask is all ones; ``None`` until the first step.
    all_ones: bool | None = None


_generating: ContextVar[Generating | None] = ContextVar(
    "safelens_tl_hooked_generate_ones", default=None
)


def marking_generate(
    generate: Callable[..., Any], original: Callable[..., Any] | None, steps: StepMethods
) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.generate`` so that its steps' ``get_residual`` and ``forward``
    calls know they are its own: ``steps`` puts :func:`recording_residual` and
    :func:`unmasked_forward` on the model for the call.

    ``generate`` generates (``generate`` or a wrapper of it); the result presents itself as
    ``original`` (``None``: ``generate``), so that a patch always wraps the original itself.
    """

    @functools.wraps(generate if original is None else original)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _generating.set(Generating(self))
        try:
            with steps.installed(self):
                return generate(self, *args, **kwargs)
        finally:
            _generating.reset(token)

    return marked


def recording_residual(get_residual: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.get_residual``: in a marked ``generate``, note the mask of its
    own call (``embeds, pos_offset`` positionally, ``attention_mask`` by keyword, no ``tokens``)
    and, at the first step, whether it is all ones (the later steps add ones to it)."""

    @functools.wraps(get_residual)
    def residual(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _generating.get()
        if state is not None and state.model is self and is_generates_residual_call(args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is not None:
                if state.all_ones is None:
                    state.all_ones = bool(mask.all())
                state.mask = mask
        return get_residual(self, *args, **kwargs)

    return residual


def unmasked_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.forward``: in a marked ``generate`` whose prompts' mask is all
    ones, the call that passes the very mask its ``get_residual`` got runs without it."""

    @functools.wraps(forward)
    def unmasked(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _generating.get()
        if state is not None and state.all_ones and state.model is self:
            mask = kwargs.get("attention_mask")
            if mask is not None and mask is state.mask:
                kwargs["attention_mask"] = None
        return forward(self, *args, **kwargs)

    return unmasked


def _applies(context: Context) -> tuple[bool, str]:
    if not targets.hooked_generate_passes_its_mask(context.release):
        return False, f"TransformerLens {context.release} passes no all-ones mask to forward"
    return True, f"TransformerLens {context.release} passes an all-ones mask at every step"


_patches = step_wraps(
    marking_generate, recording_residual, unmasked_forward, "hooked_generate_ones_mask"
)


FIX = Fix(
    id="hooked_generate_ones_mask",
    symptom="HookedTransformer.generate does masked attention work at every step where nothing "
    "is padded",
    affects=frozen({"transformer-lens": ">=3.1,<4"}),
    remedy="an all-ones step mask is left out of forward (the same numbers, bitwise)",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_generate_ones_mask.py",
    changes=("generate", "forward"),
    detector="release",
)
