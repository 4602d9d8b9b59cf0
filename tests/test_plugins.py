"""The plugin manager calls each plugin on its own and validates what it returns."""

from __future__ import annotations

from typing import Any

from safelens_tl import plugins
from safelens_tl.builtin_plugins import hooked as builtin_plugin
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import Patch
from tests.conftest import LAYOUT


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
