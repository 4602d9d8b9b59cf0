"""Turning fixes off, by id or by what they change: ``activate(exclude=...)`` and the environment
variable ``SAFELENS_TL_DISABLE``, read at each activation; ``status()`` says which fixes are off
and by what. (Through the start-up hook in a fresh interpreter: ``tests/test_autoactivate.py``.)

"Keeps every forward pass stock" is checked by watching which Python code a forward runs: with
the kind ``forward`` turned off, no line of safelens-tl runs in a forward of the tiny models.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import activation, registry, targets
from safelens_tl.activation import SafelensWarning, Status
from safelens_tl.fixes import FIXES, module_name
from safelens_tl.verify import models
from tests.conftest import (
    HAS_BRIDGE,
    HAS_HOOKED_TRANSFORMER,
    RELEASE,
    requires_hooked_transformer,
    tiny_model,
)

if HAS_BRIDGE:
    importlib.import_module(targets.BRIDGE_MODULE)

PACKAGE = Path(safelens_tl.__file__).resolve().parent
BY_KIND = {kind: {fix.id for fix in FIXES if kind in fix.changes} for kind in registry.CHANGES}


@pytest.fixture(autouse=True)
def _no_switch_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.DISABLE_VAR, raising=False)


def by_id(status: Status) -> dict[str, Any]:
    return {fix.id: fix for fix in status.fixes}


def installed_fixes() -> set[str]:
    return {fix_id for record in activation._state.installed for fix_id in record.patch.fixes}


@pytest.fixture(scope="module")
def baseline() -> dict[str, str]:
    """Each fix's state with nothing turned off."""
    safelens_tl.deactivate()
    states = {fix.id: fix.state for fix in safelens_tl.activate().fixes}
    safelens_tl.deactivate()
    return states


def check_off(status: Status, off: set[str], by: str, baseline: dict[str, str]) -> None:
    """``off`` are disabled by ``by`` and patch nothing; every other fix is as with none off."""
    assert status.active
    states = by_id(status)
    for fix in FIXES:
        state = states[fix.id]
        if fix.id in off:
            assert (state.state, state.disabled_by) == ("disabled", by), state
            assert state.reason.startswith(("turned off by", "off with")), state
        else:
            assert state.state == baseline[fix.id], state
    assert not installed_fixes() & off


def test_one_kind_turns_off_every_fix_that_declares_it(baseline: dict[str, str]) -> None:
    status = safelens_tl.activate(exclude="forward")
    off = BY_KIND["forward"] | registry.dependents(BY_KIND["forward"])
    check_off(status, off, registry.BY_ARGUMENT, baseline)
    assert by_id(status)["hooked_weight_copies"].reason == (
        f"turned off by {registry.BY_ARGUMENT}: forward"
    )


def test_one_fix_by_its_id_and_the_rest_as_without_switches(baseline: dict[str, str]) -> None:
    status = safelens_tl.activate(exclude=["hooked_weight_copies"])
    check_off(status, {"hooked_weight_copies"}, registry.BY_ARGUMENT, baseline)


def test_the_environment_variable_names_ids_and_kinds(
    monkeypatch: pytest.MonkeyPatch, baseline: dict[str, str]
) -> None:
    """Commas or blanks between names, any case: as ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``."""
    monkeypatch.setenv(registry.DISABLE_VAR, " KV_Cache,, conversion  bridge_cache ")
    status = safelens_tl.activate()
    named = {"kv_cache", "bridge_cache"} | BY_KIND["conversion"]
    check_off(status, named | registry.dependents(named), registry.BY_ENVIRONMENT, baseline)


def test_the_environment_and_the_argument_add_up(
    monkeypatch: pytest.MonkeyPatch, baseline: dict[str, str]
) -> None:
    monkeypatch.setenv(registry.DISABLE_VAR, "hooked_alibi")
    status = safelens_tl.activate(exclude="bridge_conversion")
    states = by_id(status)
    assert states["hooked_alibi"].disabled_by == registry.BY_ENVIRONMENT
    assert states["bridge_conversion"].disabled_by == registry.BY_ARGUMENT
    assert {f.id for f in status.fixes if f.state == "disabled"} == {
        "hooked_alibi",
        "bridge_conversion",
    }


