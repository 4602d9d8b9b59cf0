"""Storage for one layer's keys and values: a buffer that grows geometrically and is written in place.

Stock TransformerLens appends with ``torch.cat``, copying the whole past at every token. Here the
past lives in a buffer with spare capacity; an append writes only the new positions, and
``past_keys``/``past_values`` are views of exactly the cached length. Positions already handed out
are never written again, so a tensor returned earlier never changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Growth factor 1.25: amortized O(1) appends with at most 25% spare capacity.
_GROWTH_NUMERATOR, _GROWTH_DENOMINATOR = 5, 4

_reserved_positions: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "safelens_tl_reserved_positions", default=None
)


@contextlib.contextmanager
def reserve(total_positions: int) -> Iterator[None]:
    """Within this block, size new buffers for ``total_positions`` cached positions at once.

    Used when the final length is known (prompt plus ``max_new_tokens``): reserving exactly avoids
    both regrowth copies and spare capacity.
    """
    token = _reserved_positions.set(total_positions)
    try:
        yield
    finally:
        _reserved_positions.reset(token)


def capacity_for(needed: int, limit: int | None) -> int:
    """Return the number of positions to allocate when ``needed`` positions must fit.

    A reservation in force wins when it is large enough; otherwise grow by 25%, never beyond
    ``limit`` (the model's ``n_ctx``) unless ``needed`` itself is larger.
    """
    reserved = _reserved_positions.get()
    if reserved is not None and reserved >= needed:
        return reserved
    grown = needed + max(needed * (_GROWTH_NUMERATOR - _GROWTH_DENOMINATOR) // _GROWTH_DENOMINATOR, 1)
    if limit is not None and needed <= limit:
        grown = min(grown, limit)
    return grown


@dataclass(eq=False)
class KVStorage:
    """Buffers ``[batch, capacity, heads, d_head]`` and the views last handed to the entry."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    keys_view: torch.Tensor
    values_view: torch.Tensor

    @property
    def capacity(self) -> int:
        """Positions the buffers can hold without growing."""
        return int(self.keys.size(1))

    def backs(self, past_keys: object, past_values: object) -> bool:
        """Whether the entry still holds the views this storage handed out (not reassigned)."""
        return past_keys is self.keys_view and past_values is self.values_view

    def can_write(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> bool:
        """Whether the new positions fit and match the buffers' dtype and device."""
        if self.length + new_keys.size(1) > self.capacity:
            return False
        if self.keys.dtype != new_keys.dtype or self.keys.device != new_keys.device:
            return False
        if self.values.dtype != new_values.dtype or self.values.device != new_values.device:
            return False
        # Inference tensors cannot be written in place outside inference mode.
        return not self.keys.is_inference() or torch.is_inference_mode_enabled()

    def write(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Write the new positions after the cached ones and refresh the views."""
        start, stop = self.length, self.length + new_keys.size(1)
        self.keys[:, start:stop].copy_(new_keys)
        self.values[:, start:stop].copy_(new_values)
        self.length = stop
        self.keys_view = self.keys[:, :stop]
        self.values_view = self.values[:, :stop]


def _buffer_with(past: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
    cached = past.size(1)
    batch, _, heads, d_head = new.shape
    buffer = torch.empty((batch, capacity, heads, d_head), dtype=new.dtype, device=new.device)
    if cached:
        # copy_ converts dtype and device in one pass; an empty past is never read (it may be meta).
        buffer[:, :cached].copy_(past)
    buffer[:, cached : cached + new.size(1)].copy_(new)
    return buffer


def allocate(
    past_keys: torch.Tensor,
    past_values: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    limit: int | None,
) -> KVStorage:
    """Return new storage holding the past followed by the new positions, in the new dtype/device."""
    length = past_keys.size(1) + new_keys.size(1)
    capacity = capacity_for(length, limit)
    keys = _buffer_with(past_keys, new_keys, capacity)
    values = _buffer_with(past_values, new_values, capacity)
    return KVStorage(keys, values, length, keys[:, :length], values[:, :length])
