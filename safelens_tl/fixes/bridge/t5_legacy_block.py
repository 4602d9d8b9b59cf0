"""T5-family blocks of TransformerLens 3.x's TransformerBridge under transformers 5.

TransformerLens 3.x's ``T5BlockBridge`` replaces each Hugging Face block's ``forward`` with its own
(to fire the block's hooks), written for transformers 4: it takes the cache as
``past_key_value`` (a tuple of legacy key-value pairs) and hands it on only to sublayers whose
``forward`` shows a ``past_key_value`` parameter. transformers 5 passes one ``Cache`` object to
the block as ``past_key_values`` (``cache`` from 5.24) and its sublayers take it under that name,
so with any transformers 5:

- the cache never reached the attention sublayers: every step of a cached ``hf_generate``
  attended to itself alone, and LongT5 silently generated other tokens than without the cache;
- from transformers 5.15, whose ``T5Block.forward`` returns exactly ``(hidden states,
  self-attention position bias, cross-attention position bias)``, T5 and mT5 raised ``ValueError:
  too many values to unpack (expected 3)`` in every decoder forward, cached or not
  (``TransformerBridge.generate`` and ``hf_generate`` alike): the replaced forward still returns
  transformers 4's five-item layout with the attention weights. LongT5's stack still reads that
  layout and is left with it.

TransformerLens 4.x's block takes ``past_key_values`` and hands it on
(:mod:`safelens_tl.fixes.bridge.t5_block` then only renames), so none of this applies there.

What is patched, each acting only where transformers 5's sublayers no longer show
``past_key_value``:

- ``T5BlockBridge.forward``: the cache the stack passes (``cache`` or ``past_key_values``) is held
  for the sublayers of this block forward, and the result is returned in the layout of Hugging
  Face's own block (:func:`in_hugging_face_layout`);
- the ``forward`` of the attention sublayer classes a block meets with a cache
  (``T5LayerSelfAttention``, ``T5LayerCrossAttention``, and mT5's and LongT5's own): a call
  that passes no cache gets the one held for its block, under the name the sublayer takes.
  Installed at the first such block forward (:func:`safelens_tl.activation.install_found`),
  listed by ``status()`` and removed by ``deactivate()``. Outside a block forward (a sublayer
  called directly) nothing changes.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.fixes.bridge import t5_block as bridge_t5_block
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen, wrapping

#: What TransformerLens 3.x's block forward takes, and transformers 4's sublayers took.
LEGACY_NAME = "past_key_value"
#: The names transformers 5 passes a block its cache under (5.24 on, before 5.24).
CACHE_NAMES = (bridge_cache.NEW_NAME, bridge_cache.SHIM_OLD_NAME)
#: Marks a sublayer ``forward`` wrapped by :func:`taking_the_block_cache`.
MARK = "_safelens_takes_the_block_cache"
#: The parameter Hugging Face's block forward had while it returned attention weights too.
OPTIONAL_ATTENTIONS = "output_attentions"

#: The cache of the block forward running now, for its sublayers; ``None`` outside one.
_block_cache: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "safelens_t5_block_cache", default=None
)


#: Per sublayer ``forward``: the name it takes a transformers 5 cache under (signatures are read
#: once, not at every decoding step).
_cache_names: dict[Any, str | None] = {}
#: Per Hugging Face block ``forward``: whether it returns attention weights on request.
_optional_attentions: dict[Any, bool] = {}


def cache_name_taken(forward: Any) -> str | None:
    """The name under which a transformers 5 sublayer ``forward`` takes the cache; ``None`` for
    one that shows ``past_key_value`` (transformers 4, which TransformerLens 3.x serves) or no
    cache at all."""
    if forward in _cache_names:
        return _cache_names[forward]
    parameters = bridge_cache.parameter_names(forward)
    name = None
    if LEGACY_NAME not in parameters:
        name = next((n for n in CACHE_NAMES if n in parameters), None)
    _cache_names[forward] = name
    return name


def taking_the_block_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a sublayer class's ``forward``: called with no cache inside a block forward that was
    given one, it gets that cache under the name it takes."""
    name = cache_name_taken(original)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = _block_cache.get()
        given = any(kwargs.get(n) is not None for n in CACHE_NAMES)
        if held is not None and name is not None and not given:
            kwargs[name] = held
        return original(self, *args, **kwargs)

    setattr(forward, MARK, True)
    return forward


