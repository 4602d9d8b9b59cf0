"""An additive attention mask cast to narrower scores saturates instead of becoming -inf.

TransformerBridge's attention bridges that rebuild attention themselves add the mask to the
scores in ``AttentionBridge._apply_reconstruct_attention_mask``, after casting a floating mask
to the scores' dtype. Under ``torch.autocast`` the scores are float16 or bfloat16 while Hugging
Face built the mask in the model's float32, with ``torch.finfo(torch.float32).min`` at every
masked position; that value is beyond both half dtypes' range, so the cast makes it -inf. A query
that sees no key at all (the leading pads of a left-padded row) then has only -inf scores, its
softmax is NaN, and the NaN reaches every position of that row from the next layer on (a masked
key's weight is 0, and 0 x NaN is NaN). With 71 of the 108 architectures of
``benchmarks/bridge_architectures.py`` on TransformerLens 4.3, every padded row of a batch came
out as NaN logits under autocast, cached and uncached, and ``generate`` picked token 0 for it;
Hugging Face's own model, which adds the float32 mask to the half-precision scores in float32,
is not affected.

Here a floating mask wider than the scores is clamped to the scores' lowest finite value before
that cast: a fully masked query attends evenly to its keys, as in Hugging Face's own forward, and
nothing else changes (values that fit are cast as before). A mask already in the scores' dtype
(no autocast: every float32, float16 and bfloat16 model) is passed through untouched, and so is
compatibility mode's where the release's compatibility mode marks masked positions with -inf on
purpose and zeroes fully masked rows after its softmax (3.9 on). TransformerLens 3.0's
compatibility mode masks as the default mode does, and is saturated like it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes.bridge._reconstructed_mask import applies, wrapping_the_mask
from safelens_tl.registry import Fix, frozen


def saturated(attention_mask: Any, scores_dtype: torch.dtype) -> Any:
    """``attention_mask`` clamped to ``scores_dtype``'s lowest finite value when it is a floating
    tensor of a dtype that reaches lower; anything else unchanged (the same object)."""
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dtype == scores_dtype
        or not attention_mask.is_floating_point()
        or not scores_dtype.is_floating_point
    ):
        return attention_mask
    floor = torch.finfo(scores_dtype).min
    if torch.finfo(attention_mask.dtype).min >= floor:
        return attention_mask
    return attention_mask.clamp(min=floor)


def saturating_the_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``AttentionBridge._apply_reconstruct_attention_mask`` so that a float32 mask added
    to half-precision scores saturates (see the module docstring)."""
    # Whether the release's own method treats compatibility mode apart (its -inf masking):
    # read from the names its code looks up, which needs no source file.
    code = getattr(inspect.unwrap(original), "__code__", None)
    compatibility_apart = code is None or "compatibility_mode" in code.co_names

    @functools.wraps(original)
    def _apply_reconstruct_attention_mask(
        self: Any,
        attn_scores: torch.Tensor,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        q_seq_len: int | None = None,
    ) -> torch.Tensor:
        if not (compatibility_apart and getattr(self, "compatibility_mode", False)):
            attention_mask = saturated(attention_mask, attn_scores.dtype)
        result: torch.Tensor = original(self, attn_scores, attention_mask, seq_len, q_seq_len)
        return result

    return _apply_reconstruct_attention_mask


_patches = wrapping_the_mask(
    saturating_the_mask,
    "padded rows may come out as NaN under autocast",
)


FIX = Fix(
    id="bridge_mask_dtype",
    symptom="under torch.autocast every left-padded row of a TransformerBridge batch generates "
    "from NaN logits",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="a float32 mask saturates at the scores' dtype's minimum instead of becoming -inf",
    applies=applies,
    patches=_patches,
    test_module="tests/test_bridge_mask_dtype.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
