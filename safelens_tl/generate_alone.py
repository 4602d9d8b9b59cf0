"""Generating a batch of text prompts of different lengths in parts that need no padding, for a
``generate`` that does not mask a batch's padding (TransformerLens 3.0 to 3.7's
``TransformerBridge.generate``, :mod:`safelens_tl.bridge_generate_batch`): one call per token
count.

Prompts of one token count need no padding, so they generate right however their release masks;
the wrapper decides when a batch needs it and how to return the results.
(``HookedTransformer.generate`` of 2.13 to 3.0.0 is masked within one batch instead:
:mod:`safelens_tl.hooked_generate_mask`.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: ``return_type`` values under which a list of prompts comes back as a list of texts.
RETURNS_TEXT = ("input", "str")


def _token_count(model: Any, prompt: str) -> int:
    """The prompt's token count by the model's tokenizer; special tokens (BOS) add the same count
    to every prompt, so the grouping is ``generate``'s."""
    return len(model.tokenizer(prompt)["input_ids"])


@dataclass(frozen=True)
class SplitBatch:
    """A ``generate`` call on text prompts of different lengths, split by token count."""

    bound: inspect.BoundArguments
    prompts: list[str]
    #: Indices of the prompts by token count, in order of first appearance: each group is a batch
    #: that needs no padding.
    groups: dict[int, list[int]]

    @property
    def arguments(self) -> dict[str, Any]:
        """The call's bound arguments."""
        return self.bound.arguments

    def inputs(self) -> list[str | list[str]]:
        """One ``input`` per group: a prompt alone when its count is its own (so the call
        returns what a single prompt returns), else the group's list."""
        return [
            [self.prompts[i] for i in indices] if len(indices) > 1 else self.prompts[indices[0]]
            for indices in self.groups.values()
        ]

    def generate(self, original: Callable[..., Any]) -> list[Any]:
        """Call ``original`` once per group, every other argument as bound; its results in the
        groups' order. Under sampling each call draws from the random stream in turn."""
        given = self.bound.arguments["input"]
        results = []
        try:
            for prompt in self.inputs():
                self.bound.arguments["input"] = prompt
                results.append(original(*self.bound.args, **self.bound.kwargs))
        finally:
            self.bound.arguments["input"] = given
        return results

    def texts(self, outputs: Sequence[Any]) -> list[str]:
        """The texts of every group's call, back in the prompts' order."""
        texts: list[str] = [""] * len(self.prompts)
        for output, indices in zip(outputs, self.groups.values(), strict=True):
            # A call with a single prompt returns a string, one with several a list.
            for index, text in zip(
                indices, [output] if isinstance(output, str) else output, strict=True
            ):
                texts[index] = text
        return texts


def batch_to_split(
    signature: inspect.Signature,
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> SplitBatch | None:
    """The call split by token count, when it asks for two or more text prompts of different
    lengths; ``None`` for any other call, arguments the signature refuses included (the original
    then raises its own error).

    ``input`` is ``generate``'s first parameter in every release; a call whose prompt there is no
    list (one prompt, a tensor: nearly every call) is answered before binding, which costs about
    ten microseconds, a visible share of a short generation on a small model.
    """
    given = kwargs["input"] if "input" in kwargs else (args[0] if args else None)
    if (
        not isinstance(given, list)
        or len(given) < 2
        or not all(isinstance(prompt, str) for prompt in given)
        or getattr(model, "tokenizer", None) is None
    ):
        return None
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return None
    groups: dict[int, list[int]] = {}
    for index, prompt in enumerate(given):
        groups.setdefault(_token_count(model, prompt), []).append(index)
    return SplitBatch(bound, list(given), groups) if len(groups) > 1 else None
