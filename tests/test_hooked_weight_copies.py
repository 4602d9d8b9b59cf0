"""HookedTransformer forwards copy no weight (``safelens_tl.fixes.hooked.weight_copies``).

Real tiny HookedTransformer models (GPT-2-like: standard MLP, learned positions; Llama-like:
grouped-query attention, gated MLP, rotary), run through TransformerLens's own ``forward``,
``generate`` and ``backward``. The copies are counted below autograd by a ``TorchDispatchMode``
that records every copying ATen operation reading a tensor that shares storage with a parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.hooked import weight_copies as hooked_weight_copies
from safelens_tl.fixes.hooked.weight_copies import WeightCopyCounter
from safelens_tl.verify import models
from tests.conftest import (
    HAS_HOOKED_TRANSFORMER,
    generate_recording,
    requires_hooked_transformer,
    stock_with_positions,
)

FIXED = hooked_weight_copies.patches() if HAS_HOOKED_TRANSFORMER else []
pytestmark = [
    requires_hooked_transformer,
    pytest.mark.skipif(
        not FIXED, reason="this TransformerLens copies no weight in its forwards: nothing to fix"
    ),
]

MODELS = ("gpt2-like", "llama-like-gqa")
DTYPES = (torch.float32, torch.bfloat16)


def build(name: str, dtype: torch.dtype) -> Any:
    """A built-in tiny model with fixed weights (the same weights at every call)."""
    return models.build_model(name, dtype)


def forward_copies(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """The logits of ``model(tokens)`` and the weight copies made on the way."""
    with torch.no_grad(), WeightCopyCounter(model.parameters()) as counter:
        logits = model(tokens)
    return logits, counter.copies


def tokens(batch: int = 2, positions: int = 17) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(4, models.vocab_size(), (batch, positions), generator=generator)


@pytest.mark.parametrize("name", MODELS)
def test_stock_copies_weights_at_every_forward(name: str) -> None:
    """What the fix is for; also shows that the counter sees copies."""
    _, copies = forward_copies(build(name, torch.float32), tokens())
    assert copies, "stock made no weight copy: the counter or the release changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_patched_forward_copies_no_weight_and_gives_stock_s_logits(
    name: str, dtype: torch.dtype
) -> None:
    stock_logits, stock_copies = forward_copies(build(name, dtype), tokens())
    safelens_tl.activate()
    logits, copies = forward_copies(build(name, dtype), tokens())
    assert copies == []
    assert stock_copies
    # 16 or more rows per product: the same kernel whatever the weight's layout.
    assert torch.equal(logits, stock_logits)


@pytest.mark.parametrize("name", MODELS)
def test_one_token_logits_within_rounding_of_stock(name: str) -> None:
    """One row per product in float32 takes another kernel for the transposed layout: the last
    bits differ (docs/performance.md), nothing more."""
    prompt = tokens(1, 1)
    stock, _ = forward_copies(build(name, torch.float32), prompt)
    safelens_tl.activate()
    patched, copies = forward_copies(build(name, torch.float32), prompt)
    assert copies == []
    assert torch.allclose(patched, stock, rtol=0, atol=1e-5 * stock.abs().max().item())


@pytest.mark.parametrize("name", MODELS)
def test_cached_generate_copies_no_weight_same_hooks_and_tokens(name: str) -> None:
    prompt = tokens(1, 6)
    stock_model = build(name, torch.float32)
    # TransformerLens 2.13-3.0.0 drop learned positions when the pad id is 0, which safelens-tl
    # fixes on purpose: compare with what stock gives for any other pad id.
    with (
        stock_with_positions(stock_model),
        WeightCopyCounter(stock_model.parameters()) as stock_counter,
    ):
        stock_tokens, stock_seen = generate_recording(stock_model, prompt, 8)
    safelens_tl.activate()
    model = build(name, torch.float32)
    with WeightCopyCounter(model.parameters()) as counter:
        patched_tokens, seen = generate_recording(model, prompt, 8)
    assert stock_counter.copies
    assert counter.copies == []
    assert torch.equal(patched_tokens, stock_tokens)
    assert [(n, a.shape) for n, a in seen] == [(n, a.shape) for n, a in stock_seen]


@pytest.mark.parametrize("name", MODELS)
def test_gradients_reach_every_parameter_as_in_stock(name: str) -> None:
    def gradients(model: Any) -> dict[str, torch.Tensor]:
        logits = model(tokens())
        (logits.float().square().mean()).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    stock = gradients(build(name, torch.float32))
    safelens_tl.activate()
    model = build(name, torch.float32)
    with WeightCopyCounter(model.parameters()) as counter:
        patched = gradients(model)
    assert patched.keys() == stock.keys() == {n for n, _ in model.named_parameters()}
    for parameter, grad in stock.items():
        torch.testing.assert_close(patched[parameter], grad, rtol=1e-5, atol=1e-7)
    # The backward does not copy a weight either (it multiplies by the views' transposes).
    assert counter.copies == []


def test_status_lists_the_patches_and_deactivate_restores_stock() -> None:
    originals = {patch.target: patch.owner.__dict__[patch.attribute] for patch in FIXED}
    patched = safelens_tl.activate().to_dict()["patched"]
    for patch in FIXED:
        assert patch.target in patched
        assert patch.owner.__dict__[patch.attribute] is not originals[patch.target]
    safelens_tl.deactivate()
    for patch in FIXED:
        assert patch.owner.__dict__[patch.attribute] is originals[patch.target]
    _, copies = forward_copies(build("llama-like-gqa", torch.float32), tokens())
    assert copies  # stock again


def test_no_weight_is_kept_twice() -> None:
    """Nothing is cached: a patched model holds the same tensors as a stock one."""
    safelens_tl.activate()
    model = build("llama-like-gqa", torch.float32)
    before = {t.data_ptr() for t in model.state_dict().values()}
    forward_copies(model, tokens())
    assert {t.data_ptr() for t in model.state_dict().values()} == before
    assert all(
        not isinstance(value, torch.Tensor)
        for module in model.modules()
        for value in vars(module).values()
    )


def test_the_probe_tells_a_copying_projection_from_the_replacement() -> None:
    from transformer_lens.utilities import attention

    assert hooked_weight_copies.copies_weight(attention.simple_attn_linear)  # stock
    assert not hooked_weight_copies.copies_weight(hooked_weight_copies.simple_attn_linear)


def test_other_rearrangements_pass_through_the_attention_module_s_einops() -> None:
    """Only ``W_O``'s output-projection pattern on a contiguous tensor becomes a view."""
    import einops

    proxy = hooked_weight_copies.EinopsWithoutOutputCopy(einops)
    weight = torch.randn(4, 16, 64)
    view = proxy.rearrange(weight, hooked_weight_copies.OUTPUT_PATTERN).contiguous()
    assert type(view) is torch.Tensor and view.data_ptr() == weight.data_ptr()
    assert torch.equal(view, einops.rearrange(weight, hooked_weight_copies.OUTPUT_PATTERN))
    transposed = weight.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous
    copied = proxy.rearrange(transposed, hooked_weight_copies.OUTPUT_PATTERN)
    assert torch.equal(copied, view) and type(copied) is torch.Tensor
    other = proxy.rearrange(weight, "a b c -> c b a")
    assert torch.equal(other, weight.permute(2, 1, 0)) and type(other) is torch.Tensor
    assert proxy.reduce is einops.reduce
