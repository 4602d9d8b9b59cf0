"""Rotary attention bridges keep queries and keys in the model's dtype (float16, bfloat16).

TransformerBridge's rotary attention (``PositionEmbeddingsAttentionBridge``, TransformerLens 3.x
and 4.x) rebuilds Hugging Face's attention step by step and rotates queries and keys with Llama's
``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``. Llama's rotary module hands out
``cos``/``sin`` in the model's dtype, so that stays in it. OLMo, OLMo 2, OLMo 3 and FlexOlmo hand
them out in float32 and rotate with their own function, which casts the result back to the
query's dtype; Llama's does not. Through the bridge a float16 or bfloat16 OLMo therefore got
float32 queries and keys next to half-precision values, and its first forward failed with
``RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16`` (with
or without a cache). Had it gone on, the KV cache would have held float32 keys.

The attention bridge's ``forward`` here receives ``cos``/``sin`` in the dtype of its hidden
states when they arrive wider, as Llama's rotary module would hand them: one rounding of each
to the model's dtype, then the rotation in it. Hugging Face's OLMo rotates in float32 and rounds
once at the end, so the two differ by about a unit in the last place of the dtype (measured in
``docs/how-it-works.md``); ``hook_cos``/``hook_sin`` see the values in the model's dtype. Bridges
configured for TransformerLens's adjacent-pair rotations (GLM, ERNIE, Cohere), which rotate in
float32 and cast back themselves, are left as they are, as is everything in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.registry import Context, Fix, frozen, wrapping

#: The keyword Hugging Face's decoder layers pass ``(cos, sin)`` under.
EMBEDDINGS_ARGUMENT = "position_embeddings"
#: Bridge config flags selecting TransformerLens's own rotations, which cast back by themselves.
SELF_CASTING_ROTATIONS = ("rotary_interleaved_cos_sin", "rotary_adjacent_pairs")


def narrowed_embeddings(
    embeddings: Any, hidden_states: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` cast to the dtype of ``hidden_states`` where they are floating tensors of a
    wider dtype than it; ``None`` when nothing needs to change."""
    if not (isinstance(embeddings, tuple) and len(embeddings) == 2):
        return None
    cos, sin = embeddings
    if not (
        isinstance(hidden_states, torch.Tensor)
        and isinstance(cos, torch.Tensor)
        and isinstance(sin, torch.Tensor)
        and hidden_states.is_floating_point()
        and cos.is_floating_point()
        and cos.dtype != hidden_states.dtype
    ):
        return None
    if torch.finfo(cos.dtype).bits <= torch.finfo(hidden_states.dtype).bits:
        return None  # as wide as the hidden states or narrower: the rotation widens nothing
    return cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)


def rotating_in_model_dtype(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a rotary attention bridge's ``forward`` so that wider ``cos``/``sin`` arrive in the
    dtype of the hidden states (see the module docstring)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        embeddings = kwargs.get(EMBEDDINGS_ARGUMENT)
        if embeddings is not None:
            config = getattr(self, "config", None)
            if not any(getattr(config, flag, False) for flag in SELF_CASTING_ROTATIONS):
                hidden_states = args[0] if args else kwargs.get("hidden_states")
                narrowed = narrowed_embeddings(embeddings, hidden_states)
                if narrowed is not None:
                    kwargs[EMBEDDINGS_ARGUMENT] = narrowed
        return original(self, *args, **kwargs)

    return forward


def _applies(context: Context) -> tuple[bool, str]:
    if context.bridge.rotary_attention_class is None:
        return False, "this release has no rotary attention bridge"
    return True, "the rotary attention bridge rotates with Llama's function"


_patches = wrapping(
    lambda context: context.bridge.rotary_attention_class,
    "forward",
    rotating_in_model_dtype,
    "rotary attention",
    "float16 and bfloat16 OLMo models may fail with a dtype mismatch in attention",
)


FIX = Fix(
    id="bridge_rotary_dtype",
    symptom="OLMo-family models in float16/bfloat16 through TransformerBridge fail with a dtype "
    "mismatch, or keep a float32 KV cache",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="rotary queries and keys stay in the model's dtype",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_rotary_dtype.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
