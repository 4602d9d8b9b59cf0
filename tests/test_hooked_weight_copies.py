"""HookedTransformer forwards copy no weight (``safelens_tl.fixes.hooked.weight_copies``).

Real tiny HookedTransformer models (GPT-2-like: standard MLP, learned positions; Llama-like:
grouped-query attention, gated MLP, rotary), run through TransformerLens's own ``forward``,
``generate`` and ``backward``. The copies are counted below autograd by a ``TorchDispatchMode``
that records every copying ATen operation reading a tensor that shares storage with a parameter.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.hooked import weight_copies as hooked_weight_copies
from safelens_tl.fixes.hooked.weight_copies import WeightCopyCounter
from safelens_tl.verify import models
from tests import differential
from tests.conftest import (
    HAS_HOOKED_TRANSFORMER,
    generate_recording,
    requires_hooked_transformer,
    stock_with_positions,
)

# The patches the fix found on stock TransformerLens at its first activation (worked out once per
# process): patches() itself, asked once the start-up hook has patched, would find nothing.
FIXED = list(hooked_weight_copies._found()) if HAS_HOOKED_TRANSFORMER else []
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


@pytest.mark.parametrize("name", MODELS)
def test_patched_forward_copies_no_weight_and_gives_stock_s_logits(name: str) -> None:
    stock_logits, stock_copies = forward_copies(build(name, torch.float32), tokens())
    safelens_tl.activate()
    logits, copies = forward_copies(build(name, torch.float32), tokens())
    assert copies == []
    assert stock_copies
    # Four or more rows per product: the same kernel whatever the weight's layout.
    assert torch.equal(logits, stock_logits)


@pytest.mark.parametrize("name", MODELS)
def test_half_precision_on_the_cpu_runs_the_release_s_code(name: str) -> None:
    """bfloat16 products that read a weight in place are slower on the CPU than stock's copy
    and product (benchmarks/forward_in_place.py): stock's copies, stock's logits."""
    stock_logits, stock_copies = forward_copies(build(name, torch.bfloat16), tokens())
    safelens_tl.activate()
    logits, copies = forward_copies(build(name, torch.bfloat16), tokens())
    assert stock_copies and copies == stock_copies
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
def test_a_forward_that_autograd_records_is_stock_s(name: str) -> None:
    """Gradients and backward memory stay stock's: a forward autograd records runs the
    release's code, copies and all."""

    def gradients(model: Any) -> tuple[dict[str, torch.Tensor], list[Any]]:
        with WeightCopyCounter(model.parameters()) as counter:
            logits = model(tokens())
            (logits.float().square().mean()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return grads, counter.copies

    stock, stock_copies = gradients(build(name, torch.float32))
    safelens_tl.activate()
    model = build(name, torch.float32)
    patched, copies = gradients(model)
    assert patched.keys() == stock.keys() == {n for n, _ in model.named_parameters()}
    for parameter, grad in stock.items():
        assert torch.equal(patched[parameter], grad), parameter
    assert stock_copies and copies == stock_copies


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

    original = inspect.unwrap(attention.simple_attn_linear)
    assert hooked_weight_copies.copies_weight(original)  # stock
    replacement = hooked_weight_copies.projection_reading_in_place(original)
    assert not hooked_weight_copies.copies_weight(replacement)


@pytest.mark.parametrize("d_model", [64, 512])
def test_the_projection_never_holds_more_memory_than_stock_s(d_model: int) -> None:
    """Up to ``min(256, d_model)`` rows the projection is read in place, which then holds its
    result twice against stock's result and weight copy; above, it is stock's."""
    from transformer_lens.utilities import attention

    original = inspect.unwrap(attention.simple_attn_linear)
    replacement = hooked_weight_copies.projection_reading_in_place(original)
    heads = d_model // 16
    weight, bias = torch.randn(heads, d_model, 16), torch.randn(heads, 16)
    limit = min(hooked_weight_copies.PROJECTION_MAX_ROWS, d_model)
    taken = 0
    for rows in (1, 4, limit - 1, limit, limit + 1, 2 * limit, 1000):
        given = torch.randn(1, rows, d_model)
        with torch.no_grad():
            stock = functools.partial(original, given, weight, bias)
            expected, stock_peak = differential.peak_bytes(stock)
            ours = functools.partial(replacement, given, weight, bias)
            result, peak = differential.peak_bytes(ours)
            with WeightCopyCounter([weight, bias]) as counter:
                replacement(given, weight, bias)
        assert peak <= stock_peak, (rows, peak, stock_peak)
        assert (counter.copies == []) == (rows <= limit), rows
        taken += rows <= limit
        if rows >= 4:
            assert torch.equal(result, expected), rows
    assert taken == 4


def test_the_output_projection_view_is_made_only_from_plain_tensors() -> None:
    """Only ``W_O``'s output-projection pattern on a plain contiguous tensor becomes a view; any
    other call is einops' own."""
    import einops

    module = hooked_weight_copies.einops_without_output_copy(einops)
    rearrange = module.rearrange
    weight = torch.randn(4, 16, 64)
    with torch.no_grad():
        view = rearrange(weight, hooked_weight_copies.OUTPUT_PATTERN).contiguous()
    assert type(view) is torch.Tensor and view.data_ptr() == weight.data_ptr()
    assert torch.equal(view, einops.rearrange(weight, hooked_weight_copies.OUTPUT_PATTERN))
    transposed = weight.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous
    with torch.no_grad():
        copied = rearrange(transposed, hooked_weight_copies.OUTPUT_PATTERN)
        half = rearrange(weight.bfloat16(), hooked_weight_copies.OUTPUT_PATTERN).contiguous()
    assert torch.equal(copied, view) and type(copied) is torch.Tensor
    assert half.data_ptr() != weight.data_ptr() and type(half) is torch.Tensor
    recorded = torch.nn.Parameter(weight.clone())  # autograd records: einops' own
    assert rearrange(recorded, hooked_weight_copies.OUTPUT_PATTERN).contiguous().is_contiguous()
    other = rearrange(weight, "a b c -> c b a")
    assert torch.equal(other, weight.permute(2, 1, 0)) and type(other) is torch.Tensor
    assert module.reduce is einops.reduce and module.repeat is einops.repeat
