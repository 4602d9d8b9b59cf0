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
    from safelens_tl.activation import Status

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "is_active", "status"]


def activate() -> Status:
    """Patch the installed TransformerLens with every registered ``safelens_tl`` plugin.

    Idempotent and thread-safe: a second call while active changes nothing and returns the same
    report. Failures (an unknown TransformerLens layout, a plugin that raises) are reported with a
    warning and in the returned :class:`~safelens_tl.activation.Status`; they never raise.
    """
    from safelens_tl import activation

    return activation.activate()


def deactivate() -> Status:
    """Restore the exact original class attributes that :func:`activate` replaced.

    Safe to call when not active (it does nothing) and from several threads at once.
    """
    from safelens_tl import activation

    return activation.deactivate()


def is_active() -> bool:
    """Return ``True`` while the patches of :func:`activate` are installed."""
    from safelens_tl import activation

    return activation.is_active()


def status() -> Status:
    """Return a report: TransformerLens release, patched attributes, loaded plugins, failures."""
    from safelens_tl import activation

    return activation.status()
