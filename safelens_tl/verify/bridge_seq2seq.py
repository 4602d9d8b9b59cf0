"""Cached generation of an encoder-decoder checkpoint (T5, BART, ...) through ``TransformerBridge``.

``TransformerBridge.generate`` recomputes an encoder-decoder model's decoder at every step,
without a cache; only ``hf_generate`` (Hugging Face's own loop over the bridge's modules) uses
one. So for these checkpoints the verifier's bridge check is ``hf_generate``: greedy, with the
cache, its logits at every step replayed against two uncached forwards over the decoder tokens it
generated, as :func:`safelens_tl.verify.bridge.run_batch` does for decoder-only models:

- the bridge's own (its Hugging Face model, whose modules are the bridge's), in the same dtype;
- an independent reference, the checkpoint loaded with ``AutoModelForSeq2SeqLM`` alone.

The encoder reads the prompts as ``hf_generate`` tokenizes a list for an encoder-decoder model
(the tokenizer's own padding side, padded to the longest).

In half precision the reference comparison is reported but not held to a bound: these models'
half-precision forwards are far from their own float32 ones (a tiny T5 in bfloat16: Hugging Face's
by 0.22, the bridge's by 0.55, and the two 0.44 apart, uncached), so two implementations differ by
more than any bound that would still mean something. The cache is held to the dtype's tolerance
against the bridge's own uncached forward, as for decoder-only models, and the reference to its
bound in float32.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from safelens_tl.verify import bridge as decoder_only


def _decoder_forward(
    model: Any, encoded: Any, decoder_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One uncached forward over ``decoder_ids``: its logits, and the keys of the first decoder
    self-attention layer it caches (``None`` where none holds keys)."""
    with torch.inference_mode():
        output = model(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            decoder_input_ids=decoder_ids,
            use_cache=True,
        )
    cache = decoder_only.cache_of(output)
    # An EncoderDecoderCache holds the cross-attention's keys too, which never change.
    keys = decoder_only.first_cache_layer(getattr(cache, "self_attention_cache", cache))
    return output.logits, keys


def hugging_face_cached_error(reference: Any, encoded: Any, new_tokens: int) -> float:
    """Hugging Face's own greedy cached ``generate`` against its own uncached forward over what it
    generated, no TransformerLens involved: the rounding of the model's cached path itself."""
    with torch.inference_mode():
        output = reference.generate(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    full, _ = _decoder_forward(reference, encoded, output.sequences[:, :-1])
    return decoder_only.relative_error(torch.stack(list(output.logits), dim=1), full)


def run_batch(
    bridge: Any,
    reference: Any,
    prompts: Sequence[str],
    new_tokens: int = decoder_only.NEW_TOKENS,
) -> decoder_only.BridgeRun:
    """``hf_generate`` of ``prompts`` with and without the cache; the cached one replayed."""
    device = next(reference.parameters()).device
    encoded = bridge.tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
    start = time.perf_counter()
    cached = decoder_only.greedy_hf_generate(bridge, prompts, new_tokens, cached=True)
    middle = time.perf_counter()
    uncached = decoder_only.greedy_hf_generate(bridge, prompts, new_tokens, cached=False)
    end = time.perf_counter()
    # The decoder's start token, then one token per step: each step's logits predict the next.
    sequences = cached.sequences.to(device)
    step_logits = torch.stack(list(cached.logits), dim=1)
    own, keys = _decoder_forward(bridge.original_model, encoded, sequences[:, :-1])
    full, own_keys = _decoder_forward(reference, encoded, sequences[:, :-1])
    own_heads = None if own_keys is None else int(own_keys.shape[1])
    return decoder_only.BridgeRun(
        architecture=str(reference.config.architectures[0]),
        batch=len(prompts),
        max_rel_err=decoder_only.relative_error(step_logits, own),
        reference_rel_err=decoder_only.relative_error(step_logits, full),
        cached_tokens=sequences[:, -new_tokens:].cpu(),
        uncached_tokens=uncached.sequences[:, -new_tokens:].cpu(),
        seconds_cached=middle - start,
        seconds_uncached=end - middle,
        cache_dtype=None if keys is None else keys.dtype,
        cache_device=None if keys is None else keys.device,
        cache_heads=None if keys is None else int(keys.shape[1]),
        expected_cache_heads=decoder_only.heads_to_expect(reference.config, own_heads, keys),
        hugging_face_cached_rel_err=hugging_face_cached_error(reference, encoded, new_tokens),
        reference_held=next(reference.parameters()).dtype == torch.float32,
    )
