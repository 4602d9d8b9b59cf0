"""A padding-only 4-D attention mask keeps TransformerBridge's causal mask
(:mod:`safelens_tl.fixes.bridge.attention_mask`).

OpenAI GPT hands its layers ``[batch, 1, 1, keys]`` masks; TransformerBridge took every 4-D mask
for a full causal one, so a forward with an ``attention_mask`` attended to later positions. A real
bridge on a tiny random checkpoint, against Hugging Face's own forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.bridge import attention_mask as bridge_attention_mask
from safelens_tl.verify import bridge, checks, runner
from tests.conftest import architecture_folder, requires_bridge

ARCHITECTURE = "OpenAIGPTLMHeadModel"


def _masked_forward_error(folder: Any) -> float:
    """Largest error, relative to the largest logit, of the bridge's forward with an attention
    mask (two left-padded prompts) against Hugging Face's, over the real positions."""
    model = bridge.boot_folder(folder, torch.float32)
    reference = bridge.reference_from(folder, torch.float32)
    tokens = model.to_tokens(list(checks.PROMPTS[:2]), padding_side="left")
    mask, positions = bridge.mask_and_positions(model, tokens)
    with torch.no_grad():
        own = model(tokens, attention_mask=mask, position_ids=positions, return_type="logits")
        expected = reference(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    return float((own[real] - expected[real]).abs().max() / expected[real].abs().max())


@requires_bridge
def test_openai_gpt_generates_right_and_its_masked_forward_is_hugging_face_s(
    patched: safelens_tl.activation.Status,
) -> None:
    """Cached and uncached generation agree, both with Hugging Face, and so does a forward with
    an attention mask."""
    folder = architecture_folder(ARCHITECTURE)
    for run in bridge.run_folder(folder, torch.float32):
        assert torch.equal(run.cached_tokens, run.uncached_tokens), run
        assert run.max_rel_err <= runner.tolerance_for(torch.float32), run
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[torch.float32], run
    assert _masked_forward_error(folder) <= 1e-5


@requires_bridge
def test_stock_openai_gpt_attends_ahead_with_a_mask() -> None:
    """What the patch removes: stock's masked forward is far from Hugging Face's."""
    folder = architecture_folder(ARCHITECTURE)
    safelens_tl.deactivate()
    try:
        assert _masked_forward_error(folder) > 1e-3
    finally:
        safelens_tl.activate()


class _Recorder:
    """Stands in for an attention bridge; the wrapped method records what reaches it."""

    def __init__(self, is_causal: bool | None, is_cross_attention: bool = False) -> None:
        if is_causal is not None:
            self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        self.calls: list[Any] = []


def _original(
    self: _Recorder, attn_scores: Any, attention_mask: Any, seq_len: int, *rest: Any
) -> Any:
    self.calls.append(None if attention_mask is None else tuple(attention_mask.shape))
    return attn_scores


@pytest.mark.parametrize(
    ("mask_shape", "queries", "is_causal", "cross", "calls"),
    [
        ((2, 1, 1, 5), 5, True, False, [None, (2, 1, 1, 5)]),  # padding rows: causal first
        ((2, 1, 5, 5), 5, True, False, [(2, 1, 5, 5)]),  # a full mask says it all
        ((2, 5), 5, True, False, [(2, 5)]),  # 2-D: the bridge adds its causal mask itself
        ((2, 1, 1, 5), 1, True, False, [(2, 1, 1, 5)]),  # one query: nothing ahead to hide
        ((2, 1, 1, 5), 5, False, False, [(2, 1, 1, 5)]),  # encoder
        ((2, 1, 1, 5), 5, True, True, [(2, 1, 1, 5)]),  # cross-attention
        ((2, 1, 1, 5), 5, None, False, [(2, 1, 1, 5)]),  # TransformerLens 3.0: does not say
    ],
)
def test_only_a_padding_row_mask_in_causal_self_attention_adds_the_causal_mask(
    mask_shape: tuple[int, ...],
    queries: int,
    is_causal: bool | None,
    cross: bool,
    calls: list[Any],
) -> None:
    attention = _Recorder(is_causal, cross)
    wrapped = bridge_attention_mask.keeping_the_causal_mask(_original)
    scores = torch.zeros(2, 1, queries, 5)
    assert wrapped(attention, scores, torch.zeros(mask_shape), 5, queries) is scores
    assert attention.calls == calls
