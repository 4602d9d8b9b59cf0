"""``HookedTransformer.generate`` keeps learned positions where the tokenizer's pad token id is 0
(TransformerLens 2.13 to 3.0.0: :mod:`safelens_tl.fixes.hooked.generate_mask`). Real models, the
real ``generate``; the reference is the model's own forward, so the same assertions hold of stock
on releases whose ``generate`` is right (3.1 and later)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.verify import checks, models, runner
from tests.conftest import RELEASE, requires_hooked_transformer

pytestmark = requires_hooked_transformer

PROMPT = checks.PROMPTS[1]
NEW = 8


def _model(positions: str) -> Any:
    """The verifier's GPT-2-like model (its tokenizer's pad id is 0) with ``positions``."""
    model = models.build_model("gpt2-like", torch.float32)
    assert model.tokenizer.pad_token_id == 0  # the case the fix is for
    model.cfg.positional_embedding_type = positions
    return model


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("positions", ["standard", "shortformer"])
def test_generate_picks_the_forward_s_greedy_token_at_every_step(
    patched: safelens_tl.activation.Status, positions: str, cached: bool
) -> None:
    """Stock 2.18 and 3.0.0 give every position position 0's embedding, zeroed: the first picks
    may match (a short prompt's last logits move little), later ones do not."""
    model = _model(positions)
    generated = model.generate(
        PROMPT,
        max_new_tokens=NEW,
        do_sample=False,
        use_past_kv_cache=cached,
        stop_at_eos=False,
        verbose=False,
        return_type="tokens",
    )
    length = int(model.to_tokens(PROMPT).shape[1])
    with torch.inference_mode():
        greedy = model(generated)[0, length - 1 : -1].argmax(dim=-1)
    assert greedy.tolist() == generated[0, length:].tolist()


def test_get_residual_outside_generate_keeps_the_mask_it_is_given(
    patched: safelens_tl.activation.Status,
) -> None:
    """Only ``generate``'s own call changes: a mask passed to ``get_residual`` elsewhere (here
    one that marks the first two positions as padding) still zeroes their positions."""
    model = _model("standard")
    embed = torch.zeros(1, 5, model.cfg.d_model)
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    residual, _ = model.get_residual(embed, 0, attention_mask=mask)
    assert torch.equal(residual[0, :2], torch.zeros(2, model.cfg.d_model))
    assert residual[0, 2:].abs().sum() > 0


@pytest.mark.skipif(
    not targets.hooked_generate_masks_no_padding(RELEASE),
    reason=f"TransformerLens {RELEASE}'s generate takes positions from the tokens",
)
def test_the_verifier_fails_stock_generate_that_drops_positions() -> None:
    """``safelens-tl verify --no-patch --dtype float32`` on 2.18 or 3.0.0: cached and uncached
    ``generate`` agree (both without positions), so only the check against each prompt alone
    sees it."""
    result = runner.verify_model(models.build_model("gpt2-like", torch.float32))
    check = result.checks[0]
    assert not result.passed and result.patched is False
    assert check.max_rel_err is not None and check.max_rel_err <= checks.TOLERANCES[torch.float32]
    assert check.alone_gap is not None and check.alone_gap > 0.1
    assert check.error is not None and "not greedy for each prompt alone" in check.error


def test_the_verifier_holds_patched_generate_to_each_prompt_alone(
    patched: safelens_tl.activation.Status,
) -> None:
    result = runner.verify_model(models.build_model("gpt2-like", torch.float32))
    assert result.passed, result.checks[0].error
    assert result.checks[0].alone_gap == 0.0
