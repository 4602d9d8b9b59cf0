"""The start-up hook: activate safelens-tl right after ``transformer_lens`` finishes importing.

``safelens_tl.pth``, installed at the root of site-packages, runs ``install()`` in every Python
process that processes site-packages. So this module may use only what ``site`` has already
imported (``sys``, ``os``) and the built-in ``_thread``: no torch, pluggy, ``importlib.metadata``,
``warnings``, ``threading`` or ``typing`` before ``transformer_lens`` itself is imported, and its
import watcher (:mod:`safelens_tl._import_hooks`, hand-written rather than wrapt's, which costs
~70 ms at start-up) keeps to the same. Importing it has no side effect; ``install()`` does.

:func:`safelens_tl._import_hooks.when_imported` is the general mechanism: run a callback once a
module has finished importing. The hook uses it for ``transformer_lens``; activation uses it for
parts of TransformerLens that are imported lazily (``transformer_lens.model_bridge``).
"""

from __future__ import annotations

import os

# The watcher, re-exported here: ``when_imported`` is the general mechanism (see its module).
from safelens_tl._import_hooks import cancel as cancel
from safelens_tl._import_hooks import is_imported, is_waiting, lock, when_imported

#: The environment variable that turns the hook off.
ENV_VAR = "SAFELENS_TL_AUTOPATCH"
#: The environment variable naming fixes to leave out (ids or kinds of change), read at each
#: activation and handed on as it is: the names are parsed and checked by activation, which
#: knows the fixes, never here (``safelens_tl.registry.DISABLE_VAR`` is the same name).
DISABLE_VAR = "SAFELENS_TL_DISABLE"
#: Values of :data:`ENV_VAR` (case-insensitive, surrounding blanks ignored) that turn the hook off.
OFF_VALUES = frozenset({"0", "false", "no", "off"})
#: Values that leave it on (as does an unset variable). Any other value also leaves it on, with a
#: warning at activation: a typo such as ``disable`` must not pass for an opt-out silently.
ON_VALUES = frozenset({"", "1", "true", "yes", "on"})
WATCHED = "transformer_lens"

# What the hook did in this process, read by ``safelens-tl status``:
INACTIVE = "inactive"  # install() never ran here (no .pth processed: python -S, hook not installed)
DISABLED = "disabled"  # the opt-out was set
WATCHING = "watching"  # waiting for the first import of transformer_lens
ACTIVATED = "activated"  # safelens_tl.activate() ran (its own failures are in safelens_tl.status())
FAILED = "failed"  # auto-activation raised; recorded in safelens_tl.status() and warned
DEACTIVATED = "deactivated"  # safelens_tl.deactivate() ran before transformer_lens was imported

state = INACTIVE


def _setting() -> str:
    return os.environ.get(ENV_VAR, "").strip().lower()


def disabled_fixes() -> str:
    """The value of ``SAFELENS_TL_DISABLE`` now, as it is (empty when unset)."""
    return os.environ.get(DISABLE_VAR, "")


def enabled() -> bool:
    """Return ``False`` when ``SAFELENS_TL_AUTOPATCH`` is one of ``0``/``false``/``no``/``off``."""
    return _setting() not in OFF_VALUES


_warned_setting: str | None = None


def _warn_unknown_setting() -> None:
    """Warn once per value when ``SAFELENS_TL_AUTOPATCH`` is neither an on nor an off value."""
    global _warned_setting
    value = _setting()
    if value in ON_VALUES or value in OFF_VALUES or value == _warned_setting:
        return
    _warned_setting = value
    import warnings

    warnings.warn(
        f"safelens-tl: {ENV_VAR}={os.environ.get(ENV_VAR)!r} is not a known value; the start-up "
        f"hook stays on. Use 0, false, no or off to turn it off (1, true, yes or on to keep it).",
        RuntimeWarning,
        stacklevel=2,
    )


def install() -> str:
    """Arm the watcher, or activate at once when ``transformer_lens`` is already imported.

    Called by ``safelens_tl.pth`` at start-up; safe to call again. Returns the new :data:`state`.
    """
    global state
    if state == DEACTIVATED:  # the user said no in this process
        return state
    if not enabled():
        _disable()
        return state
    with lock:
        if is_waiting(WATCHED, activate_now):
            return state
        if not is_imported(WATCHED):
            state = WATCHING
    when_imported(WATCHED, activate_now)
    return state


def _disable() -> None:
    global state
    uninstall()
    state = DISABLED


def uninstall() -> None:
    """Stop waiting for ``transformer_lens`` (nothing happens when the hook is not waiting)."""
    cancel(WATCHED, activate_now)


def stand_down() -> None:
    """``safelens_tl.deactivate()`` before ``transformer_lens`` is imported: stop waiting for it,
    for the rest of this process, so that the import does not undo the user's choice."""
    global state
    with lock:
        if state == WATCHING or is_waiting(WATCHED, activate_now):
            uninstall()
            state = DEACTIVATED


def activate_now() -> None:
    """Activate safelens-tl; turn any exception into a warning and a ``status()`` entry.

    Never raises (except ``KeyboardInterrupt``): the import that triggered it must finish
    whatever happens here.
    """
    global state
    if state == DEACTIVATED:
        return
    if not enabled():  # the opt-out may be set in os.environ after start-up (notebooks)
        _disable()
        return
    _warn_unknown_setting()
    try:
        import safelens_tl

        safelens_tl.activate()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # nothing may end the program from inside an import
        state = FAILED
        _report(error)
        return
    state = ACTIVATED


def _report(error: BaseException) -> None:
    message = (
        f"automatic activation on `import {WATCHED}` failed ({type(error).__name__}: {error}); "
        f"TransformerLens works but is not patched. Try `import safelens_tl.patch` to see the "
        f"error, or set {ENV_VAR}=0 to turn the start-up hook off"
    )
    try:
        from safelens_tl import activation
        from safelens_tl.plugins import Failure

        activation.record_failure(Failure("safelens_tl._startup", "auto-activate", message))
    except Exception:  # the report itself cannot be built (e.g. pluggy missing): warn plainly
        import warnings

        warnings.warn(f"safelens-tl: {message}", RuntimeWarning, stacklevel=2)
