"""An image (or sound) at every step of TransformerBridge's uncached ``generate``.

``TransformerBridge.generate(..., pixel_values=..., use_past_kv_cache=False)`` (TransformerLens
3.x and 4.x) hands the image, and any other model input given by keyword (``image_grid_thw``,
``input_features``, ``mm_token_type_ids``, ...), to the first step only: its docstring's reason
is that later steps read the image from the cache. Without the cache every later step runs the
whole sequence again, image placeholders included, and the model then sees placeholders with no
image behind them: from the second generated token on, the tokens are those of another prompt
(Llava, Qwen2-Audio, ...; silently). Encoder-decoders such as Florence-2, which the loop runs
without a cache, get them at no step at all: the tokens are the same whatever the image. Hugging
Face's own uncached ``generate`` passes them at every step.

While such a ``generate`` runs, the bridge's call into the model (:mod:`bridge_model_call`)
gives every uncached step the media inputs ``generate`` was given, as Hugging Face's
``generate`` does: the inputs that hold one column per token of the prompt are extended by one
column per generated token the way Hugging Face extends them (``mm_token_type_ids`` with zeros,
text; ``token_type_ids`` with its last column). Cached steps are left as they are: they read the
image from the cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes.bridge import _positions as bridge_positions
from safelens_tl.registry import Fix, frozen, wrapping

#: Inputs with one column per token, and how Hugging Face's ``generate`` extends them by one
#: generated token: ``True`` with zeros (a text token), ``False`` with the last column.
PER_TOKEN_INPUTS: dict[str, bool] = {
    "mm_token_type_ids": True,
    "moe_mm_token_type_ids": True,
    "token_type_ids": False,
}
#: The names under which a call into the model may carry a KV cache.
CACHE_ARGUMENTS = ("past_key_values", "cache", "past_key_value", "cache_params")
#: Given to ``generate`` by keyword but handled by its loop at every step.
LOOP_OWN_INPUTS = frozenset({"attention_mask", "position_ids"})


@dataclass
class _Media:
    """The media inputs of one running ``generate``, and the length of its first call's input
    (the prompt's; ``None`` until that call)."""

    values: dict[str, Any]
    prompt_length: int | None = None


_running: ContextVar[_Media | None] = ContextVar("safelens_tl_uncached_media", default=None)


def not_media(generate: Callable[..., Any]) -> frozenset[str]:
    """The keywords of ``generate`` that are not model inputs: its parameters but
    ``pixel_values``, and those its loop passes at every step itself."""
    parameters = inspect.signature(generate).parameters
    return (frozenset(parameters) - {"pixel_values"}) | LOOP_OWN_INPUTS


def media_names(ignored: frozenset[str], kwargs: dict[str, Any]) -> frozenset[str]:
    """The model inputs ``generate`` got in ``kwargs``: ``pixel_values`` and whatever it has no
    parameter for (it passes those on to the model), when not ``None``; ``ignored`` is
    :func:`not_media` of ``generate``."""
    return frozenset(
        name for name, value in kwargs.items() if value is not None and name not in ignored
    )


def passing_media_at_every_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.generate``: while it runs with media inputs, uncached steps get
    them too (:func:`restore_media`)."""
    ignored = not_media(original)

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = media_names(ignored, kwargs)
        if not names:
            return original(self, *args, **kwargs)
        with _media_of_this_generate({name: kwargs[name] for name in names}):
            return original(self, *args, **kwargs)

    return generate


@contextlib.contextmanager
def _media_of_this_generate(values: dict[str, Any]) -> Iterator[None]:
    token = _running.set(_Media(values))
    try:
        yield
    finally:
        _running.reset(token)


def _is_cached(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS)


def _extended(name: str, value: Any, new_tokens: int) -> Any:
    """``value`` of a per-token input, one column longer for each of ``new_tokens``."""
    if new_tokens <= 0 or name not in PER_TOKEN_INPUTS or not isinstance(value, torch.Tensor):
        return value
    if PER_TOKEN_INPUTS[name]:
        added = value.new_zeros((value.shape[0], new_tokens, *value.shape[2:]))
    else:
        added = value[:, -1:].expand(-1, new_tokens, *value.shape[2:])
    return torch.cat([value, added], dim=1)


def restore_media(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """In a call into the model while a ``generate`` with media inputs runs: give a call
    without a cache those it lacks, the per-token ones extended by the tokens its input has
    beyond the first call's (the call's own ``kwargs`` are changed)."""
    media = _running.get()
    if media is None:
        return
    given = bridge_positions.model_input(args, kwargs)
    length = None if given is None else int(given.shape[1])
    if media.prompt_length is None:
        media.prompt_length = length
    if _is_cached(kwargs):
        return
    new_tokens = (
        0 if length is None or media.prompt_length is None else length - media.prompt_length
    )
    for name, value in media.values.items():
        if kwargs.get(name) is None:
            kwargs[name] = _extended(name, value, new_tokens)


_patches = wrapping(
    lambda context: context.bridge.bridge_class,
    "generate",
    passing_media_at_every_step,
    "generate options",
    "an uncached generate from an image or a sound sees it at its first step only",
)


FIX = Fix(
    id="bridge_uncached_media",
    symptom="an uncached TransformerBridge.generate from an image or a sound sees it at its "
    "first step only",
    affects=frozen({"transformer-lens": ">=3.0,<5"}),
    remedy="the media are passed at every uncached step",
    applies=lambda context: (True, "TransformerBridge.generate passes media once"),
    patches=_patches,
    test_module="tests/test_bridge_uncached_media.py",
    changes=("generate", "forward"),
    requires=("bridge_model_call",),
    when_imported=(targets.BRIDGE_MODULE,),
)
