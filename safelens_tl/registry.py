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

Each record is on its own: an exception in its detector or its patch builder fails that record
only (a :class:`~safelens_tl.plugins.Failure` naming it), and a composite patch can be rebuilt
without a record whose installation failed (:attr:`~safelens_tl.patching.Patch.narrowed`). A user
turns records off by id or by what they change (:data:`CHANGES`), in :data:`DISABLE_VAR` or with
``activate(exclude=...)`` (:func:`switches`); a record that needs another (:attr:`Fix.requires`)
goes with it.

Imported at activation only (never by the start-up hook): it imports ``packaging`` and the
TransformerLens locations of :mod:`safelens_tl.targets`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

from safelens_tl import targets
from safelens_tl.patching import Patch, passing_errors_through
from safelens_tl.plugins import Failure

#: What a wrapper contributed to an attribute does to the method it wraps.
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

#: The module whose import triggers the HookedTransformer fixes.
HOOKED_MODULE = "transformer_lens"

#: What a fix may change (:attr:`Fix.changes`), each in the words ``status`` uses. A user names one
#: to turn off every fix that changes it: ``SAFELENS_TL_DISABLE=forward`` keeps every forward pass
#: stock. A fix declares each kind its code touches, not only the one its symptom is about.
CHANGES: Mapping[str, str] = MappingProxyType(
    {
        "forward": "the forward pass: code that a forward of the model runs, inside generate or "
        "not (layers, attention, the functions they call)",
        "generate": "generation: generate, generate_stream and hf_generate themselves",
        "cache": "the KV cache: its entries, their storage, and how attention is handed the cache",
        "conversion": "building and converting models: the dtype and device of their parameters",
    }
)

#: The environment variable naming fixes (ids or :data:`CHANGES` kinds) to leave out, read at
#: each activation: ``SAFELENS_TL_DISABLE=hooked_weight_copies,bridge_cache``. The start-up
#: module reads it (``safelens_tl._startup.DISABLE_VAR``, the same name: no other module reads
#: the environment); here it names what turned a fix off.
DISABLE_VAR = "SAFELENS_TL_DISABLE"
#: What turned a fix off, as ``status()`` says it.
BY_ENVIRONMENT = DISABLE_VAR
BY_ARGUMENT = "activate(exclude=...)"


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
    #: What the fix changes, from :data:`CHANGES`: every kind its patches touch (``forward`` for
    #: any method or function a forward of the model runs, even one that acts only in some calls).
    changes: tuple[str, ...]
    #: The modules whose import triggers the fix; most records have one.
    when_imported: tuple[str, ...] = (HOOKED_MODULE,)
    #: ``"release"``: :attr:`applies` decides by :attr:`affects` alone (the registry test checks
    #: they agree); ``"feature"``: by what the installed code has.
    detector: str = "feature"
    upstream: str | None = None
    fixed_in: str | None = None
    #: Ids of records, triggered by the same import, whose patches this one needs to work (it
    #: relies on their code to act); off, failed or not applicable, they take this one with them.
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.changes if kind not in CHANGES]
        if not self.changes or unknown or isinstance(self.changes, str):
            raise ValueError(
                f"{self.id}: changes must be a tuple of one or more of {', '.join(CHANGES)}; "
                f"received {self.changes!r}"
            )

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

    #: ``None`` where the detector did not answer (it raised, or the record is off).
    applies: bool | None
    reason: str
    failed: bool = False
    #: What turned the record off (:data:`BY_ENVIRONMENT`, :data:`BY_ARGUMENT`); empty when on.
    disabled_by: str = ""


@dataclass(frozen=True)
class FixState:
    """One record in ``status()``: whether it applies here and why, and what became of it."""

    id: str
    #: ``None`` while its module has not been imported (or nothing was activated).
    applies: bool | None
    reason: str
    #: ``installed``, ``pending`` (on an import), ``failed``, ``not applicable``, ``nothing to
    #: patch`` (applies, but found no attribute to change), ``disabled`` (turned off by the user)
    #: or ``not installed`` (inactive).
    state: str
    when_imported: str = field(default="")
    #: What the fix changes (:data:`CHANGES` keys).
    changes: tuple[str, ...] = ()
    #: What turned it off when ``state`` is ``disabled``: :data:`BY_ENVIRONMENT` or
    #: :data:`BY_ARGUMENT`.
    disabled_by: str = ""

    def __str__(self) -> str:
        return f"{self.id}: {self.state} ({self.reason})"


