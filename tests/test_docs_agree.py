"""Figures and commands that several documents give agree with their one source.

The append speed-up is measured in docs/performance.md's table; README.md and CHANGELOG.md quote
it. The development install is CONTRIBUTING.md's; README.md repeats it. Figures name the release
and the command behind them, not a commit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]


def _read(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def append_speed_ups(performance: str) -> dict[str, str]:
    """docs/performance.md's "KV-cache append" table: cached positions -> stock / patched."""
    section = performance.split("### KV-cache append", 1)[1].split("\n### ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    header, *body = ([cell.strip() for cell in row] for row in rows)
    column = header.index("stock / patched")
    return {row[0]: row[column] for row in body}


#: How README.md and CHANGELOG.md quote the table: "1,399x ... at 4,096 cached positions and
#: 2,803x at 8,192".
QUOTE = re.compile(
    r"(\d[\d,.]*x)[^.|]*?\s+at\s+4,096\s+cached\s+positions\s+and\s+(\d[\d,.]*x)\s+at\s+8,192"
)


def test_the_append_table_is_read() -> None:
    ratios = append_speed_ups(_read("docs/performance.md"))
    assert {"4,096", "8,192"} <= set(ratios), ratios
    assert all(re.fullmatch(r"\d[\d,.]*x", ratio) for ratio in ratios.values()), ratios


@pytest.mark.parametrize("document", ["README.md", "CHANGELOG.md"])
def test_the_append_speed_up_is_quoted_from_performance_md(document: str) -> None:
    ratios = append_speed_ups(_read("docs/performance.md"))
    quotes = QUOTE.findall(_read(document))
    assert quotes, f"{document} does not quote the append speed-up of docs/performance.md"
    for at_4096, at_8192 in quotes:
        assert (at_4096, at_8192) == (ratios["4,096"], ratios["8,192"]), (document, quotes)


def test_the_quote_pattern_catches_a_stale_figure() -> None:
    stale = "about 900x faster than stock per append at 4,096 cached positions and\n3,000x at 8,192"
    assert QUOTE.findall(stale) == [("900x", "3,000x")]


def _install_lines(text: str) -> list[str]:
    """The `pip install -e` lines of a document's code blocks."""
    return [line.strip() for line in text.splitlines() if "pip install -e " in line]


def _one_file_lines(text: str) -> list[str]:
    """The commands that run one test file with pytest (comments dropped)."""
    return [
        line.split("#", 1)[0].strip()
        for line in text.splitlines()
        if re.search(r"\bpytest -q tests/\S+\.py", line) and "tox" not in line
    ]


def test_readme_and_contributing_install_the_same_development_environment() -> None:
    readme, contributing = _read("README.md"), _read("CONTRIBUTING.md")
    assert _install_lines(contributing), "CONTRIBUTING.md has no `pip install -e` line"
    assert _install_lines(readme) == _install_lines(contributing)
    assert _one_file_lines(contributing), "CONTRIBUTING.md runs no single test file"
    assert _one_file_lines(readme) == _one_file_lines(contributing)


def test_the_development_install_takes_the_release_ci_tests_last() -> None:
    """The TransformerLens of the development install is the newest one tox.ini tests."""
    tested = re.findall(r"transformer-lens==(\d+\.\d+\.\d+)", _read("tox.ini"))
    (line,) = _install_lines(_read("CONTRIBUTING.md"))
    (installed,) = re.findall(r"transformer-lens==(\d+\.\d+\.\d+)", line)
    newest = max(tested, key=lambda version: tuple(int(part) for part in version.split(".")))
    assert installed == newest, (installed, tested)


#: A commit named as the origin of a figure ("code `05ca65f`"): figures name the release and the
#: command that gives them.
COMMIT = re.compile(r"`[0-9a-f]{7,40}`")


def test_figures_name_no_commit() -> None:
    documents = ["README.md", "CONTRIBUTING.md", *sorted(
        path.relative_to(REPO).as_posix() for path in (REPO / "docs").glob("*.md")
    )]  # fmt: skip
    found = [
        f"{name}:{number}: {line.strip()[:100]}"
        for name in documents
        for number, line in enumerate(_read(name).splitlines(), start=1)
        if COMMIT.search(line)
    ]
    assert len(documents) >= 8, documents
    assert not found, "\n".join(found)
    assert COMMIT.search("TL 3.9.0, code `05ca65f`, load average 0.8")
