"""The repository's text speaks to users: no notes about how it was written.

Every tracked ``*.md``, ``*.py``, ``*.ini``, ``*.toml``, ``*.sh``, ``*.yml`` file and ``.ci/run``
is searched for the wording of the project's working log (:data:`FORBIDDEN` lists the patterns),
which belongs in git history, not in the reference. pytest's own vocabulary (:data:`ALLOWED`) and
links to upstream issues are allowed. This file is skipped: it spells the patterns out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.release_independent

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = (".md", ".py", ".ini", ".toml", ".sh", ".yml")
EXTRA_FILES = (".ci/run",)

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|[a-z]+teenth|[a-z]+tieth|(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)-[a-z]+"
    r"|\d+(?:st|nd|rd|th))"
)
#: Each pattern and what it stands for, as the failure names it.
FORBIDDEN: dict[str, re.Pattern[str]] = {
    "a work session": re.compile(r"\bsessions?\b", re.I),
    "an ordinal session": re.compile(rf"\b{_ORDINAL}[\s-]+sessions?\b", re.I),
    "a numbered stop": re.compile(r"\bstops?\s+#?\d+", re.I),
    "an internal issue number": re.compile(
        r"(?<!upstream )(?<!TransformerLens )(?<!TransformerLens's )\bissues?\s+#?\d+", re.I
    ),
    "a lent machine": re.compile(r"\blent\b", re.I),
    "a drawn machine": re.compile(r"\bdrawn\b", re.I),
}
#: pytest's own uses of "session", removed from a line before it is searched.
ALLOWED = re.compile(
    r"pytest[ -]sessions?\b|\bsession[- ]scoped\b|\bscope\s*=\s*[\"']session[\"']"
    r"|\bsessionstart\b|\bsessionfinish\b",
    re.I,
)


def problems(line: str) -> list[str]:
    """What in ``line`` the repository must not say (empty when nothing)."""
    searched = ALLOWED.sub("", line)
    return [name for name, pattern in FORBIDDEN.items() if pattern.search(searched)]


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    return [
        REPO / name
        for name in listed
        if name and (name.endswith(SUFFIXES) or name in EXTRA_FILES) and (REPO / name).is_file()
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # Placeholder words around each pattern: the self-check needs no sentence of a log.
        ("x session y", ["a work session"]),
        ("x thirty-fifth session y", ["a work session", "an ordinal session"]),
        ("x 26th sessions y", ["a work session", "an ordinal session"]),
        ("x stop 34 y", ["a numbered stop"]),
        ("x issue 13 y", ["an internal issue number"]),
        ("x issues 6 y", ["an internal issue number"]),
        ("x lent y", ["a lent machine"]),
        ("x drawn y", ["a drawn machine"]),
        ("(upstream issue #1005, fixed in 3.1)", []),
        ("saved once per pytest session", []),
        ('@pytest.fixture(scope="session")', []),
        ("a session-scoped fixture builds it", []),
        ("the loop stops at the first end token", []),
    ],
)
def test_the_patterns_catch_what_they_should(line: str, expected: list[str]) -> None:
    """A self-check: the search below can fail, and does not fail on legitimate wording."""
    assert problems(line) == expected


def test_the_search_covers_the_repository() -> None:
    names = {path.relative_to(REPO).as_posix() for path in tracked_files()}
    for name in ("README.md", "CHANGELOG.md", "tox.ini", "pyproject.toml", ".ci/run"):
        assert name in names
    assert any(name.startswith("safelens_tl/") for name in names)


def test_no_tracked_text_speaks_of_how_it_was_written() -> None:
    found = []
    for path in tracked_files():
        if path.name == Path(__file__).name:
            continue  # this file quotes the words it forbids
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for name in problems(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {name}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but ``-`` and ``_`` gone,
    spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_into_a_document_names_one_of_its_headings() -> None:
    """``[text](docs/performance.md#section)``: a renamed heading or fix breaks such links
    silently."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    link = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")
    checked, broken = 0, []
    for name in tracked:
        source = REPO / name
        for target, anchor in link.findall(source.read_text(encoding="utf-8")):
            document = (source.parent / target).resolve() if target else source
            if not document.is_file():
                broken.append(f"{name}: {target} does not exist")
                continue
            text = document.read_text(encoding="utf-8")
            headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
            # docs/fixes.md's generated table gives each fix an anchor of its own.
            anchors = {_anchor(heading) for heading in headings} | set(
                re.findall(r'id="([^"]+)"', text)
            )
            checked += 1
            if anchor not in anchors:
                broken.append(f"{name}: #{anchor} is no heading or anchor of {target or name}")
    assert checked >= 10, f"only {checked} links with an anchor found: is the pattern right?"
    assert not broken, "\n".join(broken)
