"""What every generation benchmark shares: safelens-tl on or off around a block, the prompt's
tokens, and the one greedy ``generate`` every timed section runs.

Its own module so that ``kv_cache.py`` and ``instruction_counts.py`` (which ``kv_cache.py`` runs)
both import it, rather than each other. Run from this folder (it is on ``sys.path`` for a script
here).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import safelens_tl


@contextmanager
def patched(on: bool) -> Iterator[None]:
    """Run the block with safelens-tl active (``on``) or with stock TransformerLens.

    Raises ``RuntimeError`` when safelens-tl does not activate (run from a source tree that was
    never installed, it finds no plugins and only warns): what ran would be stock, reported as
    patched, and the sweeps hide warnings.
    """
    if on:
        status = safelens_tl.activate()
        if not status.active:
            reasons = "; ".join(failure.message for failure in status.failures) or "no patches"
            raise RuntimeError(
                f"safelens-tl did not activate, so nothing would be patched: {reasons}"
            )
    else:
        safelens_tl.deactivate()
    try:
        yield
    finally:
        safelens_tl.deactivate()


def prompt_tokens(model: Any, prompt: int, batch: int, device: str = "cpu") -> torch.Tensor:
    """``batch`` seeded prompts of ``prompt`` tokens, on ``device``."""
    generator = torch.Generator().manual_seed(1)
    # Skip the special tokens (ids 0-3) so no prompt holds padding or EOS.
    tokens = torch.randint(4, int(model.cfg.d_vocab), (batch, prompt), generator=generator)
    return tokens.to(device)


def greedy_generate(model: Any, tokens: torch.Tensor, new: int) -> Any:
    """One greedy cached generation of exactly ``new`` tokens, as every timed section runs it."""
    return model.generate(
        tokens, max_new_tokens=new, do_sample=False, stop_at_eos=False, verbose=False
    )
