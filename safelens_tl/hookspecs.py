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
    For classes of a module TransformerLens imports lazily (``transformer_lens.model_bridge``),
    return a :class:`safelens_tl.patching.DeferredPatches` instead of importing it here. The
    patches are installed after every plugin has answered, and removed by ``deactivate()``.

    Rules for plugin authors. This hook, and the import of the plugin's module, run inside the
    user's ``import transformer_lens`` (the start-up hook activates there):

    - Return quickly. Do no I/O, network or model loading; a plugin still running after 10 s is
      named on stderr, but the import waits for it.
    - Do not wait for other threads. A thread that imports ``transformer_lens`` gets the module
      without waiting, but one that imports a TransformerLens submodule not yet imported may need
      the import lock the importing thread holds.
    - Never end the program: raising anything, ``SystemExit`` included (an ``argparse`` at import
      time), is caught, reported with a warning and in ``status()``, and the plugin is skipped;
      only ``KeyboardInterrupt`` passes through.
    - A plugin that returns anything but ``Patch`` / ``DeferredPatches`` objects is skipped as a
      whole; the others, and the built-in fixes, still apply. A
      :class:`safelens_tl.plugins.Failure` among them is reported (a warning and a ``status()``
      entry) and the rest applied: a plugin says so what it cannot patch here.
    """
