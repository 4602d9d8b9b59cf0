"""The verifier tells a deep model's rounding from a broken cache (TransformerBridge rows).

A deep model in half precision rounds its cached path further from its uncached forward than a
tiny one (a 24-layer model in float16: 5e-3), past the dtype's floor. The allowance grows with
what the model's own uncached forwards show when only the order of their sums changes
(:mod:`safelens_tl.verify.oracle`), never with a cached path; a cache whose past keys or values
are a few percent off still fails, on the built-in models and on a deep one. The deep model:
``benchmarks/verify_sensitivity.py``'s Llama with grouped-query attention (6 query and 2
key-value heads), random weights wide enough (std 0.1) to round as a trained model, at
:data:`DEPTH` layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, oracle, runner
from tests.conftest import benchmark_module, requires_bridge

pytestmark = [requires_bridge, pytest.mark.release_independent]

HALF = (torch.float16, torch.bfloat16)
#: Half the benchmark's 24 layers: a check takes half as long, and the model still rounds past
#: both floors (float16: order 2.6e-3, allowance 5.3e-3 against 2e-3; bfloat16: allowance 3.2e-2
#: against 8e-3), while keys 0.1% (float16) and 0.2% (bfloat16) off already fail
#: (`benchmarks/verify_sensitivity.py --api bridge --model deep --layers 12`, docs/verify.md).
DEPTH = 12
_deep: list[Path] = []


def deep_llama() -> Path:
    """The deep checkpoint, saved once per test run."""
    if not _deep:
        _deep.append(Path(benchmark_module("verify_sensitivity").deep_llama(DEPTH)))
    return _deep[0]


def check(folder: Path, dtype: torch.dtype) -> Any:
    return runner._bridge_check("deep-llama", dtype, "cpu", folder=str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_deep_model_passes_within_its_own_rounding(
    patched: safelens_tl.activation.Status, dtype: torch.dtype
) -> None:
    """Both dtypes pass; the allowance is what the model's uncached forwards show (above the
    floor) and the row says so; at least 64 cached positions are compared."""
    result = check(deep_llama(), dtype)
    assert result.passed, result.error
    assert result.cached_positions >= 64
    assert result.order_rel_err is not None and result.tolerance is not None
    assert result.tolerance > oracle.FLOORS[dtype]
    assert result.tolerance == min(oracle.ORDER_FACTOR * result.order_rel_err, oracle.CEILING)
    assert "order of its sums" in (result.allowance or "")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "part"), [(torch.float16, "keys"), (torch.bfloat16, "keys")], ids=str
)
def test_a_deep_model_with_a_cache_1_percent_off_fails(
    patched: safelens_tl.activation.Status,
    corrupt_past: dict[str, Any],
    dtype: torch.dtype,
    part: str,
) -> None:
    corrupt_past["part"] = part
    result = check(deep_llama(), dtype)
    assert not result.passed
    assert result.max_rel_err is not None and result.tolerance is not None
    assert result.max_rel_err > result.tolerance


@pytest.mark.parametrize("part", ("keys", "values"))
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(bridge.BRIDGE_MODELS))
def test_a_built_in_model_with_a_cache_1_percent_off_fails_the_verdict(
    patched: safelens_tl.activation.Status,
    corrupt_past: dict[str, Any],
    name: str,
    dtype: torch.dtype,
    part: str,
) -> None:
    """The whole verdict, allowance included, not only the error against the floor
    (tests/test_verify_tolerances.py)."""
    corrupt_past["part"] = part
    result = runner._bridge_check(name, dtype, "cpu")
    assert not result.passed, result.error
    assert result.tolerance == oracle.FLOORS[dtype], result.allowance


def test_the_report_shows_the_order_and_the_cached_positions() -> None:
    """The table's ``order`` and ``cached pos`` columns, and the legend of ``order``."""
    from rich.console import Console

    from safelens_tl.verify.report import CheckResult, Report, render

    row = CheckResult(
        model="m [bridge]",
        dtype="float16",
        device="cpu",
        kind="bridge",
        passed=True,
        max_rel_err=2.2e-3,
        tolerance=4.2e-3,
        order_rel_err=2.1e-3,
        cached_positions=73,
    )
    console = Console(record=True, width=250)
    render(
        Report(patched=True, transformer_lens="x", torch="y", safelens_tl="z", checks=[row]),
        console,
    )
    text = console.export_text()
    assert "order**" in text and "2.1e-03" in text and "2.2e-03 <= 4.2e-03" in text
    assert " cached " in text and " 73 " in text
    assert "** how far the model's uncached forward moves" in text
