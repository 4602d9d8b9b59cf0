"""Storage for one layer's keys and values: a buffer that grows geometrically, written in place.

Stock TransformerLens appends with ``torch.cat``, copying the whole past at every token. Here the
past lives in a buffer with spare capacity; an append writes only the new positions, and
``past_keys``/``past_values`` are views of exactly the cached length. Positions already handed out
are never written again, so a tensor returned earlier never changes.

Copy-on-write keeps stock's independence of old tensors: stock's ``torch.cat`` gives every step a
tensor of its own, so a snapshot (``clean = entry.past_keys``) and the live cache never affect each
other. Here they would share the buffer. So at each append, if anything besides the cache still
holds a handed-out view, or any other tensor sharing the buffer (a slice of it, a tensor autograd
saved), the new step goes to a fresh buffer and the old one is left to its holders. ``generate``
drops its views every step, so its appends stay in place.

That test needs torch's count of the tensors on a storage (``torch._C._storage_Use_Count``), which
CUDA builds of torch have and every build from torch 2.8 on, but CPU-only and macOS builds of
earlier releases lack. Nothing else tells whether a tensor shares the buffer (a ``detach()``, or any
view made in inference mode, leaves no trace on the buffer itself), so without it no cache is put
in a buffer: every cache is appended with ``torch.cat`` (:func:`in_place_appends`).

Layout: the buffers are head-major, ``[batch, heads, capacity, d_head]``, and hand out
``[batch, pos, heads, d_head]`` views, so that attention reads them without a copy (see
:class:`KVStorage`).

Small caches: a cache of at most :data:`SMALL_CACHE_BYTES` per tensor is not put in a buffer at
all. It is appended with ``torch.cat`` as stock does (see :class:`SmallCache`): at a few KiB, one
``cat`` costs less than the two views and the copy an in-place write needs, and a short generation
on a small model never leaves this size.

Capacity: a new buffer holds the needed positions plus 25% (amortized O(1) appends, at most 25%
spare), capped at the model's ``n_ctx``. Where the final length is known, a reservation sizes
buffers exactly instead: :func:`reserve` (a total) or :func:`reserve_ahead` (positions beyond the
first write, used by ``generate``, whose prompt length is only known once it is tokenized).
"""

from __future__ import annotations

import contextvars
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

#: Growth factor 1.25: amortized O(1) appends with at most 25% spare capacity.
_GROWTH_NUMERATOR, _GROWTH_DENOMINATOR = 5, 4
#: Under a plan (``reserve_ahead``), a buffer grows towards the planned total in steps of at most
#: 25% or this many positions, whichever is more: a ``generate`` that stops early (EOS) never holds
#: more than max(1.25 x, + PLAN_STEP positions) of what stock holds at that moment.
PLAN_STEP = 64

#: Caches whose keys (or values) would hold at most this many bytes are appended with ``torch.cat``
#: (:class:`SmallCache`); larger ones live in a buffer. 64 KiB: where the in-place write, which
#: costs about twice a ``cat``'s fixed overhead, starts to save more copying than it adds (see the
#: ``step`` and ``instructions`` sections of ``benchmarks/kv_cache.py``).
SMALL_CACHE_BYTES = 64 * 1024

_small_cache_bytes: contextvars.ContextVar[int] = contextvars.ContextVar(
    "safelens_tl_small_cache_bytes", default=SMALL_CACHE_BYTES
)
_reserved_positions: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "safelens_tl_reserved_positions", default=None
)
#: The variable :func:`reserve_ahead` sets; public for a caller that has validated its count
#: already (``generate``'s wrapper, where the context manager's own cost shows).
RESERVED_AHEAD: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "safelens_tl_reserved_ahead", default=None
)


# How many tensors share a buffer's storage: torch's count of storage references (one per tensor
# on it, views, detached tensors and inference-mode views included). Private to torch, and defined
# only in CUDA builds before torch 2.8 (pytorch/pytorch#155451 made it generic). The buffer's own
# reference count is no substitute: it misses detached tensors, and every view made in inference
# mode. Read where it is used, not bound once, so that a test can take it away.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: The small-cache limit where in-place appends are unavailable: every cache uses ``torch.cat``.
_UNLIMITED = sys.maxsize
#: Tensors of our own on each buffer's storage: the buffer and the current view.
_OWN_TENSORS = 2


class _Holder:
    value: object


