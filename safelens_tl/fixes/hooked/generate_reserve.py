"""``HookedTransformer.generate`` (and ``generate_stream``) planning the KV cache's final length.

``generate`` knows how many positions it may add (``max_new_tokens``), so each layer's buffer can
end exactly at its final length instead of growing by 25% with up to 25% spare; it grows towards
that length in bounded steps, since a generation may stop early (see
:func:`safelens_tl.kv.storage.reserve_ahead`). The prompt length is not computed here: strings
would have to be tokenized exactly as ``generate`` does (BOS, padding side, overridden defaults).
:func:`safelens_tl.kv.storage.reserve_ahead` instead adds the new tokens to whatever the first
write of each layer holds, which is the prompt.

The wrapper changes nothing else: same arguments, same result, same errors; when the arguments
cannot be read (an unknown signature, a cache turned off, odd values) it calls the original as is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator, Iterator
from typing import Any

from safelens_tl.kv import storage as kv_storage
from safelens_tl.registry import Context, Fix, Wrap, frozen


def positions_ahead(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | None:
    """Positions the cache gains after the prompt, or ``None`` when nothing should be reserved.

    ``args`` include ``self``. The last sampled token is never fed back through the model, so a
    generation of ``max_new_tokens`` tokens caches the prompt plus ``max_new_tokens - 1``.
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # the original raises its own error
    arguments = bound.arguments

    def argument(name: str) -> Any:
        if name in arguments:
            return arguments[name]
        parameter = signature.parameters.get(name)
        if parameter is None:
            return inspect.Parameter.empty
        return parameter.default

    return _ahead(argument("use_past_kv_cache"), argument("max_new_tokens"))


def _ahead(use_past_kv_cache: Any, max_new_tokens: Any) -> int | None:
    if use_past_kv_cache is not True:
        return None
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        return None
    if max_new_tokens < 1:
        return None
    return max_new_tokens - 1


#: A recipe's source for one value: (0, index) reads ``args[index]``, (1, name) ``kwargs[name]``,
#: (2, name) the parameter's default.
_Source = tuple[int, Any]
_ARGS, _KWARGS, _DEFAULTS = 0, 1, 2
#: The recipe for calls that must be bound (:func:`positions_ahead`).
_BIND = None
#: Distinct call shapes remembered per reader; a program has a handful.
_MAX_RECIPES = 64