def test_a_fix_that_needs_a_fix_turned_off_goes_with_it() -> None:
    """``bridge_generate_batch`` and ``bridge_uncached_media`` act through the call into the
    model that ``bridge_model_call`` wraps: without it, the first would pad a batch on the left
    and mask nothing."""
    chosen = registry.switches(FIXES, "", ["bridge_model_call"])
    assert set(chosen.off) == {
        "bridge_model_call",
        "bridge_generate_batch",
        "bridge_uncached_media",
    }
    by, reason = chosen.off["bridge_generate_batch"]
    assert by == registry.BY_ARGUMENT and "bridge_model_call" in reason
    if HAS_BRIDGE:
        states = by_id(safelens_tl.activate(exclude="bridge_model_call"))
        assert states["bridge_generate_batch"].state == "disabled"
        assert "bridge_model_call" in states["bridge_generate_batch"].reason


def test_an_unknown_name_in_the_environment_is_warned_with_the_valid_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A typo must not pass silently, nor break ``import transformer_lens``: warned, listed in
    ``status().notes``, and the other names still apply."""
    monkeypatch.setenv(registry.DISABLE_VAR, "hooked_weight_copy,hooked_alibi")
    with pytest.warns(SafelensWarning, match="'hooked_weight_copy' is neither") as caught:
        status = safelens_tl.activate()
    (message,) = [str(w.message) for w in caught if "hooked_weight_copy'" in str(w.message)]
    for name in [*registry.CHANGES, *(fix.id for fix in FIXES)]:
        assert name in message
    assert any("hooked_weight_copy'" in note for note in status.notes)
    assert by_id(status)["hooked_alibi"].state == "disabled"
    assert by_id(status)["hooked_weight_copies"].state != "disabled"


@pytest.mark.parametrize("active", [False, True], ids=["inactive", "active"])
def test_an_unknown_name_given_to_activate_raises_and_changes_nothing(active: bool) -> None:
    before = safelens_tl.activate() if active else safelens_tl.status()
    patched = list(activation._state.installed)
    with pytest.raises(ValueError, match="received 'forwards'") as raised:
        safelens_tl.activate(exclude=["hooked_alibi", "forwards"])
    for name in [*registry.CHANGES, "hooked_weight_copies", "bridge_cache"]:
        assert name in str(raised.value)
    assert "Nothing was changed" in str(raised.value)
    assert safelens_tl.is_active() is active
    assert activation._state.installed == patched
    if active:
        assert safelens_tl.status() is before


def test_names_must_be_strings() -> None:
    with pytest.raises(TypeError, match="received 3"):
        safelens_tl.activate(exclude=["forward", 3])  # type: ignore[list-item]


def test_activate_again_with_other_exclusions_installs_the_new_choice(
    baseline: dict[str, str],
) -> None:
    """``activate()`` without ``exclude`` keeps what is in force (idempotent); another choice
    reinstalls; ``exclude=()`` puts back what an earlier call left out."""
    first = safelens_tl.activate(exclude="hooked_alibi")
    assert safelens_tl.activate() is first
    assert safelens_tl.activate(exclude=["hooked_alibi"]) is first
    second = safelens_tl.activate(exclude="bridge_conversion")
    check_off(second, {"bridge_conversion"}, registry.BY_ARGUMENT, baseline)
    third = safelens_tl.activate(exclude=())
    assert [f.state for f in third.fixes] == [baseline[f.id] for f in FIXES]


def test_status_says_what_changes_in_words(patched: Status) -> None:
    """``str(status())`` names, for each kind of change, the fixes that make it here."""
    text = str(safelens_tl.activate(exclude="hooked_alibi"))
    assert "what it changes here" in text
    for kind, words in registry.CHANGES.items():
        label = words.split(":")[0]
        making = [f.id for f in by_id(safelens_tl.status()).values() if kind in f.changes]
        in_force = [i for i in making if by_id(safelens_tl.status())[i].state in ("installed",)]
        line = next(line for line in text.splitlines() if line.startswith(f"  {label}:"))
        assert all(fix_id in line for fix_id in in_force), line
    assert f"turned off by {registry.BY_ARGUMENT}: hooked_alibi" in text


def python_files_run(action: Callable[[], object]) -> set[Path]:
    """The Python source files whose functions ``action`` calls, in this thread."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, argument: object) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        action()
    finally:
        if previous is None or callable(previous):
            sys.setprofile(previous)
        else:  # cProfile's profiler: sys.getprofile() hands back the object, which re-installs
            sys.setprofile(None)
            previous.enable()
    return {Path(name).resolve() for name in seen if not name.startswith("<")}