def _references_added_by_getrefcount() -> int:
    """How many references ``sys.getrefcount(obj.attribute)`` itself adds to what it counts.

    One up to Python 3.13; newer interpreters may lend the argument without a reference of its
    own. Measured once, on the very form :meth:`KVStorage.shared_outside` uses.
    """
    holder = _Holder()
    holder.value = object()
    return sys.getrefcount(holder.value) - 1  # minus the holder's own reference


_GETREFCOUNT_OWN = _references_added_by_getrefcount()


def _storage_of(buffer: torch.Tensor) -> tuple[torch.UntypedStorage, int]:
    """The buffer's storage object, kept for the buffer's life, and the address the count takes.

    Keeping the object spares a new one per token, and keeps the count steady: torch may or may
    not keep a storage's Python object alive by itself, and while one exists it is counted.
    """
    storage = buffer.untyped_storage()
    return storage, int(storage._cdata)


def in_place_appends() -> bool:
    """Whether caches past the small-cache limit live in buffers written in place.

    ``False`` where torch cannot count the tensors sharing a storage (CPU-only and macOS builds
    before torch 2.8): a buffer written in place could then change a tensor the user still holds,
    unseen. Every cache is then appended with ``torch.cat``, as stock does, in the dtype and on the
    device of the keys; :func:`small_cache_limit` and :func:`reserve` change nothing.
    """
    return _storage_use_count is not None


def _other_tensors_share(address: int) -> bool:
    if _storage_use_count is None:
        return True  # cannot tell: copy (never reached, no buffer is made without the count)
    # + 1: the storage object kept by _storage_of.
    return int(_storage_use_count(address)) > _OWN_TENSORS + 1


def _require_count(name: str, value: object, unit: str = "a number of cached positions") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int ({unit}); received {value!r}")
    return value


class _Setting(AbstractContextManager[None]):
    """A ``with`` block during which a context variable holds a value.

    What :func:`reserve`, :func:`reserve_ahead` and :func:`small_cache_limit` return. A class,
    not ``contextlib.contextmanager``: ``generate`` enters one at every call, and a generator-based
    context manager costs several times more (about 10,000 instructions, against 2,000).
    """

    __slots__ = ("_token", "_value", "_variable")

    def __init__(self, variable: contextvars.ContextVar[Any], value: int) -> None:
        self._variable, self._value = variable, value

    def __enter__(self) -> None:
        self._token = self._variable.set(self._value)

    def __exit__(self, *exc_info: object) -> None:
        self._variable.reset(self._token)


def reserve(total_positions: int) -> AbstractContextManager[None]:
    """Within this block, size new buffers for ``total_positions`` cached positions at once.

    Used when the final length is known: reserving exactly avoids both regrowth copies and spare
    capacity. A buffer that must hold more than ``total_positions`` grows as usual.
    """
    return _Setting(_reserved_positions, _require_count("total_positions", total_positions))


def reserve_ahead(extra_positions: int) -> AbstractContextManager[None]:
    """Within this block, plan each new cache for its first write plus ``extra_positions``.

    ``generate`` knows how many tokens it will add (``max_new_tokens``) but its prompt length only
    once it has tokenized the input. The first write of each layer (the prompt) is stored exactly,
    and the storage remembers prompt + ``extra_positions``; when the layer needs more room it grows
    towards that total in steps of at most 25% or :data:`PLAN_STEP` positions, and the last step
    ends exactly at the total (no spare at the end). A short generation, whose total is at most
    :data:`PLAN_STEP` positions beyond the prompt, gets its total at the first write: one buffer
    per layer, never regrown, and never more than :data:`PLAN_STEP` positions beyond what stock
    holds. (Not 25% of a long prompt: the prompt's forward pass is where memory peaks.)

    Why not reserve the total at once: a generation may stop early (EOS), and ``max_new_tokens``
    can be far larger than what is generated; and the prompt's forward pass is where attention's
    memory peaks, which a cache holding every future position would raise above stock's (on
    CUDA a buffer is allocated whole). The price is a copy of the past at each step.
    """
    return _Setting(RESERVED_AHEAD, _require_count("extra_positions", extra_positions))