_lock = threading.Lock()
#: Each record's latest decision, by id (replaced at each build of its module).
_decisions: dict[str, Decision] = {}
#: The records ``status()`` reports on, in order (:func:`publish`).
_published: tuple[Fix, ...] = ()


@dataclass(frozen=True)
class Switches:
    """The records a user turned off for one activation, and the names not understood."""

    #: Record id -> (what turned it off: :data:`BY_ENVIRONMENT` or :data:`BY_ARGUMENT`, the
    #: reason ``status()`` gives).
    off: Mapping[str, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))
    #: Names in :data:`DISABLE_VAR` that are neither a record's id nor a kind of :data:`CHANGES`.
    unknown: tuple[str, ...] = ()


#: The switches of the latest activation (:func:`configure`), followed by every build.
_switches = Switches()
#: The records whose detector or patch builder raised since the latest activation: a record
#: triggered by several modules (``Fix.when_imported``) is off from its first failure on, with
#: one warning, and patches nothing at the next module's import.
_failed: set[str] = set()


def publish(fixes: Iterable[Fix]) -> None:
    """Make ``fixes`` the records ``status()`` reports on: the list of fixes hands itself over
    when it is imported (by the built-in plugins), so that the engine names no fix."""
    global _published
    _published = tuple(fixes)


def published() -> tuple[Fix, ...]:
    """The records handed over by :func:`publish` (none before the list of fixes is imported)."""
    return _published


def names(value: str | Iterable[str]) -> tuple[str, ...]:
    """The names in ``value``, lower-cased, each once, in order: a string of names separated by
    commas or blanks (``"hooked_weight_copies, cache"``), or an iterable of such strings."""
    parts = [value] if isinstance(value, str) else list(value)
    found: dict[str, None] = {}
    for part in parts:
        if not isinstance(part, str):
            raise TypeError(
                f"expected fix ids or kinds of change as strings; received {part!r} "
                f"({type(part).__name__})"
            )
        for name in part.replace(",", " ").split():
            found.setdefault(name.lower(), None)
    return tuple(found)


def valid_names(fixes: Iterable[Fix]) -> str:
    """The names a user may give, for a message: the kinds of change, then the fix ids."""
    ids = ", ".join(fix.id for fix in fixes) or "none (the built-in fixes did not load)"
    return f"kinds of change: {', '.join(CHANGES)}; fixes: {ids}"


def switches(fixes: Iterable[Fix], environment: str, argument: Iterable[str] = ()) -> Switches:
    """Which of ``fixes`` are off: those that ``environment`` (the value of :data:`DISABLE_VAR`)
    or ``argument`` (the names given to ``activate(exclude=...)``) name by id or by a kind of
    :data:`CHANGES` they declare, and those that need one of them (:attr:`Fix.requires`).

    A name in ``argument`` that is neither raises ``ValueError`` listing the valid names; such
    names in ``environment`` are returned in :attr:`Switches.unknown` for the caller to warn
    about (a variable must never break ``import transformer_lens``).
    """
    records = tuple(fixes)
    known = {fix.id for fix in records} | set(CHANGES)
    given = names(argument)
    wrong = [name for name in given if name not in known]
    if wrong:
        raise ValueError(
            f"activate(exclude=...) expects fix ids or kinds of change ({valid_names(records)}); "
            f"received {', '.join(map(repr, wrong))}. Nothing was changed."
        )
    from_environment = names(environment)
    off: dict[str, tuple[str, str]] = {}
    for by, chosen in ((BY_ENVIRONMENT, from_environment), (BY_ARGUMENT, given)):
        for name in chosen:
            for fix in records:
                if fix.id not in off and (fix.id == name or name in fix.changes):
                    off[fix.id] = (by, f"turned off by {by}: {name}")
    changed = True
    while changed:
        changed = False
        for fix in records:
            needed = next((required for required in fix.requires if required in off), None)
            if fix.id not in off and needed is not None:
                by, why = off[needed]
                off[fix.id] = (by, f"off with {needed}, which it needs ({why})")
                changed = True
    unknown = tuple(name for name in from_environment if name not in known)
    return Switches(MappingProxyType(off), unknown)


