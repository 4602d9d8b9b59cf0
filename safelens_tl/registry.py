"""The record of one fix (:class:`Fix`) and how the plugins turn records into patches.

Each fix module ends with its ``FIX = Fix(...)``; :data:`safelens_tl.fixes.FIXES` is the
one ordered list of them. The plugins ask :func:`build` for the patches of the records triggered
by one module's import; ``status()`` asks :func:`states` what became of each record, and
``python -m safelens_tl.fixes --write docs/fixes.md`` regenerates that file's table of
fixes from the records (``tests/test_registry.py`` fails while the committed table is stale).

Several records may change the same method (``TransformerBridge.generate`` has three fixes): each
contributes a :class:`Wrap`, and :func:`build` composes the contributions to one attribute into
one replacement, the earliest record in :data:`~safelens_tl.fixes.FIXES` outermost. One
patch per attribute keeps ``deactivate()`` exact and a third-party patch of it a reported conflict.

Imported at activation only (never by the start-up hook): it imports ``packaging`` and the
TransformerLens locations of :mod:`safelens_tl.targets`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.plugins import Failure

#: What a wrapper contributed to an attribute does to the method it wraps.
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

#: The module whose import triggers the HookedTransformer fixes.
HOOKED_MODULE = "transformer_lens"


@dataclass(frozen=True)
class Wrap:
    """A record's wrapper of ``owner.<attribute>``, composed with other records' wrappers of it.

    With ``area`` set, ``owner`` must define ``attribute`` itself; where it does not, a
    :class:`~safelens_tl.plugins.Failure` in ``area`` says ``consequence``. Without it, a missing
    method means the fix has nothing to do there (``generate_stream`` before TransformerLens 3.9).
    """

    owner: type | ModuleType
    attribute: str
    wrapper: Wrapper
    area: str | None = None
    consequence: str = ""


class Context:
    """What a record's detector and patches look at: the installed release and its classes.

    ``bridge`` locates TransformerBridge's classes on first use, so it is read only by records of
    ``transformer_lens.model_bridge``, once that module is imported.
    """

    def __init__(self, layout: targets.Layout, module: str, source: str) -> None:
        self.layout = layout
        #: The module whose import is being handled now.
        self.module = module
        #: The plugin credited with the failures found.
        self.source = source

    @property
    def release(self) -> str | None:
        """The installed ``transformer-lens`` version string (``None`` when it says nothing)."""
        return self.layout.release

    @functools.cached_property
    def bridge(self) -> targets.BridgeLayout:
        """TransformerBridge's classes in this release."""
        return targets.locate_bridge()


#: A record's detector: whether it applies here, and why (or why not), in one phrase.
Detector = Callable[[Context], tuple[bool, str]]
#: A record's patches: whole replacements, contributed wrappers, and failures to report.
PatchBuilder = Callable[[Context], Iterable["Patch | Wrap | Failure"]]


@dataclass(frozen=True)
class Fix:
    """One fix of stock TransformerLens (or of transformers as TransformerLens drives it)."""

    #: The fix module's name; also its docs anchor.
    id: str
    #: What a user of stock TransformerLens sees, in one line.
    symptom: str
    #: Distribution name to the releases affected, as a ``packaging`` specifier set.
    affects: Mapping[str, str]
    #: How safelens-tl fixes it, in one line.
    remedy: str
    #: The detector, run once the ``when_imported`` module is imported.
    applies: Detector
    #: The patches, built where :attr:`applies` says so.
    patches: PatchBuilder
    #: The test module, relative to the repository root.
    test_module: str
    #: The modules whose import triggers the fix; most records have one.
    when_imported: tuple[str, ...] = (HOOKED_MODULE,)
    #: ``"release"``: :attr:`applies` decides by :attr:`affects` alone (the registry test checks
    #: they agree); ``"feature"``: by what the installed code has.
    detector: str = "feature"
    upstream: str | None = None
    fixed_in: str | None = None

    @property
    def anchor(self) -> str:
        """The fix's anchor in ``docs/fixes.md``."""
        return f"docs/fixes.md#{self.id.replace('_', '-')}"

    def affects_release(self, versions: Mapping[str, str | None]) -> bool:
        """Whether each affected distribution's version in ``versions`` is in its range."""
        from packaging.specifiers import SpecifierSet

        for distribution, specifiers in self.affects.items():
            version = versions.get(distribution)
            if version is None or not SpecifierSet(specifiers).contains(version, prereleases=True):
                return False
        return True