def small_cache_limit(bytes_per_tensor: int) -> AbstractContextManager[None]:
    """Within this block, caches up to ``bytes_per_tensor`` (keys, or values) use ``torch.cat``.

    The default is :data:`SMALL_CACHE_BYTES`; ``0`` puts every cache in a buffer from its first
    write. Read when a cache is (re)stored, not at every token: a cache already appended with
    ``torch.cat`` stays small up to the limit it started with, whatever is in force meanwhile,
    and the step that would pass that limit reads the one in force then (under a larger limit
    the cache stays small, up to the new limit; otherwise it moves to a buffer).
    """
    limit = _require_count("bytes_per_tensor", bytes_per_tensor, "a number of bytes")
    return _Setting(_small_cache_bytes, limit)


def small_cache_bytes() -> int:
    """The small-cache limit in force, in bytes per tensor; ``0`` while :func:`reserve` is in
    force (a total reserved asks for a buffer); unlimited without :func:`in_place_appends`."""
    if _storage_use_count is None:
        return _UNLIMITED
    if _reserved_positions.get() is not None:
        return 0
    return _small_cache_bytes.get()


def small_cache_positions(step: torch.Tensor, limit: int | None = None) -> int:
    """How many positions a cache shaped like ``step`` may hold and still use ``torch.cat``,
    under ``limit`` bytes per tensor (default: :func:`small_cache_bytes`)."""
    batch, _, heads, d_head = step.shape
    per_position = batch * heads * d_head * step.element_size()
    limit = small_cache_bytes() if limit is None else limit
    return limit // per_position if per_position else 0


@dataclass(eq=False, slots=True)
class SmallCache:
    """A small cache's keys and values, appended with ``torch.cat`` exactly as stock does.

    Every step makes new tensors of exactly the cached length; nothing is ever written in place,
    so copy-on-write has nothing to do. Updated in place at each step (cheaper, per token, than a
    new record). Sizes are kept in bytes: ``Tensor.nbytes`` is the cheapest size torch gives.
    """

    #: The tensors last handed out; the entry still holds them unless it was reassigned.
    keys: torch.Tensor
    values: torch.Tensor
    #: ``keys.nbytes``.
    nbytes: int
    #: Bytes ``keys`` may reach before the cache moves to a buffer (the limit when it started).
    max_bytes: int
    #: The total a plan (:func:`reserve_ahead`) set for this cache, carried into its buffer.
    planned: int | None
    #: ``keys.dtype``, which new keys and values must have for the per-token path.
    dtype: torch.dtype

    @property
    def length(self) -> int:
        """Positions cached."""
        return int(self.keys.shape[1])


def capacity_for(needed: int, limit: int | None, planned: int | None = None) -> int:
    """Return the number of positions to allocate when ``needed`` positions must fit.

    A :func:`reserve` in force wins when it is large enough. A ``planned`` total (what
    :func:`reserve_ahead` set for this cache) is approached in steps: up to 25% or
    :data:`PLAN_STEP` positions beyond ``needed``, never past the plan. Otherwise grow by 25%. A
    plan or growth never goes beyond ``limit`` (the model's ``n_ctx``) unless ``needed`` itself is
    larger.
    """
    reserved = _reserved_positions.get()
    if reserved is not None and reserved >= needed:
        return reserved
    growth = needed * (_GROWTH_NUMERATOR - _GROWTH_DENOMINATOR) // _GROWTH_DENOMINATOR
    if planned is not None and planned >= needed:
        wanted = min(planned, needed + max(growth, PLAN_STEP))
    else:
        wanted = needed + max(growth, 1)
    if limit is not None and needed <= limit:
        wanted = min(wanted, limit)
    return wanted


def plan_for_first_write(length: int) -> int | None:
    """The total a new cache whose first write holds ``length`` positions is planned for.

    ``None`` unless :func:`reserve_ahead` is in force.
    """
    ahead = RESERVED_AHEAD.get()
    return None if ahead is None else length + ahead


