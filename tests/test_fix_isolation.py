"""One fix that raises costs that fix alone, whichever step of its life raises: its detector, its
patch builder, or the installation of its patches; on every release, with a warning naming it.

Each record of the registry is broken in turn (a copy of the record whose ``applies`` or
``patches`` raises, handed to the built-in plugins in place of the original; or
``patching.install`` raising for its patches), then safelens-tl is activated. Every other fix
must end as it ends with nothing broken (the fixes that need the broken one, ``Fix.requires``,
go with it), every attribute the others patch must be patched by them, and TransformerLens must
still generate: in float16 with the cache, the cached tokens those of the uncached loop, wherever
the fix that makes that right is not the broken one.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import activation, patching, targets
from safelens_tl.builtin_plugins import bridge as bridge_plugin
from safelens_tl.builtin_plugins import hooked as hooked_plugin
from safelens_tl.fixes import FIXES, HOOKED_FIXES
from safelens_tl.registry import Fix
from tests.conftest import HAS_BRIDGE, HAS_HOOKED_TRANSFORMER, RELEASE, tiny_model

if HAS_BRIDGE:
    # Imported now, so that the bridge's deferred fixes are built and installed at activation;
    # Hugging Face's CodeGen too: bridge_codegen is triggered by both modules, and a record that
    # fails at the first must be off at the second, with one warning.
    importlib.import_module(targets.BRIDGE_MODULE)
    importlib.import_module(targets.CODEGEN_MODULE)

#: The fix without which a model's cached float16 generation fails or is wrong on some release:
#: where it is the broken one, the check is only that generation runs (stock's cache raises
#: "expected scalar type" on TransformerLens 3.0.0; the attention bridges get no cache with
#: transformers 5.24+). Breaking any other fix leaves cached generation right (checked: with
#: every fix broken in turn, these two alone change the tokens).
CACHED_GENERATION_NEEDS = {"HookedTransformer": "kv_cache", "TransformerBridge": "bridge_cache"}
BROKEN = "broken on purpose"


def _ids(fix: Fix) -> str:
    return fix.id


def _dependents(broken: str) -> set[str]:
    """The records that need ``broken``, directly or in turn."""
    found: set[str] = set()
    wanted = {broken}
    changed = True
    while changed:
        changed = False
        for fix in FIXES:
            needs = set(getattr(fix, "requires", ()))
            if fix.id not in wanted and needs & wanted:
                found.add(fix.id)
                wanted.add(fix.id)
                changed = True
    return found


def _is_built_here(fix: Fix) -> bool:
    """Whether this install runs the record's code at activation: the bridge's records only
    where TransformerLens has a TransformerBridge."""
    return targets.BRIDGE_MODULE not in fix.when_imported or HAS_BRIDGE


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What an activation ended with: each fix's state, each patched attribute's fixes."""

    states: dict[str, str]
    reasons: dict[str, str]
    patched: dict[str, frozenset[str]]
    warnings: tuple[str, ...]


def _activate() -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = safelens_tl.activate()
    return Outcome(
        states={fix.id: fix.state for fix in status.fixes},
        reasons={fix.id: fix.reason for fix in status.fixes},
        patched={
            record.patch.target: frozenset(record.patch.fixes)
            for record in activation._state.installed
        },
        warnings=tuple(str(w.message) for w in caught if "safelens-tl" in str(w.message)),
    )


@pytest.fixture(scope="module")
def baseline() -> Iterator[Outcome]:
    """What an activation with nothing broken gives on this install."""
    safelens_tl.deactivate()
    outcome = _activate()
    safelens_tl.deactivate()
    assert not outcome.warnings, outcome.warnings
    yield outcome


def _break(monkeypatch: pytest.MonkeyPatch, fix: Fix, part: str) -> None:
    """Hand the plugins a copy of ``fix`` whose ``part`` (``applies`` or ``patches``) raises."""

    def broken(context: Any) -> Any:
        raise RuntimeError(f"{fix.id}'s {part} {BROKEN}")

    replaced = dataclasses.replace(fix, **{part: broken})
    plugin, name = (
        (hooked_plugin, "HOOKED_FIXES") if fix in HOOKED_FIXES else (bridge_plugin, "BRIDGE_FIXES")
    )
    records = getattr(plugin, name)
    monkeypatch.setattr(plugin, name, tuple(replaced if f is fix else f for f in records))


def _check_the_others(outcome: Outcome, baseline: Outcome, lost: set[str]) -> None:
    """Every fix not in ``lost`` ends as with nothing broken, and patches what it patched."""
    for fix in FIXES:
        if fix.id not in lost:
            assert outcome.states[fix.id] == baseline.states[fix.id], (
                fix.id,
                outcome.reasons[fix.id],
            )
    for target, fixes in baseline.patched.items():
        kept = fixes - lost
        if kept:
            assert outcome.patched.get(target) == kept, (target, outcome.patched.get(target))
        else:
            assert target not in outcome.patched, target


#: A prompt after which the tiny models' cached greedy tokens part from the uncached loop's
#: within six tokens where the cache is wrong (the TransformerBridge with transformers 5.24+).
PROMPT = "the cat runs and the dog sat on"


def _generated(model: Any, cached: bool) -> torch.Tensor:
    settings = {"max_new_tokens": 6, "do_sample": False, "verbose": False, "stop_at_eos": False}
    tokens = model.generate(PROMPT, use_past_kv_cache=cached, return_type="tokens", **settings)
    assert isinstance(tokens, torch.Tensor)
    return tokens


