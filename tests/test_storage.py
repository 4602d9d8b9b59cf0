"""Growth, reservation and capacity of the patched cache's storage, on the real TL classes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, make_cfg, requires_hooked_transformer

BATCH, HEADS, D_HEAD = 2, 4, 8
STORAGE = "_safelens_storage"


def kv(positions: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BATCH, positions, HEADS, D_HEAD)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def new_entry(entry_class: type, n_ctx: int = 4096) -> Any:
    return entry_class.init_cache_entry(make_cfg(HEADS, D_HEAD, n_ctx=n_ctx), "cpu", BATCH)


@pytest.mark.parametrize("needed", [1, 2, 3, 4, 7, 100, 1000, 4097])
def test_growth_leaves_at_most_a_quarter_spare(needed: int) -> None:
    capacity = kv_storage.capacity_for(needed, None)
    assert needed < capacity <= needed + max(needed // 4, 1)


def test_growth_never_passes_n_ctx_unless_needed() -> None:
    assert kv_storage.capacity_for(100, 110) == 110
    assert kv_storage.capacity_for(110, 110) == 110
    assert kv_storage.capacity_for(120, 110) == 150  # past n_ctx (rotary models): grow as usual


def test_reservations_size_exactly_and_nest() -> None:
    with kv_storage.reserve(500):
        assert kv_storage.capacity_for(10, 4096) == 500
        assert kv_storage.capacity_for(600, 4096) == 750  # too small a reservation: grow
        assert kv_storage.capacity_for(10, 4096, planned=40) == 500  # reserve wins over a plan
    with kv_storage.reserve_ahead(31):
        assert kv_storage.plan_for_first_write(9) == 40
        with kv_storage.reserve_ahead(0):
            assert kv_storage.plan_for_first_write(9) == 9
        assert kv_storage.plan_for_first_write(9) == 40
    assert kv_storage.plan_for_first_write(9) is None


def test_a_plan_sizes_exactly_within_n_ctx() -> None:
    assert kv_storage.capacity_for(10, 4096, planned=40) == 40
    assert kv_storage.capacity_for(10, 20, planned=40) == 20  # capped at n_ctx
    assert kv_storage.capacity_for(50, 4096, planned=40) == 62  # outgrown: 25% as usual


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10", None])
def test_reservation_rejects_bad_counts(bad: Any) -> None:
    with pytest.raises(ValueError, match="non-negative int"), kv_storage.reserve(bad):
        pass
    with pytest.raises(ValueError, match="non-negative int"), kv_storage.reserve_ahead(bad):
        pass
    assert kv_storage.capacity_for(8, None) == 10  # nothing left in force


# the real entry ---------------------------------------------------------------------------------


@torch.inference_mode()
def test_token_by_token_growth_is_geometric_and_bounded(
    patched: Any, entry_class: type, allocations: list[kv_storage.KVStorage]
) -> None:
    entry = new_entry(entry_class)
    entry.append(*kv(16))
    position_bytes = 2 * BATCH * HEADS * D_HEAD * 4
    for _ in range(400):
        entry.append(*kv(1))
        storage = entry.__dict__[STORAGE]
        length = entry.past_keys.size(1)
        assert storage.length == length == entry.past_values.size(1)
        used = length * position_bytes
        assert used <= storage.reserved_bytes <= used * 5 // 4 + position_bytes
    assert entry.past_keys.size(1) == 416
    # 1.25x growth from 16 to 416 needs 15 allocations; a linear scheme would need hundreds.
    assert len(allocations) <= 16


@torch.inference_mode()
def test_capacity_stops_at_n_ctx(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class, n_ctx=50)
    entry.append(*kv(40))
    assert entry.__dict__[STORAGE].capacity == 50
    for _ in range(10):
        entry.append(*kv(1))
    assert entry.__dict__[STORAGE].capacity == 50


@torch.inference_mode()
def test_returned_tensors_never_change(patched: Any, entry_class: type) -> None:
    entry = new_entry(entry_class)
    returned: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    keys, values = entry.append(*kv(3))
    returned.append((keys, values, keys.clone(), values.clone()))
    for _ in range(60):  # crosses several regrowths
        keys, values = entry.append(*kv(1))
        returned.append((keys, values, keys.clone(), values.clone()))
        past = entry.past_keys
        returned.append((past, entry.past_values, past.clone(), entry.past_values.clone()))
    for keys, values, keys_then, values_then in returned:
        assert torch.equal(keys, keys_then)
        assert torch.equal(values, values_then)


@torch.inference_mode()
def test_reserve_ahead_allocates_a_plan_within_one_step_at_the_first_write(
    patched: Any, entry_class: type, allocations: list[kv_storage.KVStorage]
) -> None:
    """A short generation: one buffer per layer, of exactly the final length, never regrown."""
    entry = new_entry(entry_class)
    with kv_storage.reserve_ahead(20):
        entry.append(*kv(12))
        for _ in range(20):
            entry.append(*kv(1))
    assert [storage.capacity for storage in allocations] == [32]
    assert entry.__dict__[STORAGE] is allocations[-1] and allocations[-1].length == 32


@pytest.mark.parametrize(
    ("prompt", "ahead"),
    [(12, kv_storage.PLAN_STEP + 1), (400, kv_storage.PLAN_STEP + 16)],
    ids=["one-past-the-step", "within-25%-of-a-long-prompt"],
)
@torch.inference_mode()
def test_reserve_ahead_stores_the_first_write_exactly_when_the_plan_is_further(
    patched: Any,
    entry_class: type,
    allocations: list[kv_storage.KVStorage],
    prompt: int,
    ahead: int,
) -> None:
    """More than PLAN_STEP positions ahead (even when within 25% of a long prompt): the prompt
    exactly (no future positions during its forward pass, where memory peaks), then the planned
    total at the first new token."""
    entry = new_entry(entry_class)
    with kv_storage.reserve_ahead(ahead):
        entry.append(*kv(prompt))
        for _ in range(ahead):
            entry.append(*kv(1))
    assert [storage.capacity for storage in allocations] == [prompt, prompt + ahead]
    assert entry.__dict__[STORAGE] is allocations[-1] and allocations[-1].length == prompt + ahead


@torch.inference_mode()
def test_a_reassigned_past_drops_the_plan(
    patched: Any, entry_class: type, allocations: list[kv_storage.KVStorage]
) -> None:
    entry = new_entry(entry_class)
    with kv_storage.reserve_ahead(100):
        entry.append(*kv(12))
        entry.past_keys, entry.past_values = entry.past_keys[:, :8], entry.past_values[:, :8]
        entry.append(*kv(1))  # truncated by the user: the plan for 112 no longer applies
    assert allocations[-1].length == 9
    assert allocations[-1].capacity == kv_storage.capacity_for(9, None) < 112


@torch.inference_mode()
def test_attention_reads_the_cache_without_copying_it(patched: Any, entry_class: type) -> None:
    """TL's attention flattens ``[batch, heads]`` of the rearranged keys/values before ``bmm``.

    From a position-major cache (stock's, or a slice of a position-major buffer) that reshape
    copies the whole past at every token; from the head-major buffer it is a view. A regression
    of the layout shows up here as a reshape that no longer shares memory with the cache.
    """
    entry = new_entry(entry_class)
    entry.append(*kv(5))
    for _ in range(7):  # through at least one regrowth
        keys, values = entry.append(*kv(1))
    length = keys.size(1)
    assert keys.shape == values.shape == (BATCH, length, HEADS, D_HEAD)
    # The rearrangements of calculate_attention_scores / calculate_z_scores, then matmul's flatten.
    keys_for_scores = keys.permute(0, 2, 3, 1).reshape(BATCH * HEADS, D_HEAD, length)
    values_for_z = values.permute(0, 2, 1, 3).reshape(BATCH * HEADS, length, D_HEAD)
    assert keys_for_scores.data_ptr() == keys.data_ptr()
    assert values_for_z.data_ptr() == values.data_ptr()


# the fast path ----------------------------------------------------------------------------------


@torch.inference_mode()
def _storage(positions: int = 4, capacity: int = 6) -> kv_storage.KVStorage:
    keys, values = kv(positions)
    empty = torch.empty(BATCH, 0, HEADS, D_HEAD)
    with kv_storage.reserve(capacity):
        return kv_storage.allocate(empty, empty, keys, values, None)


@torch.inference_mode()
def test_try_write_writes_a_plain_step() -> None:
    storage = _storage()
    past_keys, past_values = storage.keys_view, storage.values_view
    keys, values = kv(1)
    assert storage.try_write(past_keys, past_values, keys, values)
    assert storage.length == 5
    assert torch.equal(storage.keys_view[:, 4:], keys)
    assert torch.equal(storage.values_view[:, 4:], values)
    assert torch.equal(storage.keys_view[:, :4], past_keys)


@pytest.mark.parametrize(
    "case",
    ["reassigned", "no room", "dtype", "values dtype", "heads", "rank", "empty", "not a tensor"],
)
@torch.inference_mode()
def test_try_write_refuses_anything_unusual_and_changes_nothing(case: str) -> None:
    storage = _storage(positions=4, capacity=6)
    past_keys, past_values = storage.keys_view, storage.values_view
    keys, values = kv(1)
    args: list[Any] = [past_keys, past_values, keys, values]
    if case == "reassigned":
        args[0] = past_keys.clone()
    elif case == "no room":
        args[2], args[3] = kv(3)
    elif case == "dtype":
        args[2], args[3] = kv(1, torch.float16)
    elif case == "values dtype":
        args[3] = values.double()
    elif case == "heads":
        args[2] = torch.randn(BATCH, 1, HEADS + 1, D_HEAD)
    elif case == "rank":
        args[2] = keys[0]
    elif case == "empty":
        args[2], args[3] = kv(0)
    else:
        args[3] = values.tolist()
    assert not storage.try_write(*args)
    assert storage.length == 4
    assert storage.keys_view is past_keys and storage.values_view is past_values


# generate ---------------------------------------------------------------------------------------


@requires_hooked_transformer
def test_autocast_cache_is_bf16_and_half_the_bytes() -> None:
    from safelens_tl.verify.models import build_model

    model = build_model("gpt2-like", torch.float32)
    tokens = model.to_tokens(["the cat runs to the river and the dog sleeps"])

    def cached_bytes() -> tuple[torch.dtype, int]:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            cache = LAYOUT.cache_class.init_cache(model.cfg, "cpu", 1)
            logits = model(tokens, past_kv_cache=cache)
            for _ in range(3):
                logits = model(logits[:, -1:].argmax(-1), past_kv_cache=cache)
        tensors = [t for e in cache.entries for t in (e.past_keys, e.past_values)]
        return tensors[0].dtype, sum(t.numel() * t.element_size() for t in tensors)

    stock_dtype, stock_bytes = cached_bytes()
    safelens_tl.activate()
    dtype, patched_bytes = cached_bytes()
    assert stock_dtype == torch.float32
    assert dtype == torch.bfloat16
    assert patched_bytes * 2 == stock_bytes
