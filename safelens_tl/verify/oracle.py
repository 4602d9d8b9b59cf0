"""What cached generation must reproduce, and how closely: the verifier's oracle.

**The yardstick.** Cached generation computes, at each step, the logits of one new position from
the keys and values the cache holds for the earlier ones. One uncached forward over the whole
sequence, in the same dtype and on the same tokens (the generated ones included), computes the
same logits from scratch. That forward is the yardstick: it runs without any cache
(``use_cache=False``; no ``past_kv_cache``), so nothing a cache does, nor the code that writes and
reads it, nor Hugging Face's cache classes that its own ``generate`` shares, can move it.

**The allowance** must not come from a cached path either: Hugging Face's own cached ``generate``
runs through the same cache classes as TransformerBridge, so a bug there would raise such an
allowance together with the error. It comes from uncached forwards in the same dtype that compute
the same logits with their sums in other orders (``order``: :func:`order_error`): the forward over
the prefix that ends at a step (what generation without a cache computes there), and the forward
over the whole sequence behind :data:`SHIFTS` more positions of left padding (masked, the same
positions: every matrix product and attention row takes other lengths and alignments at every
step), and, where torch has two CPU kernels for the dtype's matrix products, the whole forward
through the other one (:func:`other_kernels`). All of them are right; they differ from the
yardstick only because the sums run in another order, which is all a correct cache changes as
well (one query against the cached keys, products of one row per sequence). The allowance is
:data:`ORDER_FACTOR` times ``order``, never below the dtype's :data:`FLOORS` (a couple of units
in the last place of the largest logit) and never above :data:`CEILING`.

**Why not the dtype's rounding against float32.** The uncached forward in the dtype against the
same forward in float32 (``rounding``: the dtype's rounding at the model's depth) counts every
rounding of the forward, while the cached and uncached paths round the same operations on the
same values and share nearly all of theirs. Measured on the built-in 2-layer models in bfloat16:
``rounding`` 3.8e-2 to 4.3e-2, the cached path 0 from the uncached one, and a cache whose past
values are 1% too large 2.0e-2 to 2.3e-2 from it: an allowance of even half the rounding would
pass that cache. ``rounding`` bounds what differs *between implementations* (the bridge against
Hugging Face's own model: :func:`reference_bound`), and what a cache that keeps a recurrent state
adds (below).

**Other kernels.** On a CPU with native bfloat16 (or float16) dot products (AVX512-BF16, AMX),
torch hands a half-precision matrix product to oneDNN above a small size (16x16x16) and computes
smaller ones itself. A cached step's products have one row per sequence, so they fall below that
size where the uncached forward's, over the whole sequence, are above it: the two paths round
through different kernels, while every prefix and padded forward runs oneDNN's alone. Measured on
such a CPU (AMD EPYC with AVX512-BF16, torch 2.13): Florence-2's tiny decoder in bfloat16, cached
against uncached 1.1e-2, prefix and padded orders 0, the uncached forward without oneDNN 2.6e-2
from it. So the uncached forward also runs once with oneDNN off, and counts as one more order.
Elsewhere both runs take the same kernel and agree exactly.

**Recurrent state.** A state-space or linear-attention layer's cache keeps a state that the
uncached forward never rounds to the dtype; the cached path rounds it at every step (Hugging
Face's own as much as TransformerBridge's). For such models the allowance is also at least
:data:`STATE_FACTOR` times ``rounding``.

**Why a correct cache passes.** Its cached logits differ from the yardstick by the order of the
sums alone, as the other orders do, and the allowance is :data:`ORDER_FACTOR` times the largest of
those, or the floor. Measured on the CPU, a correct cache's error has been at most 1.14 times
``order`` (SmolLM2-135M in float16; a 24-layer model 1.1), and within the floor on the built-in
models (docs/verify.md).

**Why a wrong cache cannot.** Everything a cache can get wrong (a stored dtype, a rounding, a
dropped, duplicated or stale position, heads in another order, a position or mask off by one for
cached steps) enters the cached logits and neither the yardstick nor the allowance, which never
touch a cache. It fails as soon as it moves the logits by more than the allowance, at any step
the run covers (every step is compared); the smallest failing bias is measured per model and
dtype in docs/verify.md (``benchmarks/verify_sensitivity.py``), and
``tests/test_verify_mutants.py`` injects such bugs into the real code and watches
``safelens-tl verify`` fail. Two hard limits hold whatever the allowance: an error above
:data:`CEILING` fails, and so does a run whose cached steps pick the uncached forward's top token
on fewer than :data:`MIN_AGREEMENT` of them (greedy agreement on the same tokens: a near tie
flipped by rounding costs one step, not the rest of the sequence).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The least allowance per dtype, relative to the largest logit: a couple of units in the last
#: place of the largest logit (float16 eps ~ 9.8e-4: two units; bfloat16 eps ~ 7.8e-3: one unit;
#: float32 1e-4). A correct cache on a CPU shows 0 to 9e-4 on the built-in models in float16 and
#: bfloat16, ~1e-6 in float32.
FLOORS: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 8e-3,
}
#: Allowance per unit of ``order``: the cached path is one more order of the same sums. Measured
#: ratio of a correct cache's error to ``order``: at most 1.14 (docs/verify.md).
ORDER_FACTOR = 2.0
#: Allowance per unit of ``rounding`` for caches that keep a recurrent state (rounded to the dtype
#: at every step, which the uncached forward never does).
STATE_FACTOR = 2.0
#: Any error above this fails, whatever the allowance: far beyond any rounding a cache may add.
CEILING = 0.1
#: Fewer cached steps than this picking the uncached forward's top token fails, whatever the error.
MIN_AGREEMENT = 0.9
#: Least bound against an independent implementation (Hugging Face's own model) in the dtype:
#: its attention and normalisations round differently from TransformerBridge's reconstruction
#: (on the built-in models up to 2e-6 in float32, 5e-3 in float16, 3e-2 in bfloat16 with no
#: cache at all).
REFERENCE_FLOORS: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
#: Two implementations each round by ``rounding`` from the float32 result: they may differ by
#: twice that.
REFERENCE_FACTOR = 2.0
#: Prefix forwards the default run measures ``order`` with (spread over the generated steps, the
#: last included); ``--thorough`` measures every step.
ORDER_STEPS = 8
#: Positions of left padding put before the whole sequence for more orders of the same sums.
SHIFTS = (1, 2, 3)


#: Dtypes whose CPU matrix products torch may hand to oneDNN's native half-precision kernels.
OTHER_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def other_kernels_apply(model: torch.nn.Module) -> bool:
    """Whether ``model``'s uncached forward also runs through :func:`other_kernels` for
    ``order``: where oneDNN is enabled and the model holds half-precision weights on the CPU."""
    mkldnn: Any = torch.backends.mkldnn
    if not (mkldnn.is_available() and mkldnn.enabled):
        return False
    return any(
        weight.device.type == "cpu" and weight.dtype in OTHER_KERNEL_DTYPES
        for weight in model.parameters()
    )


@contextlib.contextmanager
def other_kernels() -> Iterator[None]:
    """Inside, torch computes CPU matrix products with its own kernels instead of oneDNN's (the
    kernels a cached step's one-row products take): another order of the same sums."""
    # Only this setting: torch's ``mkldnn.flags()`` would also reset its other settings.
    mkldnn: Any = torch.backends.mkldnn
    previous = bool(mkldnn.enabled)
    mkldnn.enabled = False
    try:
        yield
    finally:
        mkldnn.enabled = previous


