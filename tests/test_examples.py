"""Every script in examples/ runs to completion on every TransformerLens release, as a user would
run it: where the release has the API it shows, it shows its result; where it has not, it exits 0
with one line naming the releases it is for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER
from tests.warm_python import run_python

pytestmark = pytest.mark.docs

EXAMPLES = Path(__file__).parent.parent / "examples"
#: Each example, whether the installed release has what it needs, and the releases it names
#: when it has not.
NEEDS: dict[str, tuple[bool, str]] = {
    "fp16_generate.py": (HAS_HOOKED_TRANSFORMER, "TransformerLens 2.x/3.x"),
    "own_decode_loop.py": (HAS_HOOKED_TRANSFORMER, "TransformerLens 2.x/3.x"),
    "transformer_bridge.py": (HAS_BRIDGE, "TransformerLens 3.x/4.x"),
}


def test_every_example_is_listed() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(NEEDS)


def test_no_example_uses_the_verifier_s_private_helpers_for_transformer_bridge() -> None:
    """The TransformerBridge example builds its model with transformers' and tokenizers' public
    classes, as a user can copy it."""
    text = (EXAMPLES / "transformer_bridge.py").read_text(encoding="utf-8")
    assert "safelens_tl.verify" not in text


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_example_runs(name: str) -> None:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = run_python([str(EXAMPLES / name)], env=environment, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    output = completed.stdout.strip()
    available, releases = NEEDS[name]
    if available:
        assert output, "an example should show its result"
        assert " is for " not in output, output
    else:
        assert output.splitlines() == [output], output
        assert f"examples/{name} is for {releases}" in output, output
