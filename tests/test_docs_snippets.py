"""Every Python snippet in README.md and docs/ runs as written, in a fresh interpreter, offline.

A snippet that cannot run here says so in an HTML comment on the line before it, and is skipped
with that reason: ``<!-- snippet: needs-download -->`` (a model from the Hugging Face hub),
``needs-hooked-transformer`` / ``needs-bridge`` (a TransformerLens that has it) or ``fragment``
(lines quoted from another program, not a program).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, RELEASE

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SNIPPET = re.compile(r"(?:<!-- snippet: (?P<mark>[a-z-]+) -->\n)?```python\n(?P<code>.*?)```", re.S)
SKIPS = {
    "needs-download": (True, "needs a model downloaded from the Hugging Face hub"),
    "fragment": (True, "lines quoted from TransformerLens, not a program"),
    "needs-hooked-transformer": (
        not HAS_HOOKED_TRANSFORMER,
        f"TransformerLens {RELEASE} has no HookedTransformer",
    ),
    "needs-bridge": (not HAS_BRIDGE, f"TransformerLens {RELEASE} has no TransformerBridge"),
}


def snippets() -> list[object]:
    """One pytest parameter per snippet, named ``file:line``, marked skip where it cannot run."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in SNIPPET.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            name = f"{document.relative_to(REPO)}:{line}"
            mark = match["mark"]
            if mark is not None and mark not in SKIPS:
                raise AssertionError(f"{name}: unknown snippet mark {mark!r}")
            skip, reason = SKIPS.get(mark or "", (False, ""))
            marks = [pytest.mark.skip(reason=reason)] if skip else []
            found.append(pytest.param(match["code"], id=name, marks=marks))
    return found


def test_the_documents_have_snippets() -> None:
    assert len(snippets()) >= 5


@pytest.mark.parametrize("code", snippets())
def test_snippet_runs_as_written(code: str, tmp_path: Path) -> None:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stderr[-3000:]
