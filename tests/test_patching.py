"""Patches of class and module attributes install and come off exactly."""

from __future__ import annotations

import types
from typing import Any

from safelens_tl import patching, plugins
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import MISSING, Patch
from tests.conftest import LAYOUT


def _module() -> types.ModuleType:
    module = types.ModuleType("scratch.utils")

    def helper() -> str:
        return "original"

    module.helper = helper  # type: ignore[attr-defined]
    return module


def test_a_module_attribute_is_replaced_named_and_restored_exactly() -> None:
    module = _module()
    original = module.helper  # type: ignore[attr-defined]
    patch = Patch(module, "helper", lambda: "replacement")
    assert patch.target == "scratch.utils.helper"
    installed = patching.install(patch)
    assert module.helper() == "replacement"  # type: ignore[attr-defined]
    assert patching.uninstall(installed) is MISSING
    assert module.helper is original  # type: ignore[attr-defined]


def test_a_module_attribute_that_was_absent_is_removed_again() -> None:
    module = _module()
    installed = patching.install(Patch(module, "added", 1))
    assert module.added == 1  # type: ignore[attr-defined]
    patching.uninstall(installed)
    assert not hasattr(module, "added")


def test_a_class_patch_is_named_by_module_and_qualified_name() -> None:
    patch = Patch(LAYOUT.entry_class, "append", None)
    entry = LAYOUT.entry_class
    assert patch.target == f"{entry.__module__}.{entry.__qualname__}.append"


class ModulePlugin:
    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    @hookimpl
    def safelens_tl_patches(self, layout: Any) -> list[Patch]:
        return [Patch(self.module, "helper", lambda: "replacement")]


class NotAnOwner:
    @hookimpl
    def safelens_tl_patches(self, layout: Any) -> list[Patch]:
        return [Patch("scratch.utils", "helper", None)]  # type: ignore[arg-type]


def test_a_plugin_may_patch_a_module_but_not_a_string() -> None:
    manager = plugins.new_manager()
    manager.register(ModulePlugin(_module()), name="module")
    manager.register(NotAnOwner(), name="string")
    patches, failures = plugins.collect_patches(manager, LAYOUT)
    assert [p.target for p in patches] == ["scratch.utils.helper"]
    assert [f.source for f in failures] == ["string"]
    assert "expected Patch objects naming an existing class or module attribute" in (
        failures[0].message
    )
