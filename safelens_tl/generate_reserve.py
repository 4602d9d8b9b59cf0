"""``HookedTransformer.generate`` (and ``generate_stream``) planning the KV cache's final length.

``generate`` knows how many positions it may add (``max_new_tokens``), so each layer's buffer can
end exactly at its final length instead of growing by 25% with up to 25% spare; it grows towards
that length in bounded steps, since a generation may stop early (see
:func:`safelens_tl.kv_storage.reserve_ahead`). The prompt length is not computed here: strings
would have to be tokenized exactly as ``generate`` does (BOS, padding side, overridden defaults).
:func:`safelens_tl.kv_storage.reserve_ahead` instead adds the new tokens to whatever the first
write of each layer holds, which is the prompt.

The wrapper changes nothing else: same arguments, same result, same errors; when the arguments
cannot be read (an unknown signature, a cache turned off, odd values) it calls the original as is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator, Iterator
from typing import Any

from safelens_tl import kv_storage


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


class _ArgumentReader:
    """Reads ``max_new_tokens`` and ``use_past_kv_cache`` from a call without binding it.

    ``Signature.bind`` costs about 12 µs, a visible share of a short generation. Where the
    signature is plain (named parameters, and perhaps ``**kwargs``) and the call is plainly
    bindable (no more positional arguments than parameters, keywords that name parameters, or
    any keyword where ``**kwargs`` takes them, none given twice, none required missing), the two
    values are read directly; any other call goes through :func:`positions_ahead`, which binds.
    Both give the same answer.
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

    def _value(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        if name in self.positional:
            index = self.positional.index(name)
            if index < len(args):
                return args[index]
        parameter = self.signature.parameters.get(name)
        return inspect.Parameter.empty if parameter is None else parameter.default

    def ahead(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """Like :func:`positions_ahead` for this signature, without binding plain calls."""
        given = self.positional[: len(args)]
        if (
            not self.plain
            or len(args) > len(self.positional)
            or not (self.any_keyword or self.names.issuperset(kwargs))
            or not self.required.issubset((*given, *kwargs))
            or any(name in kwargs for name in given)
        ):
            return positions_ahead(self.signature, args, kwargs)
        return _ahead(
            self._value("use_past_kv_cache", args, kwargs),
            self._value("max_new_tokens", args, kwargs),
        )


def reserving_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``original`` (``HookedTransformer.generate``) so that its cache is reserved exactly."""
    reader = _ArgumentReader(inspect.signature(original))

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        ahead = reader.ahead(args, kwargs)
        if ahead is None:
            return original(*args, **kwargs)
        with kv_storage.reserve_ahead(ahead):
            return original(*args, **kwargs)

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