#: The import watcher: it answers each import while a module's fixes wait for it (a dict
#: lookup), whatever runs; no fix.
WATCHER = PACKAGE / "_import_hooks.py"


def ours(files: set[Path]) -> set[Path]:
    """The files of safelens-tl among ``files``, the import watcher's apart."""
    return {file for file in files if file.is_relative_to(PACKAGE) and file != WATCHER}


def forwards() -> Iterator[tuple[str, Callable[[], object]]]:
    """A plain forward (no cache) of each API here, on a tiny model built before activation."""
    tokens = torch.randint(
        4, models.vocab_size(), (2, 7), generator=torch.Generator().manual_seed(0)
    )
    if HAS_HOOKED_TRANSFORMER:
        for name in ("gpt2-like", "llama-like-gqa"):
            model = tiny_model(name, torch.float32)
            yield f"HookedTransformer {name}", lambda model=model: model(tokens)
            yield (
                f"HookedTransformer {name} run_with_cache",
                lambda model=model: model.run_with_cache(tokens),
            )
    if HAS_BRIDGE:
        from safelens_tl.verify import bridge

        model = bridge.boot("llama-like-gqa", torch.float32)
        yield "TransformerBridge llama-like-gqa", lambda: model(tokens)


def fix_of(file: Path) -> str | None:
    """The fix whose module ``file`` is (the cache entry's package counts as ``kv_cache``)."""
    if file.is_relative_to(PACKAGE / "kv"):
        return "kv_cache"
    for fix in FIXES:
        if Path(str(importlib.import_module(module_name(fix)).__file__)).resolve() == file:
            return fix.id
    return None


def test_with_forward_turned_off_a_forward_runs_no_safelens_code() -> None:
    """The other half: with every fix on, the same forwards run safelens-tl's code where a
    ``forward`` fix is installed, and each fix whose module runs there declares ``forward``."""
    for name, forward in forwards():
        safelens_tl.activate()
        run = ours(python_files_run(forward))
        forward_installed = installed_fixes() & BY_KIND["forward"]
        if forward_installed:
            assert run, f"{name}: no safelens-tl code ran with {sorted(forward_installed)} on"
        for file in run:
            fix_id = fix_of(file)
            if fix_id is not None:
                assert fix_id in BY_KIND["forward"], (name, fix_id, file)
        safelens_tl.activate(exclude="forward")
        assert ours(python_files_run(forward)) == set(), name
        safelens_tl.deactivate()


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason=f"TransformerLens {RELEASE} has none")
def test_with_forward_and_generate_off_generate_runs_only_the_cache_s_code() -> None:
    model = tiny_model("llama-like-gqa", torch.float16)
    safelens_tl.activate(exclude=["forward", "generate"])

    def generate() -> object:
        return model.generate("the cat", max_new_tokens=3, use_past_kv_cache=True, verbose=False)

    run = ours(python_files_run(generate))
    assert {fix_of(file) for file in run} == {"kv_cache"}, run


#: How far a HookedTransformer forward may be from stock's with every fix on, as a fraction of the
#: largest logit: reading the weights in place (``hooked_weight_copies``, float32 only) takes
#: another matrix-product kernel for 1 to 3 rows, which rounds otherwise. Measured on
#: TransformerLens 2.18, 3.0.0 and 3.9.0 (the tiny models, shapes below): 5.3e-7 in float32;
#: float16 and bfloat16 run the release's code on the CPU, bitwise. The README quotes these.
ROUNDING = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}


@requires_hooked_transformer
@pytest.mark.parametrize("dtype", list(ROUNDING), ids=str)
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like-gqa"])
def test_forward_is_stock_s_within_rounding_and_bitwise_with_forward_off(
    name: str, dtype: torch.dtype
) -> None:
    model = tiny_model(name, dtype)
    worst = 0.0
    for batch, positions in ((1, 1), (1, 9), (4, 9)):
        tokens = torch.randint(
            4, models.vocab_size(), (batch, positions), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            safelens_tl.deactivate()
            stock = model(tokens).float()
            safelens_tl.activate(exclude="forward")
            assert torch.equal(model(tokens).float(), stock), (batch, positions)
            safelens_tl.activate(exclude=())
            patched = model(tokens).float()
        worst = max(worst, ((patched - stock).abs().max() / stock.abs().max()).item())
    assert worst <= ROUNDING[dtype], worst
