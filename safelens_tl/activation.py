"""Activation state: install every plugin's patches once, remove them exactly, report what happened.

All state changes happen under one re-entrant lock, so ``activate()``/``deactivate()`` called from
several threads at once end in a consistent state.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from safelens_tl import _import_hooks, patching
from safelens_tl.plugins import Failure

if TYPE_CHECKING:
    from safelens_tl.registry import FixState

logger = logging.getLogger("safelens_tl")
# A library logs to its own logger and leaves output to the application: without a handler,
# logging's last-resort handler would print every failure a second time, next to its warning.
logger.addHandler(logging.NullHandler())


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
    #: Modules whose patches wait for the module's first import (see ``DeferredPatches``).
    pending: tuple[str, ...] = field(default_factory=tuple)
    #: Worth knowing, not a failure (e.g. a TransformerLens recognised by its classes); warned.
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: Every fix of the registry (:mod:`safelens_tl.fixes`): whether it applies to this
    #: install and why, and whether it is installed, pending on an import, or failed.
    fixes: tuple[FixState, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-serialisable data."""
        data = asdict(self)
        data["patched"] = list(self.patched)
        data["plugins"] = list(self.plugins)
        data["pending"] = list(self.pending)
        data["notes"] = list(self.notes)
        data["failures"] = [{**asdict(f), "fixes": list(f.fixes)} for f in self.failures]
        data["fixes"] = [{**asdict(f), "changes": list(f.changes)} for f in self.fixes]
        return data

    def __str__(self) -> str:
        release = self.transformer_lens or "not installed"
        lines = [
            f"safelens-tl {'active' if self.active else 'inactive'} "
            f"(TransformerLens {release}, layout {self.layout or '-'}): "
            f"{len(self.patched)} attributes patched"
        ]
        lines += [f"  waits for import: {module}" for module in self.pending]
        if self.active and self.fixes:
            lines.append(
                "what it changes here (installed, or installed at the import it waits for):"
            )
            lines += [f"  {line}" for line in changes_in_words(self.fixes)]
        if self.fixes:
            lines.append("fixes:")
            width = max(len(fix.id) for fix in self.fixes)
            lines += [f"  {fix.id:<{width}}  {fix.state:<14} {fix.reason}" for fix in self.fixes]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"failure: {failure}" for failure in self.failures]
        return "\n".join(lines)


#: States of a fix whose changes are in force, or will be at the import it waits for.
IN_FORCE = ("installed", "pending")


def changes_in_words(fixes: Iterable[FixState]) -> list[str]:
    """One line per kind of change (``safelens_tl.registry.CHANGES``, in words) naming the fixes
    that make it, then one naming the fixes turned off and by what."""
    registry = sys.modules.get("safelens_tl.registry")
    words: dict[str, str] = dict(registry.CHANGES) if registry is not None else {}
    fixes = tuple(fixes)
    lines = []
    for kind, description in words.items():
        making = [fix.id for fix in fixes if kind in fix.changes and fix.state in IN_FORCE]
        lines.append(f"{description.split(':')[0]}: {', '.join(making) or 'nothing'}")
    off: dict[str, list[str]] = {}
    for fix in fixes:
        if fix.state == "disabled":
            off.setdefault(fix.disabled_by, []).append(fix.id)
    lines += [f"turned off by {by}: {', '.join(ids)}" for by, ids in off.items()]
    return lines


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed: list[patching.InstalledPatch] = []
        self.claimed: dict[tuple[type | ModuleType, str], str] = {}
        #: Callbacks waiting in the import watcher for a module of deferred patches.
        self.waiting: list[tuple[str, Any]] = []
        self.active = False
        self.report = Status(False, None, None, (), (), ())
        #: True while :func:`activate` plans: a start-up hook firing inside it (the plan imports
        #: transformer_lens) leaves the work to it.
        self.planning = False
        #: The names given to ``activate(exclude=...)`` for the activation in force.
        self.excluded: tuple[str, ...] = ()


