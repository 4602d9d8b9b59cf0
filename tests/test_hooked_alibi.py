"""HookedTransformer's ALiBi bias is sized to each forward (``safelens_tl.fixes.hooked.alibi``).

Stock TransformerLens keeps each layer's bias at the longest key length it has seen and adds the
rows of its last positions, so a forward after a longer one is offset by a constant per row: no
change in exact arithmetic, a large one in half precision. Real HookedTransformer models (Bloom's
configuration and a tiny Bloom checkpoint loaded by TransformerLens's own loader), real generate.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.hooked import alibi as hooked_alibi
from safelens_tl.verify import checks, models, runner
from tests.conftest import benchmark_module, requires_hooked_transformer

pytestmark = requires_hooked_transformer

HALF = (torch.float16, torch.bfloat16)
#: A forward over this many positions first makes the bias of a later 12-position forward
#: carry an offset of up to 600 x 1/4 (the first head's slope): scores rounded to whole units in
#: bfloat16.
LONG = 600


def alibi_model(dtype: torch.dtype, seed: int = 0) -> Any:
    """A two-layer HookedTransformer configured like Bloom (ALiBi, LayerNorm), random weights."""
    from transformer_lens import HookedTransformer

    cfg = models.hooked_config_class()(
        d_model=64,
        d_head=16,
        n_heads=4,
        n_layers=2,
        n_ctx=1024,
        d_vocab=models.vocab_size(),
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="alibi",
        dtype=torch.float32,
        seed=seed,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
    )
    torch.manual_seed(seed)
    model = HookedTransformer(cfg, tokenizer=models.load_tokenizer())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.to(dtype)


def _tokens(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, models.vocab_size(), (1, length), generator=generator)


def _logits_fresh_and_after_a_longer_forward(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = _tokens(12, seed=1)
    with torch.no_grad():
        fresh = model(tokens)
        model(_tokens(LONG, seed=2))
        after = model(tokens)
    return fresh, after


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_a_forward_after_a_longer_one_gives_the_logits_of_a_fresh_model(
    patched: Any, dtype: torch.dtype
) -> None:
    fresh, after = _logits_fresh_and_after_a_longer_forward(alibi_model(dtype))
    assert torch.equal(after, fresh)


def scores_in_model_dtype(model: Any) -> bool:
    """Whether attention scores are computed in the model's dtype. TransformerLens 2.x computes
    them in float32 in a float16/bfloat16 model, which makes the stale bias cost little."""
    with torch.no_grad():
        _, cache = model.run_with_cache(
            _tokens(4, seed=5), names_filter="blocks.0.attn.hook_attn_scores"
        )
    return bool(cache["blocks.0.attn.hook_attn_scores"].dtype == model.cfg.dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stock_logits_depend_on_a_longer_forward_run_before(dtype: torch.dtype) -> None:
    """What the fix is for: stock is off by more than the verifier's tolerance for the dtype."""
    model = alibi_model(dtype)
    if not scores_in_model_dtype(model):
        pytest.skip("this TransformerLens computes attention scores in float32")
    fresh, after = _logits_fresh_and_after_a_longer_forward(model)
    error = ((after.float() - fresh.float()).abs().max() / fresh.float().abs().max()).item()
    assert error > checks.TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cached_generation_after_a_longer_forward_is_what_a_fresh_model_generates(
    patched: Any, dtype: torch.dtype
) -> None:
    model = alibi_model(dtype)
    prompt = _tokens(5, seed=3)
    arguments = {**checks.greedy_arguments(16), "use_past_kv_cache": True}
    fresh = model.generate(prompt, **arguments)
    with torch.no_grad():
        model(_tokens(LONG, seed=2))
    cached = model.generate(prompt, **arguments)
    uncached = model.generate(prompt, **{**arguments, "use_past_kv_cache": False})
    assert torch.equal(cached, fresh)
    assert torch.equal(uncached, fresh)


