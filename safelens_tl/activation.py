"""Activation state: install every plugin's patches once, remove them exactly, report what happened.

All state changes happen under one re-entrant lock, so ``activate()``/``deactivate()`` called from
several threads at once end in a consistent state.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from safelens_tl import patching
from safelens_tl.plugins import Failure

logger = logging.getLogger("safelens_tl")


class SafelensWarning(UserWarning):
    """Something kept safelens-tl from patching all it meant to; TransformerLens still works."""


@dataclass(frozen=True)
class Status:
    """A report of the activation state, as returned by ``safelens_tl.status()``."""

    active: bool
    transformer_lens: str | None
    layout: str | None
    patched: tuple[str, ...]
    plugins: tuple[str, ...]
    failures: tuple[Failure, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-serialisable data."""
        data = asdict(self)
        data["patched"] = list(self.patched)
        data["plugins"] = list(self.plugins)
        data["failures"] = [asdict(f) for f in self.failures]
        return data


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed: list[patching.InstalledPatch] = []
        self.active = False
        self.report = Status(False, None, None, (), (), ())


_state = _State()


def _warn(failures: list[Failure]) -> None:
    for failure in failures:
        logger.warning("safelens-tl: %s", failure)
        warnings.warn(f"safelens-tl: {failure}", SafelensWarning, stacklevel=4)


def _plan() -> tuple[Status, list[patching.Patch]]:
    """Locate the cache classes and collect every plugin's patches, without installing any."""
    from safelens_tl import hookspecs, plugins, targets

    release = targets.installed_release()
    try:
        layout = targets.locate(release)
    except targets.UnsupportedLayoutError as error:
        failure = Failure("safelens_tl.targets", "locate", str(error))
        return Status(False, release, None, (), (), (failure,)), []
    manager = plugins.new_manager()
    failures = plugins.load_entry_point_plugins(manager)
    if not manager.get_plugins():
        failures.append(
            Failure(
                "safelens_tl.plugins",
                "load",
                f"no plugin found in the entry-point group {hookspecs.ENTRY_POINT_GROUP!r}; "
                "is safelens-tl installed (pip install safelens-tl, or pip install -e .)?",
            )
        )
    patches, patch_failures = plugins.collect_patches(manager, layout)
    failures.extend(patch_failures)
    names = tuple(name for name, _ in manager.list_name_plugin())
    status = Status(False, release, layout.known.name, (), names, tuple(failures))
    return status, patches


def activate() -> Status:
    """Install every plugin's patches; see :func:`safelens_tl.activate`."""
    with _state.lock:
        if _state.active:
            return _state.report
        planned, patches = _plan()
        if _state.active:
            # _plan() imported transformer_lens, whose start-up hook has activated meanwhile
            # (same thread, re-entrant lock): installing again would patch every attribute twice.
            return _state.report
        failures = list(planned.failures)
        claimed: dict[tuple[type, str], str] = {}
        for patch in patches:
            key = (patch.owner, patch.attribute)
            if key in claimed:
                failures.append(
                    Failure(
                        patch.plugin,
                        "install",
                        f"{patch.target} already patched by {claimed[key]}; skipped",
                    )
                )
                continue
            try:
                _state.installed.append(patching.install(patch))
                claimed[key] = patch.plugin
            except Exception as error:
                failures.append(Failure(patch.plugin, "install", f"{patch.target}: {error}"))
        _state.active = bool(_state.installed)
        _state.report = Status(
            active=_state.active,
            transformer_lens=planned.transformer_lens,
            layout=planned.layout,
            patched=tuple(i.patch.target for i in _state.installed),
            plugins=planned.plugins,
            failures=tuple(failures),
        )
        _warn(failures)
        return _state.report


def deactivate() -> Status:
    """Remove the patches in reverse order; see :func:`safelens_tl.deactivate`."""
    with _state.lock:
        failures = list(_state.report.failures)
        for installed in reversed(_state.installed):
            if not patching.uninstall(installed):
                failures.append(
                    Failure(
                        installed.patch.plugin,
                        "uninstall",
                        f"{installed.patch.target} had been replaced by someone else; "
                        "the original was restored anyway",
                    )
                )
        _state.installed.clear()
        _state.active = False
        _state.report = Status(
            False,
            _state.report.transformer_lens,
            _state.report.layout,
            (),
            _state.report.plugins,
            tuple(failures),
        )
        return _state.report


def is_active() -> bool:
    """Return whether the patches are installed."""
    return _state.active


def status() -> Status:
    """Return the latest report (before any activation: what would be patched is not computed)."""
    with _state.lock:
        return _state.report


def record_failure(failure: Failure) -> None:
    """Add a failure found outside :func:`activate` (e.g. by the start-up hook) to the report."""
    with _state.lock:
        report = _state.report
        _state.report = Status(
            report.active,
            report.transformer_lens,
            report.layout,
            report.patched,
            report.plugins,
            (*report.failures, failure),
        )
    _warn([failure])
