"""Regression tests on the real ``HookedTransformer.generate`` in float16 and bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from safelens_tl.kv import storage as kv_storage
from safelens_tl.verify import checks
from tests.conftest import RELEASE, requires_hooked_transformer

pytestmark = [requires_hooked_transformer, pytest.mark.both_cache_modes]

MODELS = ["gpt2-like", "llama-like-gqa"]
HALF_DTYPES = [torch.float16, torch.bfloat16]
_models: dict[tuple[str, torch.dtype], Any] = {}


def model_for(name: str, dtype: torch.dtype) -> Any:
    """Build each tiny model once per pytest session (building is most of the cost)."""
    if (name, dtype) not in _models:
        from safelens_tl.verify.models import build_model

        _models[name, dtype] = build_model(name, dtype)
    return _models[name, dtype]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_match_uncached(patched: Any, name: str, dtype: torch.dtype) -> None:
    model = model_for(name, dtype)
    result = checks.teacher_forced(model)
    assert result.max_rel_err <= checks.TOLERANCES[dtype], result.max_rel_err
    heads = model.cfg.n_key_value_heads or model.cfg.n_heads
    batch, positions = result.mask.shape
    for entry in result.cache.entries:
        assert entry.past_keys.dtype == dtype and entry.past_values.dtype == dtype
        assert tuple(entry.past_keys.shape) == (batch, positions, heads, model.cfg.d_head)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_generate_batch_with_left_padding(patched: Any, name: str, dtype: torch.dtype) -> None:
    model = model_for(name, dtype)
    agreement, tokens = checks.greedy_agreement(model, max_new_tokens=8)
    assert tokens.shape[0] == 2
    # Cached and uncached greedy decoding pick the same tokens on these models; a cache that
    # shifted positions or dropped the mask would not.
    assert agreement >= 0.9, agreement


def test_a_broken_cache_is_caught_by_the_tolerance(patched: Any) -> None:
    """The teacher-forced check has teeth: dropping one cached position breaks the tolerance."""
    model = model_for("gpt2-like", torch.float16)
    tokens, mask = checks.padded_batch(model)
    with torch.inference_mode():
        uncached = model(tokens, attention_mask=mask)
        cache = checks.cache_class().init_cache(model.cfg, model.cfg.device, tokens.shape[0])
        pieces = [model(tokens[:, :6], attention_mask=mask[:, :6], past_kv_cache=cache)]
        for entry in cache.entries:  # forget the oldest cached position of every layer
            entry.past_keys, entry.past_values = entry.past_keys[:, 1:], entry.past_values[:, 1:]
        cache.previous_attention_mask = cache.previous_attention_mask[:, 1:]
        for position in range(6, tokens.shape[1]):
            step = slice(position, position + 1)
            pieces.append(model(tokens[:, step], attention_mask=mask[:, step], past_kv_cache=cache))
    broken = checks.TeacherForced(torch.cat(pieces, 1), uncached, mask, cache)
    assert broken.max_rel_err > checks.TOLERANCES[torch.float16]


@pytest.mark.skipif(RELEASE != "3.0.0", reason="only TransformerLens 3.0.0 fails stock")
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_stock_generate_fails_on_3_0_0(name: str, dtype: torch.dtype) -> None:
    """Without the patch the same call fails, so the tests above cannot pass vacuously."""
    model = model_for(name, dtype)
    with pytest.raises(RuntimeError, match=r"expected scalar type|expected .*dtype|Float"):
        model.generate(
            list(checks.PROMPTS),
            max_new_tokens=2,
            do_sample=False,
            verbose=False,
            use_past_kv_cache=True,
            padding_side="left",
        )


@pytest.mark.parametrize("name", MODELS)
def test_fp32_cached_generation_is_identical_to_uncached(patched: Any, name: str) -> None:
    model = model_for(name, torch.float32)
    agreement, _ = checks.greedy_agreement(model, max_new_tokens=8)
    assert agreement == 1.0


@pytest.mark.parametrize("name", MODELS)
def test_split_inputs_and_per_head_results_keep_the_cache_right(patched: Any, name: str) -> None:
    """``set_use_split_qkv_input``, ``set_use_attn_result``, ``set_use_hook_mlp_in`` (and
    ``set_use_attn_in``, which grouped-query attention refuses) take other paths through
    attention: keys computed per head from a per-head input. In bfloat16 the cached logits must
    stay within tolerance, the cache in bfloat16 with the config's key-value heads, and greedy
    generation must pick what uncached generation picks. (TransformerLens 3.0.0 stock fails
    this: the cache it makes is float32.)"""
    from safelens_tl.verify.models import build_model

    model = build_model(name, torch.bfloat16)
    model.set_use_split_qkv_input(True)
    model.set_use_attn_result(True)
    model.set_use_hook_mlp_in(True)
    if not model.cfg.n_key_value_heads:
        model.set_use_attn_in(True)
    result = checks.teacher_forced(model)
    assert result.max_rel_err <= checks.TOLERANCES[torch.bfloat16], result.max_rel_err
    heads = model.cfg.n_key_value_heads or model.cfg.n_heads
    for entry in result.cache.entries:
        assert entry.past_keys.dtype == torch.bfloat16, entry.past_keys.dtype
        assert entry.past_keys.shape[2] == heads, entry.past_keys.shape
    agreement, _ = checks.greedy_agreement(model, max_new_tokens=8)
    assert agreement == 1.0, agreement


@pytest.mark.parametrize("name", MODELS)
def test_generation_without_the_storage_count_uses_torch_cat(
    patched: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch cannot count a storage's tensors (CPU-only and macOS builds before torch 2.8;
    taken away here, since those builds cannot be installed on this machine), caches stay in
    ``torch.cat`` tensors, in the model's dtype, and generation is as right as with buffers."""
    model = model_for(name, torch.float16)
    monkeypatch.setattr(kv_storage, "_storage_use_count", None)
    result = checks.teacher_forced(model)
    assert result.max_rel_err <= checks.TOLERANCES[torch.float16], result.max_rel_err
    for entry in result.cache.entries:
        assert entry.__dict__.get("_safelens_storage") is None
        assert entry.past_keys.dtype == torch.float16 and entry.past_keys.is_contiguous()
