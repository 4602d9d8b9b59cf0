"""Install and remove replacements of class and module attributes, keeping the exact originals."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any


class _Missing:
    """Marks an attribute the class did not define itself (it was inherited or absent)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


@dataclass(frozen=True)
class Patch:
    """Replace ``owner.<attribute>`` with ``replacement`` while active.

    ``owner`` is a class, or a module for a module-level function that TransformerLens looks up
    through its module at each call (``utils.get_attention_mask``). ``replacement`` is stored as
    given, so pass ``classmethod(f)`` for a classmethod.
    """

    owner: type | ModuleType
    attribute: str
    replacement: object
    plugin: str = field(default="", compare=False)
    #: Ids of the registry's records (:class:`safelens_tl.registry.Fix`) this patch serves.
    fixes: tuple[str, ...] = field(default=(), compare=False)
    #: Where several records contribute to this patch: the same patch without the contributions
    #: of the records given (``None`` when none is left), so that one record's failed
    #: installation costs only that record.
    narrowed: Callable[[frozenset[str]], Patch | None] | None = field(
        default=None, compare=False, repr=False
    )

    def labelled(self, plugin: str) -> Patch:
        """This patch, credited to ``plugin`` unless it names its plugin already."""
        return self if self.plugin else replace(self, plugin=plugin)

    @property
    def target(self) -> str:
        """Dotted name of the replaced attribute, e.g. ``module.Class.append``."""
        if isinstance(self.owner, ModuleType):
            return f"{self.owner.__name__}.{self.attribute}"
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attribute}"


@dataclass(frozen=True)
class DeferredPatches:
    """Patches for classes of a module TransformerLens imports lazily.

    ``transformer_lens.model_bridge`` costs about 2 s to import, and TransformerLens imports it
    only when first used; importing it at activation would add that to every
    ``import transformer_lens``. ``build`` is called once ``module`` has finished importing (at
    once when it already has) and returns the :class:`Patch` objects to install then, plus a
    :class:`safelens_tl.plugins.Failure` for each problem to report (warned, listed in
    ``status()``) rather than raised.
    """

    module: str
    build: Callable[[], Iterable[object]]
    plugin: str = field(default="", compare=False)

    def labelled(self, plugin: str) -> DeferredPatches:
        """These patches, credited to ``plugin`` unless they name their plugin already."""
        return self if self.plugin else replace(self, plugin=plugin)


@dataclass(frozen=True)
class InstalledPatch:
    """A patch in place, with what its owner held before it (``MISSING`` when nothing)."""

    patch: Patch
    original: object


def install(patch: Patch) -> InstalledPatch:
    """Put ``patch.replacement`` on its owner and return the record needed to undo it."""
    original = patch.owner.__dict__.get(patch.attribute, MISSING)
    setattr(patch.owner, patch.attribute, patch.replacement)
    return InstalledPatch(patch=patch, original=original)


def uninstall(installed: InstalledPatch) -> object:
    """Restore the original attribute exactly; return what stood there if it was not ours.

    Returns :data:`MISSING` when our replacement was still in place. Someone else's object found
    instead (a wrapper installed on top of ours) is removed too, since it may call ours, and
    returned so that the caller can say what was removed.
    """
    patch = installed.patch
    current = patch.owner.__dict__.get(patch.attribute, MISSING)
    if installed.original is MISSING:
        if patch.attribute in patch.owner.__dict__:
            delattr(patch.owner, patch.attribute)
    else:
        setattr(patch.owner, patch.attribute, installed.original)
    return MISSING if current is patch.replacement else current


#: This package's folder: a frame whose file lies in it is safelens-tl's own code.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def note_origin(error: BaseException, fixes: tuple[str, ...]) -> None:
    """Add to ``error`` (once) a note saying where it was raised: in TransformerLens or another
    library, which safelens-tl's wrappers (``fixes``) only passed through, or in safelens-tl's own
    code, with the switch that leaves those fixes out. Python 3.10 has no notes: nothing then."""
    add_note = getattr(error, "add_note", None)
    if add_note is None or getattr(error, "__safelens_tl_noted__", False):
        return
    traceback = error.__traceback__
    if traceback is None:
        return
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    origin = traceback.tb_frame.f_code.co_filename
    named = ", ".join(fixes) or "safelens-tl"
    if os.path.abspath(origin).startswith(_PACKAGE):
        add_note(
            f"safelens-tl: raised in safelens-tl's own code ({named}); "
            f"SAFELENS_TL_DISABLE={','.join(fixes) or 'forward,generate,cache,conversion'} runs "
            f"without it. Please report it with this traceback."
        )
    else:
        module = traceback.tb_frame.f_globals.get("__name__", origin)
        add_note(
            f"safelens-tl: raised in {module} (line {traceback.tb_lineno}); the safelens_tl frames "
            f"above ({named}) only passed the call through. SAFELENS_TL_AUTOPATCH=0 runs without "
            f"safelens-tl."
        )
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        error.__safelens_tl_noted__ = True  # type: ignore[attr-defined]


def passing_errors_through(
    function: Callable[..., Any], fixes: tuple[str, ...]
) -> Callable[..., Any]:
    """``function``, whose errors get :func:`note_origin`'s note. Its frame is hidden from
    IPython's and pytest's tracebacks (``__tracebackhide__``). A generator function stays one, so
    that ``inspect`` and code that checks for one see no difference."""
    if inspect.isgeneratorfunction(function):

        @functools.wraps(function)
        def streaming(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            try:
                return (yield from function(*args, **kwargs))
            except Exception as error:
                note_origin(error, fixes)
                raise

        return streaming

    @functools.wraps(function)
    def passing(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return function(*args, **kwargs)
        except Exception as error:
            note_origin(error, fixes)
            raise

    return passing
