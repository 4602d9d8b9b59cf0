"""Attention modules that pass their cache as ``layer_past`` (Falcon, BLOOM, GPTBigCode) get it
written through TransformerBridge on every release. TransformerLens 3.0's
``AttentionBridge._update_kv_cache`` reads ``past_key_values`` only, so there every cached step
attended to itself alone (:func:`safelens_tl.fixes.bridge.cache.reading_update_kv_cache`). Real
bridges on the sweep's tiny checkpoints.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

ARCHITECTURES = ("FalconForCausalLM", "BloomForCausalLM", "GPTBigCodeForCausalLM")


@requires_bridge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_cache_passed_as_layer_past_is_used(
    architecture: str, dtype: torch.dtype, patched: safelens_tl.activation.Status
) -> None:
    """Cached generation right (the verifier's bound, the same tokens as uncached, the cache in
    the model's dtype) with safelens-tl; stock wrong where its ``_update_kv_cache`` ignores
    ``layer_past`` (TransformerLens 3.0) or the cache argument was renamed (transformers 5.24)."""
    folder = str(architecture_folder(architecture))
    architectures = benchmark_module("bridge_architectures")
    result = architectures.run(folder, active=True, dtype=dtype)
    assert result.right(), result
    assert result.cache_dtype == str(dtype).removeprefix("torch."), result
    update = inspect.unwrap(targets.locate_bridge().attention_class.__dict__["_update_kv_cache"])
    if not bridge_cache.reads_layer_past(update):
        stock = architectures.run(folder, active=False, dtype=dtype)
        assert stock.wrong(), stock


def _recording(calls: list[Any]) -> Any:
    def _update_kv_cache(self: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("past_key_values"))
        return k, v

    return _update_kv_cache


def _reading_layer_past(calls: list[Any]) -> Any:
    def _update_kv_cache(self: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("past_key_values") or kwargs.get("layer_past"))
        return k, v

    return _update_kv_cache


def test_layer_past_is_mapped_only_where_the_original_ignores_it() -> None:
    """An original that ignores ``layer_past`` is handed it as ``past_key_values``; one that reads
    it itself gets the call as made; ``past_key_values`` and ``cache`` keep their precedence; the
    caller's arguments are never changed."""
    cache, other = object(), object()
    calls: list[Any] = []
    ignoring = bridge_cache.reading_update_kv_cache(_recording(calls))
    arguments = {"layer_past": cache}
    ignoring(None, 1, 2, **arguments)
    ignoring(None, 1, 2, past_key_values=other, layer_past=cache)
    ignoring(None, 1, 2, cache=other)
    ignoring(None, 1, 2)
    assert calls == [cache, other, other, None]
    assert arguments == {"layer_past": cache}

    seen: list[Any] = []
    reading = bridge_cache.reading_update_kv_cache(_reading_layer_past(seen))
    reading(None, 1, 2, layer_past=cache)
    assert seen == [cache]
    assert bridge_cache.reads_layer_past(_reading_layer_past(seen))
    assert not bridge_cache.reads_layer_past(_recording(calls))
