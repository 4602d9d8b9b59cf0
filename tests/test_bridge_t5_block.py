"""T5, mT5 and LongT5 generate right through ``TransformerBridge.hf_generate`` where transformers
passes the cache as ``cache`` (5.24 on: :mod:`safelens_tl.bridge_t5_block`). Real bridges on tiny
random encoder-decoder checkpoints; the same generation without the cache is the reference.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import bridge_cache, bridge_t5_block, targets
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
    error of the cached logits against the uncached ones. Skips where the bridge's T5 block
    cannot run with this transformers at all, in stock as with safelens-tl (TransformerLens 3.x
    with transformers 5.15+: ``too many values to unpack``)."""
    architectures = benchmark_module("bridge_architectures")
    model = architectures.boot(str(architecture_folder(architecture)))
    with torch.inference_mode():
        try:
            uncached = _generate(model, False)
        except ValueError as error:
            pytest.skip(f"this TransformerBridge's {architecture} cannot run here: {error}")
        cached = _generate(model, True)
    same = torch.equal(cached.sequences, uncached.sequences)
    logits = torch.stack(list(cached.logits), dim=1)
    expected = torch.stack(list(uncached.logits), dim=1)
    error = float((logits - expected).abs().max() / expected.abs().max())
    return same, error


def _renamed() -> bool:
    return bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME


def _skip_unless_the_block_hands_on_the_cache() -> None:
    block = targets.optional_class(targets.T5_BLOCK_BRIDGE_CLASS)
    if block is None or not bridge_t5_block.hands_sublayers_the_cache(block):
        pytest.skip(
            "this TransformerLens's T5 block hands transformers 5's sublayers no cache, in stock "
            "as with safelens-tl (not fixed)"
        )


@requires_bridge
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hf_generate_with_the_cache_equals_it_without(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """The same tokens, and logits within the verifier's float32 tolerance, with the cache and
    without it; stock picks other tokens where transformers passes the cache as ``cache``."""
    _skip_unless_the_block_hands_on_the_cache()
    same, error = _cached_against_uncached(architecture)
    assert same and error <= 1e-4, error
    if _renamed():
        safelens_tl.deactivate()
        try:
            stock_same, stock_error = _cached_against_uncached(architecture)
        finally:
            safelens_tl.activate()
        assert not stock_same and stock_error > 0.1, stock_error


@requires_bridge
def test_the_sublayers_are_patched_at_the_first_cached_block_and_unpatched_on_deactivate() -> None:
    """The attention sublayer classes get a ``forward`` that shows ``past_key_values`` once a
    block meets the renamed cache: listed by ``status()``, removed by ``deactivate()``; the
    feed-forward sublayer is left alone."""
    if not _renamed():
        pytest.skip("this transformers passes past_key_values, which the block reads")
    _skip_unless_the_block_hands_on_the_cache()
    folder = str(architecture_folder("T5ForConditionalGeneration"))
    modeling = importlib.import_module("transformers.models.t5.modeling_t5")
    attention = (modeling.T5LayerSelfAttention, modeling.T5LayerCrossAttention)
    before = {owner: owner.__dict__["forward"] for owner in attention}
    safelens_tl.deactivate()
    safelens_tl.activate()
    try:
        model = benchmark_module("bridge_architectures").boot(folder)
        with torch.inference_mode():
            try:
                _generate(model, True)
            except ValueError as error:
                pytest.skip(f"this TransformerBridge's T5 cannot run here: {error}")
        status = safelens_tl.status()
        for owner in attention:
            assert f"{owner.__module__}.{owner.__qualname__}.forward" in status.patched
            assert "past_key_values" in inspect.signature(owner.forward).parameters
        assert "forward" not in {p.rsplit(".", 2)[-2] for p in status.patched if "T5LayerFF" in p}
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
