"""TransformerLens 3.9's hooked (uncached) linear attention runs where transformers keeps the
layer's kernels at module level (transformers 5.15+: :mod:`safelens_tl.fixes.bridge.gated_delta`).
Real bridges on tiny random Qwen3-Next and Qwen3.5 checkpoints; Hugging Face's own forward is
the reference.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import gated_delta as bridge_gated_delta
from safelens_tl.verify import bridge
from tests.conftest import architecture_folder, requires_bridge

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")


def _bridge_class() -> Any:
    module, _, name = targets.GATED_DELTA_NET_BRIDGE_CLASS.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip("this TransformerLens has no GatedDeltaNetBridge")


def _reads_from_the_layer() -> bool:
    stock = _bridge_class().__dict__["_hooked_forward"]
    return bridge_gated_delta.reads_functions_from_the_layer(getattr(stock, "__wrapped__", stock))


def _linear_attention_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


@requires_bridge
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_hooked_forward_without_a_cache_runs_and_equals_hugging_face(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """``use_cache=False`` (the bridge's own re-implementation, every hook firing) gives Hugging
    Face's logits within 1e-4, ``run_with_cache`` records the layer's inner hooks, and Hugging
    Face's ``generate`` through the bridge without a cache picks the tokens it picks with one."""
    folder = architecture_folder(architecture)
    model = bridge.boot_folder(folder, torch.float32)
    reference = bridge.reference_from(folder, torch.float32)
    tokens = torch.tensor([[1, 5, 7, 11, 13, 2, 9, 4]])
    with torch.no_grad():
        expected = reference(input_ids=tokens, use_cache=False).logits
        hooked = model(tokens, use_cache=False)
        _, cache = model.run_with_cache(tokens, use_cache=False)
    scale = expected.abs().max()
    assert (hooked - expected).abs().max() <= 1e-4 * scale
    names = list(cache.keys())
    assert any(name.endswith("hook_q_pre_conv") for name in names), names
    with_cache = model.hf_generate(tokens, max_new_tokens=6, do_sample=False, use_cache=True)
    without = model.hf_generate(tokens, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(torch.as_tensor(with_cache), torch.as_tensor(without))


@requires_bridge
def test_stock_fails_only_where_the_bridge_reads_what_the_layer_lacks() -> None:
    """What the patch removes: with TransformerLens 3.9 and a transformers whose layer lacks the
    two functions, stock raises ``AttributeError``; TransformerLens 4.x and older transformers
    run, and there nothing is patched."""
    folder = architecture_folder("Qwen3_5ForCausalLM")
    tokens = torch.tensor([[1, 5, 7, 11]])
    safelens_tl.deactivate()
    try:
        model = bridge.boot_folder(folder, torch.float32)
        layer = _linear_attention_layers(model)[0]
        lacking = not hasattr(layer, bridge_gated_delta.CONVOLUTION)
        if _reads_from_the_layer() and lacking:
            with pytest.raises(AttributeError, match=bridge_gated_delta.CONVOLUTION):
                model(tokens, use_cache=False)
        else:
            model(tokens, use_cache=False)
    finally:
        status = safelens_tl.activate()
    wrapped = targets.GATED_DELTA_NET_BRIDGE_CLASS + "._hooked_forward"
    assert (wrapped in status.patched) == _reads_from_the_layer()


@requires_bridge
def test_the_layer_class_gets_the_functions_once_and_loses_them_on_deactivate() -> None:
    """The patches are made at the first forward that needs them, listed by ``status()``, made
    once, and removed by ``deactivate()`` with the rest."""
    if not _reads_from_the_layer():
        pytest.skip("this TransformerLens resolves the layer's functions itself")
    folder = architecture_folder("Qwen3NextForCausalLM")
    tokens = torch.tensor([[1, 5, 7, 11]])
    safelens_tl.deactivate()
    status = safelens_tl.activate()
    try:
        model = bridge.boot_folder(folder, torch.float32)
        layer_class = type(_linear_attention_layers(model)[0])
        if bridge_gated_delta.CONVOLUTION in layer_class.__dict__ or not hasattr(
            importlib.import_module(layer_class.__module__), bridge_gated_delta.MODULE_CHUNKED_RULE
        ):
            pytest.skip("this transformers keeps the functions on the layer")
        added = f"{layer_class.__module__}.{layer_class.__qualname__}."
        assert not any(p.startswith(added) for p in status.patched)
        with torch.no_grad():
            model(tokens, use_cache=False)
            model(tokens, use_cache=False)
        status = safelens_tl.status()
        assert sorted(p for p in status.patched if p.startswith(added)) == [
            added + bridge_gated_delta.CONVOLUTION,
            added + bridge_gated_delta.CHUNKED_RULE,
        ]
        assert status.failures == ()
        assert layer_class.__dict__[bridge_gated_delta.CONVOLUTION] is None
    finally:
        safelens_tl.deactivate()
        safelens_tl.activate()
    assert bridge_gated_delta.CONVOLUTION not in layer_class.__dict__
    assert bridge_gated_delta.CHUNKED_RULE not in layer_class.__dict__


class _Layer:
    pass


def test_a_layer_that_has_the_functions_keeps_its_own() -> None:
    """Only what a class lacks is added; the chunked rule is the modeling file's own."""

    class Complete:
        causal_conv1d_fn = staticmethod(len)
        chunk_gated_delta_rule = staticmethod(len)

    assert bridge_gated_delta.layer_functions(Complete) == []
    patches = bridge_gated_delta.layer_functions(_Layer)
    # This test module has no torch_chunk_gated_delta_rule: only the convolution is given.
    assert [(p.attribute, p.replacement) for p in patches] == [("causal_conv1d_fn", None)]
