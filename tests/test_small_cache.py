"""Small caches: appended with ``torch.cat`` as stock does, moved to a buffer past the limit.

The rules every cache follows (dtype, device, errors, snapshots, gradients, pickles) are tested in
both storage modes by the modules marked ``both_cache_modes``; these tests cover what is particular
to small caches: when a cache is small, what it holds, the move to a buffer, and the fast check
that spares the prompt's write the full validation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safelens_tl.kv import entry as kv_cache
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, make_cfg, requires_hooked_transformer

BATCH, HEADS, D_HEAD = 2, 4, 8
#: Bytes one position of the entries here takes per tensor (float32).
POSITION_BYTES = BATCH * HEADS * D_HEAD * 4


@pytest.fixture(autouse=True)
def _default_limit() -> Iterator[None]:
    """The default limit, under which these entries are small (conftest pins buffers)."""
    with kv_storage.small_cache_limit(kv_storage.SMALL_CACHE_BYTES):
        yield


def step(positions: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BATCH, positions, HEADS, D_HEAD)
    return torch.randn(shape), torch.randn(shape)


def new_entry() -> Any:
    return LAYOUT.entry_class.init_cache_entry(
        make_cfg(n_heads=HEADS, d_head=D_HEAD, n_ctx=4096), "cpu", BATCH
    )


def test_the_default_limit_is_64_kib_per_tensor() -> None:
    assert kv_storage.SMALL_CACHE_BYTES == 64 * 1024
    keys, _ = step()
    with kv_storage.small_cache_limit(kv_storage.SMALL_CACHE_BYTES):
        assert kv_storage.small_cache_positions(keys) == 64 * 1024 // POSITION_BYTES


def test_a_small_cache_moves_to_a_buffer_past_the_limit(patched: Any) -> None:
    """Up to the limit every step is a fresh contiguous tensor, as stock's torch.cat makes; the
    step that would pass the limit moves the cache to a buffer; the content is torch.cat's."""
    entry = new_entry()
    reference_keys, reference_values = entry.past_keys, entry.past_values
    held: list[torch.Tensor] = []
    with torch.no_grad(), kv_storage.small_cache_limit(10 * POSITION_BYTES):
        for _ in range(14):
            new_keys, new_values = step()
            keys, values = entry.append(new_keys, new_values)
            reference_keys = torch.cat([reference_keys, new_keys], 1)
            reference_values = torch.cat([reference_values, new_values], 1)
            assert torch.equal(keys, reference_keys) and torch.equal(values, reference_values)
            length = keys.shape[1]
            small = entry.__dict__.get("_safelens_small")
            storage = entry.__dict__.get("_safelens_storage")
            if length <= 10:
                assert storage is None and small is not None and small.length == length
                # Held below, so no earlier tensor's memory can have been reused.
                assert keys.is_contiguous() and keys.data_ptr() not in {t.data_ptr() for t in held}
                held.append(keys)
            else:
                assert small is None and storage is not None and storage.length == length


def test_a_small_cache_keeps_its_limit_until_it_reaches_it(patched: Any) -> None:
    """The limit is read when a cache is stored: a lower limit set later does not move a small
    cache before it reaches the limit it started with; the step that would pass that limit reads
    the limit in force then, and a larger one keeps the cache small up to the new limit."""
    entry = new_entry()
    with torch.no_grad():
        with kv_storage.small_cache_limit(3 * POSITION_BYTES):
            entry.append(*step(2))
        with kv_storage.small_cache_limit(0):  # lowered: the cache keeps its own limit
            entry.append(*step())
            assert _record(entry)[2:4] == (3 * POSITION_BYTES, 3 * POSITION_BYTES)
        with kv_storage.small_cache_limit(5 * POSITION_BYTES):  # raised, read at the crossing
            entry.append(*step())
            assert _record(entry)[2:4] == (4 * POSITION_BYTES, 5 * POSITION_BYTES)
            entry.append(*step())
            assert entry._safelens_storage is None
            entry.append(*step())  # 6 positions: past the new limit
        assert entry._safelens_small is None
        assert entry.__dict__["_safelens_storage"].length == 6


def test_a_generation_plan_is_carried_into_the_buffer(patched: Any) -> None:
    """generate's plan (reserve_ahead) is remembered by the small cache: the buffer it moves to
    grows towards the planned total and ends exactly there."""
    entry = new_entry()
    with (
        torch.no_grad(),
        kv_storage.reserve_ahead(40),
        kv_storage.small_cache_limit(10 * POSITION_BYTES),
    ):
        entry.append(*step(5))  # the prompt: planned total 45
        assert entry.__dict__["_safelens_small"].planned == 45
        for _ in range(40):
            entry.append(*step())
    storage = entry.__dict__["_safelens_storage"]
    assert (storage.planned, storage.capacity, storage.length) == (45, 45, 45)