def takes_a_cache(forward: Any) -> bool:
    """Whether a sublayer ``forward`` takes a transformers 5 cache (:func:`cache_name_taken`)."""
    return cache_name_taken(forward) is not None


def sublayer_patches(block: Any) -> list[Patch]:
    """Patches for the sublayer classes of ``block`` that take a transformers 5 cache."""
    return bridge_t5_block.sublayers_patches(block, MARK, takes_a_cache, taking_the_block_cache)


def builds_a_legacy_forward(block_bridge: type) -> bool:
    """Whether ``T5BlockBridge`` builds the block forward of TransformerLens 3.x, which takes the
    cache as ``past_key_value`` (read from its code, as
    :func:`safelens_tl.fixes.bridge.t5_block.hands_sublayers_the_cache` reads 4.x's)."""
    return LEGACY_NAME in bridge_t5_block.built_forward_names(block_bridge)


def drops_the_cache(block: Any) -> bool:
    """Whether ``block`` (Hugging Face's T5-family block under TransformerLens 3.x) has sublayers
    that take a transformers 5 cache, which TransformerLens 3.x's block forward never hands them."""
    layers = list(getattr(block, "layer", ()))
    return bool(layers) and cache_name_taken(type(layers[0]).forward) is not None


def in_hugging_face_layout(block: Any, output: Any) -> Any:
    """``output`` of TransformerLens 3.x's block forward, in the layout of Hugging Face's own.

    TransformerLens returns ``(hidden states,)`` followed by what each attention sublayer returns
    after its output: ``(position bias, attention weights)`` for self-attention, and the same for
    cross-attention where it ran. A Hugging Face block without ``output_attentions``
    (transformers 5.15 on, LongT5 aside) returns ``(hidden states, self-attention position bias,
    cross-attention position bias or None)``. Any other shape is returned unchanged.
    """
    hugging_face_forward = type(block).forward
    optional = _optional_attentions.get(hugging_face_forward)
    if optional is None:
        optional = OPTIONAL_ATTENTIONS in bridge_cache.parameter_names(hugging_face_forward)
        _optional_attentions[hugging_face_forward] = optional
    if optional:
        return output
    if not isinstance(output, tuple) or len(output) not in (3, 5):
        return output
    cross_bias = output[3] if len(output) == 5 else None
    return (output[0], output[1], cross_bias)


def handing_sublayers_the_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap TransformerLens 3.x's ``T5BlockBridge.forward``: under transformers 5, its block's
    sublayers get the cache the stack passed, and the stack gets the layout it reads."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        block = getattr(self, "original_component", None)
        if block is None or not drops_the_cache(block):
            return original(self, *args, **kwargs)
        cache = next((kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None), None)
        if cache is not None:
            patches = sublayer_patches(block)
            if patches:
                from safelens_tl import activation  # at call time: activation loads this module

                activation.install_found(patches)
        token = _block_cache.set(cache)
        try:
            output = original(self, *args, **kwargs)
        finally:
            _block_cache.reset(token)
        return in_hugging_face_layout(block, output)

    return forward


def _applies(context: Context) -> tuple[bool, str]:
    t5_block = context.bridge.t5_block_class
    if t5_block is None or not builds_a_legacy_forward(t5_block):
        return False, "this release's T5 block forward is not transformers 4's"
    return True, "the T5 block forward never hands on a transformers 5 cache"


# Whatever transformers 5 calls the cache, this block forward never hands it on.
_patches = wrapping(
    lambda context: context.bridge.t5_block_class,
    "forward",
    handing_sublayers_the_cache,
    "transformers compatibility",
    "its T5-family decoders may ignore the cache, or fail, with transformers 5",
)


FIX = Fix(
    id="bridge_t5_legacy_block",
    symptom="T5 and mT5 through TransformerLens 3.x's TransformerBridge with transformers 5: "
    "the cache never reaches the attention, or an error",
    affects=frozen({"transformer-lens": ">=3.0,<4", "transformers": ">=5"}),
    remedy="the block hands its sublayers the cache under transformers 5's name",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_t5_legacy_block.py",
    changes=("cache", "forward"),
    when_imported=(targets.BRIDGE_MODULE,),
)
