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
