"""Unknown or future TransformerLens: nothing patched, a warning naming the release, stock kept.

The "future" releases are real installed metadata: a temporary folder earlier on ``PYTHONPATH``
holds a ``transformer_lens-<version>.dist-info`` that ``importlib.metadata`` finds before the real
one, while ``import transformer_lens`` still loads the real package. A release of the other
layout family (3.x metadata over a 2.x package, or the reverse) is a layout whose cache classes
have been renamed and moved: the table's paths do not import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from safelens_tl import targets
from tests.conftest import LAYOUT

pytestmark = pytest.mark.release_independent

CHILD = textwrap.dedent(
    """
    import importlib, json, sys, warnings
    entry_path, *scenarios = sys.argv[1:]
    results = []
    for folder in scenarios:
        # The first scenario comes from PYTHONPATH (seen by the start-up hook at import); the
        # others put their metadata folder first on sys.path, as PYTHONPATH would.
        if folder not in sys.path:
            sys.path.insert(0, folder)
            importlib.invalidate_caches()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import transformer_lens  # the start-up hook, when installed, tries to activate here
            import safelens_tl
            report = safelens_tl.activate()
        import torch
        from safelens_tl.kv import entry as kv_cache
        from safelens_tl.targets import _import_object
        entry_class = _import_object(entry_path)
        stock = entry_class.__dict__["append"]
        # Stock behaviour: an fp32 past with fp16 keys is promoted by torch.cat (no dtype policy).
        entry = entry_class(torch.zeros(1, 0, 2, 4), torch.zeros(1, 0, 2, 4))
        keys, _ = entry.append(torch.ones(1, 1, 2, 4, dtype=torch.float16),
                               torch.ones(1, 1, 2, 4, dtype=torch.float16))
        results.append({
            "report": report.to_dict(),
            "warnings": [str(w.message) for w in caught if "safelens" in str(w.message)],
            "append_module": stock.__module__,
            "append_is_builtin": stock is kv_cache.append,
            "stock_dtype": str(keys.dtype),
        })
        sys.path.remove(folder)
    print(json.dumps(results))
    """
)

#: Metadata of the other layout family: its cache classes do not exist in the installed package.
MOVED = "3.99.0" if LAYOUT.known.first_major <= 2 else "2.99.0"
FUTURE = "9.0.0"


def _shadow_release(root: Path, version: str) -> Path:
    """Install metadata claiming ``transformer-lens==version`` (no package files) in a folder."""
    info = root / version / f"transformer_lens-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: transformer-lens\nVersion: {version}\n"
    )
    return info.parent


@pytest.fixture(scope="module")
def shadowed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One interpreter; each scenario sees one fake ``transformer-lens`` release first."""
    root = tmp_path_factory.mktemp("releases")
    folders = [str(_shadow_release(root, version)) for version in (FUTURE, MOVED)]
    environment = {**os.environ, "PYTHONPATH": folders[0]}
    environment.pop("SAFELENS_TL_AUTOPATCH", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, LAYOUT.known.entry_path, *folders],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(zip((FUTURE, MOVED), results, strict=True))


def test_locate_refuses_an_unknown_release_by_name() -> None:
    """A release outside the table raises UnsupportedLayoutError naming it."""
    with pytest.raises(targets.UnsupportedLayoutError, match=r"9\.0\.0") as raised:
        targets.locate("9.0.0")
    assert "nothing was patched" in str(raised.value)
    # A version that names no release at all is no reason to refuse: the classes decide.
    layout = targets.locate("not-a-version")
    assert layout.known is LAYOUT.known
    assert layout.note is not None and "'not-a-version'" in layout.note


def test_changed_append_signature_is_refused() -> None:
    """A release whose append takes other parameters fails the signature check, naming both."""

    class RenamedArguments(LAYOUT.entry_class):  # type: ignore[misc,name-defined]
        def append(self, keys: torch.Tensor, values: torch.Tensor) -> Any:
            return super().append(keys, values)

    class ExtraLeadingArgument(LAYOUT.entry_class):  # type: ignore[misc,name-defined]
        def append(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> Any:
            return super().append(new_keys, new_values)

    for changed in (RenamedArguments, ExtraLeadingArgument):
        with pytest.raises(targets.UnsupportedLayoutError, match="append") as raised:
            targets.check_signatures(changed)
        message = str(raised.value)
        assert "new_keys" in message and changed.__qualname__ in message
    targets.check_signatures(LAYOUT.entry_class)  # the real one passes


def _assert_nothing_patched(result: dict[str, Any], version: str) -> None:
    report = result["report"]
    assert report["transformer_lens"] == version
    assert report["active"] is False
    assert report["patched"] == []
    assert any(version in f["message"] for f in report["failures"]), report["failures"]
    assert any(version in warning for warning in result["warnings"]), result["warnings"]
    assert result["append_module"].startswith("transformer_lens.")
    assert result["append_is_builtin"] is False
    assert result["stock_dtype"] == "torch.float32"  # torch.cat's promotion: stock behaviour


def test_future_release_patches_nothing_and_warns(shadowed: dict[str, dict[str, Any]]) -> None:
    """transformer-lens 9.0.0: a warning names the release; TL keeps its own append."""
    _assert_nothing_patched(shadowed[FUTURE], FUTURE)


def test_moved_classes_patch_nothing_and_warn(shadowed: dict[str, dict[str, Any]]) -> None:
    """A known major whose cache classes are not where the table says: same outcome."""
    result = shadowed[MOVED]
    _assert_nothing_patched(result, MOVED)
    assert any("could not import" in f["message"] for f in result["report"]["failures"])


def _site_without_transformer_lens(folder: Path) -> Path:
    """A copy (by symlinks) of this environment's site-packages without TransformerLens."""
    import safelens_tl

    site_packages = Path(targets.__file__).resolve()
    for base in map(Path, sys.path):
        if base.name == "site-packages" and (base / "torch").exists():
            site_packages = base
            break
    for item in site_packages.iterdir():
        if item.name.lower().startswith(("transformer_lens", "transformer-lens")):
            continue
        (folder / item.name).symlink_to(item)
    # The source tree of an editable install is found through a .pth, which -S skips; an installed
    # wheel lives in site-packages itself, which must not go on the path (it holds TL).
    source_root = Path(safelens_tl.__file__).resolve().parent.parent
    return folder if source_root == site_packages.resolve() else source_root


def test_status_without_transformer_lens_says_so(tmp_path: Path) -> None:
    """`python -m safelens_tl status` with TL hidden: says it is not installed, no traceback."""
    source_root = _site_without_transformer_lens(tmp_path)
    environment = {**os.environ, "PYTHONPATH": f"{source_root}{os.pathsep}{tmp_path}"}
    for flags in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-S", "-m", "safelens_tl", "status", *flags],
            capture_output=True,
            text=True,
            env=environment,
            timeout=120,
        )
        output = done.stdout + done.stderr
        assert "Traceback" not in output, output
        assert done.returncode in (0, 1), output
        assert "not installed" in output or '"release": null' in output, output
    report = json.loads(done.stdout)
    assert report["transformer_lens"]["importable"] is False
    assert report["transformer_lens"]["release"] is None
    assert report["activation"]["active"] is False
