"""Cached-against-uncached checks on a real ``HookedTransformer``, shared by the verifier and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Largest relative error allowed between cached and uncached logits, per dtype. The two paths
#: compute the same sums in a different order (one query at a time against a growing cache, versus
#: all queries at once), so they differ by rounding: a few units in the last place of the dtype,
#: amplified through the layers. float16 keeps 10 mantissa bits (eps ~1e-3), bfloat16 only 7
#: (eps ~8e-3); the bounds leave ~10x margin over what the built-in models show, while a wrong
#: position, mask or dtype gives errors of order 1.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}

PROMPTS = ("the cat runs", "a big old dog sleeps in the quiet house")
CONTINUATION = "and the red bird sings while the river flows"


@dataclass(frozen=True)
class TeacherForced:
    """Logits of the cached (token by token) and uncached (one full forward) paths."""

    cached: torch.Tensor
    uncached: torch.Tensor
    mask: torch.Tensor
    cache: Any

    @property
    def max_rel_err(self) -> float:
        """Largest |cached - uncached| over real (non-pad) positions, relative to max |uncached|."""
        valid = self.mask.bool()
        difference = (self.cached.float() - self.uncached.float()).abs()[valid]
        scale = self.uncached.float().abs()[valid].max().clamp_min(1e-6)
        return float(difference.max() / scale)


def padded_batch(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of two prompts of different lengths, left-padded, each followed by a continuation."""
    texts = [f"{prompt} {CONTINUATION}" for prompt in PROMPTS]
    tokens = model.to_tokens(texts, padding_side="left")
    mask = (tokens != model.tokenizer.pad_token_id).long()
    return tokens, mask


def cache_class() -> Any:
    """The installed release's KV-cache class."""
    from safelens_tl import targets

    return targets.locate().cache_class


@torch.inference_mode()
def teacher_forced(model: Any, prompt_positions: int = 6) -> TeacherForced:
    """Run the padded batch through the model once uncached and once with the cache.

    The cached run feeds the first ``prompt_positions`` tokens at once, then one token at a time,
    exactly like ``generate``; every position's logits are kept for comparison.
    """
    tokens, mask = padded_batch(model)
    device = model.cfg.device
    tokens, mask = tokens.to(device), mask.to(device)
    uncached = model(tokens, attention_mask=mask)
    cache = cache_class().init_cache(model.cfg, model.cfg.device, tokens.shape[0])
    pieces = [model(tokens[:, :prompt_positions], attention_mask=mask[:, :prompt_positions],
                    past_kv_cache=cache)]
    for position in range(prompt_positions, tokens.shape[1]):
        step = slice(position, position + 1)
        pieces.append(model(tokens[:, step], attention_mask=mask[:, step], past_kv_cache=cache))
    return TeacherForced(torch.cat(pieces, dim=1), uncached, mask, cache)


def greedy_agreement(model: Any, max_new_tokens: int = 8) -> tuple[float, torch.Tensor]:
    """Generate greedily with and without the cache; return the share of equal new tokens."""
    common = {"max_new_tokens": max_new_tokens, "do_sample": False, "verbose": False,
              "padding_side": "left", "stop_at_eos": False, "return_type": "tokens"}
    cached = model.generate(list(PROMPTS), use_past_kv_cache=True, **common)
    uncached = model.generate(list(PROMPTS), use_past_kv_cache=False, **common)
    new_cached, new_uncached = cached[:, -max_new_tokens:], uncached[:, -max_new_tokens:]
    return float((new_cached == new_uncached).float().mean()), cached
