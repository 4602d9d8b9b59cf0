"""README.md as a newcomer reads it: the first screen, and the commands CI runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = README.split("\n## What it fixes, and why")[0]


def test_the_first_screen_fits_60_lines_and_has_the_two_commands() -> None:
    assert FIRST_SCREEN.count("\n") <= 60
    assert 'python -m pip install "torch==2.13.0" . && safelens-tl verify' in FIRST_SCREEN
    test_command = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()[-1]
    assert test_command.startswith("python3 -m tox run-parallel")
    assert test_command.removeprefix("python3 ") in FIRST_SCREEN.replace("python -m", "-m")
    for page in ("docs/verify.md", "docs/how-it-works.md", "docs/auto-activation.md"):
        assert f"]({page})" in FIRST_SCREEN
        assert (REPO / page).is_file()


def test_each_environment_ends_with_its_counts(tmp_path: Path) -> None:
    """Under tox two environments share the terminal: each ends with ``[env] N passed, ...``."""
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "@pytest.mark.skip(reason='shown as skipped')\n"
        "def test_skipped():\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TOX_ENV_NAME": "tl999", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[tl999] 1 passed, 1 skipped, 0 failed, 0 error (exit status 0)" in done.stdout
