"""T5-family blocks through TransformerBridge where transformers passes the cache as ``cache``.

TransformerLens's ``T5BlockBridge`` (T5, mT5, LongT5) replaces each Hugging Face block's
``forward`` with its own, which fires the block's hooks. That forward takes the cache as
``past_key_values`` and hands it on to the block's attention sublayers only where their
``forward`` shows a ``past_key_values`` parameter. transformers 5.24 renamed it ``cache``, keeping
the old name through a deprecation shim that the signature does not show. So the stack's cache
reached the block under a name its forward ignores, and would not have been handed on anyway:
with the cache on (``hf_generate``, whose Hugging Face loop caches by default) every decoding step
attended to itself alone, and the tokens silently differed from uncached generation.
(``TransformerBridge.generate`` recomputes the decoder without a cache and was right.)

What is patched, each only once the renamed argument actually arrives:

- ``T5BlockBridge.forward``: a cache passed as ``cache`` reaches the block as ``past_key_values``;
- the ``forward`` of the attention sublayer classes of the blocks that meet such a cache
  (``T5LayerSelfAttention``, ``T5LayerCrossAttention``, and mT5's and LongT5's own): it shows a
  ``past_key_values`` parameter again and hands it on as ``cache``, as transformers 5.25 itself
  does for Pegasus, mBART and others (``deprecate_kwarg(..., expose_in_signature=True)``).
  Installed at the first such block forward (:func:`safelens_tl.activation.install_found`),
  listed by ``status()`` and removed by ``deactivate()``. While installed, a caller passing
  ``past_key_values`` to those sublayers directly gets no deprecation warning.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen, wrapping

SOURCE = "safelens_tl.builtin_plugins.bridge"
OLD_NAME = bridge_cache.SHIM_OLD_NAME
NEW_NAME = bridge_cache.NEW_NAME
#: Marks a sublayer ``forward`` that shows ``past_key_values`` (:func:`showing_the_old_name`).
MARK = "_safelens_shows_past_key_values"

#: Per sublayer ``forward`` function: whether it takes ``cache`` and hides ``past_key_values``.
_hides_old_name: dict[Any, bool] = {}


def hides_the_old_name(forward: Any) -> bool:
    """Whether ``forward`` takes ``cache`` and its signature shows no ``past_key_values``."""
    known = _hides_old_name.get(forward)
    if known is None:
        parameters = bridge_cache.parameter_names(forward)
        known = NEW_NAME in parameters and OLD_NAME not in parameters
        _hides_old_name[forward] = known
    return known


def showing_the_old_name(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a sublayer class's ``forward``: it takes ``past_key_values`` again, visibly, and hands
    it on as ``cache`` (where ``cache`` itself is not given)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
        if past_key_values is not None and kwargs.get(NEW_NAME) is None:
            kwargs[NEW_NAME] = past_key_values
        return original(self, *args, **kwargs)

    signature = inspect.signature(original)
    parameters = list(signature.parameters.values())
    shown = inspect.Parameter(OLD_NAME, inspect.Parameter.KEYWORD_ONLY, default=None)
    # **kwargs must stay last.
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    parameters.insert(at, shown)
    forward.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    setattr(forward, MARK, True)
    return forward


def _code_objects(code: Any) -> list[Any]:
    found = [code]
    for constant in code.co_consts:
        if inspect.iscode(constant):
            found += _code_objects(constant)
    return found


def built_forward_names(block_bridge: type) -> set[str]:
    """The local names of the block forward ``T5BlockBridge._patch_t5_block_forward`` builds
    (read from its code, not run); empty where there is no such builder."""
    builder = getattr(block_bridge, "_patch_t5_block_forward", None)
    code = getattr(builder, "__code__", None)
    if code is None:
        return set()
    return {name for nested in _code_objects(code)[1:] for name in nested.co_varnames}


def hands_sublayers_the_cache(block_bridge: type) -> bool:
    """Whether ``T5BlockBridge`` builds a block forward that takes ``past_key_values`` and hands
    it on (TransformerLens 4.x). TransformerLens 3.x's takes transformers 4's ``past_key_value``
    tuples and hands transformers 5's sublayers no cache with any transformers 5
    (:mod:`safelens_tl.fixes.bridge.t5_legacy_block`)."""
    return OLD_NAME in built_forward_names(block_bridge)


def sublayers_patches(
    block: Any, mark: str, needs: Callable[[Any], bool], wrapper: Callable[..., Any]
) -> list[Patch]:
    """Patches of the ``forward`` of ``block``'s sublayer classes that ``needs`` (given the
    ``forward``) says need ``wrapper``; a ``forward`` that carries ``mark`` is wrapped already.
    For this fix and :mod:`safelens_tl.fixes.bridge.t5_legacy_block`."""
    patches = []
    for layer in getattr(block, "layer", ()):
        owner = type(layer)
        forward = getattr(owner, "forward", None)
        if forward is None or getattr(forward, mark, False) or not needs(forward):
            continue
        patches.append(Patch(owner, "forward", wrapper(forward), plugin=SOURCE))
    return patches


def sublayer_patches(block: Any) -> list[Patch]:
    """Patches for the attention sublayer classes of ``block`` that hide ``past_key_values``."""
    return sublayers_patches(block, MARK, hides_the_old_name, showing_the_old_name)


def reading_block_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``T5BlockBridge.forward``: a cache passed as ``cache`` reaches the block as
    ``past_key_values``, and the block's attention sublayers are handed it
    (:func:`sublayer_patches`)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if bridge_cache.only_under_new_name(kwargs):
            kwargs[OLD_NAME] = kwargs.pop(NEW_NAME)
            patches = sublayer_patches(getattr(self, "original_component", None))
            if patches:
                from safelens_tl import activation  # at call time: activation loads this module

                activation.install_found(patches)
        return original(self, *args, **kwargs)

    return forward


def _applies(context: Context) -> tuple[bool, str]:
    if bridge_cache.attention_cache_argument() != bridge_cache.NEW_NAME:
        return False, "transformers passes past_key_values, which the T5 block reads"
    t5_block = context.bridge.t5_block_class
    if t5_block is None or not hands_sublayers_the_cache(t5_block):
        return False, "this release has no T5 block forward that hands on past_key_values"
    return True, "the T5 block forward ignores the cache passed as `cache`"


_patches = wrapping(
    lambda context: context.bridge.t5_block_class,
    "forward",
    reading_block_forward,
    "transformers compatibility",
    "it cannot be taught the `cache` argument of this transformers, so its cached "
    "generation may ignore the cache",
)


FIX = Fix(
    id="bridge_t5_block",
    symptom="T5, mT5 and LongT5 through TransformerBridge.hf_generate silently other tokens with "
    "the cache (transformers 5.24+)",
    affects=frozen({"transformer-lens": ">=4.0,<5", "transformers": ">=5.24"}),
    remedy="the block reads the cache under `cache` and hands it to its sublayers",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_t5_block.py",
    changes=("cache", "forward"),
    when_imported=(targets.BRIDGE_MODULE,),
)
