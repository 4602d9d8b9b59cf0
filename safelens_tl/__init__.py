"""safelens-tl: cached TransformerLens generation in fp16/bf16, on GQA models, across devices.

This module is the public API only. It imports nothing beyond the standard library at module level,
because the start-up hook imports the package in every Python process: torch, pluggy and
TransformerLens are imported lazily, inside the functions, when they are first needed.
"""

from __future__ import annotations

# Not `from typing import TYPE_CHECKING`: importing typing costs ~15 ms in every process the
# start-up hook runs in. mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Iterable

    from safelens_tl.activation import Status

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "is_active", "status"]


def activate(exclude: str | Iterable[str] | None = None) -> Status:
    """Patch the installed TransformerLens with every registered ``safelens_tl`` plugin.

    ``exclude`` names fixes to leave out, by id (``"hooked_weight_copies"``) or by what they
    change (``"forward"``, ``"generate"``, ``"cache"``, ``"conversion"``): a list, or one string
    of names separated by commas. The fixes named in the environment variable
    ``SAFELENS_TL_DISABLE`` are left out too, and so is a fix that needs one left out.
    ``status()`` shows each as ``disabled`` and by what. A name that is neither a fix nor a kind
    raises ``ValueError`` listing the valid ones, and nothing changes.

    Idempotent and thread-safe: a second call while active changes nothing and returns the same
    report, unless it names other fixes to exclude (``exclude=()`` puts back those an earlier
    call left out): the fixes are then installed again with the new choice. Failures (an
    unknown TransformerLens layout, a plugin or a fix that raises) are reported with a warning
    and in the returned :class:`~safelens_tl.activation.Status`; they never raise.
    """
    from safelens_tl import _startup, activation

    return activation.activate(exclude, _startup.disabled_fixes())


def deactivate() -> Status:
    """Restore the exact original class attributes that :func:`activate` replaced.

    Safe to call when not active (it does nothing) and from several threads at once. Called
    before ``transformer_lens`` is imported, it also stops the start-up hook from activating at
    that import (``safelens-tl status`` then says the hook was deactivated); :func:`activate`
    still works.
    """
    from safelens_tl import _startup, activation

    _startup.stand_down()
    return activation.deactivate()


def is_active() -> bool:
    """Return ``True`` while the patches of :func:`activate` are installed."""
    from safelens_tl import activation

    return activation.is_active()


def status() -> Status:
    """Return a report: TransformerLens release, patched attributes, loaded plugins, failures,
    and each fix's state (installed, pending, disabled, failed, not applicable)."""
    from safelens_tl import activation

    return activation.status()