_state = _State()


def _warn(failures: list[Failure]) -> None:
    for failure in failures:
        logger.warning("safelens-tl: %s", failure)
        warnings.warn(f"safelens-tl: {failure}", SafelensWarning, stacklevel=4)


def _plan(
    exclude: tuple[str, ...], environment: str
) -> tuple[Status, list[patching.Patch | patching.DeferredPatches]]:
    """Locate the cache classes and collect every plugin's patches, without installing any.

    The fixes named by ``environment`` (the value of :data:`~safelens_tl.registry.DISABLE_VAR`)
    and by ``exclude`` are left out; a name in ``exclude`` that names nothing raises
    ``ValueError`` before anything changes.
    """
    from safelens_tl import hookspecs, plugins, registry, targets

    registry.configure(registry.Switches())
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
    switches = registry.switches(registry.published(), environment, exclude)
    registry.configure(switches)
    patches, patch_failures = plugins.collect_patches(manager, layout)
    failures.extend(patch_failures)
    names = tuple(name for name, _ in manager.list_name_plugin())
    notes: tuple[str, ...] = (layout.note,) if layout.note is not None else ()
    if switches.unknown:
        notes += (
            f"{registry.DISABLE_VAR}: {', '.join(map(repr, switches.unknown))} is neither a fix "
            f"nor a kind of change, and was ignored (the other names were turned off); "
            f"{registry.valid_names(registry.published())}",
        )
    status = Status(False, layout.release, layout.known.name, (), names, tuple(failures), (), notes)
    return status, patches


def _install_each(patches: Iterable[patching.Patch]) -> list[Failure]:
    """Install patches whose attribute no earlier patch claimed; return what was skipped.

    A patch that does not install turns off the fixes it serves (and those that need them,
    ``Fix.requires``): what this call installed for them is taken back, and a patch they share
    with other fixes is installed again without them (``Patch.narrowed``), so that a fix whose
    installation fails costs that fix alone. Where several fixes share the failing patch, each
    is left out in turn to find the one at fault; where none is, the attribute cannot be set and
    every fix that patches it is off.
    """
    failures: list[Failure] = []
    queue = list(patches)
    serving = {fix_id for patch in queue for fix_id in patch.fixes}
    done: list[patching.InstalledPatch] = []
    off: set[str] = set()
    while queue:
        patch = _narrowed(queue.pop(0), off)
        if patch is None:
            continue
        key = (patch.owner, patch.attribute)
        if key in _state.claimed:
            failures.append(
                Failure(
                    patch.plugin,
                    "install",
                    f"{patch.target} already patched by {_state.claimed[key]}; skipped",
                )
            )
            continue
        try:
            done.append(_install(patch))
            continue
        except Exception as error:
            reason = f"{patch.target}: {_describe(error)}"
        if not patch.fixes:
            failures.append(Failure(patch.plugin, "install", reason))
            continue
        at_fault = set(patch.fixes)
        for fix_id in patch.fixes if len(patch.fixes) > 1 else ():
            without = _narrowed(patch, off | {fix_id})
            try:
                if without is not None:
                    done.append(_install(without))
                    at_fault = {fix_id}
                    break
            except Exception:
                continue
        lost = (_with_dependents(at_fault) & serving) - off
        off |= lost
        failures += [_failure(fix_id, "install", reason) for fix_id in sorted(at_fault)]
        failures += [
            _failure(fix_id, "install", f"needs {', '.join(sorted(at_fault))}, not installed")
            for fix_id in sorted(lost - at_fault)
        ]
        for record in [record for record in done if set(record.patch.fixes) & lost]:
            _take_back(record)
            done.remove(record)
            queue.insert(0, record.patch)  # again, without the fixes now off
    return failures


def _install(patch: patching.Patch) -> patching.InstalledPatch:
    installed = patching.install(patch)
    _state.installed.append(installed)
    _state.claimed[(patch.owner, patch.attribute)] = patch.plugin
    return installed


