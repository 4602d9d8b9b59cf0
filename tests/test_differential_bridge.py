"""Patched against stock ``TransformerBridge.generate`` on generated calls
(:mod:`tests.differential`): every difference is one a fix claims, and otherwise patched is
stock, bitwise, with the same view to hooks (batch size and shapes of every forward, in order).

The grid: Llama (rotary, grouped-query) and GPT-2 (learned positions) checkpoints of the
architecture sweep, prompts of equal or different lengths, a list, one string or a padded tensor,
cached or not, greedy or seeded sampling, float32 or bfloat16. With transformers 5.24 and later,
stock's cached calls are the cache-argument bug (each step attends to itself): claimed wherever
they differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from tests import differential
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

pytestmark = requires_bridge

AXES: dict[str, tuple[Any, ...]] = {
    "architecture": ("LlamaForCausalLM", "GPT2LMHeadModel"),
    "lengths": ("equal", "different"),
    "input": ("list", "str", "tensor"),
    "cached": ("cached", "uncached"),
    "sampling": ("greedy", "sampled"),
    "dtype": (torch.float32, torch.bfloat16),
}
POINTS = differential.sample_grid(AXES)
HOOKS = ("blocks.0.hook_resid_pre", "blocks.0.hook_resid_post")
#: As for HookedTransformer (tests/test_differential_hooked.py): rounding, relative to the
#: largest logit, between a batch and one prompt through the same model.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

_models: dict[tuple[str, torch.dtype, bool], Any] = {}


def model_for(point: dict[str, Any], active: bool) -> Any:
    """The point's tiny bridge, booted once per state: some fixes act when a bridge is booted
    (its conversion to a dtype), so stock and patched each boot their own."""
    key = (point["architecture"], point["dtype"], active)
    if key not in _models:
        if active:
            safelens_tl.activate()
        try:
            folder = str(architecture_folder(point["architecture"]))
            _models[key] = benchmark_module("bridge_architectures").boot(folder, point["dtype"])
        finally:
            safelens_tl.deactivate()
    return _models[key]


def outcome(point: dict[str, Any], active: bool) -> differential.Outcome:
    """The point's ``generate`` call, stock or patched, each on its own bridge."""
    return differential.generate_outcome(model_for(point, active), point, active, HOOKS)


def verdict(point: dict[str, Any]) -> differential.Verdict:
    """The rule applied to one grid point; the reference is the stock bridge's forward where
    stock's forward is right (uncached, one row), the patched bridge's otherwise the same."""
    model = model_for(point, active=False)
    prompts = [model.to_tokens(prompt) for prompt in differential.prompts_of(point)]
    if point["input"] == "tensor" and point["lengths"] == "different":
        # A padded tensor carries no mask: every release runs each row as given, padding and
        # all, so each row's own forward is the row as given.
        prompts = list(differential.given_of(model, point).split(1))
    return differential.judge(
        outcome(point, active=False),
        outcome(point, active=True),
        lambda found: differential.teacher_forced_error(
            found, prompts, differential.uncached_forward(model)
        ),
        TOLERANCE[point["dtype"]],
    )


@pytest.mark.parametrize("point", POINTS, ids=[differential.point_id(p) for p in POINTS])
def test_patched_is_stock_unless_stock_is_wrong(point: dict[str, Any]) -> None:
    found = verdict(point)
    assert found.kind != "regression", found.detail


def test_the_sample_covers_every_axis_value() -> None:
    """The sample is no narrower than the grid: each value of each axis is in it."""
    for axis, values in AXES.items():
        sampled = {point[axis] for point in POINTS}
        assert sampled == set(values), (axis, sampled)