def frozen(mapping: Mapping[str, str]) -> Mapping[str, str]:
    """A read-only copy of ``mapping`` (a record's ``affects``)."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Decision:
    """What :func:`build` found for one record at its module's import."""

    applies: bool
    reason: str
    failed: bool = False


@dataclass(frozen=True)
class FixState:
    """One record in ``status()``: whether it applies here and why, and what became of it."""

    id: str
    #: ``None`` while its module has not been imported (or nothing was activated).
    applies: bool | None
    reason: str
    #: ``installed``, ``pending`` (on an import), ``failed``, ``not applicable``, ``nothing to
    #: patch`` (applies, but found no attribute to change) or ``not installed`` (inactive).
    state: str
    when_imported: str = field(default="")

    def __str__(self) -> str:
        return f"{self.id}: {self.state} ({self.reason})"


_lock = threading.Lock()
#: Each record's latest decision, by id (replaced at each build of its module).
_decisions: dict[str, Decision] = {}
#: The records ``status()`` reports on, in order (:func:`publish`).
_published: tuple[Fix, ...] = ()


def publish(fixes: Iterable[Fix]) -> None:
    """Make ``fixes`` the records ``status()`` reports on: the list of fixes hands itself over
    when it is imported (by the built-in plugins), so that the engine names no fix."""
    global _published
    _published = tuple(fixes)


def published() -> tuple[Fix, ...]:
    """The records handed over by :func:`publish` (none before the list of fixes is imported)."""
    return _published


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def build(fixes: Iterable[Fix], context: Context) -> Iterator[Patch | Failure]:
    """The patches (and failures) of the records ``context.module``'s import triggers.

    Each record's detector runs first; an exception in a record's code fails that record only.
    Wrappers of one attribute become one :class:`~safelens_tl.patching.Patch`, placed where the
    first of them came, crediting every contributing record in ``Patch.fixes``.
    """
    items: list[Patch | Failure | list[tuple[Fix, Wrap]]] = []
    groups: dict[tuple[int, str], list[tuple[Fix, Wrap]]] = {}
    for fix in fixes:
        if context.module not in fix.when_imported:
            continue
        try:
            applies, reason = fix.applies(context)
            built = list(fix.patches(context)) if applies else []
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            _decide(fix, Decision(False, _describe(error), failed=True))
            items.append(Failure(context.source, fix.id, _describe(error)))
            continue
        _decide(fix, Decision(applies, reason, failed=any(isinstance(i, Failure) for i in built)))
        for item in built:
            if isinstance(item, Wrap):
                key = (id(item.owner), item.attribute)
                if key not in groups:
                    groups[key] = []
                    items.append(groups[key])
                groups[key].append((fix, item))
            elif isinstance(item, Patch):
                items.append(Patch(item.owner, item.attribute, item.replacement, fixes=(fix.id,)))
            else:
                items.append(item)
    for entry in items:
        if isinstance(entry, list):
            composite = _composite(entry, context.source)
            if composite is not None:
                yield composite
        else:
            yield entry


def _decide(fix: Fix, decision: Decision) -> None:
    with _lock:
        _decisions[fix.id] = decision


def _composite(contributions: list[tuple[Fix, Wrap]], source: str) -> Patch | Failure | None:
    """One patch of the attribute every contribution wraps (the first outermost)."""
    first = contributions[0][1]
    owner, name = first.owner, first.attribute
    method = owner.__dict__.get(name)
    ids = tuple(dict.fromkeys(fix.id for fix, _ in contributions))
    if callable(method):
        wrappers = [wrap.wrapper for _, wrap in contributions]
        return Patch(owner, name, composed(method, *wrappers), fixes=ids)
    required = [wrap for _, wrap in contributions if wrap.area is not None]
    if not required:
        return None
    consequences = "; ".join(dict.fromkeys(wrap.consequence for wrap in required))
    with _lock:
        for fix_id in ids:
            if fix_id in _decisions:
                old = _decisions[fix_id]
                _decisions[fix_id] = Decision(old.applies, old.reason, failed=True)
    return Failure(
        source,
        str(required[0].area),
        f"{owner.__module__}.{owner.__qualname__} defines no {name}; {consequences}",
    )


