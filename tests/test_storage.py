"""Growth, reservation and capacity of the patched cache's storage, on the real TL classes."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.hooked import generate_reserve
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, make_cfg, requires_hooked_transformer

BATCH, HEADS, D_HEAD = 2, 4, 8
STORAGE = "_safelens_storage"


def kv(positions: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BATCH, positions, HEADS, D_HEAD)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def new_entry(entry_class: type, n_ctx: int = 4096) -> Any:
    return entry_class.init_cache_entry(make_cfg(HEADS, D_HEAD, n_ctx=n_ctx), "cpu", BATCH)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[kv_storage.KVStorage]]:
    """Every storage the patched entries allocate (a spy around our own function; TL is real)."""
    made: list[kv_storage.KVStorage] = []
    real = kv_storage.allocate

    def spy(*args: Any, **kwargs: Any) -> kv_storage.KVStorage:
        storage = real(*args, **kwargs)
        made.append(storage)
        return storage

    monkeypatch.setattr(kv_storage, "allocate", spy)
    yield made


# capacity_for -----------------------------------------------------------------------------------


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
@pytest.mark.parametrize("as_text", [False, True])
@pytest.mark.parametrize("new", [9, kv_storage.PLAN_STEP + 2], ids=["short", "long"])
def test_generate_reserves_the_final_length_once(
    patched: Any, allocations: list[kv_storage.KVStorage], as_text: bool, new: int
) -> None:
    from safelens_tl.verify.models import build_model

    model = build_model("gpt2-like", torch.float32)
    texts = ["the cat runs to the river", "a dog sleeps"]
    prompt: Any = texts if as_text else model.to_tokens(texts)
    prompt_length = model.to_tokens(texts).size(1)
    model.generate(prompt, max_new_tokens=new, do_sample=False, stop_at_eos=False, verbose=False)
    _assert_final_length_once_per_layer(allocations, model.cfg.n_layers, prompt_length, new)


def _assert_final_length_once_per_layer(
    allocations: list[kv_storage.KVStorage], layers: int, prompt_length: int, new: int
) -> None:
    """Each layer ends in one buffer of exactly the final length, reached in one allocation.

    A short generation (the final length at most PLAN_STEP positions beyond the prompt)
    allocates it with the prompt; a longer one first stores the prompt exactly.
    """
    # The last sampled token is never fed back, so the cache ends at prompt + new - 1.
    final = prompt_length + new - 1
    short = final - prompt_length <= kv_storage.PLAN_STEP
    assert len(allocations) == (layers if short else 2 * layers)
    if not short:
        for storage in allocations[:layers]:
            assert storage.capacity == prompt_length
    for storage in allocations[-layers:]:
        assert storage.capacity == storage.length == final


@requires_hooked_transformer
def test_generate_output_is_unchanged_by_the_reservation() -> None:
    from safelens_tl.verify.models import build_model

    model = build_model("llama-like-gqa", torch.float32)
    # One length: a padded batch of tokens is what stock 2.13-3.0.0 generates wrong
    # (tests/test_hooked_generate_mask.py); the reservation is what is compared here.
    tokens = model.to_tokens(["the bird sings", "old stone falls"])
    assert not (tokens == model.tokenizer.pad_token_id).any()
    kwargs: dict[str, Any] = {"do_sample": False, "stop_at_eos": False, "verbose": False}
    stock = model.generate(tokens, 12, **kwargs)  # max_new_tokens given positionally
    safelens_tl.activate()
    ours = model.generate(tokens, 12, **kwargs)
    assert torch.equal(ours, stock)
    without_cache = model.generate(tokens, 12, use_past_kv_cache=False, **kwargs)
    assert torch.equal(without_cache, stock)


@requires_hooked_transformer
def test_generate_wrapper_keeps_the_signature_and_is_removed(patched: Any) -> None:
    model_class = LAYOUT.model_class()
    assert model_class is not None
    wrapper = model_class.__dict__["generate"]
    original = wrapper.__wrapped__
    assert inspect.signature(wrapper) == inspect.signature(original)
    signature = inspect.signature(original)
    ahead = generate_reserve.positions_ahead
    assert ahead(signature, ("self", "text"), {"max_new_tokens": 5}) == 4
    assert ahead(signature, ("self", "text", 5), {}) == 4
    assert ahead(signature, ("self", "text"), {}) == 9  # the default, 10 new tokens
    assert ahead(signature, ("self",), {"max_new_tokens": 5, "use_past_kv_cache": False}) is None
    assert ahead(signature, ("self",), {"max_new_tokens": 0}) is None
    assert ahead(signature, ("self",), {"max_new_tokens": 2.0}) is None
    assert ahead(signature, ("self", *range(20)), {}) is None  # unbindable: left to the original
    safelens_tl.deactivate()
    assert model_class.__dict__["generate"] is original


@requires_hooked_transformer
def test_the_argument_reader_agrees_with_binding_on_every_kind_of_call() -> None:
    """The wrapper reads max_new_tokens without Signature.bind where a call is plain; it must
    answer exactly as binding does, for plain and odd calls alike."""
    model_class = LAYOUT.model_class()
    assert model_class is not None
    signature = inspect.signature(model_class.__dict__["generate"])
    reader = generate_reserve._ArgumentReader(signature)
    names = list(signature.parameters)
    up_to_cache = names.index("use_past_kv_cache")
    defaults = [signature.parameters[name].default for name in names[1 : up_to_cache + 1]]
    every_positional = ("self", *defaults[:-1], False)  # use_past_kv_cache=False, positionally
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("self", "text"), {"max_new_tokens": 5}),
        (("self", "text", 5), {}),
        (("self", "text"), {}),
        (("self",), {"max_new_tokens": 5, "use_past_kv_cache": False}),
        (("self",), {"max_new_tokens": 0}),
        (("self",), {"max_new_tokens": 2.0}),
        (("self",), {"max_new_tokens": True}),
        (("self", "text", 7), {"max_new_tokens": 5}),  # given twice: binding fails
        (("self", "text"), {"max_tokens": 5}),  # unknown keyword (or one for **kwargs)
        (("self", "text"), {"max_new_tokens": 6, "num_beams": 2}),
        (("self", *range(40)), {}),  # too many positional arguments
        ((), {"max_new_tokens": 5}),  # no self
        (every_positional, {}),
        (every_positional[:-1], {"use_past_kv_cache": True}),
    ]
    for attempt in ("first (recipe worked out)", "again (recipe remembered)"):
        for args, kwargs in calls:
            expected = generate_reserve.positions_ahead(signature, args, kwargs)
            assert reader.ahead(args, kwargs) == expected, (attempt, args, kwargs)
    assert reader.ahead(every_positional, {}) is None
    assert reader.ahead(("self", "text", 5), {}) == 4
    # A remembered recipe says where a value sits, not what it was.
    assert reader.ahead(("self", "text", 9), {}) == 8
    assert reader.ahead(("self", "text"), {"max_new_tokens": 3}) == 2
    assert reader.ahead(("self", "text"), {"max_new_tokens": 3, "use_past_kv_cache": 1}) is None


_MODEL_CLASS = LAYOUT.model_class()
requires_generate_stream = pytest.mark.skipif(
    _MODEL_CLASS is None or "generate_stream" not in _MODEL_CLASS.__dict__,
    reason=f"TransformerLens {LAYOUT.release} has no HookedTransformer.generate_stream",
)


@requires_generate_stream
def test_generate_stream_reserves_like_generate_and_streams_the_same_tokens(
    allocations: list[kv_storage.KVStorage],
) -> None:
    from safelens_tl.verify.models import build_model

    model = build_model("llama-like-gqa", torch.float32)
    # One length: a padded batch of tokens is what stock 2.13-3.0.0 generates wrong
    # (tests/test_hooked_generate_mask.py); the reservation is what is compared here.
    tokens = model.to_tokens(["the bird sings", "old stone falls"])
    assert not (tokens == model.tokenizer.pad_token_id).any()
    kwargs: dict[str, Any] = {"max_new_tokens": 9, "max_tokens_per_yield": 4}
    kwargs.update(do_sample=False, stop_at_eos=False, verbose=False)
    stock = list(model.generate_stream(tokens, **kwargs))
    assert not allocations  # stock TL never calls our storage
    safelens_tl.activate()
    streamed = model.generate_stream(tokens, **kwargs)
    first = next(streamed)
    # Between items the caller's own caches are not reserved: the reservation is the stream's.
    assert kv_storage.capacity_for(8, None) == 10
    ours = [first, *streamed]
    assert len(ours) == len(stock) > 1
    assert all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True))
    _assert_final_length_once_per_layer(allocations, model.cfg.n_layers, tokens.size(1), 9)


@requires_generate_stream
def test_generate_stream_wrapper_is_removed_and_an_early_stop_closes_the_original(
    patched: Any,
) -> None:
    from safelens_tl.verify.models import build_model

    assert _MODEL_CLASS is not None
    wrapper = _MODEL_CLASS.__dict__["generate_stream"]
    assert inspect.signature(wrapper) == inspect.signature(wrapper.__wrapped__)
    model = build_model("gpt2-like", torch.float32)
    stream = model.generate_stream(
        model.to_tokens(["the cat runs"]), max_new_tokens=6, max_tokens_per_yield=1, verbose=False
    )
    next(stream)
    original_stream = stream.gi_frame.f_locals["stream"]  # the generator TL's method returned
    assert original_stream.gi_frame is not None  # suspended mid-generation
    stream.close()
    assert original_stream.gi_frame is None  # closed with the wrapper, not left to the GC
    safelens_tl.deactivate()
    assert _MODEL_CLASS.__dict__["generate_stream"] is wrapper.__wrapped__


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


@requires_generate_stream
def test_generate_stream_stays_a_generator_function(patched: Any) -> None:
    assert _MODEL_CLASS is not None
    assert inspect.isgeneratorfunction(_MODEL_CLASS.generate_stream)
