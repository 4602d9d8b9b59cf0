"""``TransformerBridge.generate`` on prompts of different lengths where it uses no attention mask.

TransformerLens 3.0 to 3.7's ``TransformerBridge.generate`` pads a list of prompts with the
tokenizer's own padding side (usually the right; its ``padding_side`` argument is ignored with a
warning) and runs every step without an attention mask. So each prompt shorter than the longest
attends to its padding and, padded on the right, continues after it: silently other tokens than
the same prompt alone, with or without the cache (the sweep's tiny Llama on 3.0:
``[14, 46, 13, 15, 50, 1]`` for the short prompt against ``[47, 8, 17, 14, 51, 27]`` alone).
TransformerLens 3.8 pads on the left and passes the mask and the positions it implies.

Where ``generate``'s code never names an attention mask, a call with two or more text prompts
whose token counts differ runs as 3.8 runs it, inside the release's own loop: the prompts are
tokenized one by one (each as it is tokenized alone) and padded on the left into **one batch, in
the order given**, and each of the loop's calls into the model gets the mask of that padding
(ones after it) and the positions it implies. A forward that a hook runs from inside one of those
calls (the model on the hook's own tokens) is not the loop's and gets none of them: it is what a
plain forward of its tokens gives. Hooks see the batch the user passed: its size, its row order,
one forward per step. Texts come back as the texts of each prompt; tokens and logits
as 3.8 returns them (left-padded rows).

Where that cannot be done (an encoder-decoder or state-space model, media, or a model whose
``forward`` takes no ``position_ids``), the original runs as it is, with a ``UserWarning`` saying
why its shorter rows are wrong and what to do. Prompts of one length, a single prompt, tensors
and every release with a mask are the original's, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes._prompt_batches import (
    RETURNS_TEXT,
    left_padded,
    mask_from_lengths,
    text_prompts,
)
from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask
from safelens_tl.registry import Context, Fix, frozen, wrapping

#: Keyword arguments under which the loop hands a cached step its cache.
_CACHE_ARGUMENTS = ("past_key_values", "cache")

UNMASKED_WARNING = (
    "this TransformerLens release's TransformerBridge.generate uses no attention mask: in a "
    "batch of prompts of different lengths, every shorter prompt attends to its padding and "
    "generates other tokens than it does alone (stock too), and safelens-tl cannot mask {why}. "
    "Generate such prompts one at a time, or upgrade to TransformerLens 3.8 or later."
)


@dataclass
class PaddedBatch:
    """The padding of the batch a marked ``generate`` runs, and how far its model has read."""

    model: object
    #: ``[batch, prompt]``: 0 for padding, 1 for a prompt's token.
    prompt_mask: torch.Tensor
    #: Positions (prompt and generated tokens) the model's cache holds after the last call.
    seen: int = 0

    def step_arguments(self, tokens: torch.Tensor, cached: bool) -> dict[str, torch.Tensor]:
        """``attention_mask`` and ``position_ids`` for a call on ``tokens`` (``[batch, n]``),
        the last ``n`` positions of the sequence: all of it uncached, the new ones cached."""
        length = self.seen + tokens.shape[1] if cached else tokens.shape[1]
        self.seen = length
        batch, prompt = self.prompt_mask.shape
        mask = torch.ones((batch, length), dtype=self.prompt_mask.dtype, device=tokens.device)
        mask[:, :prompt] = self.prompt_mask.to(tokens.device)
        # As 3.8 (and Hugging Face's generate) derive them: count the tokens, padding at 1.
        positions = mask.long().cumsum(-1) - 1
        positions.masked_fill_(mask == 0, 1)
        return {"attention_mask": mask, "position_ids": positions[:, length - tokens.shape[1] :]}


#: The padded batch of the marked ``generate`` running in this context; ``None`` outside one.
_generating: ContextVar[PaddedBatch | None] = ContextVar(
    "safelens_tl_bridge_padded_batch", default=None
)


def mask_the_step(
    model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Token[PaddedBatch | None] | None:
    """Give a call of ``TransformerBridge.forward`` (``kwargs``, changed in place) the mask and
    positions of its batch's padding, when a marked ``generate`` of ``model`` makes it on that
    batch and passes no mask of its own; every other call is left as it is.

    Inside a marked ``generate`` the loop's own calls are the only forwards that start outside
    another forward: anything a call starts before it returns (a hook running the model on its
    own tokens) is not the loop's. So the mark is lifted for the call's duration, and the token
    returned must be handed to :func:`end_of_step` once the call is done (``None``: outside a
    marked ``generate``, nothing to hand back)."""
    state = _generating.get()
    if state is None:
        return None
    marker = _generating.set(None)
    if state.model is not model or kwargs.get("attention_mask") is not None:
        return marker
    tokens = args[0] if args else kwargs.get("input")
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.ndim != 2
        or tokens.is_floating_point()
        or tokens.shape[0] != state.prompt_mask.shape[0]
    ):
        return marker
    cached = any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS)
    for name, value in state.step_arguments(tokens, cached).items():
        kwargs.setdefault(name, value)
    return marker


def end_of_step(marker: Token[PaddedBatch | None]) -> None:
    """Put back the mark :func:`mask_the_step` lifted for a call (``marker``: what it returned)."""
    _generating.reset(marker)


def _takes_position_ids(model: Any) -> bool:
    """Whether the wrapped Hugging Face model's ``forward`` takes ``position_ids``."""
    forward = getattr(getattr(model, "original_model", None), "forward", None)
    try:
        return "position_ids" in inspect.signature(forward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _why_not_maskable(model: Any, arguments: dict[str, Any]) -> str | None:
    """Why this call's batch cannot be masked, or ``None`` when it can."""
    config = getattr(getattr(model, "original_model", None), "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model's batch"
    if getattr(model.cfg, "is_stateful", False):
        return "a state-space model's batch"
    if arguments.get("pixel_values") is not None or arguments.get("multimodal_kwargs"):
        return "a batch with images or sounds"
    if not _takes_position_ids(model):
        return "the batch of a model whose forward takes no position_ids"
    if getattr(model.tokenizer, "pad_token_id", None) is None:
        return "the batch of a tokenizer with no pad token"
    return None


def generating_padded_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.generate`` (a release whose code uses no attention mask): a batch
    of text prompts of different lengths runs as one masked, left-padded batch (see the module
    docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Nearly every call is one prompt or a tensor: answered before binding the arguments.
        given = kwargs["input"] if "input" in kwargs else (args[0] if args else None)
        prompts = text_prompts(given)
        if prompts is None or getattr(self, "tokenizer", None) is None:
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # it raises its own error
        bound.apply_defaults()
        # Each prompt as generate tokenizes one prompt alone (its BOS, its trailing-EOS rule).
        rows = [self.to_tokens(prompt, move_to_device=True, truncate=False) for prompt in prompts]
        lengths = [int(row.shape[-1]) for row in rows]
        if len(set(lengths)) == 1:
            return original(self, *args, **kwargs)  # nothing to pad: stock is right
        why = _why_not_maskable(self, bound.arguments)
        if why is not None:
            warnings.warn(UNMASKED_WARNING.format(why=why), UserWarning, stacklevel=2)
            return original(self, *args, **kwargs)
        tokens = left_padded(rows, int(self.tokenizer.pad_token_id))
        arguments = bound.arguments
        arguments["input"] = tokens
        wants_text = arguments["return_type"] in RETURNS_TEXT and not arguments.get("output_logits")
        if wants_text:
            arguments["return_type"] = "tokens"
        state = PaddedBatch(self, mask_from_lengths(lengths, int(tokens.shape[1]), tokens))
        marker = _generating.set(state)
        try:
            output = original(*bound.args, **bound.kwargs)
        finally:
            _generating.reset(marker)
        if not wants_text:
            return output
        width = tokens.shape[1]
        # Each row from its prompt's first token: what the prompt alone decodes to.
        return [
            self.tokenizer.decode(row[width - length :], skip_special_tokens=True)
            for row, length in zip(output, lengths, strict=True)
        ]

    return generate


def _applies(context: Context) -> tuple[bool, str]:
    generate = context.bridge.bridge_class.__dict__.get("generate")
    if not callable(generate):
        return False, "TransformerBridge defines no generate"
    if not bridge_hf_generate_mask.drops_the_attention_mask(generate):
        return False, "TransformerBridge.generate masks a padded batch itself"
    return True, "TransformerBridge.generate runs a batch without an attention mask"


_patches = wrapping(
    lambda context: context.bridge.bridge_class,
    "generate",
    generating_padded_batch,
    "generate options",
    "prompts of different lengths may generate other text",
)


FIX = Fix(
    id="bridge_generate_batch",
    symptom="TransformerBridge.generate([...]) on prompts of different lengths silently "
    "generates other text for the shorter ones",
    affects=frozen({"transformer-lens": ">=3.0,<3.8"}),
    remedy="the batch is padded on the left and masked at every step",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_generate_batch.py",
    changes=("generate", "forward"),
    requires=("bridge_model_call",),
    when_imported=(targets.BRIDGE_MODULE,),
    fixed_in="3.8.0",
)