def _take_back(record: patching.InstalledPatch) -> None:
    patching.uninstall(record)
    _state.installed.remove(record)
    _state.claimed.pop((record.patch.owner, record.patch.attribute), None)


def _narrowed(patch: patching.Patch, off: set[str]) -> patching.Patch | None:
    """``patch`` without the contributions of the fixes in ``off``; ``None`` when none is left."""
    if not off.intersection(patch.fixes):
        return patch
    if patch.narrowed is None:
        return None
    rebuilt = patch.narrowed(frozenset(off))
    return None if rebuilt is None else rebuilt.labelled(patch.plugin)


def _with_dependents(fix_ids: set[str]) -> set[str]:
    registry = sys.modules.get("safelens_tl.registry")
    return fix_ids | (registry.dependents(fix_ids) if registry is not None else set())


def _failure(fix_id: str, stage: str, reason: str) -> Failure:
    from safelens_tl import registry

    return registry.failure(fix_id, stage, reason)


def _publish(failures: Iterable[Failure], base: Status | None = None) -> Status:
    """Store a new report reflecting what is installed and pending now; return it."""
    base = base or _state.report
    failures = tuple(failures)
    _state.report = Status(
        active=_state.active,
        transformer_lens=base.transformer_lens,
        layout=base.layout,
        patched=tuple(i.patch.target for i in _state.installed),
        plugins=base.plugins,
        failures=failures,
        pending=tuple(dict.fromkeys(module for module, _ in _state.waiting)),
        notes=base.notes,
        fixes=_fix_states(failures),
    )
    return _state.report


def _fix_states(failures: Iterable[Failure]) -> tuple[FixState, ...]:
    """Each record's state, once the built-in plugins have loaded the list of fixes.

    Read from ``sys.modules``, never imported here: the list imports every fix module (and
    torch), which a report before TransformerLens is imported must not pay for. The list hands
    its records to :func:`safelens_tl.registry.publish`; the engine names no fix.
    """
    registry = sys.modules.get("safelens_tl.registry")
    if registry is None:
        return ()
    fixes = registry.published()
    if not fixes:
        return ()
    pending = [module for module, _ in _state.waiting]
    installed = [i.patch for i in _state.installed]
    states: tuple[FixState, ...] = registry.states(
        fixes, installed, pending, _state.active, failures
    )
    return states


def activate(exclude: str | Iterable[str] | None = None, environment: str = "") -> Status:
    """Install every plugin's patches; see :func:`safelens_tl.activate`.

    ``environment``: the value of ``SAFELENS_TL_DISABLE``, which the public function reads
    through the start-up module (the one module that reads the environment).
    """
    with _state.lock:
        if _state.planning:
            # The start-up hook, fired by the import of transformer_lens that the activation in
            # progress makes (same thread, re-entrant lock): that activation installs.
            return _state.report
        requested = None if exclude is None else _requested(exclude, _state.active)
        if _state.active:
            if requested is None or requested == _state.excluded:
                return _state.report
            _deactivate()
        _state.planning = True
        try:
            planned, patches = _plan(requested or (), environment)
        finally:
            _state.planning = False
        immediate = [p for p in patches if isinstance(p, patching.Patch)]
        deferred = [p for p in patches if isinstance(p, patching.DeferredPatches)]
        failures = list(planned.failures) + _install_each(immediate)
        _state.excluded = requested or ()
        _state.active = bool(_state.installed) or bool(deferred) or _switched_off()
        _publish(failures, planned)
        _warn(failures)
        for note in planned.notes:
            warnings.warn(f"safelens-tl: {note}", SafelensWarning, stacklevel=3)
        for batch in deferred:
            callback = functools.partial(_install_deferred, batch)
            _state.waiting.append((batch.module, callback))
            # Calls back at once when the module is imported already (it then publishes itself).
            _import_hooks.when_imported(batch.module, callback)
        return _publish(_state.report.failures)


