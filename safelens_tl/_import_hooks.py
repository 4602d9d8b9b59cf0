"""Run a callback once a module has finished importing (the import watcher).

Imported by the start-up hook (``safelens_tl._startup``) in every Python process, before
``transformer_lens``, so it may use only what ``site`` has already imported (``sys``) and the
built-in ``_thread``: no torch, pluggy, ``importlib.metadata``, ``warnings``, ``threading`` or
``typing``. Importing it has no side effect; :func:`when_imported` arms the watcher.

The watcher is hand-written rather than wrapt's post-import hooks (``register_post_import_hook``):
importing wrapt 2.x costs ~70 ms (it imports asyncio and ``importlib.metadata``), paid by every
Python process, while this finder costs one dictionary lookup per import. The start-up hook uses
it for ``transformer_lens``; activation uses it for parts of TransformerLens that are imported
lazily (``transformer_lens.model_bridge``).
"""

from __future__ import annotations

import _thread
import sys

# A name that mypy treats as true; importing ``typing`` for it would cost ~17 ms at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

# Callbacks waiting for a module to finish importing, and the modules whose import has finished
# but whose callbacks may still be running (their spec still says "initializing"). One lock
# guards both, so a callback registered while a module completes is called exactly once.
_lock = _thread.RLock()
#: The watcher's lock, for a caller that must check and register as one step.
lock = _lock
_pending: dict[str, list[Callable[[], object]]] = {}
_completed: set[str] = set()


def is_waiting(name: str, callback: Callable[[], object]) -> bool:
    """Whether ``callback`` waits for module ``name`` (given to :func:`when_imported`, not run)."""
    with _lock:
        return callback in _pending.get(name, ())


def is_imported(name: str) -> bool:
    """Whether module ``name`` is in ``sys.modules`` and has finished executing."""
    module = sys.modules.get(name)
    if module is None:
        return False
    if name in _completed:
        return True
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name: str, callback: Callable[[], object]) -> None:
    """Call ``callback()`` once module ``name`` has finished importing; now if it already has.

    The callback runs in the importing thread, right after the module's code, before the import
    statement returns. It must not raise: what it raises propagates into that import.
    """
    with _lock:
        if not is_imported(name):
            _pending.setdefault(name, []).append(callback)
            if _WATCHER not in sys.meta_path:
                sys.meta_path.insert(0, _WATCHER)
            return
    callback()


def cancel(name: str, callback: Callable[[], object]) -> None:
    """Forget a callback given to :func:`when_imported` that has not run yet."""
    with _lock:
        waiting = _pending.get(name, [])
        if callback in waiting:
            waiting.remove(callback)
        if not waiting:
            _pending.pop(name, None)
        if not _pending:
            _remove_watcher()


def _fire(name: str) -> None:
    with _lock:
        _completed.add(name)
        callbacks = _pending.pop(name, [])
        if not _pending:
            _remove_watcher()
    for callback in callbacks:
        callback()


class _NotifyingLoader:
    """Stands in for the real loader of a watched module for the length of one import.

    Before the module executes, the real loader is put back on the spec and the module, so
    nothing of this hook stays visible on it; after it executed, the callbacks run.
    """

    def __init__(self, spec: ModuleSpec, loader: object) -> None:
        self._spec = spec
        self._loader = loader

    def __getattr__(self, name: str) -> object:
        # Anything else (get_resource_reader, is_package, ...) is answered by the real loader.
        if name in {"_spec", "_loader"}:  # not set yet (copy/pickle): no endless recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        """Delegate to the real loader."""
        create: object = getattr(self._loader, "create_module", None)
        return create(spec) if callable(create) else None

    def exec_module(self, module: ModuleType) -> None:
        """Execute the module with the real loader, then run its callbacks once."""
        self._spec.loader = self._loader  # type: ignore[assignment]
        module.__loader__ = self._loader  # type: ignore[assignment]
        self._loader.exec_module(module)  # type: ignore[attr-defined]
        # The module has executed: say so now rather than when this import returns. Another
        # thread importing it meanwhile (a plugin's worker, say) then gets the module at once
        # instead of waiting for the import lock this thread holds until the callbacks finish,
        # which would deadlock if a callback waits for that thread.
        self._spec._initializing = False  # type: ignore[attr-defined]
        # Reached only when the module imported fine; after a failed import the callbacks stay,
        # so a retried import still runs them.
        _fire(self._spec.name)


if TYPE_CHECKING:
    from types import ModuleType as _ModuleType
else:
    _ModuleType = type(sys)  # types.ModuleType, without importing types at start-up


class _FiresOnFirstUse(_ModuleType):
    """The class a watched module gets when a loader other than ours is importing it.

    Another finder ahead of ours in ``sys.meta_path`` (jaxtyping's ``install_import_hook``, a
    debugger's, ...) takes the import, so our loader never runs. Seen mid-import, the module gets
    this class: the first attribute read after it finished executing (``from transformer_lens
    import X``, ``transformer_lens.X``) puts its class back and runs the callbacks first.
    """

    def __getattribute__(self, name: str) -> object:
        spec = _ModuleType.__getattribute__(self, "__dict__").get("__spec__")
        if not getattr(spec, "_initializing", False):
            module_name = _ModuleType.__getattribute__(self, "__name__")
            _ModuleType.__setattr__(self, "__class__", _trapped.pop(module_name, _ModuleType))
            _fire(module_name)
        return _ModuleType.__getattribute__(self, name)


#: The original classes of the modules given :class:`_FiresOnFirstUse`.
_trapped: dict[str, type] = {}


def _catch_up() -> None:
    """Notice watched modules that another loader has imported (or is importing) meanwhile."""
    finished = []
    with _lock:
        for name in list(_pending):
            module = sys.modules.get(name)
            if module is None or name in _trapped:
                continue
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                # Only a plain module class can be swapped (a custom one may define its own
                # attribute access, which a swap would bypass).
                if type(module).__getattribute__ is _ModuleType.__getattribute__:
                    _trapped[name] = type(module)
                    module.__class__ = _FiresOnFirstUse
            else:
                finished.append(name)
    for name in finished:
        _fire(name)


class _Watcher:
    """A meta-path finder that answers only for watched modules, to wrap their loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """Return the spec the other finders give a watched module, with its loader wrapped."""
        if fullname not in _pending:
            # Consulted for another module: a watched one may have been imported by a finder
            # ahead of this one, which never asked here. Costs a dict lookup per waiting module.
            _catch_up()
            return None
        _completed.discard(fullname)  # imported anew (e.g. after removal from sys.modules)
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is None:
                continue
            if hasattr(spec.loader, "exec_module"):
                spec.loader = _NotifyingLoader(spec, spec.loader)  # type: ignore[assignment]
            return spec
        return None


_WATCHER = _Watcher()


def _remove_watcher() -> None:
    while _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)