def test_reserve_puts_even_a_small_cache_in_a_buffer(patched: Any) -> None:
    entry = new_entry()
    with torch.no_grad(), kv_storage.reserve(32):
        entry.append(*step(2))
    assert entry._safelens_small is None
    assert entry.__dict__["_safelens_storage"].capacity == 32


def test_a_reassigned_past_is_honoured_and_stays_small(patched: Any) -> None:
    entry = new_entry()
    with torch.no_grad():
        entry.append(*step(6))
        entry.past_keys, entry.past_values = entry.past_keys[:, :2], entry.past_values[:, :2]
        kept = entry.past_keys.clone()
        new_keys, new_values = step()
        keys, _ = entry.append(new_keys, new_values)
    assert torch.equal(keys, torch.cat([kept, new_keys], 1))
    assert entry.__dict__["_safelens_small"].length == 3


def test_new_keys_on_another_device_take_the_checked_path(patched: Any) -> None:
    """The small path leaves device mismatches to torch.cat's own refusal; the checked path then
    gives the documented answer (here: a non-empty past cannot move to meta)."""
    entry = new_entry()
    with torch.no_grad():
        entry.append(*step(3))
        before = entry.past_keys
        meta = torch.empty((BATCH, 1, HEADS, D_HEAD), device="meta")
        with pytest.raises(ValueError, match="meta device"):
            entry.append(meta, meta.clone())
    assert entry.past_keys is before and entry.__dict__["_safelens_small"].length == 3


def _record(entry: Any) -> tuple[object, ...]:
    small = entry.__dict__["_safelens_small"]
    fields = ("keys", "values", "nbytes", "max_bytes", "planned", "dtype")
    return tuple(getattr(small, name) for name in fields)


def test_a_new_entry_waits_for_its_first_write_as_an_empty_small_cache(patched: Any) -> None:
    """init_cache_entry records the empty past, so that the prompt's write takes the per-token
    path; the limit and the plan are those in force at that write, not at init."""
    with kv_storage.small_cache_limit(0):
        entry = new_entry()  # created where every cache would be a buffer
    assert _record(entry) == (entry.past_keys, entry.past_values, 0, 0, None, torch.float32)
    new_keys, new_values = step(2)
    limit = kv_storage.small_cache_limit(3 * POSITION_BYTES)
    with torch.no_grad(), kv_storage.reserve_ahead(7), limit:
        keys, values = entry.append(new_keys, new_values)
        assert torch.equal(keys, new_keys) and torch.equal(values, new_values)
        assert keys.is_contiguous() and keys.data_ptr() != new_keys.data_ptr()
        assert (entry.past_keys, entry.past_values) == (keys, values)
        assert _record(entry) == (keys, values, keys.nbytes, 3 * POSITION_BYTES, 9, torch.float32)
        entry.append(*step())  # 3 positions: still small
        assert entry._safelens_storage is None
        entry.append(*step())  # 4: past the limit
    storage = entry.__dict__["_safelens_storage"]
    assert (storage.length, storage.planned) == (4, 9)


def test_a_first_write_too_large_for_the_limit_goes_to_a_buffer(patched: Any) -> None:
    entry = new_entry()
    with torch.no_grad(), kv_storage.small_cache_limit(POSITION_BYTES):
        keys, _ = entry.append(*step(2))
    assert entry._safelens_small is None
    assert entry.__dict__["_safelens_storage"].length == 2 and keys.shape[1] == 2


def test_a_first_write_in_another_dtype_follows_the_keys(patched: Any) -> None:
    """Keys computed in float16 by a float32-configured model: stored in float16 (the policy),
    where torch.cat onto the float32 empty past would have promoted them to float32."""
    entry = new_entry()
    new_keys, new_values = (tensor.half() for tensor in step(2))
    with torch.no_grad():
        keys, values = entry.append(new_keys, new_values)
        assert keys.dtype == values.dtype == torch.float16
        assert entry.__dict__["_safelens_small"].dtype is torch.float16
        keys, _ = entry.append(*(tensor.half() for tensor in step()))
    assert keys.dtype == torch.float16 and keys.shape[1] == 3


def test_a_frozen_first_write_returns_the_step_and_keeps_the_entry(patched: Any) -> None:
    entry = new_entry()
    entry.frozen = True
    before = (entry.past_keys, entry.past_values, _record(entry))
    new_keys, new_values = step(2)
    with torch.no_grad():
        keys, _ = entry.append(new_keys, new_values)
    assert torch.equal(keys, new_keys)
    assert (entry.past_keys, entry.past_values, _record(entry)) == before


def test_a_first_write_in_grad_mode_keeps_the_graph(patched: Any) -> None:
    """In grad mode the cache takes stock's path (torch.cat every step, no record kept), and
    gradients reach the keys of the first write."""
    entry = new_entry()
    new_keys = torch.randn(BATCH, 2, HEADS, D_HEAD, requires_grad=True)
    keys, _ = entry.append(new_keys, torch.randn(BATCH, 2, HEADS, D_HEAD))
    assert entry._safelens_small is None and entry._safelens_storage is None
    keys.sum().backward()
    assert new_keys.grad is not None and torch.equal(new_keys.grad, torch.ones_like(new_keys))


