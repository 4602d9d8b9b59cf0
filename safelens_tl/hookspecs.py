"""pluggy hook specifications: the door through which the built-in fix and third parties patch.

A plugin is a module or object registered under the entry-point group ``safelens_tl``::

    [project.entry-points.safelens_tl]
    my_fix = "my_package.safelens_plugin"

and implements the hooks below, marked with :data:`hookimpl`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from safelens_tl.patching import Patch
    from safelens_tl.targets import Layout

PROJECT_NAME = "safelens_tl"
ENTRY_POINT_GROUP = "safelens_tl"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def safelens_tl_patches(layout: Layout) -> Iterable[Patch]:  # type: ignore[empty-body]
    """Return the class-attribute replacements this plugin wants on the installed TransformerLens.

    ``layout`` names the cache classes of the installed release (see :mod:`safelens_tl.targets`).
    Return an iterable of :class:`safelens_tl.patching.Patch`; an empty one means "nothing here".
    The patches are installed after every plugin has answered, and removed by ``deactivate()``.
    A plugin that raises or returns anything else is reported and skipped; the others still apply.
    """
