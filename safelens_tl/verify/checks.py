"""Cached-against-uncached checks on a real ``HookedTransformer``, for the verifier and tests."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from safelens_tl.kv import entry as kv_cache
from safelens_tl.kv import storage as kv_storage
from safelens_tl.verify import models, oracle

#: The least allowance per dtype for cached against uncached logits of the same model in the same
#: dtype, relative to the largest logit: :data:`safelens_tl.verify.oracle.FLOORS` (a couple of
#: units in the last place). A correct cache on a CPU shows 0 on the built-in models in float16
#: and bfloat16 and ~1e-6 in float32; what a model's depth adds is measured per run
#: (:mod:`safelens_tl.verify.oracle`).
TOLERANCES: dict[torch.dtype, float] = oracle.FLOORS

PROMPTS = ("the cat runs", "a big old dog sleeps in the quiet house")
CONTINUATION = "and the red bird sings while the river flows"
#: What the teacher-forced check feeds after each prompt: :data:`CONTINUATION`, then words of the
#: built-in vocabulary in a fixed order, so that the last step attends over at least 64 cached
#: positions (the longest prompt is 9 words and a BOS: 76 positions in all).
LONG_CONTINUATION = " ".join(
    [CONTINUATION, *(models.WORDS[(7 * index + 3) % len(models.WORDS)] for index in range(56))]
)
#: ``--thorough``: more of the same words, up to 120 positions (the built-in models hold 128).
THOROUGH_CONTINUATION = " ".join(
    [CONTINUATION, *(models.WORDS[(7 * index + 3) % len(models.WORDS)] for index in range(100))]
)
#: Prompts per batch size, as :data:`safelens_tl.verify.bridge.BATCHES`: one prompt, and two of
#: different lengths (left-padded).
BATCHES: dict[int, tuple[str, ...]] = {1: PROMPTS[1:], 2: PROMPTS}


@dataclass(frozen=True)
class TeacherForced:
    """Logits of the cached (token by token) and uncached (one full forward) paths."""

    cached: torch.Tensor
    uncached: torch.Tensor
    mask: torch.Tensor
    cache: Any
    #: Positions fed at once before the token-by-token steps.
    prompt_positions: int = 6
    #: :func:`safelens_tl.verify.oracle.order_error` of the uncached forwards over prefixes;
    #: ``None`` where not measured.
    order: float | None = None

    @property
    def max_rel_err(self) -> float:
        """Largest |cached - uncached| over real (non-pad) positions, relative to max |uncached|."""
        return oracle.relative_error(self.cached, self.uncached, self.mask)

    @property
    def cached_positions(self) -> int:
        """Cached positions the last step attended over (padding included)."""
        return int(self.mask.shape[1]) - 1

    @property
    def top1_agreement(self) -> float:
        """Share of the token-by-token steps (real positions) whose top token is the uncached
        forward's."""
        steps = self.mask.clone()
        steps[:, : self.prompt_positions] = 0
        return oracle.agreement(self.cached, self.uncached, steps)


