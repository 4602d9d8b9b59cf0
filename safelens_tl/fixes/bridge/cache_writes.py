"""Attention bridges that compute attention without ever writing the KV cache.

TransformerLens 3.x's ALiBi attention bridges (Falcon with ALiBi, such as Falcon-RW, and MPT)
rebuild attention in their own ``_reconstruct_attention`` from the keys and values of the current
forward only: they never call ``_update_kv_cache``. Every cached generation step then attends
to its own position alone, and cached generation silently differs from uncached (relative errors
of order 1 on the tiny checkpoints), in stock as with any transformers. TransformerLens 4.x calls
``_update_kv_cache`` right after splitting the heads. (On 3.0 the write finds no cache for
Falcon, which passes it as ``layer_past``: there the fix changes nothing yet.)

The same is done here without copying either method: the patched ``_reconstruct_attention``
holds its keyword arguments (where the cache arrives) in a context variable while the original
runs, and the head split, ``_reshape_qkv_to_heads``, passes the split keys and values through
``_update_kv_cache`` when, and only when, such a reconstruction called it. A reconstruction whose
code calls ``_update_kv_cache`` itself is left alone (:func:`skips_the_cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.registry import Context, Fix, Wrap, frozen

#: Keyword arguments of the reconstruction now running, until its head split has used them.
_pending_arguments: ContextVar[dict[str, Any] | None] = ContextVar(
    "safelens_tl_pending_cache_arguments", default=None
)


#: Keyword arguments under which a reconstruction that keeps its own cache reads it (Baichuan's
#: bridge reads a legacy ``past_key_value`` tuple and builds the next one itself).
_CACHE_ARGUMENTS = (*bridge_cache.OLD_NAMES, bridge_cache.NEW_NAME, "past_key_value")


def skips_the_cache(reconstruct: Callable[..., Any] | None) -> bool:
    """Whether ``reconstruct`` (an ``_reconstruct_attention``; ``None`` when a class defines
    none) splits heads but never touches the KV cache: its code names ``_reshape_qkv_to_heads``
    but neither ``_update_kv_cache`` nor any cache argument."""
    code = getattr(reconstruct, "__code__", None)
    names: tuple[str, ...] = getattr(code, "co_names", ())
    constants: tuple[Any, ...] = getattr(code, "co_consts", ())
    if "_reshape_qkv_to_heads" not in names or "_update_kv_cache" in names:
        return False
    return not any(argument in constants for argument in _CACHE_ARGUMENTS)


def writing_the_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_reconstruct_attention`` whose head split also writes the KV cache."""

    @functools.wraps(original)
    def _reconstruct_attention(self: Any, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        token = _pending_arguments.set(kwargs)
        try:
            return original(self, q, k, v, **kwargs)
        finally:
            _pending_arguments.reset(token)

    return _reconstruct_attention


def splitting_into_the_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_reshape_qkv_to_heads`` that, inside a reconstruction patched by
    :func:`writing_the_cache`, appends the split keys and values to the cache and returns the
    whole cached keys and values, as ``_update_kv_cache`` does for the other bridges."""

    @functools.wraps(original)
    def _reshape_qkv_to_heads(self: Any, *args: Any, **kwargs: Any) -> Any:
        q, k, v, batch_size, seq_len, head_dim = original(self, *args, **kwargs)
        pending = _pending_arguments.get()
        if pending is not None:
            _pending_arguments.set(None)  # one write per reconstruction
            k, v = self._update_kv_cache(k, v, **pending)
        return q, k, v, batch_size, seq_len, head_dim

    return _reshape_qkv_to_heads


def _skipping(context: Context) -> list[type]:
    return [
        owner
        for owner in context.bridge.reconstructing_attention_classes
        if skips_the_cache(owner.__dict__.get("_reconstruct_attention"))
    ]


def _applies(context: Context) -> tuple[bool, str]:
    skipping = _skipping(context)
    if not skipping:
        return False, "every reconstructing attention bridge writes the cache"
    return True, f"{', '.join(owner.__qualname__ for owner in skipping)} never write the cache"


def _patches(context: Context) -> list[Wrap]:
    skipping = _skipping(context)
    consequence = "its cached generation attends to the current position alone"
    wraps = [
        Wrap(owner, "_reconstruct_attention", writing_the_cache, "KV cache", consequence)
        for owner in skipping
    ]
    names = ", ".join(owner.__qualname__ for owner in skipping)
    wraps.append(
        Wrap(
            context.bridge.attention_class,
            "_reshape_qkv_to_heads",
            splitting_into_the_cache,
            "KV cache",
            f"{names}: {consequence}",
        )
    )
    return wraps


FIX = Fix(
    id="bridge_cache_writes",
    symptom="Falcon (ALiBi) and MPT cached TransformerBridge generation attends to the current "
    "position alone",
    affects=frozen({"transformer-lens": ">=3.0,<4"}),
    remedy="the cache is written at the head split, as TransformerLens 4.x does",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_cache_writes.py",
    changes=("cache", "forward"),
    when_imported=(targets.BRIDGE_MODULE,),
)