def _requested(exclude: str | Iterable[str], active: bool) -> tuple[str, ...]:
    """The names given to ``activate(exclude=...)``; while an activation is in force they are
    checked against its fixes here, so that a wrong name raises before anything changes (a
    first activation checks them once the plugins have handed over the fixes, before installing
    anything)."""
    from safelens_tl import registry

    requested = registry.names(exclude)
    if active:
        registry.switches(registry.published(), "", requested)  # raises on an unknown name
    return requested


def _switched_off() -> bool:
    """Whether the user turned a fix off in this activation (then nothing installed is still an
    activation: the user's choice, not a failure)."""
    registry = sys.modules.get("safelens_tl.registry")
    return registry is not None and bool(registry.current_switches().off)


def _install_deferred(batch: patching.DeferredPatches) -> None:
    """Build and install one plugin's deferred patches; called once their module is imported.

    Runs inside that module's import, so nothing may escape: a failure is reported like any
    other plugin failure and the import completes.
    """
    from safelens_tl import plugins

    with _state.lock:
        entry = next((w for w in _state.waiting if w[1].args[0] is batch), None)
        if entry is None:  # deactivated (or re-activated) meanwhile
            return
        _state.waiting.remove(entry)
        failures: list[Failure] = []
        try:
            built = list(batch.build())
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            failures.append(Failure(batch.plugin, f"patches for {batch.module}", _describe(error)))
            built = []
        failures.extend(item for item in built if isinstance(item, Failure))
        patches = [item for item in built if isinstance(item, patching.Patch)]
        malformed = [item for item in built if not isinstance(item, Failure | patching.Patch)]
        malformed += [item for item in patches if not plugins.is_valid_patch(item)]
        if malformed:
            failures.append(
                Failure(
                    batch.plugin,
                    f"patches for {batch.module}",
                    f"expected Patch objects, received {malformed[0]!r}; all were skipped",
                )
            )
            patches = []
        failures.extend(_install_each(p.labelled(batch.plugin) for p in patches))
        _publish([*_state.report.failures, *failures])
    _warn(failures)


def install_found(patches: Iterable[patching.Patch]) -> None:
    """Install patches a replacement finds it needs while running (a class first met in a
    forward), so that ``status()`` lists them and :func:`deactivate` removes them.

    Does nothing while inactive; a patch whose attribute its own plugin already holds (another
    thread got there first) is skipped without a report.
    """
    with _state.lock:
        if not _state.active:
            return
        fresh = [p for p in patches if _state.claimed.get((p.owner, p.attribute)) != p.plugin]
        if not fresh:
            return
        failures = _install_each(fresh)
        _publish([*_state.report.failures, *failures])
    _warn(failures)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _describe_object(value: object) -> str:
    function = getattr(value, "__func__", value)
    name = getattr(function, "__qualname__", None) or type(value).__qualname__
    module = getattr(function, "__module__", None) or type(value).__module__
    return f"{module}.{name}"


def deactivate() -> Status:
    """Remove the patches in reverse order; see :func:`safelens_tl.deactivate`."""
    with _state.lock:
        return _deactivate()


def _deactivate() -> Status:
    with _state.lock:
        failures = list(_state.report.failures)
        removed = []
        for installed in reversed(_state.installed):
            foreign = patching.uninstall(installed)
            if foreign is not patching.MISSING:
                removed.append(
                    Failure(
                        installed.patch.plugin,
                        "uninstall",
                        f"{installed.patch.target} had been replaced after safelens-tl patched "
                        f"it, by {_describe_object(foreign)}; deactivate() removed that too (it "
                        f"may have called safelens-tl's replacement) and restored the original",
                    )
                )
        failures.extend(removed)
        _state.installed.clear()
        _state.claimed.clear()
        for module, callback in _state.waiting:
            _import_hooks.cancel(module, callback)
        _state.waiting.clear()
        _state.active = False
        _state.excluded = ()
        report = _publish(failures)
    _warn(removed)
    return report


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
        _publish([*_state.report.failures, failure])
    _warn([failure])
