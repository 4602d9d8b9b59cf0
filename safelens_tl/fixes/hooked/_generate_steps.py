"""What the two fixes of ``HookedTransformer.generate``'s step mask share (``hooked_generate_mask``
on TransformerLens 2.13 to 3.0.0, ``hooked_generate_ones_mask`` on 3.1 to 3.9): ``generate`` marks
the model for the call, and ``get_residual`` and ``forward`` change the mask of the calls that
``generate`` makes itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safelens_tl.registry import Context, PatchBuilder, Wrap, Wrapper


def step_wraps(
    marking: Callable[[Callable[..., Any], Callable[..., Any]], Callable[..., Any]],
    residual: Wrapper,
    forward: Wrapper,
) -> PatchBuilder:
    """A record's ``patches``: ``generate`` wrapped by ``marking(inner, original)`` (presented as
    the original ``generate``), ``get_residual`` by ``residual`` and ``forward`` by ``forward``."""

    def patches(context: Context) -> list[Wrap]:
        model = context.layout.model_class()
        original = None if model is None else model.__dict__.get("generate")
        if model is None or not callable(original):
            return []
        return [
            # Outermost: the reservation then sees the tokens a list was turned into.
            Wrap(model, "generate", lambda inner: marking(inner, original)),
            Wrap(model, "get_residual", residual),
            Wrap(model, "forward", forward),
        ]

    return patches


def is_generates_residual_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``get_residual`` call has the shape of ``generate``'s own: ``embeds,
    pos_offset`` positionally, ``attention_mask`` by keyword, no ``tokens``."""
    return len(args) <= 2 and "tokens" not in kwargs
