"""``HookedTransformer.generate`` leaves its all-ones attention mask out of ``forward`` where
nothing is padded (TransformerLens 3.1 to 3.9: :mod:`safelens_tl.fixes.hooked.generate_ones_mask`),
and users see exactly what stock gives them: tokens, logits and every hook's activations, bitwise.
Real models, the real ``generate``; stock runs the same call in the same process."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.verify import checks
from tests.conftest import (
    LAYOUT,
    RELEASE,
    fixes_patching,
    generate_recording,
    requires_hooked_transformer,
    tiny_model,
    weights_read_in_place,
)

pytestmark = requires_hooked_transformer

passes_its_mask = pytest.mark.skipif(
    not targets.hooked_generate_passes_its_mask(RELEASE),
    reason=f"TransformerLens {RELEASE}'s generate passes no all-ones mask to forward",
)
NEW = 6


@pytest.fixture
def stock_then_patched() -> Iterator[None]:
    safelens_tl.deactivate()
    try:
        yield
    finally:
        safelens_tl.activate()


@passes_its_mask
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like-gqa"])
def test_tokens_logits_and_every_activation_are_stock_s_bitwise(
    name: str, dtype: torch.dtype, cached: bool, stock_then_patched: None
) -> None:
    """One prompt and prompts of one length: the same tokens, step logits and activations of
    every hook point (rotary queries and keys, attention scores and pattern included)."""
    model = tiny_model(name, dtype)
    for prompt in (checks.PROMPTS[1], ["the cat runs", "the dog runs"]):
        options = {"use_past_kv_cache": cached, "return_type": "tokens", "output_logits": True}
        # The mask is what is compared: stock reads the weights as safelens-tl does.
        with weights_read_in_place():
            stock, stock_seen = generate_recording(model, prompt, NEW, **options)
        safelens_tl.activate()
        ours, ours_seen = generate_recording(model, prompt, NEW, **options)
        safelens_tl.deactivate()
        assert torch.equal(ours.sequences, stock.sequences)
        assert all(torch.equal(a, b) for a, b in zip(ours.logits, stock.logits, strict=True))
        assert [name for name, _ in ours_seen] == [name for name, _ in stock_seen]
        different = [
            hook
            for (hook, a), (_, b) in zip(ours_seen, stock_seen, strict=True)
            if not torch.equal(a, b)
        ]
        assert not different, different[:5]


def _masks_reaching_attention(
    model: Any, prompt: Any, monkeypatch: pytest.MonkeyPatch
) -> list[bool]:
    """For each attention layer's causal masking during ``generate``: whether a padding mask
    came with it."""
    attention_class = type(model.blocks[0].attn)
    apply = attention_class.apply_causal_mask
    masked: list[bool] = []

    def spy(self: Any, scores: Any, offset: int = 0, attention_mask: Any = None) -> Any:
        masked.append(attention_mask is not None)
        return apply(self, scores, offset, attention_mask)

    monkeypatch.setattr(attention_class, "apply_causal_mask", spy)
    model.generate(prompt, max_new_tokens=3, do_sample=False, verbose=False)
    return masked


@passes_its_mask
def test_the_mask_is_left_out_only_where_it_is_all_ones(
    patched: safelens_tl.activation.Status, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("llama-like-gqa", torch.float32)
    assert not any(_masks_reaching_attention(model, checks.PROMPTS[1], monkeypatch))
    padded = _masks_reaching_attention(model, list(checks.PROMPTS), monkeypatch)
    assert padded and all(padded)


@passes_its_mask
def test_a_forward_call_with_its_own_mask_inside_generate_keeps_it(
    patched: safelens_tl.activation.Status,
) -> None:
    """Only ``generate``'s own mask object is left out: a hook that runs ``forward`` from a
    residual with a mask of its own (here one that hides the first position) gets it applied."""
    model = tiny_model("llama-like-gqa", torch.float32)
    tokens = model.to_tokens(checks.PROMPTS[1])
    residual, _ = model.get_residual(model.embed(tokens), 0)
    own_mask = torch.ones_like(tokens)
    own_mask[0, 0] = 0
    with torch.inference_mode():
        expected = model(residual, start_at_layer=0, attention_mask=own_mask)
        unmasked = model(residual, start_at_layer=0)
    assert not torch.equal(expected, unmasked)
    inside: list[torch.Tensor] = []
    running: list[bool] = []

    def run_forward(activation: torch.Tensor, hook: Any) -> None:
        if not running:  # once, and not from the forward it runs itself
            running.append(True)
            inside.append(model(residual, start_at_layer=0, attention_mask=own_mask))

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", run_forward)]):
        model.generate(checks.PROMPTS[0], max_new_tokens=2, do_sample=False, verbose=False)
    assert torch.equal(inside[0], expected)


def test_the_wrappers_are_installed_exactly_on_those_releases(
    patched: safelens_tl.activation.Status,
) -> None:
    model_class = LAYOUT.model_class()
    assert model_class is not None
    expected = targets.hooked_generate_passes_its_mask(RELEASE)
    assert ("hooked_generate_ones_mask" in fixes_patching(model_class, "generate")) == expected
    # get_residual and forward are wrapped on the model, only while its generate runs.
    for name in ("get_residual", "forward"):
        assert fixes_patching(model_class, name) == (), name
    source = inspect.getsource(inspect.unwrap(model_class.__dict__["generate"]))
    assert ("attention_mask=attention_mask," in source.split("self.forward(")[-1]) == expected


@pytest.mark.parametrize(
    ("release", "passes"),
    [
        ("3.0.0", False),
        ("3.1.0", True),
        ("3.9.0", True),
        ("3.10.2", True),
        ("4.3.0", False),
        ("2.18.0", False),
        ("main", False),
    ],
)
def test_the_releases_whose_generate_passes_its_mask(release: str, passes: bool) -> None:
    assert targets.hooked_generate_passes_its_mask(release) == passes
