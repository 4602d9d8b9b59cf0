"""``safelens-tl verify --model`` on what is no usable checkpoint: one line on stderr that says
what is wrong with the path or the checkpoint, exit 2, nothing reported as a failed check; on every
release (HookedTransformer's loader on 2.x/3.x, TransformerBridge's on 4.x). Run in process
through the command line's own ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safelens_tl import cli
from safelens_tl.verify import bridge, local_model, models, report


def verify_model(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["verify", "--model", path, "--dtype", "float16", "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The verifier's error line (third-party warnings may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("safelens-tl verify: error:")]
    assert len(lines) == 1, err
    return lines[0]


def heads_not_a_multiple(tmp_path: Path) -> Path:
    """A real Llama checkpoint whose config has 4 attention heads and 3 key-value heads."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=models.vocab_size(),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=3,
        head_dim=16,
    )
    return bridge.save_checkpoint(config, "bad-heads", models.load_tokenizer())


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("empty folder", "the folder has no config.json"),
        ("gguf file", "is a file, not a checkpoint folder"),
        ("config without weights", "has config.json but no weights"),
        ("4 heads, 3 key-value heads", "4 attention heads and 3 key-value heads"),
        ("missing folder", "no such file or folder"),
        ("missing gguf", "no such file or folder"),
    ],
)
def test_a_bad_checkpoint_is_one_line_and_exit_2(
    case: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if case == "empty folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif case == "gguf file":
        path = tmp_path / "model.gguf"
        path.write_bytes(b"GGUF")
    elif case == "config without weights":
        path = tmp_path / "config-only"
        path.mkdir()
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        (path / "config.json").write_text(json.dumps(config))
    elif case == "4 heads, 3 key-value heads":
        path = heads_not_a_multiple(tmp_path)
    elif case == "missing folder":
        path = tmp_path / "nowhere"
    else:
        path = tmp_path / "nowhere.gguf"
    code, out, err = verify_model(str(path), capsys)
    assert code == 2, (out, err)
    line = one_error_line(err)
    assert f"--model {path}" in line and expected in line, line
    assert "Hugging Face Hub" not in line and "official model names" not in line, line
    assert "FAILED" not in out


def test_a_checkpoint_that_fails_to_load_is_a_load_error_not_a_failed_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever the files cannot tell: a checkpoint whose weights do not load (here, weights of
    another shape than its config says) is reported as what it is, exit 2."""
    from transformers import LlamaConfig

    small = LlamaConfig(
        vocab_size=models.vocab_size(),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    folder = bridge.save_checkpoint(small, "mismatched", models.load_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=64, num_attention_heads=4)
    (folder / "config.json").write_text(json.dumps(config))
    code, out, err = verify_model(str(folder), capsys)
    assert code == 2, (out, err)
    line = one_error_line(err)
    assert str(folder) in line and ("cannot load" in line or "size" in line), line


def test_a_hub_name_is_not_taken_for_a_path() -> None:
    """``org/model`` is a Hub name; paths are written as paths."""
    assert not local_model.looks_like_a_path("HuggingFaceTB/SmolLM2-135M")
    assert local_model.checkpoint_problem("HuggingFaceTB/SmolLM2-135M") is None
    for path in ("./m", "/m", "~/m", "a/b/c", "m.gguf"):
        assert local_model.looks_like_a_path(path), path


@pytest.mark.parametrize(("passed", "failed"), [(1, 0), (0, 1), (2, 0), (1, 1)])
def test_the_summary_counts_checks_in_words(passed: int, failed: int) -> None:
    checks = [
        report.CheckResult(model="m", dtype="float16", device="cpu", passed=True)
        for _ in range(passed)
    ] + [
        report.CheckResult(model="m", dtype="float16", device="cpu", passed=False)
        for _ in range(failed)
    ]
    line = report.summary_line(
        report.Report(
            patched=True,
            transformer_lens="x",
            torch=torch.__version__,
            safelens_tl="y",
            checks=checks,
        )
    )
    total = passed + failed
    if total == 1:
        assert ("PASSED: the 1 check:" if passed else "FAILED: the 1 check failed") in line
    elif failed:
        assert f"FAILED: {failed} of {total} checks failed" in line
    else:
        assert f"PASSED: all {total} checks:" in line
    assert "all 1 checks" not in line and "1 of 1" not in line