def floor_for(dtype: torch.dtype) -> float:
    """The least allowance of ``dtype``; dtypes without one (float64) take float32's."""
    return FLOORS.get(dtype, FLOORS[torch.float32])


@dataclass(frozen=True)
class Allowance:
    """How far a correct cache's logits may be from the uncached forward's, and why."""

    dtype: torch.dtype
    #: :data:`FLOORS` of the dtype.
    floor: float
    #: :func:`order_error` of the same model, dtype and tokens (``None``: not measured).
    order: float | None
    #: The uncached forward in the dtype against float32 (``None``: not measured).
    rounding: float | None
    #: Whether the cache keeps a recurrent state (then :data:`STATE_FACTOR` x ``rounding`` too).
    recurrent: bool = False

    @property
    def value(self) -> float:
        """The bound: the largest of the floor, :data:`ORDER_FACTOR` x ``order`` and (recurrent
        state) :data:`STATE_FACTOR` x ``rounding``; at most :data:`CEILING`. NaN measurements
        leave the floor."""
        bound = self.floor
        if self.order is not None and not math.isnan(self.order):
            bound = max(bound, ORDER_FACTOR * self.order)
        if self.recurrent and self.rounding is not None and not math.isnan(self.rounding):
            bound = max(bound, STATE_FACTOR * self.rounding)
        return min(bound, CEILING)

    def basis(self) -> str:
        """Where :attr:`value` comes from, in words."""
        if self.value >= CEILING:
            return f"the ceiling {CEILING:g}"
        state = self.rounding is not None and self.value == STATE_FACTOR * self.rounding
        if self.recurrent and state and self.value > self.floor:
            return (
                f"{STATE_FACTOR:g}x this model's rounding in {_name(self.dtype)} against "
                f"float32 ({self.rounding:.1e}; the cache keeps a recurrent state)"
            )
        if self.order is not None and self.value > self.floor:
            return (
                f"{ORDER_FACTOR:g}x how far this model's uncached forward moves when only the "
                f"order of its sums changes ({self.order:.1e})"
            )
        return f"the {_name(self.dtype)} floor"


