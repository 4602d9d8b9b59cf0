"""Cached generation through ``TransformerBridge`` (TransformerLens 4.x) on a tiny local Llama.

TransformerBridge generates through Hugging Face's own caches, which safelens-tl does not patch:
this checks TransformerLens as installed. A tiny ``LlamaForCausalLM`` with random weights (grouped-
query attention, rotary positions) is saved to a temporary folder with the in-process tokenizer and
booted from there, so nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from safelens_tl.verify import checks, models

MODEL_NAME = "llama-like-gqa (TransformerBridge)"
NEW_TOKENS = 8

_folder: Path | None = None


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Hide transformers' "Loading weights" bars; restore the user's setting afterwards."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def model_folder() -> Path:
    """Save the tiny Llama and the tokenizer once per process; return the folder."""
    global _folder
    if _folder is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = models.load_tokenizer()
        config = LlamaConfig(
            vocab_size=models.vocab_size(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            # Larger than the default 0.02 so the logits are well apart and a cache error shows.
            initializer_range=0.3,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        folder = Path(tempfile.mkdtemp(prefix="safelens-tl-llama-"))
        with _no_progress_bars():
            LlamaForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        _folder = folder
    return _folder


@dataclass(frozen=True)
class BridgeResult:
    """What one bridge run measured."""

    max_rel_err: float
    agreement: float
    seconds_cached: float
    seconds_uncached: float
    weights_dtype: torch.dtype


def _left_padding_mask(tokens: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """1 from each row's first real token on: pads only lead (generated pads stay attended)."""
    first_real = (tokens != pad_token_id).long().argmax(dim=1, keepdim=True)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return (positions >= first_real).long()


def _sequences_and_logits(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    sequences = output.sequences if hasattr(output, "sequences") else output[0]
    logits = output.logits if hasattr(output, "logits") else output[1]
    if isinstance(logits, (tuple, list)):
        logits = torch.stack(list(logits), dim=1)
    return sequences, logits


def run_bridge(dtype: torch.dtype, device: str) -> BridgeResult:
    """Boot the tiny Llama in ``dtype`` on ``device``; compare cached generation with uncached.

    The logits the cached ``generate`` produced at each step are compared with one uncached
    forward over the generated sequence (teacher forcing); greedy tokens are compared with an
    uncached ``generate``.
    """
    from transformer_lens.model_bridge import TransformerBridge

    folder = str(model_folder())
    with _no_progress_bars():
        bridge = TransformerBridge.boot_transformers(folder, dtype=dtype, device=device)
    common = checks.greedy_arguments(NEW_TOKENS)
    start = time.perf_counter()
    output = bridge.generate(
        list(checks.PROMPTS), use_past_kv_cache=True, output_logits=True, **common
    )
    middle = time.perf_counter()
    uncached_tokens = bridge.generate(list(checks.PROMPTS), use_past_kv_cache=False, **common)
    end = time.perf_counter()
    sequences, step_logits = _sequences_and_logits(output)
    mask = _left_padding_mask(sequences, int(bridge.tokenizer.pad_token_id))
    position_ids = (mask.cumsum(dim=1) - 1).clamp_min(0)
    with torch.inference_mode():
        full = bridge(
            sequences, attention_mask=mask, position_ids=position_ids, return_type="logits"
        )
    reference = full[:, -NEW_TOKENS - 1 : -1].float()
    difference = (step_logits.float().to(reference.device) - reference).abs().max()
    max_rel_err = float(difference / reference.abs().max().clamp_min(1e-6))
    new_cached = sequences[:, -NEW_TOKENS:].to(uncached_tokens.device)
    agreement = float((new_cached == uncached_tokens[:, -NEW_TOKENS:]).float().mean())
    weights_dtype = next(bridge.parameters()).dtype
    return BridgeResult(max_rel_err, agreement, middle - start, end - middle, weights_dtype)
