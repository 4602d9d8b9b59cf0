"""The pluggy plugin manager: loads the ``safelens_tl`` entry points and collects their patches.

pluggy's own ``load_setuptools_entrypoints`` and hook calls stop at the first exception. Here every
plugin is loaded and called on its own, so one broken plugin is reported and skipped while the
others (the built-in fix among them) still apply. Nothing is swallowed silently: each failure
becomes a :class:`Failure` that the caller turns into a warning and a ``status()`` entry.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from safelens_tl import hookspecs
from safelens_tl.patching import DeferredPatches, Patch
from safelens_tl.targets import Layout


@dataclass(frozen=True)
class Failure:
    """Something that went wrong while activating: which plugin, at which stage, and why."""

    source: str
    stage: str
    message: str
    #: Ids of the registry's records (:class:`safelens_tl.registry.Fix`) this failure turned off.
    fixes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.source} ({self.stage}): {self.message}"


#: Modules of the built-in plugins (registered through the same entry-point group as any other).
BUILTINS = ("safelens_tl.builtin_plugins.hooked", "safelens_tl.builtin_plugins.bridge")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


#: Seconds a plugin may run before a note on stderr says which one is holding up the import.
SLOW_PLUGIN_SECONDS = 10.0


@contextlib.contextmanager
def _watched(source: str, stage: str) -> Iterator[None]:
    """Run a plugin's code; if it has not returned after :data:`SLOW_PLUGIN_SECONDS`, say so.

    A plugin runs inside ``import transformer_lens`` and cannot be interrupted from here; what
    can be done is to tell the user, while it hangs, which plugin it is and how to skip it.
    """

    def report() -> None:
        sys.stderr.write(
            f"safelens-tl: plugin {source} ({stage}) has not returned after "
            f"{SLOW_PLUGIN_SECONDS:.0f} s; the import of TransformerLens waits for it. "
            f"Set SAFELENS_TL_AUTOPATCH=0 to skip auto-activation, or uninstall the plugin's "
            f"distribution.\n"
        )

    timer = threading.Timer(SLOW_PLUGIN_SECONDS, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def new_manager() -> pluggy.PluginManager:
    """Return a plugin manager that knows the ``safelens_tl`` hook specifications."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def _entry_points() -> Iterable[object]:
    from importlib import metadata

    return metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)


def _path_stamps() -> tuple[tuple[str, int], ...]:
    """Each ``sys.path`` folder with the time it last changed: installing, upgrading or removing
    a distribution adds or removes its ``.dist-info`` folder there, which changes that time."""
    stamps = []
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        try:
            stamps.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:
            stamps.append((folder, -1))
    return tuple(stamps)


#: The entry points found last, as (source, entry point), and the ``sys.path`` they were found on.
_listed: tuple[tuple[tuple[str, int], ...], tuple[tuple[str, Any], ...]] | None = None
_listed_lock = threading.Lock()


def _sources() -> tuple[tuple[str, Any], ...]:
    """The installed ``safelens_tl`` entry points, each with the name it is registered under.

    Reading every distribution's metadata takes 10-15 ms, which each ``activate()`` would pay;
    the list is read again whenever a ``sys.path`` folder has changed since (a distribution
    installed or removed) or ``sys.path`` itself has.
    """
    global _listed
    stamps = _path_stamps()
    with _listed_lock:
        if _listed is not None and _listed[0] == stamps:
            return _listed[1]
        sources = []
        for entry_point in _entry_points():
            name: str = entry_point.name  # type: ignore[attr-defined]
            dist = getattr(entry_point, "dist", None)
            sources.append((f"{dist.name}:{name}" if dist is not None else name, entry_point))
        _listed = (stamps, tuple(sources))
        return _listed[1]


def load_entry_point_plugins(manager: pluggy.PluginManager) -> list[Failure]:
    """Register every installed ``safelens_tl`` entry point; return the ones that failed."""
    failures: list[Failure] = []
    seen: set[str] = set()
    for source, entry_point in _sources():
        # The same distribution can be visible twice (an editable install next to a wheel).
        if source in seen or manager.has_plugin(source):
            continue
        seen.add(source)
        try:
            with _watched(source, "load"):
                plugin = entry_point.load()  # type: ignore[attr-defined]
            manager.register(plugin, name=source)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit from an argparse at import, too
            failures.append(Failure(source, "load", _describe(error)))
    return failures


def collect_patches(
    manager: pluggy.PluginManager, layout: Layout
) -> tuple[list[Patch | DeferredPatches], list[Failure]]:
    """Ask each registered plugin for its patches; validate each answer on its own."""
    patches: list[Patch | DeferredPatches] = []
    failures: list[Failure] = []
    # The built-in fixes answer first, so they claim their attributes even when a third-party
    # plugin sits earlier on sys.path; a conflicting plugin is then the one reported and skipped.
    implementations = sorted(
        manager.hook.safelens_tl_patches.get_hookimpls(),
        key=lambda implementation: getattr(implementation.plugin, "__name__", "") not in BUILTINS,
    )
    for implementation in implementations:
        source = implementation.plugin_name
        try:
            # pluggy lets an implementation take a subset of the specified arguments.
            offered = {"layout": layout}
            arguments = {name: offered[name] for name in implementation.argnames}
            with _watched(source, "safelens_tl_patches"):
                answer: Any = implementation.function(**arguments)
                received = list(answer) if answer is not None else []
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            failures.append(Failure(source, "safelens_tl_patches", _describe(error)))
            continue
        # A Failure in the answer is reported, and the rest of the answer kept (the built-in
        # plugins report each fix that cannot be built this way, so it costs that fix alone).
        failures.extend(item for item in received if isinstance(item, Failure))
        received = [item for item in received if not isinstance(item, Failure)]
        malformed = [item for item in received if not _is_valid_patch(item)]
        if malformed:
            failures.append(
                Failure(
                    source,
                    "safelens_tl_patches",
                    "expected Patch objects naming an existing class or module attribute, "
                    f"received {malformed[0]!r}; all of this plugin's patches were skipped",
                )
            )
            continue
        patches.extend(item.labelled(source) for item in received)
    return patches, failures


def is_valid_patch(item: object) -> bool:
    """Whether ``item`` is a :class:`Patch` naming a class or module and an attribute name."""
    return (
        isinstance(item, Patch)
        and isinstance(item.owner, (type, ModuleType))
        and isinstance(item.attribute, str)
        and item.attribute.isidentifier()
    )


def _is_valid_patch(item: object) -> bool:
    if isinstance(item, DeferredPatches):
        return isinstance(item.module, str) and callable(item.build)
    return is_valid_patch(item)
