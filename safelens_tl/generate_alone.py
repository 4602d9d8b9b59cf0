"""Generating a batch of text prompts of different lengths in parts that need no padding, for
``generate`` methods that do not mask a batch's padding (:mod:`safelens_tl.hooked_generate_batch`:
one call per token count; :mod:`safelens_tl.bridge_generate_batch`: one call per prompt).

Prompts of one token count need no padding, so they generate right however their release masks;
the wrappers decide when a batch needs it and how to return the results.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

#: ``return_type`` values under which a list of prompts comes back as a list of texts.
RETURNS_TEXT = ("input", "str")


def batch_to_split(
    signature: inspect.Signature, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[inspect.BoundArguments, list[str]] | None:
    """``generate``'s arguments bound (``model`` as ``self``) and its prompts, when the call asks
    for two or more text prompts of different lengths; ``None`` for any other call, arguments the
    signature refuses included (the original then raises its own error).

    ``input`` is ``generate``'s first parameter in every release; a call whose prompt there is no
    list (one prompt, a tensor: nearly every call) is answered before binding, which costs about
    ten microseconds, a visible share of a short generation on a small model.
    """
    given = kwargs["input"] if "input" in kwargs else (args[0] if args else None)
    if not isinstance(given, list):
        return None
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return None
    prompts = prompts_of_different_lengths(bound.arguments, getattr(model, "tokenizer", None))
    return None if prompts is None else (bound, prompts)


def prompts_of_different_lengths(arguments: dict[str, Any], tokenizer: Any) -> list[str] | None:
    """The bound ``input`` when it is two or more strings whose token counts differ (a batch that
    needs padding), else ``None``. Special tokens (BOS) add the same count to every prompt."""
    prompts = arguments.get("input")
    if (
        tokenizer is None
        or not isinstance(prompts, list)
        or len(prompts) < 2
        or not all(isinstance(prompt, str) for prompt in prompts)
    ):
        return None
    counts = {len(tokenizer(prompt)["input_ids"]) for prompt in prompts}
    return prompts if len(counts) > 1 else None


def generate_each(
    original: Callable[..., Any], bound: inspect.BoundArguments, inputs: Sequence[Any]
) -> list[Any]:
    """Call ``original`` once per input (a prompt, or a list of prompts of one length), every
    other argument as bound; return the results.

    Under sampling each call draws from the random stream in turn.
    """
    given = bound.arguments["input"]
    results = []
    try:
        for prompt in inputs:
            bound.arguments["input"] = prompt
            results.append(original(*bound.args, **bound.kwargs))
    finally:
        bound.arguments["input"] = given
    return results
