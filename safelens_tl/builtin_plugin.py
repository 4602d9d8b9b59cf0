"""The built-in fix, registered like any third-party plugin through the ``safelens_tl`` group."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import (
    generate_reserve,
    hooked_alibi,
    hooked_generate_mask,
    hooked_generate_ones_mask,
    hooked_moe_dtype,
    hooked_weight_copies,
    hooked_zeros_mask,
    kv_cache,
    targets,
)
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import Patch
from safelens_tl.targets import Layout


def _labelling_init_cache(original: classmethod[Any, Any, Any]) -> classmethod[Any, Any, Any]:
    """Wrap the cache's ``init_cache`` so each entry knows its layer (for error messages)."""
    function = original.__func__

    @functools.wraps(function)
    def init_cache(cls: type, *args: Any, **kwargs: Any) -> Any:
        cache = function(cls, *args, **kwargs)
        kv_cache.label_layers(cache)
        return cache

    return classmethod(init_cache)


@hookimpl
def safelens_tl_patches(layout: Layout) -> list[Patch]:
    """Patch the entry's ``init_cache_entry``/``append``, the cache's mask and ``init_cache``,
    ``HookedTransformer.generate``/``generate_stream`` (cache reserved at its final length), the
    step mask of ``generate``'s ``get_residual``/``forward`` calls (2.13-3.0.0: built from the
    prompts as 3.1 builds it, so that a padded batch is masked and learned positions are kept
    where the pad token id is 0, and its mask of zeros computed once per ``generate``; 3.1-3.9:
    left out of ``forward`` where it is all ones), and the construction of ALiBi attention and
    mixture-of-experts layers, where the release has them.
    """
    entry, cache = layout.entry_class, layout.cache_class
    patches = [
        Patch(entry, "init_cache_entry", classmethod(kv_cache.init_cache_entry)),
        Patch(entry, "append", kv_cache.append),
        Patch(entry, "__getstate__", kv_cache.getstate),
    ]
    if callable(cache.__dict__.get("append_attention_mask")):
        patches.append(Patch(cache, "append_attention_mask", kv_cache.append_attention_mask))
    original_init_cache = cache.__dict__.get("init_cache")
    if isinstance(original_init_cache, classmethod):
        patches.append(Patch(cache, "init_cache", _labelling_init_cache(original_init_cache)))
    model = layout.model_class()
    if model is None:
        return patches
    unmasked = targets.hooked_generate_masks_no_padding(layout.release)
    passes_its_mask = targets.hooked_generate_passes_its_mask(layout.release)
    # Each sizes every layer's cache once, for prompt + max_new_tokens (no regrowth, no spare).
    # generate_stream exists from TL 3.9 on; its presence is checked, not the release.
    for name, wrap in (
        ("generate", generate_reserve.reserving_generate),
        ("generate_stream", generate_reserve.reserving_generate_stream),
    ):
        original = model.__dict__.get(name)
        if callable(original):
            replacement = wrap(original)
            if name == "generate" and unmasked:
                # Outermost: the reservation then sees the tokens a list was turned into.
                replacement = hooked_generate_mask.masking_generate(
                    hooked_zeros_mask.remembering_generate(replacement), original
                )
            elif name == "generate" and passes_its_mask:
                replacement = hooked_generate_ones_mask.marking_generate(replacement, original)
            patches.append(Patch(model, name, replacement))
    step_wrappers: tuple[tuple[str, Callable[..., Any]], ...] = ()
    if unmasked:
        step_wrappers = (
            ("get_residual", hooked_generate_mask.masked_step_residual),
            ("forward", hooked_generate_mask.masked_step_forward),
        )
    elif passes_its_mask:
        step_wrappers = (
            ("get_residual", hooked_generate_ones_mask.recording_residual),
            ("forward", hooked_generate_ones_mask.unmasked_forward),
        )
    for name, wrap_step in step_wrappers:
        original = model.__dict__.get(name)
        if callable(original):
            patches.append(Patch(model, name, wrap_step(original)))
    utils = targets.optional_module(targets.HOOKED_UTILS_MODULE) if unmasked else None
    original_mask = None if utils is None else utils.__dict__.get("get_attention_mask")
    if utils is not None and callable(original_mask):
        patches.append(
            Patch(utils, "get_attention_mask", hooked_zeros_mask.answering_zeros(original_mask))
        )
    patches.extend(_layer_patches())
    # Forwards that copy weight matrices at every call (TransformerLens 3.x; Q/K/V also 2.x).
    patches.extend(hooked_weight_copies.patches())
    return patches


def _layer_patches() -> list[Patch]:
    """HookedTransformer layers that half precision breaks outside the cache: ALiBi attention
    (bias sized to each forward) and mixture-of-experts (built in ``cfg.dtype``)."""
    patches = []
    for dotted, wrap in (
        (targets.HOOKED_ATTENTION_CLASS, hooked_alibi.fitting_alibi),
        (targets.HOOKED_MOE_CLASS, hooked_moe_dtype.in_model_dtype),
    ):
        owner = targets.optional_class(dotted)
        original = None if owner is None else owner.__dict__.get("__init__")
        if owner is not None and callable(original):
            patches.append(Patch(owner, "__init__", wrap(original)))
    return patches
