"""The built-in TransformerBridge fixes (TransformerLens 3.x/4.x), registered like any plugin.

``transformer_lens.model_bridge`` is imported lazily by TransformerLens (about 2 s), so the
patches are :class:`~safelens_tl.patching.DeferredPatches`: built and installed when that module
is first imported, not at ``import transformer_lens``. Which fixes there are is in the registry
(:data:`safelens_tl.fixes.BRIDGE_FIXES`); each decides by what the installed code has
(feature detection), never by version numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from safelens_tl import registry, targets
from safelens_tl.fixes import BRIDGE_FIXES
from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask
from safelens_tl.fixes.bridge import stateful_generate as bridge_stateful_generate
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import DeferredPatches, Patch
from safelens_tl.plugins import Failure
from safelens_tl.targets import Layout

SOURCE = "safelens_tl.builtin_plugins.bridge"
#: What each reader patch applies to the method it replaces.
_Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@hookimpl
def safelens_tl_patches(layout: Layout) -> list[DeferredPatches]:
    """One batch of deferred patches per module whose import triggers a TransformerBridge fix
    (``transformer_lens.model_bridge``; Hugging Face's CodeGen), when TransformerBridge exists."""
    if not targets.has_bridge():
        return []
    modules = dict.fromkeys(module for fix in BRIDGE_FIXES for module in fix.when_imported)
    return [
        DeferredPatches(module, functools.partial(patches_for, layout, module))
        for module in modules
    ]


def patches_for(layout: Layout, module: str) -> Iterator[Patch | Failure]:
    """Build the patches of the fixes ``module``'s import triggers, once it is imported.

    Yields a :class:`~safelens_tl.plugins.Failure` (reported, not raised) for what cannot be
    fixed here.
    """
    yield from registry.build(BRIDGE_FIXES, registry.Context(layout, module, SOURCE))


def hf_generate_wrappers(hf_generate: Callable[..., Any]) -> list[_Wrapper]:
    """What wraps this release's ``TransformerBridge.hf_generate``, outermost first: a
    state-space model's ``generate`` options always, the attention mask of a batch of prompts
    where the release drops it (TransformerLens 3.0-3.8). The registry composes the same, from
    :mod:`safelens_tl.fixes.bridge.stateful_generate` and
    :mod:`safelens_tl.fixes.bridge.hf_generate_mask`."""
    wrappers: list[_Wrapper] = [bridge_stateful_generate.honouring_generate_options]
    if bridge_hf_generate_mask.drops_the_attention_mask(hf_generate):
        wrappers.append(bridge_hf_generate_mask.passing_the_attention_mask)
    return wrappers
