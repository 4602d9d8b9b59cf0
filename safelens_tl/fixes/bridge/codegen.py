"""TransformerBridge's CodeGen attention under transformers 5.24+, and in half precision.

TransformerBridge's CodeGen attention (``CodeGenAttentionBridge``, TransformerLens 3.x and 4.x)
rebuilds Hugging Face's attention step by step from parts of Hugging Face's ``CodeGenAttention``:
the rotary table ``embed_positions`` and the score divisor ``scale_attn``. Two things went wrong:

- transformers 5.24 moved the table to one rotary module of the whole model, which hands each
  layer ``position_embeddings=(sin, cos)``, and replaced ``scale_attn`` (``sqrt(head_dim)``) by
  its inverse, ``scaling``. Every forward of a CodeGen model through the bridge raised
  ``AttributeError: 'CodeGenAttention' object has no attribute 'embed_positions'``, with or
  without a cache.
- The table is float32 in every dtype of the model, and the bridge kept the rotated queries and
  keys in float32 beside half-precision values. The KV cache then took float32 keys, promoted
  the values to float32, and the output projection failed: ``expected m1 and m2 to have the same
  dtype, but got: float != c10::BFloat16`` (float16 and bfloat16, transformers 5.23 and older).

Here the bridge's ``_reconstruct_attention`` receives queries and keys already rotated, with the
sines and cosines the model handed the layer (or, where it hands none, from the layer's own
table, as before), then cast to the dtype of the values, as Hugging Face's CodeGen does before
its cache; a call without positions rotates nothing, as before. Hugging Face's
``CodeGenAttention`` answers ``scale_attn`` with ``sqrt(head_dim)``, the value transformers 5.23
stored on each instance, where the instance holds none. The bridge's hooks (``hook_q``,
``hook_k``, ...) fire where they did and see what they saw; in float32 the result is the
bridge's own, to the bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets

# The keyword transformers passes a layer's rotary embeddings under; CodeGen's from 5.24 on.
from safelens_tl.fixes.bridge.rotary_dtype import EMBEDDINGS_ARGUMENT
from safelens_tl.patching import Patch
from safelens_tl.plugins import Failure
from safelens_tl.registry import Context, Fix, Wrap, frozen

#: The keyword the bridge looks positions up with; dropped once the rotation is done here.
POSITIONS_ARGUMENT = "position_ids"


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Each adjacent pair ``(a, b)`` of the last dimension becomes ``(-b, a)``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def rotate(
    x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, rotary_dim: int | None
) -> torch.Tensor:
    """``x`` (``[batch, seq, heads, head_dim]``) rotated by ``sin``/``cos`` (``[batch, seq,
    rotary_dim / 2]``) in its first ``rotary_dim`` features (all when ``None``), CodeGen's way:
    each half-size angle applies to one adjacent pair of features."""
    width = x.shape[-1] if rotary_dim is None else rotary_dim
    turning, passing = x[..., :width], x[..., width:]
    # One angle per pair of features, shared by every head.
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, dim=3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, dim=3)
    turned = turning * cos + _rotate_pairs(turning) * sin
    return torch.cat((turned, passing), dim=-1) if passing.shape[-1] else turned


def sines_and_cosines(
    attention: Any, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's ``(sin, cos)``: what the model handed it (transformers 5.24+), else its own
    table at the call's positions; ``None`` when the call says neither (nothing to rotate)."""
    embeddings = kwargs.get(EMBEDDINGS_ARGUMENT)
    if (
        isinstance(embeddings, tuple)
        and len(embeddings) == 2
        and all(isinstance(part, torch.Tensor) for part in embeddings)
    ):
        sin, cos = embeddings  # CodeGen's order, unlike Llama's (cos, sin)
        return sin, cos
    positions = kwargs.get(POSITIONS_ARGUMENT)
    table = getattr(getattr(attention, "original_component", None), "embed_positions", None)
    if not isinstance(positions, torch.Tensor) or not isinstance(table, torch.Tensor):
        return None
    sincos = table.to(positions.device)[positions]
    half = sincos.shape[-1] // 2
    return sincos[..., :half], sincos[..., half:]


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[batch, seq, heads * head_dim]`` as ``[batch, seq, heads, head_dim]`` (4-D stays)."""
    return x if x.ndim == 4 else x.reshape(*x.shape[:-1], -1, head_dim)


def rotating_with_model_embeddings(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``CodeGenAttentionBridge._reconstruct_attention`` so that it receives rotated
    queries and keys in the values' dtype (see the module docstring)."""

    @functools.wraps(original)
    def _reconstruct_attention(
        self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> Any:
        found = sines_and_cosines(self, kwargs)
        if found is None or q.ndim not in (3, 4):
            return original(self, q, k, v, **kwargs)
        sin, cos = found
        head_dim = q.shape[-1] if q.ndim == 4 else q.shape[-1] // self.config.n_heads
        rotary_dim = getattr(self.original_component, "rotary_dim", None)
        q_turned = rotate(_split_heads(q, head_dim), sin, cos, rotary_dim).to(v.dtype)
        k_turned = rotate(_split_heads(k, head_dim), sin, cos, rotary_dim).to(v.dtype)
        # Without positions the bridge rotates nothing: the rotation is done.
        rest = {
            key: value
            for key, value in kwargs.items()
            if key not in (EMBEDDINGS_ARGUMENT, POSITIONS_ARGUMENT)
        }
        return original(self, q_turned.reshape(q.shape), k_turned.reshape(k.shape), v, **rest)

    return _reconstruct_attention


class HeadSizeScale:
    """``scale_attn`` of Hugging Face's ``CodeGenAttention``: ``sqrt(head_dim)``, for instances
    that hold none (transformers 5.24+).

    A non-data descriptor: an instance's own ``scale_attn`` (transformers 5.23 and older sets one)
    comes first, so those are answered exactly as before.
    """

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        head_dim = getattr(instance, "head_dim", None)
        if not isinstance(head_dim, int):
            raise AttributeError(
                f"{type(instance).__name__!r} object has no attribute 'scale_attn'"
            )
        return math.sqrt(head_dim)


def _applies(context: Context) -> tuple[bool, str]:
    if context.module == targets.CODEGEN_MODULE:
        return True, "Hugging Face's CodeGen attention is imported"
    if context.bridge.codegen_attention_class is None:
        return False, "this release has no CodeGen attention bridge"
    return True, "the CodeGen attention bridge reads Hugging Face's rotary table"


def _patches(context: Context) -> list[Patch | Wrap | Failure]:
    if context.module == targets.CODEGEN_MODULE:
        attention = targets.optional_class(targets.CODEGEN_ATTENTION_CLASS)
        if attention is None:
            return [
                Failure(
                    context.source,
                    "CodeGen",
                    f"expected {targets.CODEGEN_ATTENTION_CLASS}; CodeGen models may fail "
                    "through TransformerBridge",
                )
            ]
        if "scale_attn" in attention.__dict__:
            return []
        return [Patch(attention, "scale_attn", HeadSizeScale())]
    owner = context.bridge.codegen_attention_class
    assert owner is not None  # _applies said so
    return [
        Wrap(
            owner,
            "_reconstruct_attention",
            rotating_with_model_embeddings,
            "CodeGen",
            "CodeGen models fail with transformers 5.24+, and in float16 and bfloat16",
        )
    ]


FIX = Fix(
    id="bridge_codegen",
    symptom="CodeGen through TransformerBridge raises AttributeError with transformers 5.24+, "
    "and a dtype mismatch in float16/bfloat16",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="the bridge rotates with the model's position embeddings; scale_attn is answered",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_codegen.py",
    changes=("forward",),
    # Importing Hugging Face's CodeGen costs about 0.3 s, paid only by those who load CodeGen.
    when_imported=(targets.BRIDGE_MODULE, targets.CODEGEN_MODULE),
)
