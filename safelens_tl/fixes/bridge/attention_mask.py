"""A padding mask of one row per sequence keeps the causal mask of reconstructed attention.

TransformerBridge's attention bridges that rebuild attention themselves mask the scores in
``AttentionBridge._apply_reconstruct_attention_mask``. It takes any 4-D mask to be Hugging Face's
full causal mask (``[batch, 1, queries, keys]``) and then applies no causal mask of its own. Some
Hugging Face models hand their layers a 4-D mask that only marks padding, one row broadcast over
every query (``[batch, 1, 1, keys]``): OpenAI GPT builds that from any ``attention_mask`` and
keeps causality inside its own attention. Through the bridge such a forward let every position
attend to later ones: OpenAI GPT's logits with an ``attention_mask`` (a batch of prompts,
TransformerBridge's uncached ``generate``, a replay for comparison) were off by about 1e-2
relative to Hugging Face's, while a forward without a mask and each cached step (one query) were
right.

Here such a mask, met with more than one query in a causal self-attention bridge, is applied on
top of the bridge's own causal mask: the scores pass through the original method without a mask
(which applies the causal one), then with it (which adds it). Full-size 4-D masks, masks of
other ranks, single-query steps, and bridges that are not causal (encoders, cross-attention, and
TransformerLens 3.0's bridges, which do not say) are masked exactly as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes.bridge._reconstructed_mask import applies, wrapping_the_mask
from safelens_tl.registry import Fix, frozen


def is_padding_row_mask(attention_mask: Any, queries: int) -> bool:
    """Whether ``attention_mask`` is 4-D with a single query row, met with several queries."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.ndim >= 4
        and attention_mask.shape[-2] == 1
        and queries > 1
    )


def keeping_the_causal_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``AttentionBridge._apply_reconstruct_attention_mask`` so that a padding-row mask is
    added on top of the causal mask (see the module docstring)."""

    @functools.wraps(original)
    def _apply_reconstruct_attention_mask(
        self: Any,
        attn_scores: torch.Tensor,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        q_seq_len: int | None = None,
    ) -> torch.Tensor:
        queries = seq_len if q_seq_len is None else q_seq_len
        # The mask's shape first: it rules out nearly every call at once.
        if (
            is_padding_row_mask(attention_mask, queries)
            and getattr(self, "is_causal", False) is True
            and not getattr(self, "is_cross_attention", False)
        ):
            attn_scores = original(self, attn_scores, None, seq_len, q_seq_len)
        result: torch.Tensor = original(self, attn_scores, attention_mask, seq_len, q_seq_len)
        return result

    return _apply_reconstruct_attention_mask


_patches = wrapping_the_mask(
    keeping_the_causal_mask,
    "a forward with an attention_mask may attend to later positions in models whose mask "
    "marks only padding (OpenAI GPT)",
)


FIX = Fix(
    id="bridge_attention_mask",
    symptom="OpenAI GPT through TransformerBridge: a forward with an attention_mask attends to "
    "later positions",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="a padding-row mask keeps the causal mask",
    applies=applies,
    patches=_patches,
    test_module="tests/test_bridge_attention_mask.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
