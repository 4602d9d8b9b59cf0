"""Positions of a cached step of a multimodal-rotary model driven without ``position_ids``.

Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V and the other models of transformers 5 whose
rotary positions follow an image's grid ("M-RoPE") compute them in ``compute_3d_position_ids``
when the caller gives none. After a prompt with an image, a cached step's positions are the
running count of the attention mask plus the image's offset; that count is taken over the whole
mask, one position per column, and never cut to the step's own tokens. Hugging Face's
``generate`` passes ``position_ids`` itself and never reaches that branch; TransformerBridge's
``generate`` loop passes the whole mask and no positions, so a step of one token got positions
for every column of the mask: its query and key were broadcast to the mask's length, the cache
took all of those keys, and the next step raised ``RuntimeError: The size of tensor a (19) must
match the size of tensor b (10)`` (stock and with safelens-tl, with transformers 5.9 to 5.25 at
least, whenever the prompt's ``mm_token_type_ids`` came with the image, as their processors
return it).

The first time the bridge calls such a model, the class that defines ``compute_3d_position_ids``
gets a wrapper that keeps the last positions, one per token of the step, when it is given more
(as a patch that ``deactivate()`` removes). Positions of the right length are left as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from safelens_tl.patching import Patch

METHOD = "compute_3d_position_ids"
SOURCE = "safelens_tl.builtin_plugins.bridge"
#: Set on the wrapper, so that a class already fitted is recognised without a lock.
_FITTED = "__safelens_tl_step_positions__"
#: For each class of model met, the classes defining :data:`METHOD` for it and for its inner
#: ``model`` (where Hugging Face's composites keep it): found once, since this runs at every step.
_owners: dict[type, tuple[type, ...]] = {}


def _defining_classes(model: Any) -> tuple[type, ...]:
    known = _owners.get(type(model))
    if known is None:
        found = []
        for candidate in (model, getattr(model, "model", None)):
            if candidate is None:
                continue
            owner = next((k for k in type(candidate).__mro__ if METHOD in k.__dict__), None)
            if owner is not None and owner not in found:
                found.append(owner)
        known = _owners[type(model)] = tuple(found)
    return known


def keeping_the_step_s_positions(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``compute_3d_position_ids``: positions longer than the step's ``inputs_embeds`` are
    cut to their last ones, one per token of the step."""
    try:
        embeds_index = list(inspect.signature(original).parameters).index("inputs_embeds")
    except ValueError:
        embeds_index = -1

    @functools.wraps(original)
    def compute_3d_position_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        positions = original(self, *args, **kwargs)
        embeds = kwargs.get("inputs_embeds")
        # The index counts self, which args does not hold.
        if embeds is None and 0 < embeds_index <= len(args):
            embeds = args[embeds_index - 1]
        if not (isinstance(positions, torch.Tensor) and isinstance(embeds, torch.Tensor)):
            return positions
        step = embeds.shape[1]
        return positions[..., -step:] if positions.shape[-1] > step else positions

    setattr(compute_3d_position_ids, _FITTED, True)
    return compute_3d_position_ids


def step_position_patches(model: Any) -> list[Patch]:
    """Patches for the classes of ``model`` and of its inner ``model`` that define
    ``compute_3d_position_ids`` and are not fitted yet."""
    patches = []
    for owner in _defining_classes(model):
        method = owner.__dict__[METHOD]
        if not getattr(method, _FITTED, False):
            patches.append(Patch(owner, METHOD, keeping_the_step_s_positions(method), SOURCE))
    return patches


def fit_step_positions(model: Any) -> None:
    """Install :func:`step_position_patches` of ``model``, if any (while safelens-tl is
    active)."""
    patches = step_position_patches(model)
    if patches:
        from safelens_tl import activation  # at call time: activation loads this module

        activation.install_found(patches)
