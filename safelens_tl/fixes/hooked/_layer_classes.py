"""What the fixes of a HookedTransformer layer class's ``__init__`` share (``hooked_alibi``,
``hooked_moe_dtype``): the class, found by its path in :mod:`safelens_tl.targets`, where the
release has it.
"""

from __future__ import annotations

from safelens_tl import targets
from safelens_tl.registry import Context, Detector, PatchBuilder, Wrap, Wrapper


def builds(path: str) -> Detector:
    """A record's detector: whether this release has HookedTransformer and the class at ``path``."""

    def applies(context: Context) -> tuple[bool, str]:
        if context.layout.model_class() is None:
            return False, "this release has no HookedTransformer"
        if targets.optional_class(path) is None:
            return False, f"this release has no {path}"
        return True, f"this release builds {path.rsplit('.', 1)[-1]} layers"

    return applies


def wrapping_init(path: str, wrapper: Wrapper) -> PatchBuilder:
    """A record's ``patches``: the ``__init__`` of the class at ``path`` wrapped by ``wrapper``."""

    def patches(context: Context) -> list[Wrap]:
        owner = targets.optional_class(path)
        return [] if owner is None else [Wrap(owner, "__init__", wrapper)]

    return patches
