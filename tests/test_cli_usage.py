"""The ``safelens-tl`` command's usage errors: each names what is wrong, exits 2, and answers
before anything slow is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from safelens_tl.cli import EXIT_USAGE, main

pytestmark = pytest.mark.release_independent


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["--bogus", "status"], ["status", "--bogus"], ["verify", "--bogus"]],
    ids=["alone", "before-a-command", "after-status", "after-verify"],
)
def test_an_unknown_option_is_named(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse names an unknown option only where the command is not a required argument;
    otherwise ``safelens-tl --bogus`` said that COMMAND is required."""
    assert main(argv) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in error, error
    assert "required" not in error, error


def test_a_missing_command_is_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "the following arguments are required: COMMAND (verify or status)" in error, error


def test_an_unknown_command_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verfy"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "invalid choice: 'verfy'" in error and "verify" in error and "status" in error, error


def test_the_installed_command_names_an_unknown_option() -> None:
    """The same through ``python -m safelens_tl``, as a shell runs it: one line, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "safelens_tl", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "safelens-tl: error: unrecognized arguments: --bogus" in done.stderr
    assert "Traceback" not in done.stderr


#: Runs ``verify --model PATH`` for each path given, in one fresh interpreter, and prints per path
#: the exit code, the error lines and which of the slow modules were imported by then.
_CHILD = """
import contextlib, io, json, sys
from safelens_tl.cli import main
slow = ("torch", "transformers", "transformer_lens")
results = []
for path in sys.argv[1:]:
    error = io.StringIO()
    with contextlib.redirect_stderr(error):
        code = main(["verify", "--model", path])
    imported = [name for name in slow if name in sys.modules]
    results.append({"path": path, "code": code, "error": error.getvalue(), "imported": imported})
print(json.dumps(results))
"""


def _checkpoint_folders(root: Path) -> dict[str, tuple[str, str]]:
    """Paths that are no checkpoint, each with the words its error must hold."""
    (root / "model.gguf").write_bytes(b"GGUF")
    (root / "empty").mkdir()
    (root / "no-weights").mkdir()
    (root / "no-weights" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"]}), encoding="utf-8"
    )
    heads = root / "heads"
    heads.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6}
    (heads / "config.json").write_text(
        json.dumps({**config, "num_key_value_heads": 4}), encoding="utf-8"
    )
    (heads / "model.safetensors").write_bytes(b"")
    return {
        str(root / "no-such-folder"): ("no such file or folder", ""),
        str(root / "model.gguf"): ("is a file, not a checkpoint folder", "gguf_file"),
        str(root / "empty"): ("the folder has no config.json", ""),
        str(root / "no-weights"): ("no weights", "save_pretrained"),
        str(heads): ("6 attention heads and 4 key-value heads", "multiple"),
    }


def test_a_model_path_error_answers_before_torch_and_transformer_lens_are_imported(
    tmp_path: Path,
) -> None:
    """A mistyped ``--model`` folder took 5-8 s to be refused, the time TransformerLens takes to
    import. The path is now checked from its files first: one line, exit 2, and neither torch,
    transformers nor TransformerLens imported (the deterministic form of "under a second")."""
    expected = _checkpoint_folders(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *expected],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [result["path"] for result in results] == list(expected)
    for result in results:
        words, advice = expected[result["path"]]
        lines = result["error"].splitlines()
        assert result["code"] == EXIT_USAGE, result
        assert len(lines) == 1, result
        assert lines[0].startswith("safelens-tl verify: error: --model "), result
        assert words in lines[0] and advice in lines[0], result
        assert result["imported"] == [], result
