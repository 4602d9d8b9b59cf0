"""The KV cache entry of HookedTransformer (every release): dtype and device follow the keys,
shapes are checked, and a step is appended in place past 64 KiB per tensor.

The replacement methods are :mod:`safelens_tl.kv.entry`'s; this module is the record that installs
them on the release's entry and cache classes.
"""

from __future__ import annotations

from safelens_tl.kv.entry import (
    append,
    append_attention_mask,
    getstate,
    init_cache_entry,
    labelling_init_cache,
)
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen


def _patches(context: Context) -> list[Patch]:
    entry, cache = context.layout.entry_class, context.layout.cache_class
    patches = [
        Patch(entry, "init_cache_entry", classmethod(init_cache_entry)),
        Patch(entry, "append", append),
        Patch(entry, "__getstate__", getstate),
    ]
    if callable(cache.__dict__.get("append_attention_mask")):
        patches.append(Patch(cache, "append_attention_mask", append_attention_mask))
    original_init_cache = cache.__dict__.get("init_cache")
    if isinstance(original_init_cache, classmethod):
        patches.append(Patch(cache, "init_cache", labelling_init_cache(original_init_cache)))
    return patches


FIX = Fix(
    id="kv_cache",
    symptom="the KV cache starts as an empty float32 tensor on the config's device: dtype or "
    "device errors (TL 3.0.0 in float16/bfloat16), float32 caches under autocast, shape errors "
    "deep inside torch, and O(length) copies per generated token",
    affects=frozen({"transformer-lens": ">=2.0,<5"}),
    remedy="the cache entry follows the dtype and device of the keys it is given, checks shapes "
    "(a ValueError naming the layer) and appends in place past 64 KiB per tensor",
    applies=lambda context: (True, "every release's KV-cache entry"),
    patches=_patches,
    test_module="tests/test_kv_cache.py",
    changes=("cache",),
)
