"""``TransformerBridge.generate`` on prompts of different lengths where it uses no attention mask.

TransformerLens 3.0 to 3.7's ``TransformerBridge.generate`` pads a list of prompts with the
tokenizer's own padding side (usually the right; its ``padding_side`` argument is ignored with a
warning) and runs every step without an attention mask. So each prompt shorter than the longest
attends to its padding and, padded on the right, continues after it: silently other tokens than
the same prompt alone, with or without the cache, stock or patched (the sweep's tiny Llama on 3.0:
``[14, 46, 13, 15, 50, 1]`` for the short prompt against ``[47, 8, 17, 14, 51, 27]`` alone).
TransformerLens 3.8 builds the mask and pads on the left.

Where ``generate``'s code never names an attention mask, a call with two or more string prompts
whose token counts differ, asking for text back (``return_type`` ``"input"`` or ``"str"``, nothing
else returned), generates the prompts of each token count as one batch of their own (which needs
no padding; a prompt alone when its count is its own) and returns the list of texts in the
prompts' order: what the same prompts give one at a time, as on 3.8. Under sampling each group
draws from the random stream in turn, so the samples are not the batch's (whose shorter rows
were wrong anyway). Any other call on such prompts (tokens, logits or activations back) goes to
the original with a ``UserWarning`` saying why its shorter rows are wrong and what to do; prompts
of one length, a single prompt, tensors and media are the original's, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from safelens_tl.generate_alone import RETURNS_TEXT, batch_to_split

#: Options that ask ``generate`` for more than text; prompts generated in groups could not return
#: them as one batch.
EXTRA_RETURNS = ("output_logits", "return_cache", "return_input_tokens")


def generating_each_length_apart(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.generate`` (a release whose code uses no attention mask): a batch
    of text prompts of different lengths generates right (see the module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        split = batch_to_split(signature, self, args, kwargs)
        if split is None:
            return original(self, *args, **kwargs)
        arguments = split.arguments
        if arguments.get("pixel_values") is not None or arguments.get("multimodal_kwargs"):
            return original(self, *args, **kwargs)
        wants_more = any(arguments.get(name) for name in EXTRA_RETURNS)
        if arguments.get("return_type", "input") not in RETURNS_TEXT or wants_more:
            warnings.warn(
                "this TransformerLens release's TransformerBridge.generate uses no attention "
                "mask: in a batch of prompts of different lengths, every shorter prompt attends "
                "to its padding and generates other tokens than it does alone (stock too). "
                "Generate such prompts one at a time, pass return_type='str', or upgrade to "
                "TransformerLens 3.8 or later.",
                UserWarning,
                stacklevel=2,
            )
            return original(self, *args, **kwargs)
        return split.texts(split.generate(original))

    return generate