def composed(original: Callable[..., Any], *wrappers: Wrapper) -> Callable[..., Any]:
    """``original`` wrapped by each of ``wrappers``, the first outermost. Its ``__wrapped__`` is
    ``original`` itself, as a single wrapper's is: what the patch replaced, one step away."""
    result = original
    for wrap in reversed(wrappers):
        result = wrap(result)
    if result is not original:
        result.__wrapped__ = original  # type: ignore[attr-defined]
    return result


def wrapping(
    owner: Callable[[Context], type | None],
    attribute: str,
    wrapper: Wrapper,
    area: str | None = None,
    consequence: str = "",
) -> PatchBuilder:
    """A record's ``patches`` that wrap one method, ``owner(context).<attribute>``, by ``wrapper``
    (:class:`Wrap` says what ``area`` and ``consequence`` mean). The record's detector has found
    the owner: a release without it is one the record does not apply to."""

    def patches(context: Context) -> list[Wrap]:
        found = owner(context)
        assert found is not None  # the detector said so
        return [Wrap(found, attribute, wrapper, area, consequence)]

    return patches


def own_method(owner: type, name: str) -> Callable[..., Any] | None:
    """``owner.<name>`` where ``owner`` defines it itself and it is callable, else ``None``."""
    method = owner.__dict__.get(name)
    return method if callable(method) else None


def states(
    fixes: Iterable[Fix], installed: Iterable[Patch], pending: Iterable[str], active: bool
) -> tuple[FixState, ...]:
    """What became of each record, for ``status()``."""
    installed_ids = {fix_id for patch in installed for fix_id in patch.fixes}
    waiting = set(pending)
    found = []
    with _lock:
        decisions = dict(_decisions)
    for fix in fixes:
        module = fix.when_imported[0]
        decision = decisions.get(fix.id)
        if active and module in waiting:
            found.append(FixState(fix.id, None, f"waits for import {module}", "pending", module))
        elif not active:
            found.append(FixState(fix.id, None, "not activated", "not installed", module))
        elif decision is None:
            # Its plugin never built it: TransformerLens has no such module (2.x's bridge).
            reason = f"this TransformerLens has no {module}"
            found.append(FixState(fix.id, False, reason, "not applicable", module))
        elif decision.failed and fix.id not in installed_ids:
            found.append(FixState(fix.id, decision.applies, decision.reason, "failed", module))
        elif fix.id in installed_ids:
            found.append(FixState(fix.id, True, decision.reason, "installed", module))
        elif decision.applies:
            found.append(FixState(fix.id, True, decision.reason, "nothing to patch", module))
        else:
            reason = f"{decision.reason} (affects {_ranges(fix)})"
            found.append(FixState(fix.id, False, reason, "not applicable", module))
    return tuple(found)


def _ranges(fix: Fix) -> str:
    return ", ".join(f"{name} {spec}" for name, spec in fix.affects.items())


def markdown(fixes: Iterable[Fix]) -> str:
    """The generated table of ``docs/fixes.md``: one row per record, in registry order."""
    lines = [
        "| fix | symptom on stock | affects | upstream | with safelens-tl | test |",
        "|---|---|---|---|---|---|",
    ]
    for fix in fixes:
        affects = "; ".join(f"{name} `{spec}`" for name, spec in fix.affects.items())
        upstream = f"[link]({fix.upstream})" if fix.upstream else "-"
        if fix.fixed_in:
            upstream += f" (fixed in {fix.fixed_in})"
        test = f"[{fix.test_module.rsplit('/', 1)[-1]}](../{fix.test_module})"
        anchor = f'<a id="{fix.id.replace("_", "-")}"></a>`{fix.id}`'
        cells = (anchor, fix.symptom, affects, upstream, fix.remedy, test)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


#: Where the generated table starts and ends in ``docs/fixes.md`` (the text around it is kept).
BEGIN = "<!-- generated from safelens_tl/fixes/__init__.py: python -m safelens_tl.fixes -->"
END = "<!-- end of the generated table -->"


def render_document(current: str, fixes: Iterable[Fix]) -> str:
    """``current`` (``docs/fixes.md``) with the generated table between its markers replaced."""
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{markdown(fixes)}\n{END}{tail}"