def padded_batch(
    model: Any, continuation: str = CONTINUATION, prompts: tuple[str, ...] = PROMPTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of the prompts (by default two of different lengths), left-padded, each followed by
    ``continuation``."""
    texts = [f"{prompt} {continuation}" for prompt in prompts]
    tokens = model.to_tokens(texts, padding_side="left")
    return tokens, left_padding_mask(tokens, model.tokenizer, model.cfg.default_prepend_bos)


def left_padding_mask(tokens: torch.Tensor, tokenizer: Any, prepend_bos: bool) -> torch.Tensor:
    """1 from each row's first real token on, for left-padded ``tokens``.

    Only the leading run of pad tokens is padding (a pad id inside the text stays attended). When
    the pad token is also the BOS token (GPT-2's tokenizer), the last of that run is the BOS.
    """
    pad_id = tokenizer.pad_token_id
    is_pad: torch.Tensor = tokens == pad_id
    leading = is_pad.long().cumprod(dim=1).sum(dim=1, keepdim=True)
    if prepend_bos and pad_id == tokenizer.bos_token_id:
        leading = (leading - 1).clamp_min(0)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return (positions >= leading).long()


def cache_class() -> Any:
    """The installed release's KV-cache class."""
    from safelens_tl import targets

    return targets.locate().cache_class


@torch.inference_mode()
def teacher_forced(
    model: Any,
    prompt_positions: int = 6,
    batch: int = 2,
    continuation: str = LONG_CONTINUATION,
    order_steps: int | None = 0,
) -> TeacherForced:
    """:func:`teacher_forced_batches` for one of :data:`BATCHES`."""
    (run,) = teacher_forced_batches(
        model, (batch,), prompt_positions, continuation=continuation, order_steps=order_steps
    )
    return run


@torch.inference_mode()
def teacher_forced_batches(
    model: Any,
    batches: tuple[int, ...] = tuple(BATCHES),
    prompt_positions: int = 6,
    continuation: str = LONG_CONTINUATION,
    order_steps: int | None = 0,
) -> list[TeacherForced]:
    """Run each left-padded batch (:data:`BATCHES`) through the model once uncached and once with
    the cache.

    The cached run feeds the first ``prompt_positions`` tokens at once, then one token at a time,
    exactly like ``generate``; every position's logits are kept for comparison. The prompt and
    the first two steps are kept as a small cache (``torch.cat``), the rest in a buffer written
    in place, which grows by a quarter whenever it is full (nine times over the default
    continuation): each way safelens-tl stores a cache, and the moves between them, in one run.
    (Left to the default limit, these tiny models' caches would stay small throughout.)
    ``order_steps``: how many uncached forwards over prefixes measure ``order`` (0: none; ``None``:
    one per step).

    Every uncached forward (the yardsticks and the allowance's) runs before any cached one, in
    order of length, shortest first: a forward whose result depends on what ran before it (stock
    TransformerLens keeps its ALiBi bias at the longest length seen and offsets every shorter
    forward after it) then meets that state in the code under test alone.
    """
    device = model.cfg.device
    inputs = []
    for batch in batches:
        tokens, mask = padded_batch(model, continuation, BATCHES[batch])
        inputs.append((tokens.to(device), mask.to(device)))
    logits = _uncached_forwards(model, inputs, prompt_positions, order_steps)
    runs = []
    for index, (tokens, mask) in enumerate(inputs):
        uncached = logits[index, "whole", 0]
        order = None
        if order_steps != 0:
            order = _order(model, index, mask, uncached, logits)
        cache = cache_class().init_cache(model.cfg, model.cfg.device, tokens.shape[0])
        small_bytes = (prompt_positions + 2) * position_bytes(model.cfg, tokens.shape[0])
        with kv_storage.small_cache_limit(small_bytes):
            cached = cached_logits(model, tokens, mask, cache, prompt_positions)
        runs.append(TeacherForced(cached, uncached, mask, cache, prompt_positions, order))
    return runs


#: (batch index, "whole" | "prefix" | "shift" | "kernels", position or shift)
_Forward = tuple[int, str, int]


def _uncached_forwards(
    model: Any,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    prompt_positions: int,
    order_steps: int | None,
) -> dict[_Forward, torch.Tensor]:
    """The logits of every uncached forward, shortest first: the whole sequence of each batch;
    with ``order_steps``, the last position of the forwards over prefixes ending at that many of
    the token-by-token positions (spread, the last included; ``None``: all of them), the whole
    sequence behind :data:`~safelens_tl.verify.oracle.SHIFTS` more positions of left padding, and
    the whole sequence through :func:`~safelens_tl.verify.oracle.other_kernels` where they
    apply."""
    pad_id = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    planned: list[tuple[int, _Forward, torch.Tensor, torch.Tensor]] = []
    for index, (tokens, mask) in enumerate(inputs):
        length = tokens.shape[1]
        planned.append((length, (index, "whole", 0), tokens, mask))
        if order_steps == 0:
            continue
        for step in oracle.order_steps(length - prompt_positions, order_steps):
            end = prompt_positions + step + 1
            planned.append((end, (index, "prefix", end - 1), tokens[:, :end], mask[:, :end]))
        for shift in oracle.SHIFTS:
            pad = torch.full(
                (tokens.shape[0], shift), 0 if pad_id is None else int(pad_id), dtype=tokens.dtype
            ).to(tokens.device)
            shifted_mask = torch.cat([torch.zeros_like(pad, dtype=mask.dtype), mask], dim=1)
            planned.append(
                (length + shift, (index, "shift", shift), torch.cat([pad, tokens], 1), shifted_mask)
            )
        if oracle.other_kernels_apply(model):
            planned.append((length, (index, "kernels", 0), tokens, mask))
    logits: dict[_Forward, torch.Tensor] = {}
    for _, key, tokens, mask in sorted(planned, key=lambda forward: forward[0]):
        _, kind, at = key
        kernels = oracle.other_kernels() if kind == "kernels" else contextlib.nullcontext()
        with kernels:
            out = model(tokens, attention_mask=mask)
        logits[key] = out[:, -1] if kind == "prefix" else out[:, at:] if kind == "shift" else out
    return logits


def _order(
    model: Any,
    index: int,
    mask: torch.Tensor,
    uncached: torch.Tensor,
    logits: dict[_Forward, torch.Tensor],
) -> float:
    """``order`` (:func:`safelens_tl.verify.oracle.order_error`) of batch ``index``: other orders
    of the same sums, each one uncached forward in the dtype (:func:`_uncached_forwards`), against
    the forward over the whole sequence at the same positions."""
    valid = mask.bool()
    other, whole = [], []
    for (batch, kind, at), out in logits.items():
        if batch != index or kind == "whole":
            continue
        if kind == "prefix":
            # Left padding: a row whose prefix is all padding has no logits worth comparing.
            real = valid[:, at]
            other.append(out[real])
            whole.append(uncached[:, at][real])
        else:
            other.append(out[valid])
            whole.append(uncached[valid])
    scale = float(uncached.float().abs()[valid].max())
    return oracle.order_error(other, whole, scale)


def position_bytes(cfg: Any, batch: int) -> int:
    """Bytes one cached position takes in the keys (or the values) of one layer."""
    itemsize = torch.finfo(kv_cache.resolve_dtype(cfg.dtype)).bits // 8
    return batch * expected_cache_heads(cfg) * int(cfg.d_head) * itemsize


@torch.inference_mode()
def cached_logits(
    model: Any, tokens: torch.Tensor, mask: torch.Tensor, cache: Any, prompt_positions: int = 6
) -> torch.Tensor:
    """Feed ``tokens`` through ``cache`` as ``generate`` does; return the logits of every position.

    Separate from :func:`teacher_forced` so that a control run can pass a deliberately broken
    (frozen) cache and show that the comparison notices.
    """
    head = slice(0, prompt_positions)
    pieces = [model(tokens[:, head], attention_mask=mask[:, head], past_kv_cache=cache)]
    for position in range(prompt_positions, tokens.shape[1]):
        step = slice(position, position + 1)
        pieces.append(model(tokens[:, step], attention_mask=mask[:, step], past_kv_cache=cache))
    return torch.cat(pieces, dim=1)


@torch.inference_mode()
def corrupted_cache_error(
    model: Any, part: str = "values", scale: float = 1.01, prompt_positions: int = 6
) -> float:
    """``max_rel_err`` when the cached past keys or values (``part``) are ``scale`` too large.

    The cache is filled with the prompt, then every layer's past ``part`` is scaled once and the
    continuation fed one token at a time: what a cache that is slightly wrong looks like.
    """
    tokens, mask = padded_batch(model)
    device = model.cfg.device
    tokens, mask = tokens.to(device), mask.to(device)
    uncached = model(tokens, attention_mask=mask)
    cache = cache_class().init_cache(model.cfg, model.cfg.device, tokens.shape[0])
    head = slice(0, prompt_positions)
    pieces = [model(tokens[:, head], attention_mask=mask[:, head], past_kv_cache=cache)]
    attribute = {"keys": "past_keys", "values": "past_values"}[part]
    for entry in cache.entries:
        setattr(entry, attribute, getattr(entry, attribute) * scale)
    for position in range(prompt_positions, tokens.shape[1]):
        step = slice(position, position + 1)
        pieces.append(model(tokens[:, step], attention_mask=mask[:, step], past_kv_cache=cache))
    cached = torch.cat(pieces, dim=1)
    return TeacherForced(cached, uncached, mask, cache).max_rel_err


@torch.inference_mode()
def frozen_cache_control(model: Any, prompt_positions: int = 6) -> float:
    """``max_rel_err`` of a cache that stores nothing (frozen): what a broken cache looks like.

    A frozen cache drops every past token, the way a cache with a wrong position or a lost append
    would; the error it shows calibrates the tolerances against a real failure.
    """
    tokens, mask = padded_batch(model)
    device = model.cfg.device
    tokens, mask = tokens.to(device), mask.to(device)
    uncached = model(tokens, attention_mask=mask)
    cache = cache_class().init_cache(model.cfg, model.cfg.device, tokens.shape[0])
    cache.freeze()
    cached = cached_logits(model, tokens, mask, cache, prompt_positions)
    return TeacherForced(cached, uncached, mask, cache).max_rel_err


def expected_cache_heads(cfg: Any) -> int:
    """Heads a correct cache stores: ``n_key_value_heads`` (grouped-query) or else ``n_heads``.

    Deliberately not taken from :mod:`safelens_tl.kv.entry`: the verifier must not trust the code
    it checks.
    """
    heads = getattr(cfg, "n_key_value_heads", None)
    return int(heads if heads is not None else cfg.n_heads)


def layer_device(model: Any, layer: int) -> torch.device:
    """The device a block's attention runs on (differs per layer when the model is split)."""
    return torch.device(model.blocks[layer].attn.W_K.device)


def cache_problems(model: Any, cache: Any, length: int) -> list[str]:
    """Compare every cache entry's dtype, device, heads and length with what the model needs."""
    problems: list[str] = []
    expected_heads = expected_cache_heads(model.cfg)
    for layer, entry in enumerate(cache.entries):
        keys = entry.past_keys
        device = layer_device(model, layer)
        if keys.dtype != model.cfg.dtype:
            problems.append(f"layer {layer}: cache dtype {keys.dtype}, model {model.cfg.dtype}")
        if keys.device != device:
            problems.append(f"layer {layer}: cache on {keys.device}, attention on {device}")
        if keys.shape[2] != expected_heads:
            problems.append(
                f"layer {layer}: cache has {keys.shape[2]} heads, {expected_heads} expected"
            )
        if keys.shape[1] != length:
            problems.append(f"layer {layer}: cache holds {keys.shape[1]} positions, {length} fed")
    return problems


@dataclass(frozen=True)
class TimedGeneration:
    """Greedy generation with and without the cache: agreement and time per new token."""

    agreement: float
    cached_tokens: torch.Tensor
    new_tokens: int
    seconds_cached: float
    seconds_uncached: float

    @property
    def speedup(self) -> float:
        """Uncached time over cached time (above 1: the cache saves time)."""
        return self.seconds_uncached / max(self.seconds_cached, 1e-9)


def greedy_arguments(max_new_tokens: int) -> dict[str, Any]:
    """``generate`` arguments for deterministic, comparable runs on the left-padded prompts."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "verbose": False,
        "padding_side": "left",
        "stop_at_eos": False,
        "return_type": "tokens",
    }


def timed_generation(
    model: Any, max_new_tokens: int = 8, small_cache: bool = False
) -> TimedGeneration:
    """Generate greedily on the left-padded batch of two, cached then uncached, and time both.

    ``small_cache``: the cached ``generate`` keeps the prompt and two steps in a small cache
    (``torch.cat``) and then moves to a buffer planned for the rest (``generate`` reserves its
    new tokens ahead), as a larger model's cache would; left to the default limit, the built-in
    models' caches stay small."""
    common = greedy_arguments(max_new_tokens)
    limit: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if small_cache:
        prompt = int(model.to_tokens(list(PROMPTS), padding_side="left").shape[1])
        per_position = position_bytes(model.cfg, len(PROMPTS))
        limit = kv_storage.small_cache_limit((prompt + 2) * per_position)
    start = time.perf_counter()
    with limit:
        cached = model.generate(list(PROMPTS), use_past_kv_cache=True, **common)
    middle = time.perf_counter()
    uncached = model.generate(list(PROMPTS), use_past_kv_cache=False, **common)
    end = time.perf_counter()
    new_cached, new_uncached = cached[:, -max_new_tokens:], uncached[:, -max_new_tokens:]
    agreement = float((new_cached == new_uncached).float().mean())
    return TimedGeneration(agreement, cached, max_new_tokens, middle - start, end - middle)


def greedy_agreement(model: Any, max_new_tokens: int = 8) -> tuple[float, torch.Tensor]:
    """Generate greedily with and without the cache; return the share of equal new tokens."""
    timed = timed_generation(model, max_new_tokens)
    return timed.agreement, timed.cached_tokens


@dataclass(frozen=True)
class BatchAgainstAlone:
    """``generate``'s picks in the left-padded batch, held to greedy on each prompt alone."""

    #: The largest shortfall of a picked token's logit below the top logit of that step, over
    #: every generated step of every row, relative to the row's largest |logit|: 0 when every pick
    #: is the alone greedy choice.
    worst_gap: float
    #: Rows whose prompt tokens in the batch are not the prompt's own tokens (a wrong layout).
    misplaced_rows: tuple[int, ...]


@torch.inference_mode()
def batch_against_alone(model: Any, generated: torch.Tensor, new_tokens: int) -> BatchAgainstAlone:
    """Hold each row of ``generated`` (``generate``'s tokens for the left-padded :data:`PROMPTS`)
    to its prompt alone: the row's prompt and picks, without padding, go through one uncached
    forward, and each pick's logit is compared with the top logit of its step.

    The cached-against-uncached checks cannot see a ``generate`` that lets the shorter prompt
    attend to its padding (TransformerLens 2.13 to 3.0.0): cached and uncached then agree, both
    wrong. Greedy ties are allowed up to rounding: a pick counts as greedy when its logit is within
    twice the dtype's tolerance of the top one (each of the two logits may be off by one).
    """
    worst = 0.0
    misplaced = []
    for row, prompt in enumerate(PROMPTS):
        alone = model.to_tokens(prompt).to(generated.device)
        length = int(alone.shape[1])
        sequence = generated[row, -(length + new_tokens) :]
        if not torch.equal(sequence[:length], alone[0]):
            misplaced.append(row)
            continue
        logits = model(sequence.unsqueeze(0))[0, length - 1 : -1].float()
        picked = logits.gather(1, sequence[length:].unsqueeze(1)).squeeze(1)
        gaps = (logits.max(dim=1).values - picked) / logits.abs().max().clamp_min(1e-6)
        worst = max(worst, float(gaps.max()))
    return BatchAgainstAlone(worst, tuple(misplaced))
