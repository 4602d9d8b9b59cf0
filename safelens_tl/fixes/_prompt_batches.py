"""Batches of text prompts of different lengths: padding them on the left and masking that
padding by each prompt's own token count, for the ``generate`` fixes that batch prompts
(:mod:`safelens_tl.fixes.hooked.generate_mask`, :mod:`safelens_tl.fixes.bridge.generate_batch`).

The mask is counted, never read off the pad token: where the tokenizer's BOS (or a token a prompt
starts with) is its pad token, as in GPT-2's, looking at the tokens cannot tell padding from a
prompt's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: ``return_type`` values under which a list of prompts comes back as a list of texts.
RETURNS_TEXT = ("input", "str")


def text_prompts(given: Any) -> list[str] | None:
    """``given`` when it is a list of two or more strings (a batch that may need padding),
    else ``None``."""
    if isinstance(given, list) and len(given) >= 2 and all(isinstance(p, str) for p in given):
        return given
    return None


def mask_from_lengths(lengths: Sequence[int], width: int, like: torch.Tensor) -> torch.Tensor:
    """``[len(lengths), width]``, 1 on each row's last ``lengths[i]`` positions and 0 before them
    (left padding), with ``like``'s dtype and device."""
    positions = torch.arange(width, device=like.device)
    starts = torch.tensor([width - length for length in lengths], device=like.device)
    return (positions.unsqueeze(0) >= starts.unsqueeze(1)).to(like.dtype)


def left_padded(rows: Sequence[torch.Tensor], pad: int) -> torch.Tensor:
    """The ``[1, n]`` token rows stacked into one ``[batch, max n]`` tensor, each row at the
    right end and ``pad`` before it."""
    width = max(int(row.shape[-1]) for row in rows)
    first = rows[0]
    tokens = torch.full((len(rows), width), pad, dtype=first.dtype, device=first.device)
    for index, row in enumerate(rows):
        tokens[index, width - row.shape[-1] :] = row.reshape(-1)
    return tokens