def allowance(
    dtype: torch.dtype,
    order: float | None,
    rounding: float | None = None,
    recurrent: bool = False,
) -> Allowance:
    """The :class:`Allowance` of a model in ``dtype`` whose uncached forwards show ``order`` (and,
    with a recurrent state, ``rounding``)."""
    return Allowance(dtype, floor_for(dtype), order, rounding, recurrent)


def reference_bound(dtype: torch.dtype, rounding: float | None) -> float:
    """The bound against an independent implementation in ``dtype``: its floor, or
    :data:`REFERENCE_FACTOR` x ``rounding`` where larger (deep models in half precision)."""
    floor = REFERENCE_FLOORS.get(dtype, REFERENCE_FLOORS[torch.float32])
    if rounding is None or math.isnan(rounding):
        return floor
    return max(floor, REFERENCE_FACTOR * rounding)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def relative_error(
    logits: torch.Tensor,
    expected: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> float:
    """Largest absolute difference of ``logits`` from ``expected``, relative to the largest
    ``expected`` logit (in float32), over the positions ``valid`` marks (``[batch, pos]``; all
    when ``None``). ``scale`` replaces that largest logit (to put several comparisons on one
    scale). NaN anywhere compared gives NaN."""
    expected = expected.float()
    difference = (logits.float().to(expected.device) - expected).abs()
    if valid is not None:
        mask = valid.to(expected.device).bool()
        difference, expected = difference[mask], expected[mask]
    if difference.numel() == 0:
        return 0.0
    if torch.isnan(difference).any():
        return math.nan
    largest = float(expected.abs().max()) if scale is None else scale
    return float(difference.max()) / max(largest, 1e-6)


def worst_error(errors: Iterable[float]) -> float:
    """The largest of ``errors``, or NaN when any is NaN: Python's ``max`` keeps whichever of a
    number and a NaN comes first, and so could report NaN logits as right."""
    values = list(errors)
    return math.nan if any(math.isnan(value) for value in values) else max(values, default=0.0)


def agreement(
    logits: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor | None = None
) -> float:
    """Share of positions where ``logits`` and ``expected`` pick the same top token (greedy
    agreement on the same tokens), over the positions ``valid`` marks."""
    same = logits.float().argmax(dim=-1).cpu() == expected.float().argmax(dim=-1).cpu()
    if valid is not None:
        same = same[valid.cpu().bool()]
    return float(same.float().mean()) if same.numel() else 1.0


def order_steps(total: int, wanted: int | None) -> list[int]:
    """Which of ``total`` steps (0-based) the order measurement takes: ``wanted`` spread evenly,
    the first and the last included; every step when ``wanted`` is ``None`` or at least
    ``total``."""
    if total <= 0:
        return []
    if wanted is None or wanted >= total:
        return list(range(total))
    if wanted <= 1:
        return [total - 1]
    return sorted({round(i * (total - 1) / (wanted - 1)) for i in range(wanted)})


def order_error(
    other: Sequence[torch.Tensor], whole: Sequence[torch.Tensor], scale: float
) -> float:
    """``order``: the logits of uncached forwards in other orders (``other``; the last position of
    a forward over a prefix, or the positions of a forward behind more padding) against the
    uncached forward over the whole sequence at the same positions (``whole``), relative to
    ``scale`` (the largest logit of the compared steps).

    A forward that picks another top token than the whole one's on more than
    ``1 - MIN_AGREEMENT`` of its positions computes something else (a model whose positions do
    not follow the mask, say) and is left out: it could only widen the allowance. NaN logits are
    left out the same way, or give NaN, which leaves the floor (:attr:`Allowance.value`)."""
    errors = [
        relative_error(mine, theirs, scale=scale)
        for mine, theirs in zip(other, whole, strict=True)
        if mine.numel() == 0 or agreement(mine, theirs) >= MIN_AGREEMENT
    ]
    return worst_error(errors)


def judge(
    error: float,
    bound: Allowance,
    agreement_share: float | None,
    what: str,
) -> list[str]:
    """Problems with a cached path whose logits are ``error`` (relative) from the yardstick and
    whose greedy picks agree with it on ``agreement_share`` of the steps. ``what`` names the
    comparison, e.g. "cached generate's logits differ from the bridge's uncached forward"."""
    problems = []
    # Written as "not <=" so that a NaN error fails too.
    if not error <= bound.value:
        problems.append(
            f"{what} by {error:.2e} (relative), above the allowance {bound.value:.1e} "
            f"({bound.basis()})"
        )
    if agreement_share is not None and not agreement_share >= MIN_AGREEMENT:
        problems.append(
            f"the cached steps pick the uncached forward's top token on {agreement_share:.0%} "
            f"of the steps only (at least {MIN_AGREEMENT:.0%} required)"
        )
    return problems