def test_the_verifier_passes_a_bloom_checkpoint_in_bfloat16_that_stock_fails() -> None:
    """The tiny Bloom checkpoint, loaded as ``from_pretrained`` would: the verifier's own uncached
    pass over the whole batch comes first, so stock's cached pass gets the offset bias (where
    attention scores are computed in the model's dtype: TransformerLens 3.x)."""
    architectures = benchmark_module("hooked_architectures")
    folder = architectures.build("BloomForCausalLM")
    outcomes = {
        active: architectures.run(folder, "BloomForCausalLM", active, torch.bfloat16)
        for active in (True, False)
    }
    assert outcomes[True].passed, outcomes[True]
    assert outcomes[True].cache_dtype == "bfloat16"
    if not scores_in_model_dtype(alibi_model(torch.bfloat16)):
        pytest.skip("TransformerLens 2.x computes attention scores in float32: stock passes too")
    assert not outcomes[False].passed
    # TransformerLens 3.0.0's stock cache fails in half precision before any logits compare.
    stock_error = outcomes[False].max_rel_err
    assert stock_error is None or stock_error > checks.TOLERANCES[torch.bfloat16]


def test_only_alibi_layers_get_the_hook(patched: Any) -> None:
    alibi = alibi_model(torch.float32)
    other = models.build_model("gpt2-like", torch.float32)
    assert all(len(block.attn._forward_pre_hooks) == 1 for block in alibi.blocks)
    assert all(not block.attn._forward_pre_hooks for block in other.blocks)


def test_a_model_built_while_stock_gets_no_hook() -> None:
    model = alibi_model(torch.float32)
    assert all(not block.attn._forward_pre_hooks for block in model.blocks)


def test_deactivating_gives_the_stock_behaviour_back() -> None:
    safelens_tl.activate()
    model = alibi_model(torch.bfloat16)
    safelens_tl.deactivate()
    fresh, after = _logits_fresh_and_after_a_longer_forward(model)
    assert not torch.equal(after, fresh)


def test_a_whole_model_pickles_with_its_hook_and_keeps_the_fix(patched: Any) -> None:
    """``torch.save(model)`` (not a state dict) stores the hook by reference to this module."""
    buffer = io.BytesIO()
    torch.save(alibi_model(torch.bfloat16), buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    fresh, after = _logits_fresh_and_after_a_longer_forward(restored)
    assert torch.equal(after, fresh)


def test_the_cut_bias_is_the_bias_transformer_lens_computes_for_that_length(patched: Any) -> None:
    from transformer_lens.components.abstract_attention import AbstractAttention

    model = alibi_model(torch.float32)
    attention = model.blocks[0].attn
    with torch.no_grad():
        model(_tokens(40, seed=4))
    hooked_alibi.fit_alibi(attention, (), {"key_input": torch.zeros(1, 9, 64)})
    assert torch.equal(attention.alibi, AbstractAttention.create_alibi_bias(4, 9, "cpu"))


def test_a_bias_too_short_is_left_for_transformer_lens_to_rebuild(patched: Any) -> None:
    model = alibi_model(torch.float32)
    attention = model.blocks[0].attn
    with torch.no_grad():
        model(_tokens(5, seed=4))
    before = attention.alibi
    hooked_alibi.fit_alibi(attention, (), {"key_input": torch.zeros(1, 9, 64)})
    assert attention.alibi is before


def test_key_positions_count_the_cached_past_and_the_new_keys(cache_class: type) -> None:
    cfg = alibi_model(torch.float32).cfg
    cache = cache_class.init_cache(cfg, "cpu", 1)
    entry = cache.entries[0]
    keys = torch.zeros(1, 7, cfg.n_heads, cfg.d_head)
    entry.append(keys, keys)
    new = torch.zeros(1, 1, cfg.d_model)
    assert hooked_alibi.key_positions((new, new, new, entry), {}) == 8
    assert hooked_alibi.key_positions((), {"key_input": new, "past_kv_cache_entry": entry}) == 8
    assert hooked_alibi.key_positions((new,), {"key_input": new}) == 1
    assert hooked_alibi.key_positions((), {}) is None


def test_the_verifier_on_a_fresh_alibi_model_is_unchanged_in_float32(patched: Any) -> None:
    result = runner.check_hooked(alibi_model(torch.float32), "alibi")
    assert result.passed, result.error
