"""Property-based tests: the patched entry against a plain ``torch.cat`` reference model.

Hypothesis draws a starting entry (dtype, device, batch, heads, d_head) and a program of operations:
appends of 1..N positions in fp32/fp16/bf16 under grad mode, ``torch.no_grad`` or
``torch.inference_mode``; frozen toggles; truncating reassignment of ``past_keys``/``past_values``
(as views of the cache or as the user's own copies); a reset to an empty past on ``meta``; a
non-empty ``meta`` past (which the next append must refuse with a ``ValueError``); and a
keys/values length mismatch (also refused); snapshots of the live cache (the tensor itself, a slice,
a ``detach()``, a permuted view); and in-place edits of the live cache (activation patching). An
append may keep what it returns or drop it, as ``generate`` does, so that buffers are written in
place while only a snapshot holds them. The small-cache limit is generated too, so that programs run
with small caches (``torch.cat``), with buffers, and across the move from one to the other; and
whether torch can count a storage's tensors (without it, every cache must use ``torch.cat``).

The reference is made of real tensors, related as stock's are: every snapshot and edit is applied
to it too, so aliasing (an edit reaching a snapshot of the same live tensor, and nothing older)
follows from torch itself. After every operation the returned tensors and the stored state must
equal the reference bit for bit, and so must every tensor the program still holds.

The number of examples comes from the Hypothesis profile (``ci`` by default; see conftest.py).
New keys are never created on ``meta``: a model computes real keys, only the cache may start there.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import safelens_tl
from safelens_tl.kv import storage as kv_storage
from tests.conftest import make_cfg

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NEW = 5
#: Small-cache limits in bytes per tensor: every cache in a buffer (0); caches that start small
#: (appended with torch.cat) and move to a buffer after a few positions (these shapes hold 2 to
#: 96 bytes per position); and the default, under which these caches stay small.
SMALL_LIMITS = (0, 64, 512, kv_storage.SMALL_CACHE_BYTES)

MODES: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}


@functools.cache
def _cfg(heads: int, d_head: int, dtype: torch.dtype) -> Any:
    # Real config objects of the installed release; building one per example would dominate.
    return make_cfg(n_heads=heads, d_head=d_head, dtype=dtype)


@dataclass
class Reference:
    """What a stock ``torch.cat`` entry with the documented dtype/device policy would hold."""

    keys: torch.Tensor
    values: torch.Tensor
    frozen: bool = False

    def must_refuse(self) -> bool:
        """The documented refusals: a non-empty meta past, or keys and values of other lengths."""
        non_empty_meta = any(
            t.size(1) and t.device.type == "meta" for t in (self.keys, self.values)
        )
        return bool(non_empty_meta or self.keys.size(1) != self.values.size(1))

    def append(
        self, new_keys: torch.Tensor, new_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate with ``torch.cat`` in the keys' dtype; store unless frozen."""
        new_values = new_values.to(new_keys.dtype)
        keys = torch.cat([*self._past(self.keys, new_keys), new_keys], dim=1)
        values = torch.cat([*self._past(self.values, new_values), new_values], dim=1)
        if not self.frozen:
            # torch.cat allocates: the reference never shares memory with what the entry hands out.
            self.keys, self.values = keys, values
        return keys, values

    @staticmethod
    def _past(past: torch.Tensor, new: torch.Tensor) -> list[torch.Tensor]:
        # An empty past contributes nothing (it may sit on meta, where it holds no data).
        return [past.to(new.dtype)] if past.size(1) else []


@dataclass
class Handed:
    """Every tensor the program holds, each with its counterpart in the reference."""

    items: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        if actual.device.type != "meta":
            self.items.append((actual, expected))

    def unchanged(self) -> Iterator[bool]:
        """Whether each tensor held still equals its counterpart."""
        for actual, expected in self.items:
            yield torch.equal(actual, expected)


