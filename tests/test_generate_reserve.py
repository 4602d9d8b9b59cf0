"""``generate_reserve``: ``HookedTransformer.generate`` and ``generate_stream`` (TL 3.9+) run with
each layer's cache planned at prompt + ``max_new_tokens - 1``, allocated once at its final length
for a short generation; tokens, signature and errors stay stock's, and ``deactivate()`` removes the
wrappers. The plan itself (``reserve_ahead``) is tested in ``tests/test_storage.py``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.hooked import generate_reserve
from safelens_tl.kv import storage as kv_storage
from tests.conftest import LAYOUT, requires_hooked_transformer


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
    # The generator TL's method returned, held by the reservation's loop below the wrappers.
    running = stream
    while running.gi_yieldfrom is not None:
        running = running.gi_yieldfrom
    original_stream = running.gi_frame.f_locals["stream"]
    assert original_stream.gi_frame is not None  # suspended mid-generation
    stream.close()
    assert original_stream.gi_frame is None  # closed with the wrapper, not left to the GC
    safelens_tl.deactivate()
    assert _MODEL_CLASS.__dict__["generate_stream"] is wrapper.__wrapped__


@requires_generate_stream
def test_generate_stream_stays_a_generator_function(patched: Any) -> None:
    assert _MODEL_CLASS is not None
    assert inspect.isgeneratorfunction(_MODEL_CLASS.generate_stream)