_BAD_FIRST_WRITES = {
    "wrong heads": (
        (torch.randn(BATCH, 2, HEADS + 1, D_HEAD), torch.randn(BATCH, 2, HEADS + 1, D_HEAD)),
        ValueError,
        "heads",
    ),
    "keys and values disagree on pos": (
        (torch.randn(BATCH, 2, HEADS, D_HEAD), torch.randn(BATCH, 3, HEADS, D_HEAD)),
        ValueError,
        "agree on batch and pos",
    ),
    "integer keys": (
        (torch.ones(BATCH, 2, HEADS, D_HEAD, dtype=torch.long),) * 2,
        ValueError,
        "floating point",
    ),
    "3-dim keys": (
        (torch.randn(BATCH, 2, HEADS * D_HEAD), torch.randn(BATCH, 2, HEADS * D_HEAD)),
        ValueError,
        "4-dim",
    ),
    "not tensors": (([1.0], [1.0]), TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("case", list(_BAD_FIRST_WRITES))
def test_a_bad_first_write_is_refused_and_changes_nothing(patched: Any, case: str) -> None:
    """The prompt's write relies on torch.cat and the sizes it yields for its checks; what they
    do not accept goes to full validation, which names the problem."""
    (new_keys, new_values), error, message = _BAD_FIRST_WRITES[case]
    entry = new_entry()
    before = (entry.past_keys, entry.past_values, _record(entry), dict(vars(entry)))
    with torch.no_grad(), pytest.raises(error, match=message):
        entry.append(new_keys, new_values)
    assert (entry.past_keys, entry.past_values, _record(entry), dict(vars(entry))) == before


def test_the_limit_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="non-negative int"), kv_storage.small_cache_limit(-1):
        pass


_dimension = st.integers(1, 3)
_shape = st.tuples(st.integers(1, 2), st.integers(0, 3), _dimension, _dimension).map(list)


@given(
    past_keys=_shape,
    past_values=_shape,
    new_keys=_shape,
    new_values=_shape,
    dims=st.tuples(*[st.sampled_from([3, 4, 4, 4])] * 4),
    dtypes=st.tuples(*[st.sampled_from([torch.float32, torch.bfloat16, torch.int64])] * 4),
    meta=st.tuples(*[st.booleans()] * 4),
    same_shapes=st.booleans(),
)
def test_the_fast_check_agrees_with_full_validation(
    past_keys: list[int],
    past_values: list[int],
    new_keys: list[int],
    new_values: list[int],
    dims: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    meta: tuple[bool, ...],
    same_shapes: bool,
) -> None:
    """For exact tensors, the prompt's fast check accepts exactly what full validation accepts,
    so that skipping validation never lets bad input through, and valid input is never slowed."""
    shapes = [past_keys, past_values, new_keys, new_values]
    if same_shapes:  # mostly-valid input, where the two could disagree in subtle ways
        shapes = [list(past_keys), list(past_keys), list(new_keys), list(new_keys)]
        shapes[2][0] = shapes[3][0] = shapes[0][0]
    tensors = [
        torch.empty(shape[:dim], dtype=dtype, device="meta" if on_meta else "cpu")
        for shape, dim, dtype, on_meta in zip(shapes, dims, dtypes, meta, strict=True)
    ]
    entry = new_entry()
    try:
        kv_cache._validate(entry, *tensors)
    except (TypeError, ValueError):
        accepted = False
    else:
        accepted = True
    assert kv_cache._plainly_valid(*tensors) == accepted


@requires_hooked_transformer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_generate_crossing_the_limit_matches_buffers_and_uncached(
    patched: Any, dtype: torch.dtype
) -> None:
    """A real generate whose caches start small and move to buffers half way gives the tokens
    of one that keeps buffers throughout (and, in float32, of an uncached one)."""
    from safelens_tl.verify import checks
    from safelens_tl.verify.models import build_model

    model = build_model("gpt2-like", dtype)
    tokens = model.to_tokens(list(checks.PROMPTS)[:1])
    per_position = model.cfg.n_heads * model.cfg.d_head * torch.finfo(dtype).bits // 8
    arguments = checks.greedy_arguments(12)
    with kv_storage.small_cache_limit((tokens.shape[1] + 6) * per_position):
        crossing = model.generate(tokens, use_past_kv_cache=True, **arguments)
    with kv_storage.small_cache_limit(0):
        buffered = model.generate(tokens, use_past_kv_cache=True, **arguments)
    assert torch.equal(crossing, buffered)
    if dtype == torch.float32:
        uncached = model.generate(tokens, use_past_kv_cache=False, **arguments)
        assert torch.equal(crossing, uncached)