class _ArgumentReader:
    """Reads ``max_new_tokens`` and ``use_past_kv_cache`` from a call without binding it.

    ``Signature.bind`` costs about 12 µs, a visible share of a short generation, and so does
    working out by hand where each value sits. Whether a call is plainly bindable, and where the
    two values sit, depends only on the call's shape (how many positional arguments, which
    keywords in which order), so that is worked out once per shape and kept as a recipe: where
    the signature is plain (named parameters, and perhaps ``**kwargs``) and the call plainly
    bindable (no more positional arguments than parameters, keywords that name parameters, or any
    keyword where ``**kwargs`` takes them, none given twice, none required missing), the recipe
    says where to read each value; any other call goes through :func:`positions_ahead`, which
    binds. Both give the same answer.
    """

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        kind = inspect.Parameter
        parameters = [p for p in signature.parameters.values() if p.kind is not kind.VAR_KEYWORD]
        self.any_keyword = len(parameters) < len(signature.parameters)
        plain = (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
        self.plain = all(parameter.kind in plain for parameter in parameters)
        self.positional = [p.name for p in parameters if p.kind is kind.POSITIONAL_OR_KEYWORD]
        self.names = frozenset(p.name for p in parameters)
        self.required = frozenset(p.name for p in parameters if p.default is kind.empty)
        self._recipes: dict[tuple[Any, ...], tuple[_Source, _Source] | None] = {}
        self._defaults: dict[str, Any] = {}
        for name in ("use_past_kv_cache", "max_new_tokens"):
            parameter = signature.parameters.get(name)
            self._defaults[name] = kind.empty if parameter is None else parameter.default

    def _source(self, name: str, given: int, keywords: tuple[str, ...]) -> _Source:
        if name in keywords:
            return _KWARGS, name
        if name in self.positional:
            index = self.positional.index(name)
            if index < given:
                return _ARGS, index
        return _DEFAULTS, name

    def _recipe(self, given: int, keywords: tuple[str, ...]) -> tuple[_Source, _Source] | None:
        named = self.positional[:given]
        if (
            not self.plain
            or given > len(self.positional)
            or not (self.any_keyword or self.names.issuperset(keywords))
            or not self.required.issubset((*named, *keywords))
            or any(name in keywords for name in named)
        ):
            return _BIND
        return (
            self._source("use_past_kv_cache", given, keywords),
            self._source("max_new_tokens", given, keywords),
        )

    def ahead(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """Like :func:`positions_ahead` for this signature, without binding plain calls."""
        shape = (len(args), *kwargs)
        try:
            recipe = self._recipes[shape]
        except KeyError:
            recipe = self._recipe(len(args), tuple(kwargs))
            if len(self._recipes) < _MAX_RECIPES:
                self._recipes[shape] = recipe
        if recipe is _BIND:
            return positions_ahead(self.signature, args, kwargs)
        sources = (args, kwargs, self._defaults)
        (use_from, use_key), (new_from, new_key) = recipe
        use, new = sources[use_from][use_key], sources[new_from][new_key]
        if use is True and type(new) is int and new > 0:
            return new - 1  # the usual call, answered as _ahead would
        return _ahead(use, new)


def reserving_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``original`` (``HookedTransformer.generate``) so that its cache is reserved exactly."""
    reader = _ArgumentReader(inspect.signature(original))

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        ahead = reader.ahead(args, kwargs)
        if ahead is None:
            return original(*args, **kwargs)
        # kv_storage.reserve_ahead's variable, set directly: ``ahead`` is already a valid count,
        # and the context manager's checks and object cost a visible share of a short generate.
        token = kv_storage.RESERVED_AHEAD.set(ahead)
        try:
            return original(*args, **kwargs)
        finally:
            kv_storage.RESERVED_AHEAD.reset(token)

    return generate


def _reserved_while_running(stream: Iterator[Any], ahead: int) -> Generator[Any, None, Any]:
    """Yield what ``stream`` yields, with the reservation in force only while ``stream`` runs.

    A context variable set inside a generator would stay set in the caller's context between
    items, so any cache the caller fills meanwhile would be reserved too. Setting it around each
    step of the original keeps it to the original's own appends.
    """
    try:
        while True:
            with kv_storage.reserve_ahead(ahead):
                try:
                    item = next(stream)
                except StopIteration as stop:
                    return stop.value
            yield item
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()  # a caller that stops early releases the original (and its cache) at once


def reserving_generate_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``original`` (``HookedTransformer.generate_stream``, TL 3.9+) like ``generate``.

    The wrapper is itself a generator function, as the original is, so ``inspect`` and code that
    checks for one see no difference. Like any generator function taking ``*args, **kwargs``, it
    binds the arguments when the first item is requested: an argument the original does not take
    raises ``TypeError`` there, not at the call.
    """
    reader = _ArgumentReader(inspect.signature(original))

    @functools.wraps(original)
    def generate_stream(*args: Any, **kwargs: Any) -> Generator[Any, None, Any]:
        ahead = reader.ahead(args, kwargs)
        stream = original(*args, **kwargs)
        if ahead is None:
            return (yield from stream)
        return (yield from _reserved_while_running(stream, ahead))

    return generate_stream


def _applies(context: Context) -> tuple[bool, str]:
    if context.layout.model_class() is None:
        return False, "this release has no HookedTransformer"
    return True, "HookedTransformer.generate can size the cache once"


def _patches(context: Context) -> list[Wrap]:
    model = context.layout.model_class()
    assert model is not None  # _applies said so
    # generate_stream exists from TL 3.9 on; a Wrap without an area skips a missing method.
    return [
        Wrap(model, "generate", reserving_generate),
        Wrap(model, "generate_stream", reserving_generate_stream),
    ]


FIX = Fix(
    id="generate_reserve",
    symptom="a cached HookedTransformer.generate regrows every layer's cache as it goes",
    affects=frozen({"transformer-lens": ">=2.0,<4"}),
    remedy="generate and generate_stream reserve each layer's cache at prompt + max_new_tokens",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_generate_reserve.py",
    changes=("generate", "cache"),
)
