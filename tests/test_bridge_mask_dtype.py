"""A float32 attention mask added to half-precision scores saturates instead of becoming -inf
(:mod:`safelens_tl.fixes.bridge.mask_dtype`).

Under ``torch.autocast`` TransformerBridge's reconstructed attention cast Hugging Face's float32
mask to the scores' bfloat16, which turned every masked position into -inf: the leading pads of a
left-padded row had nothing to attend to, softmaxed to NaN, and the NaN filled that row's logits
from the next layer on. Real bridges of tiny random checkpoints, against Hugging Face's own
model under the same autocast.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.bridge import mask_dtype as bridge_mask_dtype
from safelens_tl.verify import bridge, checks
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

#: Three ways attention is rebuilt: rotary positions (Llama), a joint q/k/v projection (GPT-2),
#: soft-capped scores with sliding windows (Gemma 2).
ARCHITECTURES = ["LlamaForCausalLM", "GPT2LMHeadModel", "Gemma2ForCausalLM"]


def _runs_under_autocast(architecture: str, compatibility_mode: bool = False) -> list[Any]:
    """:func:`safelens_tl.verify.bridge.run_batches` of a float32 bridge under bfloat16
    autocast: cached generation against the bridge's uncached forward and Hugging Face's."""
    folder = str(architecture_folder(architecture))
    model = benchmark_module("bridge_architectures").boot(folder)
    if compatibility_mode:
        with contextlib.redirect_stdout(None):
            model.enable_compatibility_mode(disable_warnings=True)
    reference = bridge.reference_from(folder, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return bridge.run_batches(model, reference)


@requires_bridge
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_padded_batch_under_autocast_generates_what_hugging_face_computes(
    patched: safelens_tl.activation.Status, architecture: str
) -> None:
    """Every cached step's logits are finite, within bfloat16 rounding of the bridge's uncached
    forward and of Hugging Face's own forward under the same autocast, and cached and uncached
    generation pick the same tokens."""
    runs = _runs_under_autocast(architecture)
    assert [run.batch for run in runs] == [1, 2]
    for run in runs:
        assert run.max_rel_err <= checks.TOLERANCES[torch.bfloat16], run
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[torch.bfloat16], run
        assert torch.equal(run.cached_tokens, run.uncached_tokens), run


@requires_bridge
def test_compatibility_mode_under_autocast_stays_right(
    patched: safelens_tl.activation.Status,
) -> None:
    """Compatibility mode masks with -inf on purpose and zeroes fully masked rows itself: its
    mask is left alone, and its padded batch is right too."""
    for run in _runs_under_autocast("LlamaForCausalLM", compatibility_mode=True):
        assert run.max_rel_err <= checks.TOLERANCES[torch.bfloat16], run
        assert torch.equal(run.cached_tokens, run.uncached_tokens), run


@requires_bridge
def test_stock_fills_a_padded_row_with_nan_under_autocast() -> None:
    """What the patch removes: stock's cached logits of the padded batch are NaN."""
    safelens_tl.deactivate()
    try:
        padded = _runs_under_autocast("LlamaForCausalLM")[1]
    finally:
        safelens_tl.activate()
    assert padded.batch == 2
    assert not padded.max_rel_err <= 1.0  # NaN compares false with everything


def test_a_float32_mask_saturates_at_the_half_precision_floor() -> None:
    mask = torch.tensor([0.0, -1.0e3, torch.finfo(torch.float32).min])
    for half in (torch.bfloat16, torch.float16):
        cast = bridge_mask_dtype.saturated(mask, half).to(half)
        assert torch.isfinite(cast).all(), cast
        assert cast[-1] == torch.finfo(half).min
        assert cast[:2].tolist() == mask[:2].to(half).tolist()
    # What stock's cast does with the same mask.
    assert torch.isneginf(mask.to(torch.bfloat16)[-1])


@pytest.mark.parametrize(
    ("mask", "scores_dtype"),
    [
        (torch.zeros(2, dtype=torch.bfloat16), torch.bfloat16),  # no autocast: same dtype
        (torch.zeros(2, dtype=torch.float16), torch.bfloat16),  # already within bfloat16
        (torch.zeros(2, dtype=torch.float32), torch.float32),
        (torch.ones(2, dtype=torch.bool), torch.bfloat16),  # boolean masks are converted apart
        (None, torch.bfloat16),
    ],
    ids=["same-dtype", "float16-mask", "float32", "boolean", "none"],
)
def test_other_masks_pass_through_as_the_same_object(mask: Any, scores_dtype: torch.dtype) -> None:
    assert bridge_mask_dtype.saturated(mask, scores_dtype) is mask


class _Attention:
    """Stands in for an attention bridge; the wrapped method returns the mask it received."""

    def __init__(self, compatibility_mode: bool) -> None:
        self.compatibility_mode = compatibility_mode


def _original(
    self: _Attention, attn_scores: Any, attention_mask: Any, seq_len: int, *rest: Any
) -> Any:
    """As 3.9 and later: compatibility mode masks apart (with -inf)."""
    _ = self.compatibility_mode
    return attention_mask


def _original_without_compatibility_apart(
    self: _Attention, attn_scores: Any, attention_mask: Any, seq_len: int, *rest: Any
) -> Any:
    """As 3.0: compatibility mode masks as the default mode does."""
    return attention_mask


def test_compatibility_mode_s_mask_reaches_the_original_unchanged() -> None:
    wrapped = bridge_mask_dtype.saturating_the_mask(_original)
    scores = torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
    mask = torch.full((1, 1, 2, 2), torch.finfo(torch.float32).min)
    assert wrapped(_Attention(compatibility_mode=True), scores, mask, 2) is mask
    clamped = wrapped(_Attention(compatibility_mode=False), scores, mask, 2)
    assert float(clamped.min()) == torch.finfo(torch.bfloat16).min


def test_compatibility_mode_that_masks_as_the_default_mode_is_saturated_too() -> None:
    """A release whose compatibility mode masks as its default mode (3.0) gets the saturated
    mask in both modes: its fully masked rows would otherwise softmax to NaN."""
    wrapped = bridge_mask_dtype.saturating_the_mask(_original_without_compatibility_apart)
    scores = torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
    mask = torch.full((1, 1, 2, 2), torch.finfo(torch.float32).min)
    for compatibility_mode in (True, False):
        clamped = wrapped(_Attention(compatibility_mode), scores, mask, 2)
    assert float(clamped.min()) == torch.finfo(torch.bfloat16).min