def configure(chosen: Switches) -> None:
    """Make ``chosen`` the switches that builds follow from now on (set at each activation)."""
    global _switches
    with _lock:
        _switches = chosen
        _failed.clear()


def current_switches() -> Switches:
    """The switches of the latest activation."""
    with _lock:
        return _switches


def dependents(fix_ids: Iterable[str]) -> set[str]:
    """The published records that need one of ``fix_ids``, directly or through others."""
    found: set[str] = set()
    wanted = set(fix_ids)
    changed = True
    while changed:
        changed = False
        for fix in _published:
            if fix.id not in found and fix.id not in wanted and wanted & set(fix.requires):
                found.add(fix.id)
                wanted.add(fix.id)
                changed = True
    return found


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def failure(fix_id: str, stage: str, reason: str) -> Failure:
    """The report of a record that is off because ``reason``: a warning and a ``status()`` entry
    that name it."""
    return Failure(
        f"fix {fix_id}", stage, f"{reason}; this fix is off, the others apply", fixes=(fix_id,)
    )


def build(fixes: Iterable[Fix], context: Context) -> Iterator[Patch | Failure]:
    """The patches (and failures) of the records ``context.module``'s import triggers.

    Each record's detector runs first, then its patch builder; an exception in either fails that
    record only, reported as a :class:`~safelens_tl.plugins.Failure` that names it. A record
    turned off (:func:`configure`) runs no code at all; one whose required record
    (:attr:`Fix.requires`) is not built here is left out with it. Wrappers of one attribute
    become one :class:`~safelens_tl.patching.Patch`, placed where the first of them came,
    crediting every contributing record in ``Patch.fixes``.
    """
    with _lock:
        off = dict(_switches.off)
    triggered = [fix for fix in fixes if context.module in fix.when_imported]
    built: dict[str, list[Patch | Wrap | Failure]] = {}
    failures: list[Failure] = []
    with _lock:
        failed_before = set(_failed)
    for fix in triggered:
        if fix.id in off:
            by, reason = off[fix.id]
            _decide(fix, Decision(None, reason, disabled_by=by))
            continue
        if fix.id in failed_before:
            continue  # off since it failed at another module's import: reported there
        stage, applies, reason, made = "detector", None, "", []
        try:
            applies, reason = fix.applies(context)
            if applies:
                stage = "patch builder"
                made = list(fix.patches(context))
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            _decide(fix, Decision(applies, f"{stage}: {_describe(error)}", failed=True))
            failures.append(failure(fix.id, stage, _describe(error)))
            with _lock:
                _failed.add(fix.id)
            continue
        _decide(fix, Decision(applies, reason, failed=any(isinstance(i, Failure) for i in made)))
        if applies:
            built[fix.id] = made
    failures.extend(_drop_unmet_requirements(triggered, built))
    yield from failures
    items: list[Patch | Failure | list[tuple[Fix, Wrap]]] = []
    groups: dict[tuple[int, str], list[tuple[Fix, Wrap]]] = {}
    for fix in triggered:
        for item in built.get(fix.id, ()):
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


def _drop_unmet_requirements(
    triggered: list[Fix], built: dict[str, list[Patch | Wrap | Failure]]
) -> list[Failure]:
    """Take out of ``built`` every record that needs one not built (in turn, what needs it)."""
    failures = []
    changed = True
    while changed:
        changed = False
        for fix in triggered:
            missing = next((r for r in fix.requires if r not in built), None)
            if fix.id not in built or missing is None:
                continue
            del built[fix.id]
            changed = True
            with _lock:
                theirs = _decisions.get(missing)
            if theirs is not None and theirs.disabled_by:
                reason = f"off with {missing}, which it needs ({theirs.reason})"
                _decide(fix, Decision(None, reason, disabled_by=theirs.disabled_by))
            elif theirs is not None and theirs.failed:
                reason = f"needs {missing}, which failed"
                _decide(fix, Decision(True, f"requires: {reason}", failed=True))
                failures.append(failure(fix.id, "requires", reason))
            else:
                _decide(fix, Decision(False, f"needs {missing}, which does not apply here"))
    return failures


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
        return _composed_patch(owner, name, method, contributions)
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


