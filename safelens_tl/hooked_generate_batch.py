"""``HookedTransformer.generate`` on prompts of different lengths where it masks no padding.

TransformerLens 2.13 to 3.0.0's ``HookedTransformer.generate`` builds the attention mask of every
step from a tensor of zeros instead of the prompts' tokens
(:func:`safelens_tl.targets.hooked_generate_masks_no_padding`), so in a batch of prompts of
different lengths each shorter prompt attends to its padding, left or right, and silently
generates other tokens than it does alone, with or without the cache, stock or patched (the
sweep's tiny Llama on 3.0: ``[13, 10, 52, 15, 52, 51]`` for the short prompt in a left-padded
batch, ``[47, 8, 17, 14, 51, 27]`` alone). TransformerLens 3.1 masks the padding and pads a list
on the left (upstream issue #1005).

There, a call with two or more string prompts whose token counts differ generates the prompts of
each token count as one batch of their own (which needs no padding; a prompt alone when its count
is its own), and returns what TransformerLens 3.1 returns for the whole batch: with
``return_type`` ``"str"`` (or ``"input"``) the list of texts; with ``"tokens"`` one tensor, each
prompt left-padded with the tokenizer's pad token to the longest, followed by its generated
tokens, a row that stopped at EOS filled up with the EOS padding token to the longest generation.
Under sampling each group draws from the random stream in turn, so the samples are not the
batch's (whose shorter rows were wrong anyway). ``return_type="embeds"`` and ``output_logits``
go to the original with a ``UserWarning`` saying why its shorter rows are wrong and what to do;
prompts of one length, a single prompt and token tensors are the original's, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from safelens_tl.generate_alone import RETURNS_TEXT, batch_to_split

UNMASKED_BATCH_WARNING = (
    "this TransformerLens release's HookedTransformer.generate masks no padding: in a batch of "
    "prompts of different lengths, every shorter prompt attends to its padding and generates "
    "other tokens than it does alone (stock too). Generate such prompts one at a time, pass "
    "return_type='str' or 'tokens', or upgrade to TransformerLens 3.1 or later."
)


def _eos_padding(arguments: dict[str, Any], tokenizer: Any) -> int:
    """The token ``generate`` writes after a row's EOS while other rows go on."""
    if not arguments.get("stop_at_eos", True):
        return 0  # every row runs to max_new_tokens: nothing to fill
    eos = arguments.get("eos_token_id")
    if eos is None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        return eos
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else int(eos[0])


def _count_as_generate_tokenizes(model: Any, prompt: str, arguments: dict[str, Any]) -> int:
    """The prompt's token count as ``generate`` tokenizes it (its BOS and padding options)."""
    tokenize = {
        name: arguments[name] for name in ("prepend_bos", "padding_side") if name in arguments
    }
    return int(model.to_tokens(prompt, **tokenize).shape[1])


def _tokens_as_a_batch(
    model: Any,
    outputs: Sequence[torch.Tensor],
    groups: dict[int, list[int]],
    arguments: dict[str, Any],
) -> torch.Tensor:
    """One ``[batch, prompt + new]`` tensor from the groups' calls, laid out as a masked batch
    is: prompts left-padded to the longest, generations filled up to the longest."""
    longest_prompt = max(groups)
    longest_generation = max(
        int(output.shape[1]) - length for output, length in zip(outputs, groups, strict=True)
    )
    pad = model.tokenizer.pad_token_id
    eos = _eos_padding(arguments, model.tokenizer)
    rows: list[torch.Tensor] = [outputs[0][0]] * sum(len(indices) for indices in groups.values())
    for output, (length, indices) in zip(outputs, groups.items(), strict=True):
        new = int(output.shape[1]) - length
        left = output.new_full((len(indices), longest_prompt - length), pad)
        right = output.new_full((len(indices), longest_generation - new), eos)
        for index, row in zip(indices, torch.cat((left, output, right), dim=1), strict=True):
            rows[index] = row
    return torch.stack(rows)


def generating_each_length_apart(
    generate_with: Callable[..., Any], original: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.generate`` of a release that masks no padding: a batch of text
    prompts of different lengths generates right, one call per token count (see the module
    docstring).

    ``generate_with`` generates (``generate`` or a wrapper of it); the result presents itself as
    ``original`` (by default ``generate_with``), so that a patch always wraps the original itself.
    """
    presented = generate_with if original is None else original
    signature = inspect.signature(presented)

    @functools.wraps(presented)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        split = batch_to_split(signature, self, args, kwargs, _count_as_generate_tokenizes)
        if split is None:
            return generate_with(self, *args, **kwargs)
        arguments = split.arguments
        return_type = arguments.get("return_type", "input")
        extra = arguments.get("generation_kwargs") or {}  # TransformerLens 3.0's HF-style options
        if return_type not in (*RETURNS_TEXT, "tokens") or extra.get("output_logits"):
            warnings.warn(UNMASKED_BATCH_WARNING, UserWarning, stacklevel=2)
            return generate_with(self, *args, **kwargs)
        outputs = split.generate(generate_with)
        if return_type in RETURNS_TEXT:
            return split.texts(outputs)
        return _tokens_as_a_batch(self, outputs, split.groups, arguments)

    return generate
