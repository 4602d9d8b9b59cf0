"""Cohere's rotary positions on a rotary attention bridge that does not know them.

Cohere and Cohere 2 rotate each query and key element with its neighbour (pairs (0, 1), (2, 3),
...), and their rotary module hands out ``cos``/``sin`` with each frequency repeated in place
(``[c0, c0, c1, c1, ...]``). TransformerLens 3.9's ``PositionEmbeddingsAttentionBridge``, which
rebuilds Hugging Face's attention step by step, knows two conventions: Llama's rotate-half (pairs
(i, i + d/2)), and GLM's adjacent pairs with ``cos``/``sin`` in Llama's layout
(``[c0, c1, ..., c0, c1, ...]``, ``cfg.rotary_adjacent_pairs``); it rotates Cohere's with
Llama's. Cohere's queries and keys are then rotated wrongly, and its logits are not Hugging
Face's (on the tiny checkpoint: 0.14 off where the largest is 0.46), cached or not, in stock as
before this fix. TransformerLens 4.x knows the convention (``cfg.rotary_interleaved_cos_sin``).

Where the bridge's ``forward`` names neither flag for Cohere's convention
(:func:`lacks_interleaved_rotary`) but knows GLM's, a call on a Cohere attention
(:func:`is_cohere_attention`) is turned into GLM's: ``cos``/``sin`` are handed over in Llama's
layout, which GLM's rotation expands back to Cohere's, value for value, and the bridge's config
says adjacent pairs. ``hook_cos``/``hook_sin`` of these bridges see the Llama layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.registry import Context, Fix, frozen, wrapping

#: TransformerLens 4.x's config flag for Cohere's convention, and the one for GLM's.
INTERLEAVED_FLAG, ADJACENT_PAIRS_FLAG = "rotary_interleaved_cos_sin", "rotary_adjacent_pairs"
#: The keyword Hugging Face's decoder layers pass ``(cos, sin)`` under.
EMBEDDINGS_ARGUMENT = "position_embeddings"
#: Hugging Face's modeling modules of the models with Cohere's convention.
COHERE_MODULES = ("transformers.models.cohere.", "transformers.models.cohere2.")


def names_in_code(function: Any) -> frozenset[str]:
    """The strings and global names a function's code uses (empty for what has no code)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return frozenset()
    return frozenset(c for c in code.co_consts if isinstance(c, str)) | frozenset(code.co_names)


def lacks_interleaved_rotary(forward: Any) -> bool:
    """Whether a rotary attention bridge's ``forward`` knows GLM's adjacent-pair rotation but not
    Cohere's (TransformerLens 3.9)."""
    names = names_in_code(forward)
    return ADJACENT_PAIRS_FLAG in names and INTERLEAVED_FLAG not in names


def is_cohere_attention(bridge: Any) -> bool:
    """Whether the Hugging Face attention behind ``bridge`` is Cohere's or Cohere 2's."""
    original = getattr(bridge, "original_component", None)
    return type(original).__module__.startswith(COHERE_MODULES)


def llama_layout(embeddings: Any) -> Any:
    """``(cos, sin)`` of Cohere's layout (each frequency twice in place) in Llama's (the
    frequencies, then the same again); anything else as it is."""
    if not (isinstance(embeddings, tuple) and len(embeddings) == 2):
        return embeddings
    cos, sin = embeddings
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return embeddings
    return tuple(torch.cat([half, half], dim=-1) for half in (cos[..., 0::2], sin[..., 0::2]))


def rotating_cohere_in_pairs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a rotary attention bridge's ``forward`` that lacks Cohere's rotation
    (:func:`lacks_interleaved_rotary`): on a Cohere attention it rotates as Hugging Face's."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        embeddings = kwargs.get(EMBEDDINGS_ARGUMENT)
        if embeddings is not None and is_cohere_attention(self):
            setattr(self.config, ADJACENT_PAIRS_FLAG, True)
            kwargs[EMBEDDINGS_ARGUMENT] = llama_layout(embeddings)
        return original(self, *args, **kwargs)

    return forward


def _applies(context: Context) -> tuple[bool, str]:
    rotary = context.bridge.rotary_attention_class
    if rotary is None:
        return False, "this release has no rotary attention bridge"
    if not lacks_interleaved_rotary(rotary.__dict__.get("forward")):
        return False, "the rotary attention bridge knows Cohere's rotation"
    return True, "the rotary attention bridge rotates Cohere's pairs as Llama's"


_patches = wrapping(
    lambda context: context.bridge.rotary_attention_class,
    "forward",
    rotating_cohere_in_pairs,
    "rotary attention",
    "Cohere's rotary positions may be applied as Llama's",
)


FIX = Fix(
    id="bridge_cohere_rotary",
    symptom="Cohere and Cohere 2 through TransformerBridge give silently other logits",
    affects=frozen({"transformer-lens": ">=3.9,<4"}),
    remedy="Cohere's queries and keys are rotated in neighbouring pairs, as Hugging Face does",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_cohere_rotary.py",
    changes=("forward",),
    when_imported=(targets.BRIDGE_MODULE,),
)
