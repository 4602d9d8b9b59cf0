"""OLMo-Hybrid's generation cache where transformers no longer has the class TransformerLens asks.

TransformerBridge's own ``generate`` asks the architecture adapter for the cache of a model with a
recurrent state (``create_stateful_cache``). TransformerLens 3.9 and 4.3's OLMo-Hybrid adapter
imports ``OlmoHybridDynamicCache`` from Hugging Face's OLMo-Hybrid module for it; transformers 5.9
had that class, later releases (5.23 and 5.24 here) build the model's cache as
``DynamicCache(config=config)`` and have none, so every cached generation of an OLMo-Hybrid model
raised ``ImportError: cannot import name 'OlmoHybridDynamicCache'``. Where that import fails, the
adapter now returns the cache the model's own ``forward`` builds; where it succeeds, what it
returned before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.registry import Context, Fix, Wrap, frozen


def model_s_own_cache(hf_model: Any) -> Any:
    """The cache Hugging Face's hybrid models build for themselves from transformers 5.23 on:
    a ``DynamicCache`` laid out by the model's config (attention and linear-attention layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=hf_model.config)


def falling_back_to_the_model_s_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an adapter's ``create_stateful_cache`` so that a cache class missing from the
    installed transformers gives :func:`model_s_own_cache` instead of an ``ImportError``."""

    @functools.wraps(original)
    def create_stateful_cache(self: Any, hf_model: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, hf_model, *args, **kwargs)
        except ImportError:
            return model_s_own_cache(hf_model)

    return create_stateful_cache


def _applies(context: Context) -> tuple[bool, str]:
    if not context.bridge.stateful_cache_adapters:
        return False, "no adapter of this release creates a stateful cache"
    return True, "an adapter imports its cache class from transformers"


def _patches(context: Context) -> list[Wrap]:
    return [
        Wrap(
            adapter,
            "create_stateful_cache",
            falling_back_to_the_model_s_cache,
            "transformers compatibility",
            "its cached generation may fail on a cache class this transformers lacks",
        )
        for adapter in context.bridge.stateful_cache_adapters
    ]


FIX = Fix(
    id="bridge_hybrid_cache",
    symptom="OLMo-Hybrid's cached TransformerBridge.generate raises ImportError "
    "(OlmoHybridDynamicCache) with transformers 5.23+",
    affects=frozen({"transformer-lens": ">=3.9,<5", "transformers": ">=5.23"}),
    remedy="the adapter falls back to the cache the model builds",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_hybrid_cache.py",
    changes=("cache",),
    when_imported=(targets.BRIDGE_MODULE,),
)
