"""Diagnostics on a user's model that name a known mistake and its fix."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def weights_dtype(model: Any) -> torch.dtype | None:
    """The dtype most floating-point parameters have, or ``None`` for a model without any."""
    counts = Counter(p.dtype for p in model.parameters() if p.is_floating_point())
    return counts.most_common(1)[0][0] if counts else None


def half_trap(model: Any) -> str | None:
    """Name the ``model.half()`` trap when the weights' dtype differs from ``cfg.dtype``.

    ``model.half()`` / ``model.bfloat16()`` cast the weights but leave ``cfg.dtype`` alone, and
    TransformerLens builds caches and casts activations from ``cfg.dtype``: the model then mixes
    dtypes. ``model.to(torch.float16)`` updates both.
    """
    from safelens_tl.kv_cache import resolve_dtype

    weights = weights_dtype(model)
    try:
        configured = resolve_dtype(getattr(model.cfg, "dtype", None))
    except ValueError as error:
        return str(error)
    if weights is None or weights == configured:
        return None
    return (
        f"the weights are {dtype_name(weights)} but model.cfg.dtype is "
        f"{dtype_name(configured)} (the model.half() trap: .half()/.bfloat16() do not update "
        f"cfg.dtype); convert with model.to(torch.{dtype_name(weights)}) instead"
    )
