"""Attention bridges that never wrote the KV cache (TransformerLens 3.x's ALiBi bridges).

Falcon with ALiBi (Falcon-RW's layout) and MPT generate through TransformerBridge with the cache
ignored in stock TransformerLens 3.9: every cached step attends to its own position alone. With
safelens-tl the keys and values are written at the head split, and cached generation agrees with
the uncached forward and with Hugging Face's own. Greedy, float32 and bfloat16, one prompt and a
left-padded batch (``benchmarks/bridge_architectures.py``'s ``run``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import cache_writes as bridge_cache_writes
from safelens_tl.verify import bridge, models
from tests.conftest import architecture_folder, benchmark_module, requires_bridge, subclasses

pytestmark = requires_bridge

_falcon_folder: list[Path] = []


def _falcon_with_alibi() -> Path:
    """A tiny Falcon checkpoint with ``alibi=True`` (the bridge picks its ALiBi attention)."""
    if not _falcon_folder:
        architectures = benchmark_module("bridge_architectures")
        config_name, settings = architectures.ARCHITECTURES["FalconForCausalLM"]
        tokenizer = models.load_tokenizer()
        config = architectures._language_config(config_name, {**settings, "alibi": True}, tokenizer)
        config.architectures = ["FalconForCausalLM"]
        _falcon_folder.append(bridge.save_checkpoint(config, "falcon-alibi", tokenizer))
    return _falcon_folder[0]


def _folder(name: str) -> Path:
    return _falcon_with_alibi() if name == "falcon-alibi" else architecture_folder(name)


#: The attention bridge each checkpoint gets.
ATTENTION_OF = {
    "falcon-alibi": "ALiBiJointQKVAttentionBridge",
    "MptForCausalLM": "MPTALiBiAttentionBridge",
}


def _attention_class(name: str) -> type:
    dotted = next(d for d in targets.RECONSTRUCTING_ATTENTION_BRIDGES if d.endswith(name))
    found = targets.optional_class(dotted)
    if found is None:
        pytest.skip(f"this TransformerLens has no {name}")
    return found


def _every_attention_bridge() -> list[type]:
    """Every attention bridge class of the release (TransformerBridge imports them all)."""
    return subclasses(targets.locate_bridge().attention_class)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ATTENTION_OF))
def test_an_alibi_bridge_generates_right_with_its_cache(name: str, dtype: torch.dtype) -> None:
    attention = _attention_class(ATTENTION_OF[name])
    folder = str(_folder(name))
    architectures = benchmark_module("bridge_architectures")
    patched = architectures.run(folder, active=True, dtype=dtype)
    if patched.error and "Could not determine supported architecture" in patched.error:
        pytest.skip(f"this TransformerBridge does not support {name}")
    reconstruct = inspect.unwrap(attention.__dict__["_reconstruct_attention"])
    if not bridge_cache_writes.skips_the_cache(reconstruct):
        assert patched.right(), patched  # 4.x writes the cache itself; nothing is patched
        return
    stock = architectures.run(folder, active=False, dtype=dtype)
    assert stock.wrong(), stock  # the cache is ignored: what the patch fixes
    # On TransformerLens 3.0 this also needs the cache Falcon passes as ``layer_past`` read
    # (safelens_tl.fixes.bridge.cache.reading_update_kv_cache).
    assert patched.right(), patched
    assert patched.cache_dtype == str(dtype).removeprefix("torch."), patched


def test_every_attention_bridge_that_skips_the_cache_is_listed() -> None:
    """A bridge of this release whose own reconstruction splits heads but never writes the cache
    is in ``targets.RECONSTRUCTING_ATTENTION_BRIDGES``, so it is patched."""
    listed = set(map(targets.optional_class, targets.RECONSTRUCTING_ATTENTION_BRIDGES))
    for attention in _every_attention_bridge():
        reconstruct = attention.__dict__.get("_reconstruct_attention")
        if bridge_cache_writes.skips_the_cache(reconstruct):
            assert attention in listed, attention


def test_only_the_bridges_that_skip_the_cache_are_patched() -> None:
    """The head split is patched only where such a bridge exists; deactivation restores all.
    (CodeGen's reconstruction is wrapped for its rotation,
    :mod:`safelens_tl.fixes.bridge.codegen`.)"""
    layout = targets.locate_bridge()
    split = layout.attention_class.__dict__["_reshape_qkv_to_heads"]
    originals = {c: c.__dict__.get("_reconstruct_attention") for c in _every_attention_bridge()}
    skipping = {c for c, f in originals.items() if bridge_cache_writes.skips_the_cache(f)}
    safelens_tl.activate()
    for owner, original in originals.items():
        now = owner.__dict__.get("_reconstruct_attention")
        if owner in skipping or owner is layout.codegen_attention_class:
            assert now is not original and now.__wrapped__ is original, owner
        else:
            assert now is original, owner
    patched_split = layout.attention_class.__dict__["_reshape_qkv_to_heads"]
    assert (patched_split is not split) == bool(skipping)
    safelens_tl.deactivate()
    assert layout.attention_class.__dict__["_reshape_qkv_to_heads"] is split
    for owner, original in originals.items():
        assert owner.__dict__.get("_reconstruct_attention") is original, owner


def test_a_split_outside_a_patched_reconstruction_writes_nothing() -> None:
    """The head split writes the cache only for the reconstruction that asked, once."""
    calls: list[Any] = []

    class Attention:
        def _update_kv_cache(self, k: Any, v: Any, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return k + 1, v + 1

        @bridge_cache_writes.splitting_into_the_cache
        def _reshape_qkv_to_heads(self, q: Any, k: Any, v: Any, heads: int) -> Any:
            return q, k, v, 1, 1, 1

        @bridge_cache_writes.writing_the_cache
        def _reconstruct_attention(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            first = self._reshape_qkv_to_heads(q, k, v, 1)
            second = self._reshape_qkv_to_heads(q, k, v, 1)
            return first, second

    attention = Attention()
    assert attention._reshape_qkv_to_heads(0, 0, 0, 1) == (0, 0, 0, 1, 1, 1)
    assert calls == []
    first, second = attention._reconstruct_attention(0, 0, 0, cache="the cache", layer=3)
    assert first == (0, 1, 1, 1, 1, 1) and second == (0, 0, 0, 1, 1, 1)
    assert calls == [{"cache": "the cache", "layer": 3}]
    assert attention._reshape_qkv_to_heads(0, 0, 0, 1) == (0, 0, 0, 1, 1, 1)
    assert len(calls) == 1
