"""The verifier tells a deep model's rounding from a broken cache (TransformerBridge rows).

A deep model in half precision rounds its cached path further from its uncached forward than a
tiny one (a 30-layer Llama in bfloat16: 2e-2), past the dtype's fixed tolerance, while a cache
that is 1% off moves a tiny model's logits by less than that. The verdict holds such an error to
twice Hugging Face's own cached-against-uncached error on the same checkpoint, once the same
checkpoint in float32 shows the cached path exact; a cache 1% off still fails, on the built-in
models and on a deep one. The deep model: a 24-layer Llama with grouped-query attention (6 query
and 2 key-value heads), random weights wide enough (std 0.1) to round as a trained model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, models, runner
from tests.conftest import requires_bridge

pytestmark = [requires_bridge, pytest.mark.release_independent]

HALF = (torch.float16, torch.bfloat16)
_deep: list[Path] = []


def deep_llama() -> Path:
    """The deep checkpoint, saved once per test run."""
    if not _deep:
        from transformers import LlamaConfig

        tokenizer = models.load_tokenizer()
        config = LlamaConfig(
            vocab_size=models.vocab_size(),
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=24,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.1,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        _deep.append(bridge.save_checkpoint(config, "deep-llama", tokenizer))
    return _deep[0]


def check(folder: Path, dtype: torch.dtype) -> Any:
    return runner._bridge_check("deep-llama", dtype, "cpu", folder=str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_deep_model_passes_within_its_own_rounding(
    patched: safelens_tl.activation.Status, dtype: torch.dtype
) -> None:
    """Both dtypes pass, each past a fixed bound (float16 its own error, bfloat16 its error
    against Hugging Face's forward), and the report says why that is rounding."""
    result = check(deep_llama(), dtype)
    assert result.passed, result.error
    fixed = [runner.tolerance_for(dtype), bridge.REFERENCE_TOLERANCES[dtype]]
    errors = [result.max_rel_err, result.reference_rel_err]
    assert any(error > bound for error, bound in zip(errors, fixed, strict=True)), errors
    assert result.rounding is not None and result.rounding.startswith("within rounding")
    assert f"{result.hugging_face_cached_rel_err:.1e}" in result.rounding


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "part"), [(torch.float16, "keys"), (torch.bfloat16, "values")], ids=str
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
    assert result.rounding is None or result.rounding.startswith("not rounding"), result.rounding


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
    """The whole verdict, float32 control included, not only the error against the tolerance
    (tests/test_verify_tolerances.py)."""
    corrupt_past["part"] = part
    result = runner._bridge_check(name, dtype, "cpu")
    assert not result.passed, result.rounding


def test_the_report_shows_hugging_face_s_own_rounding_and_says_when_within_it() -> None:
    """The table's ``HF own`` column, its legend, and the line that says an error is rounding."""
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
        hugging_face_cached_rel_err=2.1e-3,
        rounding="within rounding: because",
    )
    console = Console(record=True, width=250)
    render(
        Report(patched=True, transformer_lens="x", torch="y", safelens_tl="z", checks=[row]),
        console,
    )
    text = console.export_text()
    assert "HF own**" in text and "2.1e-03" in text and "2.2e-03 <= 4.2e-03" in text
    assert "** Hugging Face's own cached generate" in text
    assert "m [bridge] float16 cpu: within rounding: because" in text
