"""activate()/deactivate()/is_active()/status(): idempotent, exactly reversible, reported."""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any

import pytest

import safelens_tl
from safelens_tl.activation import SafelensWarning
from safelens_tl.kv import entry as kv_cache
from tests.conftest import LAYOUT, RELEASE
from tests.warm_python import run_python

pytestmark = pytest.mark.startup

PATCHED_ATTRIBUTES = {
    LAYOUT.entry_class: ("init_cache_entry", "append", "__getstate__"),
    LAYOUT.cache_class: ("append_attention_mask", "init_cache"),
}


def class_attributes() -> dict[tuple[type, str], object]:
    return {
        (owner, name): owner.__dict__.get(name)
        for owner, names in PATCHED_ATTRIBUTES.items()
        for name in names
    }


def test_activate_patches_and_reports() -> None:
    report = safelens_tl.activate()
    assert safelens_tl.is_active() and report.active
    assert LAYOUT.entry_class.__dict__["append"] is kv_cache.append
    assert report.transformer_lens == RELEASE
    patched_names = {".".join(target.split(".")[-2:]) for target in report.patched}
    for owner, names in PATCHED_ATTRIBUTES.items():
        assert {f"{owner.__name__}.{name}" for name in names} <= patched_names
    assert "safelens-tl:kv_cache" in report.plugins
    assert report.failures == ()
    assert safelens_tl.status() == report


def test_activate_is_idempotent() -> None:
    first = safelens_tl.activate()
    attributes = class_attributes()
    second = safelens_tl.activate()
    assert second is first
    assert class_attributes() == attributes


def test_deactivate_restores_exact_originals() -> None:
    originals = class_attributes()
    safelens_tl.activate()
    assert class_attributes() != originals
    report = safelens_tl.deactivate()
    assert not safelens_tl.is_active() and not report.active and report.patched == ()
    restored = class_attributes()
    for key, original in originals.items():
        assert restored[key] is original, key
    safelens_tl.deactivate()  # a second deactivate is harmless
    assert class_attributes() == originals


def test_activate_and_deactivate_from_threads_end_consistent() -> None:
    originals = class_attributes()
    barrier = threading.Barrier(8)

    def toggle(index: int) -> None:
        barrier.wait()
        for _ in range(20):
            safelens_tl.activate() if index % 2 else safelens_tl.deactivate()

    threads = [threading.Thread(target=toggle, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if safelens_tl.is_active():
        assert LAYOUT.entry_class.__dict__["append"] is kv_cache.append
    else:
        assert class_attributes() == originals
    safelens_tl.deactivate()
    assert class_attributes() == originals


def test_import_patch_module_activates() -> None:
    import safelens_tl.patch as patch_module

    safelens_tl.deactivate()
    importlib.reload(patch_module)
    assert safelens_tl.is_active()
    assert patch_module.STATUS.active


def test_import_patch_in_a_fresh_interpreter() -> None:
    """``import safelens_tl.patch`` activates in a new process, the start-up hook turned off (a
    warm child, ``tests/warm_python.py``: the subject is the explicit spelling, not start-up)."""
    code = (
        "import os; os.environ['SAFELENS_TL_AUTOPATCH'] = '0'\n"
        "import safelens_tl.patch, safelens_tl\n"
        "from safelens_tl import targets\n"
        "from safelens_tl.kv import entry as kv_cache\n"
        "assert targets.locate().entry_class.__dict__['append'] is kv_cache.append\n"
        "print(safelens_tl.status().active)\n"
    )
    completed = run_python(["-c", code], timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().endswith("True")


def test_status_to_dict_is_plain_data(patched: Any) -> None:
    data = safelens_tl.status().to_dict()
    assert data["active"] is True
    assert isinstance(data["patched"], list) and isinstance(data["failures"], list)
    assert data["transformer_lens"] == RELEASE


def test_deactivate_says_which_wrapper_on_top_of_ours_it_removed(entry_class: type) -> None:
    stock = entry_class.__dict__["append"]
    safelens_tl.activate()
    ours = entry_class.__dict__["append"]

    def third_party_append(self: Any, keys: Any, values: Any) -> Any:
        return ours(self, keys, values)

    entry_class.append = third_party_append  # type: ignore[attr-defined]
    with pytest.warns(SafelensWarning, match="third_party_append") as caught:
        report = safelens_tl.deactivate()
    assert "had been replaced after safelens-tl patched it" in str(caught[0].message)
    assert entry_class.__dict__["append"] is stock
    assert any(
        f.stage == "uninstall" and "third_party_append" in f.message for f in report.failures
    )


def test_deactivate_is_quiet_when_everything_was_still_ours() -> None:
    safelens_tl.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SafelensWarning)
        safelens_tl.deactivate()


class _FoundLater:
    """A class a replacement meets only while running (as a layer class in a forward)."""


def test_patches_found_while_running_are_reported_made_once_and_removed() -> None:
    """``install_found``: listed by ``status()``, a second request by the same plugin (another
    thread) is skipped without a report, ``deactivate()`` removes them, and while inactive
    nothing is installed."""
    from safelens_tl import activation
    from safelens_tl.patching import Patch

    found = Patch(_FoundLater, "found", 1, plugin="tests")
    target = f"{__name__}._FoundLater.found"
    safelens_tl.activate()
    try:
        activation.install_found([found])
        activation.install_found([found])
        status = safelens_tl.status()
        assert status.patched.count(target) == 1
        assert not any(target in str(failure) for failure in status.failures)
        assert _FoundLater.__dict__["found"] == 1
    finally:
        safelens_tl.deactivate()
    assert "found" not in _FoundLater.__dict__
    activation.install_found([found])
    assert "found" not in _FoundLater.__dict__
    safelens_tl.activate()
