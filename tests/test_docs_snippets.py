"""Every Python snippet in README.md and docs/ runs as written, in a fresh interpreter, offline.

An HTML comment on the line before a snippet says what it needs, as space-separated marks:
``<!-- snippet: needs-download -->`` (a model from the Hugging Face hub: skipped),
``gpt2-from-hub`` (it loads ``"gpt2"`` from the hub: it runs against a Hugging Face cache that
holds a tiny random GPT-2 under that name, so the code runs exactly as written, offline),
``needs-hooked-transformer`` / ``needs-bridge`` (a TransformerLens that has it: skipped, with the
reason, on the others) or ``fragment`` (lines quoted from another program: skipped).

A snippet that shows its output has it in the next ``text`` block, marked ``<!-- output -->`` on
the line before it; the snippet's standard output must be that text. ``<!-- output: patched -->``
is the output with safelens-tl active: the snippet then runs after ``import safelens_tl.patch``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, RELEASE
from tests.warm_python import run_python

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SNIPPET = re.compile(
    r"(?:<!-- snippet: (?P<marks>[a-z0-9 -]+?) -->\n)?```python\n(?P<code>.*?)```"
    r"(?P<after>(?:(?!```python).)*?<!-- output(?P<output_mark>: [a-z]+)? -->\n```text\n"
    r"(?P<output>.*?)```)?",
    re.S,
)
SKIPS = {
    "needs-download": (True, "needs a model downloaded from the Hugging Face hub"),
    "fragment": (True, "lines quoted from TransformerLens, not a program"),
    "needs-hooked-transformer": (
        not HAS_HOOKED_TRANSFORMER,
        f"TransformerLens {RELEASE} has no HookedTransformer",
    ),
    "needs-bridge": (not HAS_BRIDGE, f"TransformerLens {RELEASE} has no TransformerBridge"),
}
#: Marks that change how a snippet runs, not whether.
SETUPS = {"gpt2-from-hub"}
#: The hub name the ``gpt2-from-hub`` cache holds, and the commit its ``refs/main`` names.
HUB_NAME = "gpt2"
HUB_COMMIT = "0" * 40


@dataclass(frozen=True)
class Snippet:
    name: str
    code: str
    marks: tuple[str, ...]
    #: The output the document shows, or ``None`` when it shows none.
    output: str | None
    #: Whether that output is the one with safelens-tl active.
    patched: bool

    @property
    def skip_reason(self) -> str | None:
        for mark in self.marks:
            skip, reason = SKIPS.get(mark, (False, ""))
            if skip:
                return reason
        return None


def find_snippets() -> list[Snippet]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in SNIPPET.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            name = f"{document.relative_to(REPO)}:{line}"
            marks = tuple((match["marks"] or "").split())
            unknown = [mark for mark in marks if mark not in SKIPS and mark not in SETUPS]
            if unknown:
                raise AssertionError(f"{name}: unknown snippet marks {unknown}")
            output_mark = (match["output_mark"] or "").removeprefix(": ")
            if output_mark not in ("", "patched"):
                raise AssertionError(f"{name}: unknown output mark {output_mark!r}")
            found.append(
                Snippet(name, match["code"], marks, match["output"], output_mark == "patched")
            )
    return found


SNIPPETS = find_snippets()


def _params() -> list[object]:
    return [
        pytest.param(
            snippet,
            id=snippet.name,
            marks=[pytest.mark.skip(reason=snippet.skip_reason)] if snippet.skip_reason else [],
        )
        for snippet in SNIPPETS
    ]


def test_snippets_run_here_and_some_show_output() -> None:
    """Counted without the skipped ones: on every release three or more snippets run, and on
    every release with TransformerBridge or HookedTransformer one of them that loads a model."""
    runnable = [snippet for snippet in SNIPPETS if snippet.skip_reason is None]
    assert len(runnable) >= 3, [snippet.name for snippet in runnable]
    assert any("gpt2-from-hub" in snippet.marks for snippet in runnable), runnable
    assert any(snippet.output is not None for snippet in SNIPPETS)


def test_the_snippet_parser_finds_marks_and_output() -> None:
    """A self-check on a sample document: marks, the code, and the output block after it."""
    sample = (
        "<!-- snippet: gpt2-from-hub needs-bridge -->\n```python\nprint(1)\n```\n\nOutput:\n\n"
        "<!-- output: patched -->\n```text\n1\n```\n\n```python\nprint(2)\n```\n"
    )
    matches = list(SNIPPET.finditer(sample))
    assert [match["code"] for match in matches] == ["print(1)\n", "print(2)\n"]
    assert matches[0]["marks"] == "gpt2-from-hub needs-bridge"
    assert matches[0]["output"] == "1\n" and matches[0]["output_mark"] == ": patched"
    assert matches[1]["output"] is None


@pytest.fixture(scope="session")
def gpt2_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding a tiny random GPT-2 (and the verifier's word-level
    tokenizer) under the name ``gpt2``, as ``from_pretrained("gpt2")`` finds it offline."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from safelens_tl.verify.models import load_tokenizer

    cache = tmp_path_factory.mktemp("hub")
    repository = cache / f"models--{HUB_NAME}"
    snapshot = repository / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(HUB_COMMIT)
    tokenizer = load_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_ctx=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    return cache


@pytest.mark.parametrize("snippet", _params())
def test_snippet_runs_as_written(
    snippet: Snippet, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if "gpt2-from-hub" in snippet.marks:
        cache = request.getfixturevalue("gpt2_hub_cache")
        environment.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"))
    code = ("import safelens_tl.patch\n" if snippet.patched else "") + snippet.code
    done = run_python(["-c", code], cwd=tmp_path, timeout=300, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    if snippet.output is not None:
        assert done.stdout.strip() == snippet.output.strip(), done.stdout