#: How a snapshot of the live cache is taken: each shares the live tensor's memory.
SNAPSHOTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "itself": lambda tensor: tensor,
    "slice": lambda tensor: tensor[:, : (tensor.size(1) + 1) // 2],
    "detach": torch.Tensor.detach,
    "permute": lambda tensor: tensor.permute(0, 2, 1, 3),
}


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same shape, dtype, device and (off meta) the same bits."""
    if (actual.shape, actual.dtype, actual.device) != (
        expected.shape,
        expected.dtype,
        expected.device,
    ):
        return False
    return actual.device.type == "meta" or torch.equal(actual, expected)


append_op = st.tuples(
    st.just("append"),
    # One position (a generated token) as often as all other sizes together: only steps that
    # fit a buffer's spare room are written in place.
    st.one_of(st.just(1), st.integers(1, MAX_NEW)),
    # Keys' dtype, or None: the cache's own (as a model computes them; in-place writes need it).
    st.one_of(st.none(), st.sampled_from(DTYPES)),
    st.one_of(st.none(), st.sampled_from(DTYPES)),  # values' own dtype, or None: same as keys
    # Grad mode twice as rare as each other mode: it always appends with torch.cat (as stock
    # does) and so leaves no buffer to write in place at the next step.
    st.sampled_from(["grad", "inference", "inference", "no_grad", "no_grad"]),
    st.booleans(),  # new keys/values require grad (only meaningful in grad mode)
    st.booleans(),  # the program keeps what append returns (else drops it, as generate does)
)
perturbation = st.one_of(
    st.tuples(st.just("toggle_frozen")),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.booleans()),
    st.tuples(st.just("reset_meta")),
    st.tuples(st.just("snapshot"), st.sampled_from(sorted(SNAPSHOTS))),
    st.tuples(st.just("edit"), st.integers(-3, 3)),
    st.tuples(st.just("refused"), st.sampled_from(["meta_past", "misalign"]), append_op),
)
#: Consecutive one-position appends in the cache's dtype outside grad mode, dropping what they
#: return: what ``generate`` does, and what buffers are written in place for.
steps_op = st.tuples(st.just("steps"), st.integers(1, 8), st.sampled_from(["no_grad", "inference"]))
operations = st.lists(
    st.one_of(append_op, steps_op, perturbation),
    min_size=1,
    max_size=16,
)


def _step(
    entry: Any, ref: Reference, operation: tuple[Any, ...], seed: int, handed: Handed
) -> None:
    kind = operation[0]
    batch, _, heads, d_head = entry.past_keys.shape
    if kind == "toggle_frozen":
        entry.frozen = ref.frozen = not ref.frozen
    elif kind == "truncate":
        _, fraction, own_copy = operation
        length = int(min(ref.keys.size(1), ref.values.size(1)) * fraction)
        keys, values = entry.past_keys[:, :length], entry.past_values[:, :length]
        ref_keys, ref_values = ref.keys[:, :length], ref.values[:, :length]
        if own_copy:
            keys, values = keys.clone(), values.clone()
            ref_keys, ref_values = ref_keys.clone(), ref_values.clone()
        entry.past_keys, entry.past_values = keys, values
        ref.keys, ref.values = ref_keys, ref_values
        handed.add(keys, ref_keys)
        handed.add(values, ref_values)
    elif kind == "snapshot":
        take = SNAPSHOTS[operation[1]]
        handed.add(take(entry.past_keys), take(ref.keys))
        handed.add(take(entry.past_values), take(ref.values))
    elif kind == "edit":
        _edit_live(entry, ref, float(operation[1]))
    elif kind == "steps":
        _, count, mode = operation
        for step in range(count):
            single = ("append", 1, None, None, mode, False, False)
            _append(entry, ref, single, seed * 8 + step, batch, heads, d_head, handed)
    elif kind == "reset_meta":
        empty = torch.empty((batch, 0, heads, d_head), device="meta")
        entry.past_keys, entry.past_values = empty, empty.clone()
        ref.keys, ref.values = empty, empty
    elif kind == "refused":
        _, how, attempt = operation
        good, saved = (entry.past_keys, entry.past_values), (ref.keys, ref.values)
        if how == "meta_past":
            stale = torch.empty((batch, 1 + attempt[1] % 3, heads, d_head), device="meta")
            entry.past_keys, entry.past_values = stale, stale.clone()
            ref.keys, ref.values = stale, stale
        else:
            entry.past_values = torch.zeros((batch, ref.keys.size(1) + 1, heads, d_head))
            ref.values = entry.past_values.clone()
        _append(entry, ref, attempt, seed, batch, heads, d_head, handed)
        # The user repairs the past; the program goes on from a valid state.
        entry.past_keys, entry.past_values = good
        ref.keys, ref.values = saved
    else:
        _append(entry, ref, operation, seed, batch, heads, d_head, handed)


def _edit_live(entry: Any, ref: Reference, value: float) -> None:
    """Overwrite the live keys and values in place, as activation patching does."""
    pairs = ((entry.past_keys, ref.keys), (entry.past_values, ref.values))
    for actual, expected in pairs:
        if actual.device.type == "meta":
            continue
        # Inference tensors may only be edited in inference mode; others under no_grad (they
        # may require grad).
        inference = actual.is_inference() or expected.is_inference()
        with torch.inference_mode() if inference else torch.no_grad():
            actual.fill_(value)
            expected.fill_(value)


def _append(
    entry: Any,
    ref: Reference,
    operation: tuple[Any, ...],
    seed: int,
    batch: int,
    heads: int,
    d_head: int,
    handed: Handed,
) -> None:
    _, positions, keys_dtype, values_dtype, mode, requires_grad, keep = operation
    keys_dtype = keys_dtype or entry.past_keys.dtype
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, positions, heads, d_head)
    with MODES[mode]():
        new_keys = torch.randn(shape, generator=generator).to(keys_dtype)
        new_values = torch.randn(shape, generator=generator).to(values_dtype or keys_dtype)
        if mode == "grad" and requires_grad:
            new_keys.requires_grad_(True)
            new_values.requires_grad_(True)
        # Weak references: a reference of the test's own would count as a holder of the cache's
        # views, and every append would copy on write instead of writing in place.
        before = (weakref.ref(entry.past_keys), weakref.ref(entry.past_values))
        if ref.must_refuse():
            with pytest.raises(ValueError, match="positions"):
                entry.append(new_keys, new_values)
            # Refused input leaves the entry exactly as it was.
            assert entry.past_keys is before[0]() and entry.past_values is before[1]()
            return
        keys, values = entry.append(new_keys, new_values)
        expected_keys, expected_values = ref.append(new_keys, new_values)
        assert _same(keys, expected_keys), (keys.shape, keys.dtype, expected_keys.dtype)
        assert _same(values, expected_values), (values.shape, values.dtype, expected_values.dtype)
        assert keys.requires_grad == expected_keys.requires_grad
        if new_keys.requires_grad:
            # Gradients through the cache equal those through torch.cat.
            weight = torch.randn(keys.shape, generator=generator).to(keys.dtype)
            (ours,) = torch.autograd.grad((keys * weight).sum(), new_keys, retain_graph=True)
            (theirs,) = torch.autograd.grad((expected_keys * weight).sum(), new_keys)
            assert torch.equal(ours, theirs)
        if ref.frozen:
            assert entry.past_keys is before[0]() and entry.past_values is before[1]()
    if keep:
        handed.add(keys, expected_keys)
        handed.add(values, expected_values)


@given(
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(["cpu", "meta"]),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    d_head=st.sampled_from([1, 4]),
    program=operations,
    seed=st.integers(0, 2**16),
    small_limit=st.sampled_from(SMALL_LIMITS),
    reserved=st.one_of(st.none(), st.integers(0, 48)),
    storage_count=st.booleans(),
)
# Without torch's storage count, a buffer was written in place while a detached snapshot of it
# was held, so editing the live cache changed the snapshot (fixed by using torch.cat throughout).
@example(
    dtype=torch.float32,
    device="cpu",
    batch=1,
    heads=2,
    d_head=4,
    program=[("steps", 3, "no_grad"), ("snapshot", "detach"), ("steps", 1, "no_grad"), ("edit", 2)],
    seed=0,
    small_limit=0,
    reserved=None,
    storage_count=False,
)
def test_entry_matches_torch_cat_reference(
    entry_class: type,
    dtype: torch.dtype,
    device: str,
    batch: int,
    heads: int,
    d_head: int,
    program: list[tuple[Any, ...]],
    seed: int,
    small_limit: int,
    reserved: int | None,
    storage_count: bool,
) -> None:
    """Any program: same returned tensors, same stored state, every tensor held as stock's."""
    assert safelens_tl.activate().active
    # Without torch's storage count (CPU-only and macOS builds before torch 2.8, which cannot be
    # installed here), every cache must be appended with torch.cat.
    missing = mock.patch.object(kv_storage, "_storage_use_count", None)
    # A reservation (a total known ahead) gives buffers room to be written in place for many
    # steps; without one, a small buffer has room for about one step before it grows.
    reservation = nullcontext() if reserved is None else kv_storage.reserve(reserved)
    with nullcontext() if storage_count else missing, reservation:
        entry = entry_class.init_cache_entry(_cfg(heads, d_head, dtype), device, batch)
        assert (entry.past_keys.dtype, entry.past_keys.device.type) == (dtype, device)
        ref = Reference(entry.past_keys, entry.past_values)
        handed = Handed()
        for index, operation in enumerate(program):
            with kv_storage.small_cache_limit(small_limit):
                _step(entry, ref, operation, seed + index, handed)
            assert entry.frozen == ref.frozen
            assert _same(entry.past_keys, ref.keys), operation
            assert _same(entry.past_values, ref.values), operation
            assert all(handed.unchanged()), f"a tensor held differs from stock's at {operation}"
            if not kv_storage.in_place_appends():
                assert getattr(entry, "_safelens_storage", None) is None, "a buffer, no count"
