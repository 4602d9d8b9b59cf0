"""Positions of a cached step that TransformerBridge gives only as ``cache_position``.

TransformerBridge's generate loop for state-space and hybrid models (TransformerLens 3.x/4.x) tells
the model where a cached step is with ``cache_position``, and passes ``position_ids`` only for a
left-padded batch. Models of transformers 5 no longer take ``cache_position``: it lands in their
``**kwargs``, unread. Most of them count positions from what their cache holds, but Bamba counts
from 0 at every call, so a single prompt through Bamba (whose attention layers are rotary) had
every generated token at position 0: silently wrong with any transformers 5 release. Hugging
Face's own ``generate`` always passes ``position_ids``, which is why it is right there.

The call into the model gets ``position_ids`` equal to ``cache_position`` for every row (what
transformers 4 models derived from it themselves) when its ``forward`` takes ``position_ids`` but
not ``cache_position`` and none were given. For the models that count from their cache those are
the positions they would have computed anyway.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

#: Keyed by the ``forward`` function itself, so that a replaced method is looked at anew.
_needs_positions: dict[Any, bool] = {}


def reads_positions_not_cache_position(model_class: type) -> bool:
    """Whether ``model_class.forward`` takes ``position_ids`` and not ``cache_position``.

    Remembered per method: asked at every step.
    """
    forward = getattr(model_class, "forward", None)
    known = _needs_positions.get(forward)
    if known is None:
        try:
            parameters = inspect.signature(forward).parameters  # type: ignore[arg-type]
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        known = "position_ids" in parameters and "cache_position" not in parameters
        _needs_positions[forward] = known
    return known


def model_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The ``[batch, pos, ...]`` input of a call into the model: its first positional argument,
    ``input_ids`` or ``inputs_embeds``, whichever is such a tensor first."""
    for candidate in (*args[:1], kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
        if isinstance(candidate, torch.Tensor) and candidate.dim() >= 2:
            return candidate
    return None


def add_positions_from_cache_position(
    args: tuple[Any, ...], kwargs: dict[str, Any], model_class: type
) -> None:
    """Give a call into ``model_class`` ``position_ids`` from its ``cache_position`` where the
    model reads only the former (the call's own ``kwargs`` are changed)."""
    cache_position = kwargs.get("cache_position")
    if not isinstance(cache_position, torch.Tensor) or cache_position.dim() != 1:
        return
    if kwargs.get("position_ids") is not None or not reads_positions_not_cache_position(
        model_class
    ):
        return
    positions = cache_position.unsqueeze(0)
    given = model_input(args, kwargs)
    kwargs["position_ids"] = positions if given is None else positions.expand(given.shape[0], -1)
