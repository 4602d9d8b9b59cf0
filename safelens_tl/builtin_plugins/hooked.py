"""The built-in HookedTransformer fixes, registered like any third-party plugin through the
``safelens_tl`` group.

Which fixes there are, and when each applies, is in the registry
(:data:`safelens_tl.fixes.HOOKED_FIXES`, one :class:`~safelens_tl.registry.Fix` per fix
module); this plugin only asks it for the patches of ``import transformer_lens``. A new
HookedTransformer fix is not wired here: its module's ``FIX`` record joins ``HOOKED_FIXES``.
"""

from __future__ import annotations

from safelens_tl import registry
from safelens_tl.fixes import HOOKED_FIXES
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import Patch
from safelens_tl.plugins import Failure
from safelens_tl.targets import Layout

SOURCE = "safelens_tl.builtin_plugins.hooked"


@hookimpl
def safelens_tl_patches(layout: Layout) -> list[Patch | Failure]:
    """The patches of every HookedTransformer fix that applies to this release: the cache entry,
    ``generate``'s reservation and step masks, ALiBi and mixture-of-experts layers.

    A fix that cannot be built is a :class:`~safelens_tl.plugins.Failure` among them, naming
    that fix: reported, and the others installed.
    """
    context = registry.Context(layout, registry.HOOKED_MODULE, SOURCE)
    return list(registry.build(HOOKED_FIXES, context))