_bridges: dict[str, Any] = {}


def _bridge() -> Any:
    """The verifier's tiny GQA Llama booted as a TransformerBridge in float16, once."""
    if "llama" not in _bridges:
        from safelens_tl.verify import bridge

        _bridges["llama"] = bridge.boot("llama-like-gqa", torch.float16)
    return _bridges["llama"]


def _check_transformer_lens_runs(broken: set[str]) -> None:
    """Float16 generation runs on each API here, and the cached loop gives the uncached loop's
    tokens unless the fix that makes it right is among ``broken``."""
    models: list[Any] = []
    if HAS_HOOKED_TRANSFORMER:
        models.append(tiny_model("llama-like-gqa", torch.float16))
    if HAS_BRIDGE:
        models.append(_bridge())
    for model in models:
        uncached = _generated(model, cached=False)
        if CACHED_GENERATION_NEEDS[type(model).__name__] in broken:
            if type(model).__name__ == "TransformerBridge":
                _generated(model, cached=True)  # runs (wrong with transformers 5.24+)
            continue
        assert torch.equal(_generated(model, cached=True), uncached), type(model).__name__


@pytest.mark.parametrize("part", ["applies", "patches"])
@pytest.mark.parametrize("fix", FIXES, ids=_ids)
def test_a_fix_that_raises_costs_that_fix_alone(
    fix: Fix, part: str, baseline: Outcome, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _is_built_here(fix):
        pytest.skip(f"TransformerLens {RELEASE} has no TransformerBridge: no bridge fix is built")
    _break(monkeypatch, fix, part)
    outcome = _activate()
    never_called = part == "patches" and baseline.states[fix.id] == "not applicable"
    if never_called:
        # Its detector says no here, so its patch builder never runs: nothing changes.
        lost: set[str] = set()
        assert outcome.states[fix.id] == "not applicable"
        assert not outcome.warnings, outcome.warnings
    else:
        built = {"installed", "nothing to patch", "failed"}
        lost = {fix.id} | {d for d in _dependents(fix.id) if baseline.states[d] in built}
        for fix_id in lost:
            assert outcome.states[fix_id] == "failed", (fix_id, outcome.reasons[fix_id])
        assert BROKEN in outcome.reasons[fix.id]
        # One warning per fix lost, each naming its fix; none blames a plugin or another fix.
        assert len(outcome.warnings) == len(lost), outcome.warnings
        (own,) = [w for w in outcome.warnings if BROKEN in w]
        assert f"fix {fix.id} " in own, own
    _check_the_others(outcome, baseline, lost)
    _check_transformer_lens_runs(lost)


@pytest.mark.parametrize("fix", FIXES, ids=_ids)
def test_a_fix_whose_installation_fails_costs_that_fix_alone(
    fix: Fix, baseline: Outcome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``patching.install`` raises for every patch the fix contributes to, shared ones too: the
    patches it shares are installed without its part."""
    if baseline.states[fix.id] != "installed":
        pytest.skip(f"{fix.id} is not installed on TransformerLens {RELEASE}")
    install: Callable[[patching.Patch], patching.InstalledPatch] = patching.install

    def failing(patch: patching.Patch) -> patching.InstalledPatch:
        if fix.id in patch.fixes:
            raise RuntimeError(f"cannot set {patch.target}: {BROKEN}")
        return install(patch)

    monkeypatch.setattr(patching, "install", failing)
    outcome = _activate()
    lost = {fix.id} | {d for d in _dependents(fix.id) if baseline.states[d] == "installed"}
    for fix_id in lost:
        assert outcome.states[fix_id] == "failed", (fix_id, outcome.reasons[fix_id])
    assert BROKEN in outcome.reasons[fix.id] and "install" in outcome.reasons[fix.id]
    assert any(f"fix {fix.id} " in w and BROKEN in w for w in outcome.warnings), outcome.warnings
    _check_the_others(outcome, baseline, lost)
    _check_transformer_lens_runs(lost)
    # deactivate() restores what was installed, the patches rebuilt without the fix included.
    safelens_tl.deactivate()
    assert not activation._state.installed


def test_an_attribute_that_cannot_be_set_costs_the_fixes_that_patch_it(
    baseline: Outcome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no single fix is at fault (the attribute itself refuses), every fix patching that
    attribute is off, and only those (with the fixes that need them)."""
    shared = {t: f for t, f in baseline.patched.items() if len(f) > 1}
    if not shared:
        pytest.skip(f"no attribute is patched by two fixes on TransformerLens {RELEASE}")
    target, fixes = next(iter(shared.items()))
    install = patching.install

    def failing(patch: patching.Patch) -> patching.InstalledPatch:
        if patch.target == target:
            raise TypeError(f"cannot set {target}: {BROKEN}")
        return install(patch)

    monkeypatch.setattr(patching, "install", failing)
    outcome = _activate()
    lost = set(fixes)
    for fix_id in fixes:
        lost |= {d for d in _dependents(fix_id) if baseline.states[d] == "installed"}
    for fix_id in lost:
        assert outcome.states[fix_id] == "failed", (fix_id, outcome.reasons[fix_id])
    _check_the_others(outcome, baseline, lost)
