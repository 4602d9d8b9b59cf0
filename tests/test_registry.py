"""The registry of fixes, record by record: each record's detector, ranges, patches, test module
and docs row, on the installed TransformerLens (real classes, nothing mocked)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import traceback
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import pytest

import safelens_tl
from safelens_tl import activation, patching, registry, targets
from safelens_tl.fixes import FIXES, module_name
from safelens_tl.registry import Fix
from tests.conftest import HAS_BRIDGE, LAYOUT

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "fixes.md"
STATES = {"installed", "pending", "failed", "not applicable", "nothing to patch"}

if HAS_BRIDGE:
    # TransformerLens imports it lazily; the bridge's records are built at its import.
    importlib.import_module(targets.BRIDGE_MODULE)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _context(fix: Fix) -> registry.Context:
    """The context the plugins build ``fix`` in on this install; skips where it is not built."""
    module = fix.when_imported[0]
    if module == targets.BRIDGE_MODULE and not HAS_BRIDGE:
        pytest.skip(f"TransformerLens {LAYOUT.release} has no TransformerBridge")
    return registry.Context(LAYOUT, module, "tests")


def test_ids_are_unique_and_name_their_modules() -> None:
    ids = [fix.id for fix in FIXES]
    assert len(ids) == len(set(ids))
    for fix in FIXES:
        module = importlib.import_module(module_name(fix))
        assert module.FIX is fix


@pytest.mark.parametrize("fix", FIXES, ids=lambda fix: fix.id)
def test_the_record_is_complete(fix: Fix) -> None:
    """A symptom and a remedy of one line, valid ranges, a test module and a docs row."""
    from packaging.specifiers import SpecifierSet

    assert fix.symptom and "\n" not in fix.symptom
    assert fix.remedy and "\n" not in fix.remedy
    assert "transformer-lens" in fix.affects
    for specifiers in fix.affects.values():
        SpecifierSet(specifiers)  # raises on a malformed range
    assert fix.detector in ("release", "feature")
    # What it changes, from the closed set a user names to turn fixes off.
    assert fix.changes and set(fix.changes) <= set(registry.CHANGES), fix.changes
    by_id = {other.id: other for other in FIXES}
    for required in fix.requires:
        # Built at the same import, so that a failure or a switch can take this one with it.
        assert by_id[required].when_imported == fix.when_imported, required
    # One test module per fix, named after it, so that a fix's tests are found by its id.
    assert fix.test_module == f"tests/test_{fix.id}.py", fix.test_module
    assert (REPO / fix.test_module).is_file(), fix.test_module
    assert f'<a id="{fix.id.replace("_", "-")}"></a>`{fix.id}`' in DOCS.read_text("utf-8")
    assert fix.anchor.startswith("docs/fixes.md#")


@pytest.mark.parametrize("fix", FIXES, ids=lambda fix: fix.id)
def test_the_detector_agrees_with_the_declared_ranges(fix: Fix) -> None:
    """A release detector says exactly what the ranges say; a feature detector answers a bool and
    a reason, and applies only to releases its ranges name."""
    applies, reason = fix.applies(_context(fix))
    assert isinstance(applies, bool)
    assert isinstance(reason, str) and reason
    versions = {name: _version(name) for name in fix.affects}
    if fix.detector == "release":
        assert applies == fix.affects_release(versions), (reason, versions)
    elif applies:
        assert fix.affects_release(versions), (reason, versions, dict(fix.affects))


@pytest.mark.parametrize("fix", FIXES, ids=lambda fix: fix.id)
def test_every_patch_is_restored_on_deactivate(
    fix: Fix, patched: safelens_tl.activation.Status
) -> None:
    """What the record installed is, after ``deactivate()``, exactly what stood there before."""
    ours = [i for i in activation._state.installed if fix.id in i.patch.fixes]
    state = {f.id: f for f in safelens_tl.status().fixes}[fix.id]
    assert (state.state == "installed") == bool(ours), state
    if not ours:
        pytest.skip(f"{fix.id} is not installed here: {state.reason}")
    safelens_tl.deactivate()
    try:
        for installed in ours:
            patch = installed.patch
            now = patch.owner.__dict__.get(patch.attribute, patching.MISSING)
            assert now is installed.original, patch.target
    finally:
        safelens_tl.activate()


def test_status_lists_every_fix(patched: safelens_tl.activation.Status) -> None:
    status = safelens_tl.status()
    assert [f.id for f in status.fixes] == [fix.id for fix in FIXES]
    for state in status.fixes:
        assert state.state in STATES, state
        assert state.reason
        assert (state.applies is False) == (state.state == "not applicable"), state
    data = json.loads(json.dumps(status.to_dict()))
    assert [f["id"] for f in data["fixes"]] == [fix.id for fix in FIXES]
    text = str(status)
    for fix in FIXES:
        assert re.search(rf"^\s+{fix.id}\s", text, re.M), text


def test_a_release_fix_out_of_range_says_so(patched: safelens_tl.activation.Status) -> None:
    """Every release-ranged record that does not apply names the range it affects."""
    by_id = {f.id: f for f in safelens_tl.status().fixes}
    for fix in FIXES:
        if fix.detector == "release" and by_id[fix.id].state == "not applicable":
            assert fix.affects["transformer-lens"] in by_id[fix.id].reason


def test_the_docs_table_is_generated_from_the_registry() -> None:
    """``docs/fixes.md``'s table is the registry's; regenerate it with
    ``python -m safelens_tl.fixes --write docs/fixes.md``."""
    current = DOCS.read_text("utf-8")
    assert registry.BEGIN in current and registry.END in current
    assert registry.render_document(current, FIXES) == current


def test_a_record_must_say_what_it_changes() -> None:
    record = FIXES[0]
    for wrong in ((), ("forwards",), "forward"):
        with pytest.raises(ValueError, match="changes must be a tuple of one or more of forward"):
            dataclasses.replace(record, changes=wrong)


def test_the_switch_variable_is_the_one_the_start_up_module_reads() -> None:
    from safelens_tl import _startup

    assert registry.DISABLE_VAR == _startup.DISABLE_VAR == registry.BY_ENVIRONMENT


def _raise_value_error(*args: object, **kwargs: object) -> None:
    raise ValueError("the wrapped library said no")


def test_an_error_raised_below_a_wrapper_says_where_it_was_raised() -> None:
    """A wrapper that only passes a call through leaves a note: the error came from the code it
    wrapped, not from safelens-tl; its own frame is hidden from IPython and pytest."""

    def passing(original: object) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            return original(*args, **kwargs)  # type: ignore[operator]

        return wrapper

    replacement = registry.composed(_raise_value_error, passing, fixes=("some_fix",))
    with pytest.raises(ValueError, match="said no") as raised:
        replacement()
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1, notes
    assert f"raised in {__name__}" in notes[0]
    assert "(some_fix) only passed the call through" in notes[0]
    frames = [frame for frame, _ in traceback.walk_tb(raised.value.__traceback__)]
    assert any(frame.f_locals.get("__tracebackhide__") for frame in frames)
    # Raised again through a second wrapper: still one note.
    outer = registry.composed(replacement, passing, fixes=("other_fix",))
    with pytest.raises(ValueError) as again:
        outer()
    assert len(again.value.__notes__) == 1


def test_a_wrapped_generator_function_stays_one_and_notes_its_errors() -> None:
    """``generate_stream`` is a generator function; code that checks with ``inspect`` must still
    see one through the wrappers, and an error raised while it streams gets the same note."""

    def stream(count: int) -> Iterator[int]:
        yield from range(count)
        raise ValueError("the wrapped stream said no")

    def passing(original: Callable[..., Iterator[int]]) -> Callable[..., Iterator[int]]:
        def wrapper(*args: object, **kwargs: object) -> Iterator[int]:
            return (yield from original(*args, **kwargs))

        return wrapper

    replacement = registry.composed(stream, passing, fixes=("some_fix",))
    assert inspect.isgeneratorfunction(replacement)
    items = replacement(3)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="stream said no") as raised:
        next(items)
    (note,) = raised.value.__notes__
    assert "(some_fix) only passed the call through" in note


def test_an_error_raised_in_safelens_own_code_says_so_and_how_to_leave_it_out() -> None:
    def failing(original: object) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            return patching.install(None)  # type: ignore[arg-type]  # AttributeError in there

        return wrapper

    # The error is raised in safelens_tl/patching.py, one of the package's own files.
    replacement = registry.composed(_raise_value_error, failing, fixes=("some_fix",))
    with pytest.raises(AttributeError) as raised:
        replacement()
    (note,) = raised.value.__notes__
    assert "safelens-tl's own code (some_fix)" in note and "SAFELENS_TL_DISABLE=some_fix" in note


@pytest.mark.skipif(not LAYOUT.known.has_hooked_transformer, reason="no HookedTransformer here")
def test_a_transformer_lens_error_in_generate_names_transformer_lens() -> None:
    """A ``generate`` TransformerLens refuses (token input and no tokenizer) raises stock's
    error, with a note that TransformerLens raised it through safelens-tl's wrappers."""
    import torch

    from safelens_tl.verify import models

    model = models.build_model("gpt2-like", torch.float32)
    model.tokenizer = None
    tokens = torch.tensor([[5, 6, 7]])
    with pytest.raises(AssertionError) as stock:
        model.generate(tokens, max_new_tokens=2, verbose=False)
    safelens_tl.activate()
    with pytest.raises(AssertionError) as patched:
        model.generate(tokens, max_new_tokens=2, verbose=False)
    assert str(patched.value) == str(stock.value)
    assert not getattr(stock.value, "__notes__", None)
    (note,) = patched.value.__notes__
    assert note.startswith("safelens-tl: raised in transformer_lens.HookedTransformer")
