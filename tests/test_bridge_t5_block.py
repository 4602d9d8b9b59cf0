"""T5, mT5 and LongT5 generate right through ``TransformerBridge.hf_generate`` where transformers
passes the cache as ``cache`` (5.24 on: :mod:`safelens_tl.fixes.bridge.t5_block`), and through
TransformerLens 3.x's T5 block, written for transformers 4, with any transformers 5
(:mod:`safelens_tl.fixes.bridge.t5_legacy_block`). Real bridges on tiny random encoder-decoder
checkpoints; the same generation without the cache is the reference.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.fixes.bridge import t5_block as bridge_t5_block
from safelens_tl.fixes.bridge import t5_legacy_block as bridge_t5_legacy_block
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

ARCHITECTURES = (
    "T5ForConditionalGeneration",
    "MT5ForConditionalGeneration",
    "LongT5ForConditionalGeneration",
)


def _generate(model: Any, cached: bool) -> Any:
    """The hf_generate sweep's generation, with every step's logits (and all of its steps)."""
    sweep = benchmark_module("bridge_hf_generate")
    return sweep.generate(model, cached, min_new_tokens=sweep.NEW_TOKENS, output_logits=True)


def _cached_against_uncached(architecture: str) -> tuple[bool, float]:
    """Whether cached and uncached ``hf_generate`` pick the same tokens, and the largest relative
    error of the cached logits against the uncached ones."""
    architectures = benchmark_module("bridge_architectures")
    model = architectures.boot(str(architecture_folder(architecture)))
    with torch.inference_mode():
        uncached = _generate(model, False)
        cached = _generate(model, True)
    same = torch.equal(cached.sequences, uncached.sequences)
    logits = torch.stack(list(cached.logits), dim=1)
    expected = torch.stack(list(uncached.logits), dim=1)
    error = float((logits - expected).abs().max() / expected.abs().max())
    return same, error


def _renamed() -> bool:
    return bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME


def _legacy_block() -> bool:
    """Whether this TransformerLens's T5 block is 3.x's, written for transformers 4."""
    block = targets.optional_class(targets.T5_BLOCK_BRIDGE_CLASS)
    return block is not None and bridge_t5_legacy_block.builds_a_legacy_forward(block)


def _skip_unless_booted(architecture: str) -> None:
    if architecture not in targets.bridge_architectures():
        pytest.skip(f"this TransformerBridge does not boot {architecture}")


@requires_bridge
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hf_generate_with_the_cache_equals_it_without(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """The same tokens, and logits within the verifier's float32 tolerance, with the cache and
    without it. Stock picks other tokens where transformers passes the cache as ``cache``; with
    TransformerLens 3.x's block it ignores the cache (LongT5) or, from transformers 5.15, cannot
    run T5 and mT5 at all (``too many values to unpack``)."""
    _skip_unless_booted(architecture)
    same, error = _cached_against_uncached(architecture)
    assert same and error <= 1e-4, error
    if not (_renamed() or _legacy_block()):
        return
    safelens_tl.deactivate()
    try:
        stock_same, stock_error = _cached_against_uncached(architecture)
    except ValueError as error:
        assert _legacy_block() and "too many values to unpack" in str(error), error
        return
    finally:
        safelens_tl.activate()
    assert not stock_same and stock_error > 0.1, stock_error


@requires_bridge
def test_the_sublayers_are_patched_at_the_first_cached_block_and_unpatched_on_deactivate() -> None:
    """The attention sublayer classes get a ``forward`` that shows ``past_key_values`` (4.x) or
    takes its block's cache (3.x's block) once a block meets the renamed cache (any cache, with
    3.x's block): listed by ``status()``, removed by ``deactivate()``; the feed-forward sublayer is
    left alone."""
    legacy = _legacy_block()
    if not (_renamed() or legacy):
        pytest.skip("this transformers passes past_key_values, which the block reads")
    folder = str(architecture_folder("T5ForConditionalGeneration"))
    modeling = importlib.import_module("transformers.models.t5.modeling_t5")
    attention = (modeling.T5LayerSelfAttention, modeling.T5LayerCrossAttention)
    before = {owner: owner.__dict__["forward"] for owner in attention}
    safelens_tl.deactivate()
    safelens_tl.activate()
    try:
        model = benchmark_module("bridge_architectures").boot(folder)
        with torch.inference_mode():
            _generate(model, True)
        status = safelens_tl.status()
        for owner in attention:
            assert f"{owner.__module__}.{owner.__qualname__}.forward" in status.patched
            if legacy:
                assert getattr(owner.forward, bridge_t5_legacy_block.MARK, False)
            else:
                assert "past_key_values" in inspect.signature(owner.forward).parameters
        assert not any("T5LayerFF" in p for p in status.patched)
        assert status.failures == ()
    finally:
        safelens_tl.deactivate()
        safelens_tl.activate()
    assert {owner: owner.__dict__["forward"] for owner in attention} == before


class _Sublayer:
    def forward(self, hidden_states: Any, mask: Any = None, cache: Any = None, **kw: Any) -> Any:
        return hidden_states, cache, kw


def test_a_sublayer_shows_and_hands_on_the_old_name() -> None:
    """``past_key_values`` is shown before ``**kwargs`` and handed on as ``cache``; a ``cache``
    given too wins; the marked function is not wrapped twice; ``forward`` functions that already
    show the old name, or take no cache, are left alone."""
    assert bridge_t5_block.hides_the_old_name(_Sublayer.forward)
    wrapped = bridge_t5_block.showing_the_old_name(_Sublayer.forward)
    names = list(inspect.signature(wrapped).parameters)
    assert names == ["self", "hidden_states", "mask", "cache", "past_key_values", "kw"]
    layer, kept, other = _Sublayer(), object(), object()
    assert wrapped(layer, 1, past_key_values=kept) == (1, kept, {})
    assert wrapped(layer, 1, past_key_values=other, cache=kept) == (1, kept, {})

    class Block:
        def __init__(self) -> None:
            self.layer = [_Sublayer()]

    patches = bridge_t5_block.sublayer_patches(Block())
    assert [(p.owner, p.attribute) for p in patches] == [(_Sublayer, "forward")]
    assert not bridge_t5_block.hides_the_old_name(wrapped)
    assert not bridge_t5_block.hides_the_old_name(lambda hidden_states: hidden_states)

    class Builder:
        def _patch_t5_block_forward(self) -> None:
            def patched_forward(hidden_states: Any, past_key_value: Any = None) -> Any:
                return hidden_states, past_key_value

            self.forward = patched_forward

    assert not bridge_t5_block.hands_sublayers_the_cache(Builder)  # TransformerLens 3.x's shape
    assert bridge_t5_legacy_block.builds_a_legacy_forward(Builder)

    class Builder4x:
        def _patch_t5_block_forward(self) -> None:
            def patched_forward(hidden_states: Any, past_key_values: Any = None) -> Any:
                return hidden_states, past_key_values

            self.forward = patched_forward

    assert bridge_t5_block.hands_sublayers_the_cache(Builder4x)
    assert not bridge_t5_legacy_block.builds_a_legacy_forward(Builder4x)
    assert not bridge_t5_legacy_block.builds_a_legacy_forward(_Sublayer)


class _OldSublayer:
    def forward(self, hidden_states: Any, past_key_value: Any = None, **kw: Any) -> Any:
        return hidden_states, past_key_value, kw


class _RenamedSublayer:
    def forward(self, hidden_states: Any, past_key_values: Any = None, **kw: Any) -> Any:
        return hidden_states, past_key_values, kw


def test_a_sublayer_takes_its_block_s_cache_under_its_own_name() -> None:
    """Inside a block forward that holds a cache, a sublayer called without one gets it, under
    ``cache`` or ``past_key_values`` (whichever it takes); a cache passed explicitly wins;
    outside a block forward nothing is added; transformers 4's sublayers are left alone."""
    held, given = object(), object()
    new = bridge_t5_legacy_block.taking_the_block_cache(_Sublayer.forward)
    old = bridge_t5_legacy_block.taking_the_block_cache(_RenamedSublayer.forward)
    assert new(_Sublayer(), 1) == (1, None, {})
    token = bridge_t5_legacy_block._block_cache.set(held)
    try:
        assert new(_Sublayer(), 1) == (1, held, {})
        assert old(_RenamedSublayer(), 1) == (1, held, {})
        assert new(_Sublayer(), 1, cache=given) == (1, given, {})
        assert old(_RenamedSublayer(), 1, past_key_values=given) == (1, given, {})
    finally:
        bridge_t5_legacy_block._block_cache.reset(token)
    assert bridge_t5_legacy_block.cache_name_taken(_OldSublayer.forward) is None

    class Block:
        def __init__(self, *layers: Any) -> None:
            self.layer = list(layers)

    patches = bridge_t5_legacy_block.sublayer_patches(Block(_Sublayer(), _OldSublayer()))
    assert [(p.owner, p.attribute) for p in patches] == [(_Sublayer, "forward")]
    assert bridge_t5_legacy_block.drops_the_cache(Block(_RenamedSublayer()))
    assert not bridge_t5_legacy_block.drops_the_cache(Block(_OldSublayer()))
    assert not bridge_t5_legacy_block.drops_the_cache(Block())


def test_the_block_output_takes_hugging_face_s_layout() -> None:
    """TransformerLens 3.x's ``(hidden, bias, weights[, cross bias, cross weights])`` becomes
    ``(hidden, bias, cross bias or None)`` for a Hugging Face block without
    ``output_attentions``; a block with it (LongT5) and unknown shapes are left as they are."""

    class Block:
        def forward(self, hidden_states: Any, cache: Any = None) -> Any:
            return hidden_states

    class OldLayoutBlock:
        def forward(self, hidden_states: Any, output_attentions: bool = False) -> Any:
            return hidden_states

    layout = bridge_t5_legacy_block.in_hugging_face_layout
    assert layout(Block(), ("h", "b", "w", "cb", "cw")) == ("h", "b", "cb")
    assert layout(Block(), ("h", "b", "w")) == ("h", "b", None)
    assert layout(Block(), ("h", "b")) == ("h", "b")
    assert layout(OldLayoutBlock(), ("h", "b", "w", "cb", "cw")) == ("h", "b", "w", "cb", "cw")
