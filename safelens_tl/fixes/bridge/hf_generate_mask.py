"""``TransformerBridge.hf_generate`` on a batch of prompts where TransformerLens drops its mask.

Given a list of prompts, TransformerLens 3.0 to 3.8.1's ``hf_generate`` pads them with the
tokenizer's own padding side (usually the right) and hands Hugging Face's ``generate`` the token
ids alone, without the attention mask. Hugging Face cannot tell the padding from the text (the
bridge sets ``pad_token_id`` to the end-of-sequence token), so every prompt shorter than the
longest attended to its padding and, for decoder-only models, continued after it: silently other
tokens than the same prompt alone, with or without the cache (on the sweep's tiny Llama, 4 of 6
tokens of the shorter prompt). TransformerLens 3.9 tokenizes the list itself and passes the mask,
left-padding decoder-only models, as Hugging Face's ``generate`` requires.

Where ``hf_generate``'s code passes no attention mask (:func:`drops_the_attention_mask`), a call
with two or more string prompts and no ``attention_mask`` of its own is tokenized here as 3.9
does (left padding for decoder-only models, the tokenizer's side for encoder-decoder ones) and
handed to the original as token ids with the mask; what it returns is decoded as the original
decodes a list of prompts, unless tokens were asked for. Sequences asked for as tokens are then
left-padded, as on TransformerLens 3.9. Every other call is the original's, unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from safelens_tl import targets
from safelens_tl.registry import Context, Fix, Wrap, frozen

MASK = "attention_mask"
#: ``return_type`` values under which ``hf_generate`` returns what Hugging Face returns.
RETURNS_TOKENS = ("tokens",)


def drops_the_attention_mask(method: Any) -> bool:
    """Whether ``method``'s code never names an attention mask: ``hf_generate`` on TransformerLens
    3.0-3.8, ``generate`` on 3.0-3.7 (:mod:`safelens_tl.fixes.bridge.generate_batch`)."""
    code = getattr(method, "__code__", None)
    if code is None:
        return False
    names = (*code.co_names, *code.co_varnames, *(c for c in code.co_consts if isinstance(c, str)))
    return not any(MASK in name for name in names)


def _is_batch_of_prompts(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 1 and all(isinstance(v, str) for v in value)


def _decoded(tokenizer: Any, outputs: Any) -> list[str]:
    """A list of prompts' outputs decoded as TransformerLens decodes them."""
    sequences = getattr(outputs, "sequences", outputs)
    return [tokenizer.decode(sequence, skip_special_tokens=True) for sequence in sequences]


def passing_the_attention_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TransformerBridge.hf_generate``: a batch of string prompts reaches Hugging Face's
    ``generate`` with its attention mask."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def hf_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # the original's own error
        arguments = bound.arguments
        extra = arguments.get("generation_kwargs", {})
        tokenizer = getattr(self, "tokenizer", None)
        prompts = arguments.get("input")
        if not _is_batch_of_prompts(prompts) or MASK in extra or tokenizer is None:
            return original(self, *args, **kwargs)
        config = getattr(getattr(self, "original_model", None), "config", None)
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        side = tokenizer.padding_side if encoder_decoder else "left"
        encoded = tokenizer(
            prompts, return_tensors="pt", padding=True, truncation=False, padding_side=side
        ).to(self.cfg.device)
        arguments["input"] = encoded["input_ids"]
        arguments["generation_kwargs"] = {**extra, MASK: encoded[MASK]}
        outputs = original(*bound.args, **bound.kwargs)
        if arguments.get("return_type", "input") in RETURNS_TOKENS:
            return outputs
        return _decoded(tokenizer, outputs)

    return hf_generate


def _applies(context: Context) -> tuple[bool, str]:
    hf_generate = context.bridge.bridge_class.__dict__.get("hf_generate")
    if not callable(hf_generate):
        return False, "TransformerBridge defines no hf_generate"
    if not drops_the_attention_mask(hf_generate):
        return False, "TransformerBridge.hf_generate passes the batch's mask itself"
    return True, "TransformerBridge.hf_generate drops the batch's attention mask"


def _patches(context: Context) -> list[Wrap]:
    return [Wrap(context.bridge.bridge_class, "hf_generate", passing_the_attention_mask)]


FIX = Fix(
    id="bridge_hf_generate_mask",
    symptom="TransformerBridge.hf_generate([...]) silently generates other tokens for every "
    "prompt shorter than the longest",
    affects=frozen({"transformer-lens": ">=3.0,<3.9"}),
    remedy="the batch's attention mask is passed to Hugging Face's generate",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_bridge_hf_generate_mask.py",
    changes=("generate",),
    when_imported=(targets.BRIDGE_MODULE,),
    fixed_in="3.9.0",
)
