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
    """Name a model whose weights are mostly not in ``cfg.dtype``, and the fix.

    The usual cause is the ``model.half()`` trap: ``model.half()`` / ``model.bfloat16()`` cast the
    weights but leave ``cfg.dtype`` alone, and TransformerLens builds caches and casts activations
    from ``cfg.dtype``, so the model mixes dtypes. ``model.to(torch.float16)`` updates both. When
    some weights are in ``cfg.dtype`` and most are not, the model was built that way
    (TransformerLens's mixture-of-experts layers, without safelens-tl's fix), and those are named.
    A few weights in another dtype are left alone: Apertus's activation keeps its two scalars in
    float32 and computes right.
    """
    from safelens_tl.kv.entry import resolve_dtype

    weights = weights_dtype(model)
    try:
        configured = resolve_dtype(getattr(model.cfg, "dtype", None))
    except ValueError as error:
        return str(error)
    if weights is None or weights == configured:
        return None
    floating = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
    if not any(p.dtype == configured for _, p in floating):
        return (
            f"the weights are {dtype_name(weights)} but model.cfg.dtype is "
            f"{dtype_name(configured)} (the model.half() trap: .half()/.bfloat16() do not update "
            f"cfg.dtype); convert with model.to(torch.{dtype_name(weights)}) instead"
        )
    stray = [(name, p.dtype) for name, p in floating if p.dtype != configured]
    stray_dtypes = sorted({dtype_name(dtype) for _, dtype in stray})
    shown = ", ".join(name for name, _ in stray[:3])
    shown += f" and {len(stray) - 3} more" if len(stray) > 3 else ""
    return (
        f"{len(stray)} of the model's {len(floating)} weights are {'/'.join(stray_dtypes)} "
        f"({shown}) while model.cfg.dtype and the others are {dtype_name(configured)}: the model "
        f"was built with mixed dtypes (TransformerLens builds mixture-of-experts layers in "
        f"float32 unless safelens-tl is active); convert with "
        f"model.to(torch.{dtype_name(configured)})"
    )
