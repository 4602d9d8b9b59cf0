"""The plugin manager calls each plugin on its own and validates what it returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from safelens_tl import plugins
from safelens_tl.builtin_plugins import hooked as builtin_plugin
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import Patch
from tests.conftest import LAYOUT
from tests.test_plugin_isolation import write_distribution


class Raising:
    @hookimpl
    def safelens_tl_patches(self, layout: Any) -> list[Patch]:
        raise RuntimeError("boom")


class Malformed:
    @hookimpl
    def safelens_tl_patches(self) -> list[object]:  # takes a subset of the arguments: allowed
        return ["not a patch"]


def test_one_broken_plugin_does_not_hide_the_others() -> None:
    manager = plugins.new_manager()
    manager.register(builtin_plugin, name="builtin")
    manager.register(Raising(), name="raising")
    manager.register(Malformed(), name="malformed")
    patches, failures = plugins.collect_patches(manager, LAYOUT)
    assert {p.attribute for p in patches} >= {"append", "init_cache_entry"}
    assert all(p.plugin == "builtin" for p in patches)
    by_source = {f.source: f for f in failures}
    assert "RuntimeError: boom" in by_source["raising"].message
    assert "expected Patch" in by_source["malformed"].message
    assert len(failures) == 2


def test_installed_entry_points_include_the_builtin_fix() -> None:
    manager = plugins.new_manager()
    failures = plugins.load_entry_point_plugins(manager)
    assert failures == []
    assert manager.has_plugin("safelens-tl:kv_cache")


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Forget the remembered entry points and count each time the metadata is read again."""
    reads: list[int] = []
    read = plugins._entry_points

    def counted() -> Any:
        reads.append(1)
        return read()

    monkeypatch.setattr(plugins, "_listed", None)
    monkeypatch.setattr(plugins, "_entry_points", counted)
    return reads


def test_entry_points_are_read_once_while_no_path_folder_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _count_reads(monkeypatch)
    for _ in range(3):
        manager = plugins.new_manager()
        assert plugins.load_entry_point_plugins(manager) == []
        assert manager.has_plugin("safelens-tl:kv_cache")
    assert len(reads) == 1


def test_a_plugin_installed_after_the_first_read_is_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Installing a distribution adds its ``.dist-info`` folder, which changes its folder's time;
    a new ``sys.path`` entry is a change as well."""
    reads = _count_reads(monkeypatch)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = {source for source, _ in plugins._sources()}
    assert "safelens-tl:kv_cache" in before
    write_distribution(site, "late_plugin", "X = 1\n", "[safelens_tl]\nlate = late_plugin\n")
    after = {source for source, _ in plugins._sources()}
    assert after - before == {"late_plugin:late"}
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins._sources()
    assert len(reads) == 3
