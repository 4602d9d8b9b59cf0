"""The verifier's Python API on real tiny models, the model.half() diagnostic and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import safelens_tl
from safelens_tl.cli.verify import UsageError, parse_dtypes
from safelens_tl.verify import checks, diagnostics, models, report, runner
from safelens_tl.verify.cache_class_checks import cache_class_problems
from tests.conftest import RELEASE, requires_hooked_transformer


@requires_hooked_transformer
def test_verify_model_passes_on_a_patched_gqa_model_in_float16(
    patched: safelens_tl.activation.Status,
) -> None:
    model = models.build_model("llama-like-gqa", torch.float16)
    result = runner.verify_model(model, name="mine")
    assert result.passed, result.checks[0].error
    check = result.checks[0]
    assert (check.model, check.dtype, check.device) == ("mine", "float16", "cpu")
    assert check.max_rel_err is not None and check.max_rel_err <= checks.TOLERANCES[torch.float16]
    assert check.cache_dtype == "float16"
    assert check.cache_heads == model.cfg.n_key_value_heads == 2
    assert check.generate_ok is True and check.speedup is not None
    assert result.patched is True
    # The model was checked as it is: not converted, not moved.
    assert model.cfg.dtype == torch.float16
    assert next(model.parameters()).dtype == torch.float16


@requires_hooked_transformer
@pytest.mark.skipif(RELEASE != "3.0.0", reason="the dtype regression is TransformerLens 3.0.0's")
def test_verify_model_reports_stock_300_failure_as_a_failed_check() -> None:
    model = models.build_model("gpt2-like", torch.bfloat16)
    result = runner.verify_model(model)
    assert not result.passed and result.patched is False
    error = result.checks[0].error
    assert error is not None and "expected scalar type Float but found BFloat16" in error
    assert result.checks[0].generate_ok is False


@requires_hooked_transformer
def test_a_few_weights_in_float32_are_not_called_a_trap() -> None:
    """Apertus's activation keeps two scalars per layer in float32 and computes right; the
    diagnostic is for models whose weights are mostly in another dtype than ``cfg.dtype``."""
    model = models.build_model("llama-like-gqa", torch.bfloat16)
    model.blocks[0].ln1.w.data = model.blocks[0].ln1.w.data.float()
    assert diagnostics.half_trap(model) is None


@requires_hooked_transformer
def test_half_trap_is_named_with_its_fix(patched: safelens_tl.activation.Status) -> None:
    model = models.build_model("gpt2-like", torch.float32).half()
    assert model.cfg.dtype == torch.float32  # what makes .half() a trap
    result = runner.verify_model(model)
    assert not result.passed
    assert any("model.to(torch.float16)" in line for line in result.diagnostics)
    error = result.checks[0].error
    assert error is not None and "model.half() trap" in error
    assert diagnostics.half_trap(model.to(torch.float16)) is None


@requires_hooked_transformer
def test_the_comparison_sees_a_broken_cache(patched: safelens_tl.activation.Status) -> None:
    """A frozen cache forgets every past token; the error must dwarf every tolerance."""
    model = models.build_model("llama-like-gqa", torch.float32)
    assert checks.teacher_forced(model).max_rel_err <= checks.TOLERANCES[torch.float32]
    assert checks.frozen_cache_control(model) > 10 * max(checks.TOLERANCES.values())


@requires_hooked_transformer
def test_left_padding_mask_keeps_a_bos_that_doubles_as_pad() -> None:
    tokenizer = models.load_tokenizer()
    pad, bos = tokenizer.pad_token_id, tokenizer.bos_token_id
    tokens = torch.tensor([[pad, pad, bos, 7, pad], [bos, 7, 8, 9, 10]])
    mask = checks.left_padding_mask(tokens, tokenizer, prepend_bos=True)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    tokenizer.pad_token = tokenizer.bos_token  # GPT-2's tokenizer: pad is BOS
    tokens = torch.tensor([[bos, bos, bos, 7], [bos, 7, 8, 9]])
    mask = checks.left_padding_mask(tokens, tokenizer, prepend_bos=True)
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patched_cache_classes_pass(
    patched: safelens_tl.activation.Status, dtype: torch.dtype
) -> None:
    assert cache_class_problems(dtype, "cpu") == []


@pytest.mark.skipif(RELEASE != "3.0.0", reason="the dtype regression is TransformerLens 3.0.0's")
def test_stock_300_cache_classes_fail_in_float16() -> None:
    problems = cache_class_problems(torch.float16, "cpu")
    assert any("empty entry is torch.float32" in problem for problem in problems)


def test_report_json_has_error_only_on_failed_checks(tmp_path: Path) -> None:
    good = report.CheckResult("m", "float16", "cpu", passed=True, max_rel_err=0.0)
    bad = report.CheckResult("m", "bfloat16", "cpu", passed=False, error="boom")
    full = report.Report(patched=True, transformer_lens=RELEASE, torch="x", safelens_tl="y")
    full.checks = [good, bad]
    path = tmp_path / "r.json"
    report.write_json(full, path)
    data = json.loads(path.read_text())
    assert data["passed"] is False
    assert "error" not in data["checks"][0] and data["checks"][1]["error"] == "boom"
    full.checks = [good]
    assert full.to_dict()["passed"] is True
    full.checks = []
    assert full.passed is False  # nothing checked is not a pass


def test_unwritable_report_path_is_refused_before_running(tmp_path: Path) -> None:
    with pytest.raises(report.ReportPathError, match="does not exist"):
        report.check_writable(tmp_path / "missing" / "r.json")
    with pytest.raises(report.ReportPathError, match="is a folder"):
        report.check_writable(tmp_path)
    report.check_writable(tmp_path / "r.json")  # a writable path is accepted
    assert not (tmp_path / "r.json").exists()  # and not created early


def test_dtype_lists_comma_separated_or_repeated() -> None:
    assert parse_dtypes(None) == [torch.float16, torch.bfloat16]
    assert parse_dtypes(["bfloat16,float32"]) == [torch.bfloat16, torch.float32]
    assert parse_dtypes(["fp16", "float16", "bf16"]) == [torch.float16, torch.bfloat16]
    with pytest.raises(UsageError, match="unknown dtype 'int8'"):
        parse_dtypes(["float16,int8"])
    with pytest.raises(UsageError, match="no dtype given"):
        parse_dtypes([" , "])


def test_the_built_in_models_run_on_one_thread_and_the_count_is_restored() -> None:
    """Too small to gain from a second thread, they lost time to it on a shared CPU; the caller's
    setting comes back afterwards, even after an error."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with runner.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), runner.one_thread():
            raise RuntimeError("a check failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
