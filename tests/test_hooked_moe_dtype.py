"""HookedTransformer's mixture-of-experts layers are built in ``cfg.dtype``
(``safelens_tl.fixes.hooked.moe_dtype``). Real HookedTransformer models: Mixtral's configuration,
and tiny Mixtral and OLMoE checkpoints loaded by TransformerLens's own loader.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import checks, diagnostics, models, runner
from tests.conftest import benchmark_module, requires_hooked_transformer

pytestmark = requires_hooked_transformer

HALF = (torch.float16, torch.bfloat16)


def mixtral_config(dtype: torch.dtype) -> Any:
    """Mixtral's shape in miniature: rotary, RMS norms, grouped-query attention, 4 experts."""
    return models.hooked_config_class()(
        d_model=64,
        d_head=16,
        n_heads=4,
        n_key_value_heads=2,
        d_mlp=64,
        n_layers=2,
        n_ctx=256,
        d_vocab=models.vocab_size(),
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=16,
        gated_mlp=True,
        num_experts=4,
        experts_per_token=2,
        dtype=dtype,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
    )


def moe_model(dtype: torch.dtype, seed: int = 0) -> Any:
    """A Mixtral-like HookedTransformer built in ``dtype``, as ``from_pretrained`` builds it."""
    from transformer_lens import HookedTransformer

    torch.manual_seed(seed)
    return HookedTransformer(mixtral_config(dtype), tokenizer=models.load_tokenizer())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_parameter_is_built_in_the_model_dtype(patched: Any, dtype: torch.dtype) -> None:
    model = moe_model(dtype)
    assert {parameter.dtype for parameter in model.parameters()} == {dtype}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stock_builds_float32_experts_and_its_forward_fails(dtype: torch.dtype) -> None:
    """What the fix is for."""
    model = moe_model(dtype)
    assert model.blocks[0].mlp.experts[0].W_in.weight.dtype == torch.float32
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.tensor([[1, 5, 6]]))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_verifier_names_stock_s_float32_experts_not_the_half_trap(dtype: torch.dtype) -> None:
    """Only the experts differ from ``cfg.dtype``: not the ``model.half()`` trap."""
    problem = diagnostics.half_trap(moe_model(dtype))
    assert problem is not None
    assert "model.half() trap" not in problem
    assert "blocks.0.mlp.experts.0" in problem and "float32" in problem
    assert f"model.to(torch.{str(dtype).removeprefix('torch.')})" in problem


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cached_generation_runs_and_matches_uncached(patched: Any, dtype: torch.dtype) -> None:
    result = runner.check_hooked(moe_model(dtype), "mixtral-like")
    assert result.passed, result.error
    assert result.cache_dtype == str(dtype).removeprefix("torch.")


def test_float32_builds_the_same_parameters_as_stock(patched: Any) -> None:
    patched_state = moe_model(torch.float32, seed=3).state_dict()
    safelens_tl.deactivate()
    stock_state = moe_model(torch.float32, seed=3).state_dict()
    assert patched_state.keys() == stock_state.keys()
    assert all(torch.equal(patched_state[name], stock_state[name]) for name in stock_state)


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "OlmoeForCausalLM"])
def test_checkpoints_loaded_by_transformer_lens_pass_the_verifier_in_bfloat16(
    architecture: str,
) -> None:
    architectures = benchmark_module("hooked_architectures")
    try:
        folder = architectures.build(architecture)
    except LookupError as missing:  # an older transformers lacks the config
        pytest.skip(str(missing))
    patched = architectures.run(folder, architecture, True, torch.bfloat16)
    stock = architectures.run(folder, architecture, False, torch.bfloat16)
    if patched.load_error is not None and patched.load_error == stock.load_error:
        pytest.skip(f"this TransformerLens cannot load {architecture}: {patched.load_error}")
    assert patched.passed, patched
    assert patched.max_rel_err is not None
    assert patched.max_rel_err <= checks.TOLERANCES[torch.bfloat16]
    assert not stock.passed
