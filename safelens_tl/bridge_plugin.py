"""The built-in TransformerBridge fix (TransformerLens 3.x/4.x), registered like any plugin.

``transformer_lens.model_bridge`` is imported lazily by TransformerLens (about 2 s), so the
patches are :class:`~safelens_tl.patching.DeferredPatches`: built and installed when that module
is first imported, not at ``import transformer_lens``. Every patch is chosen by what the installed
code has (feature detection), never by version numbers: see :mod:`safelens_tl.bridge_cache` and
:mod:`safelens_tl.bridge_conversion`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from safelens_tl import bridge_cache, bridge_conversion, targets
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import DeferredPatches, Patch
from safelens_tl.plugins import Failure
from safelens_tl.targets import Layout

SOURCE = "safelens_tl.bridge_plugin"
#: What each reader patch applies to the method it replaces.
_Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@hookimpl
def safelens_tl_patches(layout: Layout) -> list[DeferredPatches]:
    """TransformerBridge's cache argument, ``cfg`` sync and rotary precision, when it exists."""
    if not targets.has_bridge():
        return []
    return [DeferredPatches(targets.BRIDGE_MODULE, bridge_patches)]


def bridge_patches() -> Iterator[Patch | Failure]:
    """Build the patches once ``transformer_lens.model_bridge`` is imported.

    Yields a :class:`~safelens_tl.plugins.Failure` (reported, not raised) for what cannot be
    fixed here.
    """
    bridge = targets.locate_bridge()
    for name in ("to", "_apply"):
        method = getattr(bridge.bridge_class, name)
        yield Patch(bridge.bridge_class, name, bridge_conversion.converting(method))
    if bridge_cache.attention_cache_argument() != bridge_cache.NEW_NAME:
        return  # transformers passes past_key_values, which TransformerLens reads: nothing to fix
    readers: list[tuple[type, str, _Wrapper]] = [
        (bridge.attention_class, "_update_kv_cache", bridge_cache.reading_update_kv_cache)
    ]
    readers += [(c, "forward", bridge_cache.reading_forward) for c in bridge.forward_cache_readers]
    for owner, cached_path in bridge.state_cache_readers:
        if callable(getattr(owner, cached_path, None)):
            reader = functools.partial(bridge_cache.reading_state_forward, cached_path=cached_path)
            readers.append((owner, "forward", reader))
        else:
            yield Failure(
                SOURCE,
                "transformers compatibility",
                f"{owner.__module__}.{owner.__qualname__} has no {cached_path}; it cannot be "
                f"taught the `cache` argument of this transformers, so its cached generation "
                f"may start every step from an empty state",
            )
    for owner, name, wrap in readers:
        method = owner.__dict__.get(name)
        if callable(method):
            yield Patch(owner, name, wrap(method))
        else:
            yield Failure(
                SOURCE,
                "transformers compatibility",
                f"{owner.__module__}.{owner.__qualname__} defines no {name}; it cannot be taught "
                f"the `cache` argument of this transformers, so its cached generation may ignore "
                f"the cache",
            )
    yield from _model_call_patches(bridge)


def _model_call_patches(bridge: targets.BridgeLayout) -> Iterator[Patch | Failure]:
    """How the bridge hands the cache to the model, and reads it back, once the shim is gone."""
    if bridge.driver_class is not None:
        driver = bridge.driver_class
        yield Patch(
            driver, "forward", bridge_cache.renaming_driver_forward(driver.__dict__["forward"])
        )
    else:
        model = targets.optional_class(targets.REFERENCE_MODEL)
        if model is not None and not bridge_cache.accepts_past_key_values(model):
            yield Failure(
                SOURCE,
                "transformers compatibility",
                f"the installed transformers no longer accepts `past_key_values` "
                f"({targets.REFERENCE_MODEL}.forward takes `cache` and has no deprecation shim), "
                "and this TransformerLens release's TransformerBridge passes the cache under "
                "that name: cached TransformerBridge.generate would ignore its cache. Use "
                "TransformerLens 4.x, or transformers<5.40",
            )
    output = targets.optional_class(targets.MODEL_OUTPUT_CLASS)
    if output is not None and not hasattr(output, bridge_cache.SHIM_OLD_NAME):
        yield Patch(output, bridge_cache.SHIM_OLD_NAME, bridge_cache.output_alias())
