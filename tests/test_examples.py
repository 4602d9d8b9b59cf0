"""Every script in examples/ runs to completion, as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_bridge, requires_hooked_transformer

EXAMPLES = Path(__file__).parent.parent / "examples"
#: Each example and the TransformerLens API it needs.
NEEDS: dict[str, pytest.MarkDecorator] = {
    "fp16_generate.py": requires_hooked_transformer,
    "own_decode_loop.py": requires_hooked_transformer,
    "transformer_bridge.py": requires_bridge,
}


def test_every_example_is_listed() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(NEEDS)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=mark) for name, mark in sorted(NEEDS.items())]
)
def test_example_runs(name: str) -> None:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip(), "an example should show its result"
