"""README.md as a newcomer reads it: the first screen, and the commands CI runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.warm_python import run_python

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = README.split("\n## What it fixes\n")[0]


def test_the_first_screen_fits_60_lines_and_has_the_two_commands() -> None:
    assert FIRST_SCREEN.count("\n") <= 60
    assert "python -m pip install . && safelens-tl verify" in FIRST_SCREEN
    test_command = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()[-1]
    assert test_command.startswith("python3 -m tox run-parallel")
    assert test_command.removeprefix("python3 ") in FIRST_SCREEN.replace("python -m", "-m")
    for page in ("docs/verify.md", "docs/how-it-works.md", "docs/auto-activation.md"):
        assert f"]({page})" in FIRST_SCREEN
        assert (REPO / page).is_file()


def test_the_install_keeps_the_user_s_torch_and_says_when_to_pin_it() -> None:
    """``pip install .`` keeps a torch already installed; the pinned line is for a fresh
    environment. No placeholder stands for a URL."""
    lines = [line for line in FIRST_SCREEN.splitlines() if line.startswith("python -m pip install")]
    assert lines[0].startswith("python -m pip install .  ") and "yours is kept" in lines[0], lines
    assert lines[1].startswith('python -m pip install "torch==2.13.0" .') and "fresh" in lines[1]
    assert "<URL" not in README and "git+<" not in README


def test_the_first_screen_shows_transformer_bridge_before_hooked_transformer() -> None:
    """``pip install transformer-lens`` gives 4.x, which has no ``HookedTransformer``: the first
    screen's example uses ``TransformerBridge``; the ``HookedTransformer`` one says its releases."""
    assert "TransformerBridge.boot_transformers(" in FIRST_SCREEN
    assert "HookedTransformer.from_pretrained" not in FIRST_SCREEN
    hooked = README.index("HookedTransformer.from_pretrained")
    assert "TransformerLens 2.x/3.x" in README[hooked - 400 : hooked]


def test_the_verify_table_s_cache_column_is_explained() -> None:
    assert "`2h`" in README and "key/value heads" in README


def test_each_environment_ends_with_its_counts(tmp_path: Path) -> None:
    """Under tox two environments share the terminal: each ends with ``[env] N passed, ...``."""
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "@pytest.mark.skip(reason='shown as skipped')\n"
        "def test_skipped():\n    pass\n"
    )
    done = run_python(
        ["-m", "pytest", "-q", "-p", "tests.conftest", str(tmp_path)],
        cwd=REPO,
        timeout=300,
        env={**os.environ, "TOX_ENV_NAME": "tl999", "HF_HUB_OFFLINE": "1", "PYTEST_ADDOPTS": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[tl999] 1 passed, 1 skipped, 0 failed, 0 error (exit status 0)" in done.stdout
