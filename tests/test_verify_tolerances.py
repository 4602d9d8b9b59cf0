"""The verifier's tolerances pass a correct cache and fail one that is only 1% off, in every dtype.

A tolerance loose enough to pass a slightly wrong cache would make ``verify`` say "right" where it
is not. Each built-in model, in each dtype, is run with its past keys or values scaled by 1.01
after the prompt, through the real ``HookedTransformer`` cache and through TransformerBridge.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, checks, models
from tests.conftest import requires_bridge, requires_hooked_transformer

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PARTS = ("keys", "values")


@requires_hooked_transformer
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(models.BUILTIN_MODELS))
def test_a_cache_1_percent_off_fails_hooked_transformer_rows(
    patched: safelens_tl.activation.Status, name: str, dtype: torch.dtype, part: str
) -> None:
    model = models.build_model(name, dtype)
    tolerance = checks.TOLERANCES[dtype]
    assert checks.teacher_forced(model).max_rel_err <= tolerance
    assert checks.corrupted_cache_error(model, part, 1.01) > tolerance


@requires_bridge
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(bridge.BRIDGE_MODELS))
def test_a_cache_1_percent_off_fails_transformer_bridge_rows(
    patched: safelens_tl.activation.Status,
    corrupt_past: dict[str, Any],
    name: str,
    dtype: torch.dtype,
    part: str,
) -> None:
    model = bridge.boot(name, dtype)
    reference = bridge.reference_model(name, dtype)
    prompts = bridge.BATCHES[2]
    tolerance = checks.TOLERANCES[dtype]
    # Only the cached logits against the bridge's own uncached forward are read here.
    assert bridge.run_batch(model, reference, prompts, hf_generate=False).max_rel_err <= tolerance
    corrupt_past["part"] = part
    assert bridge.run_batch(model, reference, prompts, hf_generate=False).max_rel_err > tolerance