@dataclass(eq=False)
class KVStorage:
    """Buffers ``[batch, heads, capacity, d_head]`` and the views last handed to the entry.

    The buffers are head-major; the views handed out are ``[batch, pos, heads, d_head]`` as
    TransformerLens expects (a strided view, no copy). Head-major is what attention wants:
    TransformerLens rearranges keys to ``[batch, heads, d_head, pos]`` and values to
    ``[batch, heads, pos, d_head]`` before ``matmul``, and from this layout both are plain strided
    views that ``bmm`` reads directly. From the stock ``[batch, pos, heads, d_head]`` layout (or a
    slice of it) torch must first copy the whole past into a contiguous tensor, every token,
    every layer, whenever the batch holds more than one sequence.
    """

    keys: torch.Tensor
    values: torch.Tensor
    #: Positions written so far; the views cover exactly these.
    length: int
    #: The total this cache is planned to reach (see :func:`reserve_ahead`), or ``None``.
    planned: int | None = None

    keys_view: torch.Tensor = field(init=False, repr=False)
    values_view: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # What the per-token path compares and builds with, read once per buffer: a tensor's
        # shape, dtype or device costs a fresh Python object per read, and a view made with
        # as_strided from the buffer itself costs about half a narrow() of its transposed view.
        keys, values = self.keys, self.values
        self._capacity = int(keys.size(2))
        self._key_layout = (int(keys.size(0)), int(keys.size(1)), int(keys.size(3)))
        self._value_layout = (int(values.size(0)), int(values.size(1)), int(values.size(3)))
        # Strides of the buffers seen as [batch, capacity, heads, d_head], the views' layout.
        self._key_strides = keys.transpose(1, 2).stride()
        self._value_strides = values.transpose(1, 2).stride()
        self._key_position_stride = self._key_strides[1]
        self._value_position_stride = self._value_strides[1]
        self._dtype, self._values_dtype = keys.dtype, values.dtype
        self._device, self._values_device = keys.device, values.device
        # Where the per-token path never applies: meta buffers, and inference tensors outside
        # inference mode (checked per call, since the mode can change between appends).
        self._meta = keys.is_meta or values.is_meta
        self._inference = keys.is_inference() or values.is_inference()
        self._keys_storage, self._keys_address = _storage_of(keys)
        self._values_storage, self._values_address = _storage_of(values)
        batch, heads, d_head = self._key_layout
        self.keys_view = keys.as_strided((batch, self.length, heads, d_head), self._key_strides)
        batch, heads, d_head = self._value_layout
        self.values_view = values.as_strided(
            (batch, self.length, heads, d_head), self._value_strides
        )

    @property
    def capacity(self) -> int:
        """Positions the buffers can hold without growing."""
        return self._capacity

    @property
    def reserved_bytes(self) -> int:
        """Bytes the buffers occupy, spare capacity included."""
        keys, values = self.keys, self.values
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def shared_outside(self, entry: Any) -> bool:
        """Whether anything but the cache holds a view handed out or another tensor on the buffers.

        ``entry`` is the cache entry, whose ``past_keys``/``past_values`` are the cache's own
        references. Call it before taking any other reference to the views.
        """
        # References to a view we know of: our attribute, getrefcount's own, and the entry's
        # attribute while it still holds that view. A caller's variable, a snapshot, autograd's
        # saved tensor: each adds one.
        known = 1 + _GETREFCOUNT_OWN + (entry.past_keys is self.keys_view)
        if sys.getrefcount(self.keys_view) > known:
            return True
        known = 1 + _GETREFCOUNT_OWN + (entry.past_values is self.values_view)
        if sys.getrefcount(self.values_view) > known:
            return True
        return _other_tensors_share(self._keys_address) or _other_tensors_share(
            self._values_address
        )

    def backs(self, past_keys: object, past_values: object) -> bool:
        """Whether the entry still holds the views this storage handed out (not reassigned)."""
        return past_keys is self.keys_view and past_values is self.values_view

    def can_write(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> bool:
        """Whether the new positions fit and match the buffers' dtype and device."""
        if self.length + new_keys.size(1) > self._capacity:
            return False
        if self._dtype != new_keys.dtype or self._device != new_keys.device:
            return False
        if self._values_dtype != new_values.dtype or self._values_device != new_values.device:
            return False
        # Inference tensors cannot be written in place outside inference mode.
        return not self._inference or torch.is_inference_mode_enabled()

    def try_append(self, entry: Any, new_keys: object, new_values: object) -> bool:
        """The whole per-token path: :meth:`try_write` unless a view is shared (copy-on-write).

        ``entry`` is the cache entry. Returns ``False``, changing nothing, for anything but a plain
        step into a buffer nothing else holds; the caller then takes its full path, which copies
        on write, validates and grows.
        """
        if self.shared_outside(entry):
            return False
        return self.try_write(entry.past_keys, entry.past_values, new_keys, new_values)

    def try_write(
        self,
        past_keys: object,
        past_values: object,
        new_keys: object,
        new_values: object,
    ) -> bool:
        """Write the step and return ``True`` when it is plainly valid; else change nothing.

        The per-token fast path: it accepts only what full validation would accept unchanged
        (still our views, exact tensors of the buffers' dtype, device, batch, heads and d_head,
        room left), so the caller may skip its own checks when this returns ``True``. Anything
        unusual returns ``False`` and goes through the caller's full path and its clear errors.
        """
        if past_keys is not self.keys_view or past_values is not self.values_view:
            return False
        if type(new_keys) is not torch.Tensor or type(new_values) is not torch.Tensor:
            return False
        if new_keys.dtype is not self._dtype or new_values.dtype is not self._values_dtype:
            return False
        key_shape, value_shape = new_keys.shape, new_values.shape
        if len(key_shape) != 4 or len(value_shape) != 4:
            return False
        batch, positions, heads, d_head = key_shape
        stop = self.length + positions
        if positions < 1 or stop > self._capacity or value_shape[1] != positions:
            return False
        if (batch, heads, d_head) != self._key_layout:
            return False
        if (value_shape[0], value_shape[2], value_shape[3]) != self._value_layout:
            return False
        if new_keys.device != self._device or new_values.device != self._values_device:
            return False
        # The full path refuses meta caches that hold positions; leave those to it.
        if self._meta or (self._inference and not torch.is_inference_mode_enabled()):
            return False
        self._write_unchecked(new_keys, new_values, positions, stop)
        return True

    def write(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Write the new positions after the cached ones and refresh the views."""
        positions = new_keys.size(1)
        self._write_unchecked(new_keys, new_values, positions, self.length + positions)

    def _write_unchecked(
        self, new_keys: torch.Tensor, new_values: torch.Tensor, positions: int, stop: int
    ) -> None:
        start = self.length
        keys, values = self.keys, self.values
        key_strides, value_strides = self._key_strides, self._value_strides
        # Views made with as_strided from the buffers themselves: the cheapest view torch offers
        # from Python (this runs once per token per layer); they equal
        # keys.transpose(1, 2).narrow(1, start, positions) and .narrow(1, 0, stop).
        keys.as_strided(new_keys.shape, key_strides, start * self._key_position_stride).copy_(
            new_keys
        )
        values.as_strided(
            new_values.shape, value_strides, start * self._value_position_stride
        ).copy_(new_values)
        self.length = stop
        batch, heads, d_head = self._key_layout
        self.keys_view = keys.as_strided((batch, stop, heads, d_head), key_strides)
        batch, heads, d_head = self._value_layout
        self.values_view = values.as_strided((batch, stop, heads, d_head), value_strides)


def _buffer_with(past: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
    cached = past.size(1)
    batch, _, heads, d_head = new.shape
    buffer = torch.empty((batch, heads, capacity, d_head), dtype=new.dtype, device=new.device)
    positions = buffer.transpose(1, 2)  # [batch, capacity, heads, d_head], a view
    if cached:
        # copy_ converts dtype and device in one pass; an empty past is never read (it may be meta).
        positions.narrow(1, 0, cached).copy_(past)
    positions.narrow(1, cached, new.size(1)).copy_(new)
    return buffer


def allocate(
    past_keys: torch.Tensor,
    past_values: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    limit: int | None,
    planned: int | None = None,
) -> KVStorage:
    """Return new storage holding the past, then the new positions, in the new dtype/device.

    ``planned``: the total the previous storage of this cache was planned for, if any. A cache's
    first write under :func:`reserve_ahead` starts a plan and is stored exactly (no spare), or
    at the planned total when that is at most :data:`PLAN_STEP` positions more (a short
    generation).
    """
    length = past_keys.size(1) + new_keys.size(1)
    if planned is None and past_keys.size(1) == 0:
        planned = plan_for_first_write(length)
        if planned is not None and planned - length <= PLAN_STEP:
            capacity = capacity_for(length, limit, planned)  # a short generation: all at once
        else:
            # A plan further away: the prompt is stored exactly; see reserve_ahead.
            capacity = capacity_for(length, limit, length if planned is not None else None)
    else:
        capacity = capacity_for(length, limit, planned)
    keys = _buffer_with(past_keys, new_keys, capacity)
    values = _buffer_with(past_values, new_values, capacity)
    return KVStorage(keys, values, length, planned)
