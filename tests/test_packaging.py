"""The distributions as a package index receives them, and the workflow that publishes them.

The built wheel and sdist carry the license and the start-up hook; the metadata names the
project's URLs; the description (the README as the index shows it) has no relative link; the
release workflow publishes a tag only when it names the package's version. tox's ``package``
environment builds the distributions and runs this file; the release workflow runs it on the very
files it publishes (``SAFELENS_TL_DIST``). It needs neither torch nor TransformerLens, and runs
without ``tests/conftest.py`` (``--noconftest``).
"""

from __future__ import annotations

import email
import email.message
import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[1]
REPOSITORY_URL = "https://github.com/safelens-tl/safelens-tl"
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
TAG_CHECK_STEP = "the tag is v + the package's version"


def package_version() -> str:
    """``__version__`` as safelens_tl/__init__.py writes it: the version's one place."""
    text = (REPO / "safelens_tl" / "__init__.py").read_text(encoding="utf-8")
    (version,) = re.findall(r'^__version__ = "([^"]+)"$', text, re.M)
    return version


VERSION = package_version()


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The wheel and the sdist: those in ``$SAFELENS_TL_DIST`` (the release workflow's), or built
    here from the working tree with ``python -m build``."""
    given = os.environ.get("SAFELENS_TL_DIST")
    if given:
        folder = Path(given)
    else:
        if importlib.util.find_spec("build") is None:
            pytest.skip("needs the build package (`python -m tox -e package` installs it)")
        folder = tmp_path_factory.mktemp("dist")
        command = [sys.executable, "-m", "build", "--outdir", str(folder), str(REPO)]
        # Without isolation where the build backend is installed (tox's package environment):
        # nothing to download.
        if all(importlib.util.find_spec(name) for name in ("hatchling", "hatch_fancy_pypi_readme")):
            command.append("--no-isolation")
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels, sdists = sorted(folder.glob("*.whl")), sorted(folder.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(folder.iterdir())
    yield wheels[0], sdists[0]
    if not given:
        shutil.rmtree(folder, ignore_errors=True)


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def test_the_wheel_ships_the_license_and_the_start_up_hook(dists: tuple[Path, Path]) -> None:
    wheel, _ = dists
    assert wheel.name == f"safelens_tl-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"safelens_tl-{VERSION}.dist-info"
        assert archive.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        # At the root of site-packages, where Python runs it at start-up; in RECORD, so that
        # `pip uninstall` removes it.
        assert archive.read("safelens_tl.pth") == (REPO / "safelens_tl.pth").read_bytes()
        record = archive.read(f"{info}/RECORD").decode()
    assert re.search(r"^safelens_tl\.pth,", record, re.M), record[:500]
    assert "safelens_tl/py.typed" in names


def test_the_sdist_ships_what_a_wheel_and_a_contributor_need(dists: tuple[Path, Path]) -> None:
    _, sdist = dists
    root = f"safelens_tl-{VERSION}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        license_file = archive.extractfile(f"{root}/LICENSE")
        assert license_file is not None and license_file.read() == (REPO / "LICENSE").read_bytes()
    for name in (
        "LICENSE",
        "safelens_tl.pth",
        "README.md",
        "CHANGELOG.md",
        "CONTRIBUTING.md",
        "pyproject.toml",
        "tox.ini",
        "safelens_tl/__init__.py",
        "tests/conftest.py",
        "docs/fixes.md",
    ):
        assert f"{root}/{name}" in names, name


def test_the_metadata_names_the_license_and_the_project_s_urls(dists: tuple[Path, Path]) -> None:
    metadata = _wheel_metadata(dists[0])
    assert metadata["Name"] == "safelens-tl" and metadata["Version"] == VERSION
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    urls = dict(entry.split(", ", 1) for entry in metadata.get_all("Project-URL") or [])
    assert set(urls) == {"Homepage", "Source", "Issues", "Changelog", "Documentation"}, urls
    assert all(url.startswith(REPOSITORY_URL) for url in urls.values()), urls
    assert urls["Issues"] == f"{REPOSITORY_URL}/issues"
    for name, path in (("Changelog", "CHANGELOG.md"), ("Documentation", "docs")):
        assert (REPO / urls[name].split("/main/", 1)[1]).exists() and path in urls[name], urls


#: Markdown links ``[text](target)``, reference definitions ``[text]: target``, and HTML
#: ``href``/``src`` attributes.
LINK = re.compile(r"\]\(([^)\s]+)\)|^\s*\[[^\]]+\]:\s*(\S+)|(?:href|src)=\"([^\"]+)\"", re.M)


def links(markdown: str) -> list[str]:
    return [next(group for group in found if group) for found in LINK.findall(markdown)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_packaged_readme_has_no_relative_link(dists: tuple[Path, Path]) -> None:
    """On the package index a relative link (``docs/fixes.md``, ``#usage``) leads nowhere: each
    points to the repository at the release's tag, to a file and heading that exist."""
    metadata = _wheel_metadata(dists[0])
    assert metadata["Description-Content-Type"] == "text/markdown"
    description = metadata.get_payload()
    assert isinstance(description, str) and description.startswith("# safelens-tl")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    found = links(description)
    assert len(found) == len(links(readme)) >= 17, (len(found), len(links(readme)))
    relative = [link for link in found if not re.match(r"https?://", link)]
    assert not relative, relative
    at_tag = re.compile(rf"{re.escape(REPOSITORY_URL)}/(?:blob|tree)/v{re.escape(VERSION)}/(.+)")
    ours = [match for link in found if (match := at_tag.fullmatch(link))]
    assert len(ours) >= 17, found
    for match in ours:
        path, _, anchor = match[1].partition("#")
        assert (REPO / path).exists(), match[0]
        if anchor:
            text = (REPO / path).read_text(encoding="utf-8")
            headings = {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
            assert anchor in headings, match[0]
    # Folders are GitHub's tree pages, files its blob pages.
    for link in found:
        if link.startswith(REPOSITORY_URL + "/"):
            assert ("/tree/" in link) == link.endswith("/"), link


def test_the_link_pattern_finds_every_kind_of_link() -> None:
    text = '[a](docs/x.md) [b](#c)\n[d]: e/f.md\n<img src="g.png"> <a href="h.html">'
    assert links(text) == ["docs/x.md", "#c", "e/f.md", "g.png", "h.html"]


def _workflow() -> dict[Any, Any]:
    yaml = pytest.importorskip("yaml", reason="reading the workflow needs PyYAML")
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    return loaded


def _tag_check_script() -> str:
    steps = _workflow()["jobs"]["build"]["steps"]
    (step,) = [step for step in steps if step.get("name") == TAG_CHECK_STEP]
    script: str = step["run"]
    return script


def _run_tag_check(tag: str) -> subprocess.CompletedProcess[str]:
    """The workflow's own tag check, run as the workflow runs it: bash in the repository root,
    with ``python`` on PATH and the tag in ``GITHUB_REF_NAME``."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("the workflow's step is a bash script; no bash here")
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "GITHUB_REF_NAME": tag, "PATH": path}
    return subprocess.run(
        [bash, "-e", "-c", _tag_check_script()],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_workflow_publishes_tags_that_name_the_version() -> None:
    """A tag ``v*`` starts the workflow; its first check passes ``v<version>`` only."""
    workflow = _workflow()
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    patterns = triggers["push"]["tags"]
    assert patterns == ["v*"], triggers
    assert any(fnmatch.fnmatchcase(f"v{VERSION}", pattern) for pattern in patterns)
    done = _run_tag_check(f"v{VERSION}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"releasing safelens-tl {VERSION}" in done.stdout


@pytest.mark.parametrize("tag", ["v0.0.0", f"v{VERSION}.post1", VERSION, f"v{VERSION}rc1"])
def test_the_workflow_refuses_a_tag_that_names_another_version(tag: str) -> None:
    done = _run_tag_check(tag)
    assert done.returncode != 0, done.stdout
    assert f"expected v{VERSION} (safelens_tl/__init__.py)" in done.stdout


def test_the_workflow_builds_checks_and_publishes_by_trusted_publishing() -> None:
    workflow = _workflow()
    assert workflow["permissions"] == {"contents": "read"}
    build, publish = workflow["jobs"]["build"], workflow["jobs"]["publish"]
    runs = [step.get("run", "") for step in build["steps"]]
    names = [step.get("name") for step in build["steps"]]
    order = [
        names.index(TAG_CHECK_STEP),
        next(i for i, run in enumerate(runs) if "python -m build" in run),
        next(i for i, run in enumerate(runs) if "twine check --strict dist/*" in run),
        next(i for i, run in enumerate(runs) if "tests/test_packaging.py" in run),
    ]
    assert order == sorted(order), names  # the tag first, then build, check, test
    assert publish["needs"] == "build"
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    uses = [step for step in publish["steps"] if "gh-action-pypi-publish" in step.get("uses", "")]
    (upload,) = uses
    assert upload["uses"] == "pypa/gh-action-pypi-publish@release/v1"
    # Trusted publishing: no token or password is handed to the action.
    assert not {"password", "user"} & set(upload.get("with") or {}), upload


def test_the_version_has_one_place() -> None:
    """pyproject.toml takes the version from safelens_tl/__init__.py; no module repeats it."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    source = r'^\[tool\.hatch\.version\]\npath = "safelens_tl/__init__\.py"$'
    assert re.search(source, pyproject, re.M)
    assert re.search(r'^dynamic = \[[^\]]*"version"', pyproject, re.M)
    assert not re.search(r"^version\s*=", pyproject, re.M)
    assigned = [
        path.relative_to(REPO).as_posix()
        for path in (REPO / "safelens_tl").rglob("*.py")
        if re.search(r"^__version__\s*=", path.read_text(encoding="utf-8"), re.M)
    ]
    assert assigned == ["safelens_tl/__init__.py"], assigned


def test_the_changelog_has_a_section_for_the_version() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## \[{re.escape(VERSION)}\]", changelog, re.M), VERSION