def _composed_patch(
    owner: type | ModuleType,
    name: str,
    method: Callable[..., Any],
    contributions: list[tuple[Fix, Wrap]],
) -> Patch:
    """The patch of ``owner.<name>`` by every contribution; where several records contribute, it
    can be rebuilt without some of them (:attr:`~safelens_tl.patching.Patch.narrowed`), so that
    one record's failed installation costs only that record."""
    ids = tuple(dict.fromkeys(fix.id for fix, _ in contributions))

    def narrowed(failed: frozenset[str]) -> Patch | None:
        kept = [(fix, wrap) for fix, wrap in contributions if fix.id not in failed]
        return _composed_patch(owner, name, method, kept) if kept else None

    replacement = composed(method, *(wrap.wrapper for _, wrap in contributions), fixes=ids)
    return Patch(owner, name, replacement, fixes=ids, narrowed=narrowed if len(ids) > 1 else None)


def composed(
    original: Callable[..., Any], *wrappers: Wrapper, fixes: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """``original`` wrapped by each of ``wrappers``, the first outermost, and by
    :func:`~safelens_tl.patching.passing_errors_through` (an error raised below says where it came
    from). Its ``__wrapped__`` is ``original`` itself, as a single wrapper's is: what the patch
    replaced, one step away."""
    result = original
    for wrap in reversed(wrappers):
        result = wrap(result)
    if result is not original:
        if inspect.isfunction(result):
            result = passing_errors_through(result, fixes)
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
    fixes: Iterable[Fix],
    installed: Iterable[Patch],
    pending: Iterable[str],
    active: bool,
    failures: Iterable[Failure] = (),
) -> tuple[FixState, ...]:
    """What became of each record, for ``status()``; ``failures`` are those reported after the
    builds (a record whose installation failed)."""
    installed_ids = {fix_id for patch in installed for fix_id in patch.fixes}
    waiting = set(pending)
    failed_later = {fix_id: f"{f.stage}: {f.message}" for f in failures for fix_id in f.fixes}
    found = []
    with _lock:
        decisions = dict(_decisions)
        off = dict(_switches.off)
    for fix in fixes:
        module = fix.when_imported[0]
        decision = decisions.get(fix.id)

        def state(applies: bool | None, reason: str, name: str, by: str = "") -> FixState:
            return FixState(fix.id, applies, reason, name, module, fix.changes, by)  # noqa: B023

        if not active:
            found.append(state(None, "not activated", "not installed"))
        elif fix.id in off:
            by, reason = off[fix.id]
            found.append(state(None, reason, "disabled", by))
        elif module in waiting:
            found.append(state(None, f"waits for import {module}", "pending"))
        elif decision is None:
            # Its plugin never built it: TransformerLens has no such module (2.x's bridge).
            found.append(state(False, f"this TransformerLens has no {module}", "not applicable"))
        elif fix.id in installed_ids:
            found.append(state(True, decision.reason, "installed"))
        elif decision.disabled_by:
            found.append(state(None, decision.reason, "disabled", decision.disabled_by))
        elif decision.failed or fix.id in failed_later:
            reason = decision.reason if decision.failed else failed_later[fix.id]
            found.append(state(decision.applies, reason, "failed"))
        elif decision.applies:
            found.append(state(True, decision.reason, "nothing to patch"))
        else:
            reason = f"{decision.reason} (affects {_ranges(fix)})"
            found.append(state(False, reason, "not applicable"))
    return tuple(found)


def _ranges(fix: Fix) -> str:
    return ", ".join(f"{name} {spec}" for name, spec in fix.affects.items())


def markdown(fixes: Iterable[Fix]) -> str:
    """The generated table of ``docs/fixes.md``: one row per record, in registry order."""
    lines = [
        "| fix | changes | symptom on stock | affects | upstream | with safelens-tl | test |",
        "|---|---|---|---|---|---|---|",
    ]
    for fix in fixes:
        affects = "; ".join(f"{name} `{spec}`" for name, spec in fix.affects.items())
        upstream = f"[link]({fix.upstream})" if fix.upstream else "-"
        if fix.fixed_in:
            upstream += f" (fixed in {fix.fixed_in})"
        test = f"[{fix.test_module.rsplit('/', 1)[-1]}](../{fix.test_module})"
        anchor = f'<a id="{fix.id.replace("_", "-")}"></a>`{fix.id}`'
        changes = ", ".join(f"`{kind}`" for kind in fix.changes)
        cells = (anchor, changes, fix.symptom, affects, upstream, fix.remedy, test)
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
