"""Shared fixtures: the real cache classes of the installed TransformerLens, and their configs."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, settings

import safelens_tl
from safelens_tl import targets
from safelens_tl.kv import storage as kv_storage

# Hypothesis profiles. "ci" is the default: >= 1000 property examples in a plain run.
# The function-scoped fixtures here only reset activation, which every example may share.
_SHARED = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=1000, **_SHARED)
settings.register_profile("dev", max_examples=100, **_SHARED)
settings.register_profile("thorough", max_examples=20_000, **_SHARED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

LAYOUT = targets.locate()
RELEASE = LAYOUT.release
HAS_HOOKED_TRANSFORMER = LAYOUT.known.has_hooked_transformer

HAS_BRIDGE = targets.has_bridge()

#: Also gives the test the ``bridge`` mark (:func:`pytest_collection_modifyitems`), by which tox
#: selects what runs where only transformers differs (``tl430-tf523``).
requires_bridge = pytest.mark.skipif(
    not HAS_BRIDGE, reason=f"TransformerLens {RELEASE} has no TransformerBridge"
)

requires_hooked_transformer = pytest.mark.skipif(
    not HAS_HOOKED_TRANSFORMER,
    reason=f"TransformerLens {RELEASE} has no HookedTransformer",
)


_tiny_models: dict[tuple[str, torch.dtype], Any] = {}


def tiny_model(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """A built-in model of the verifier (``gpt2-like``, ``llama-like-gqa``), built once per test
    run and shared: a test that changes it (its tokenizer, hooks) puts it back."""
    if (name, dtype) not in _tiny_models:
        from safelens_tl.verify.models import build_model

        _tiny_models[name, dtype] = build_model(name, dtype)
    return _tiny_models[name, dtype]


def generate_recording(
    model: Any, prompt: Any, max_new_tokens: int, **options: Any
) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Greedy ``generate``'s result and every hook's activation, in the order the hooks ran."""
    seen: list[tuple[str, torch.Tensor]] = []

    def record(activation: torch.Tensor, hook: Any) -> None:
        seen.append((hook.name, activation.detach().clone()))

    settings = {"do_sample": False, "verbose": False, **options}
    with model.hooks(fwd_hooks=[(lambda name: True, record)]):
        result = model.generate(prompt, max_new_tokens=max_new_tokens, **settings)
    return result, seen


@contextlib.contextmanager
def stock_with_positions(model: Any) -> Iterator[None]:
    """Stock ``generate`` as the release runs it for a tokenizer whose pad token id is not 0.

    TransformerLens 2.13 to 3.0.0's ``generate`` drops learned positions when that id is 0, and
    safelens-tl returns on purpose what the release returns for any other pad id
    (:mod:`safelens_tl.fixes.hooked.generate_mask`): the stock answer to compare with. Elsewhere,
    and for other pad ids, nothing changes.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if (
        not targets.hooked_generate_masks_no_padding(RELEASE)
        or tokenizer is None
        or tokenizer.pad_token_id != 0
    ):
        yield
        return
    tokenizer.pad_token_id = tokenizer.bos_token_id
    try:
        yield
    finally:
        tokenizer.pad_token_id = 0


@contextlib.contextmanager
def weights_read_in_place() -> Iterator[None]:
    """Stock TransformerLens plus only safelens-tl's weight-copy patches
    (:mod:`safelens_tl.fixes.hooked.weight_copies`), for tests that hold another patch to stock's
    numbers bitwise: reading a weight in place changes the last bits of one-row float32 and of
    float16 products, which is not what those tests are about. Use while safelens-tl is
    inactive."""
    from safelens_tl import patching
    from safelens_tl.fixes.hooked import weight_copies as hooked_weight_copies

    installed = [patching.install(patch) for patch in hooked_weight_copies.patches()]
    try:
        yield
    finally:
        for record in reversed(installed):
            patching.uninstall(record)


def fixes_patching(owner: Any, attribute: str) -> tuple[str, ...]:
    """The ids of the fixes whose installed patch stands on ``owner.<attribute>`` now (none:
    nothing of safelens-tl's is there)."""
    from safelens_tl import activation

    with activation._state.lock:
        for installed in activation._state.installed:
            patch = installed.patch
            if patch.owner is owner and patch.attribute == attribute:
                return patch.fixes
    return ()


#: ``benchmarks/``: scripts, not a package.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_module(name: str) -> Any:
    """Import ``benchmarks/<name>.py`` (the folder is not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def subclasses(cls: type) -> list[type]:
    """Every class below ``cls`` (children, their children, ...) that has been imported."""
    found = []
    for sub in cls.__subclasses__():
        found.extend([sub, *subclasses(sub)])
    return found


_architecture_folders: dict[str, Path] = {}


def architecture_folder(architecture: str) -> Path:
    """The tiny checkpoint of ``benchmarks/bridge_architectures.py``, saved once per pytest session;
    skips where this transformers or TransformerLens lacks the architecture."""
    factory = importlib.import_module("transformer_lens.factories.architecture_adapter_factory")
    # "<architecture>+audio": that architecture with an audio tower (bridge_architectures.py).
    base = architecture.split("+")[0]
    if base not in getattr(factory, "SUPPORTED_ARCHITECTURES", {}):
        pytest.skip(f"this TransformerBridge does not support {base}")
    if architecture not in _architecture_folders:
        architectures = benchmark_module("bridge_architectures")
        try:
            _architecture_folders[architecture] = Path(architectures.build(architecture))
        except LookupError as missing:
            pytest.skip(str(missing))
    return _architecture_folders[architecture]


def make_cfg(
    n_heads: int = 4,
    d_head: int = 8,
    n_key_value_heads: int | None = None,
    dtype: Any = torch.float32,
    n_layers: int = 2,
    n_ctx: int = 64,
) -> Any:
    """A real config of the installed release (HookedTransformerConfig / TransformerLensConfig)."""
    config_class = LAYOUT.config_class()
    return config_class(
        d_model=n_heads * d_head,
        d_head=d_head,
        n_heads=n_heads,
        n_layers=n_layers,
        n_ctx=n_ctx,
        act_fn="relu",
        n_key_value_heads=n_key_value_heads,
        dtype=dtype,
    )


#: The tests this run selected (after ``-m`` and ``-k``): fixtures that start child processes
#: start only those the selected tests read.
SELECTED = pytest.StashKey[list[pytest.Item]]()

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def reads(name: str) -> Callable[[F], F]:
    """The child process (a key of its module's plan, see :func:`selected`) that the decorated
    test reads: only the children of the tests selected in this run are started."""

    def record(test: F) -> F:
        test.child = name  # type: ignore[attr-defined]
        return test

    return record


def selected(request: pytest.FixtureRequest, plan: dict[str, T]) -> dict[str, T]:
    """The entries of ``plan`` that a selected test of the requesting module :func:`reads`."""
    wanted = {
        getattr(item.function, "child", None)
        for item in request.config.stash[SELECTED]
        if isinstance(item, pytest.Function) and item.module is request.module
    }
    return {name: entry for name, entry in plan.items() if name in wanted}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    """Before ``-m`` deselects: the tests of TransformerBridge and its fixes (marked
    :data:`requires_bridge`, or in a ``test_bridge_*`` module) get the ``bridge`` mark, since
    transformers alone can change their outcome. After: :data:`SELECTED` holds what is left."""
    for item in items:
        in_bridge_module = item.path.name.startswith("test_bridge_")
        if in_bridge_module or any(
            mark == requires_bridge.mark for mark in item.iter_markers("skipif")
        ):
            item.add_marker(pytest.mark.bridge)
    result = yield
    config.stash[SELECTED] = list(items)
    return result


@pytest.fixture(autouse=True)
def _restore_stock_after_test() -> Iterator[None]:
    """Every test starts and ends with stock TransformerLens unless it activates itself."""
    safelens_tl.deactivate()
    yield
    safelens_tl.deactivate()


#: How a test's caches are stored: "buffer" (``small_cache_limit(0)``: every cache in a buffer
#: from its first write, which is what tests of buffers, growth and copy-on-write need) or "small"
#: (the default limit: the caches of these tiny models are appended with torch.cat).
CACHE_MODES = {"buffer": 0, "small": kv_storage.SMALL_CACHE_BYTES}


def pytest_collection_finish() -> None:
    """Move what collection made (torch, transformers, TransformerLens, the test modules: about
    half a million objects that live to the end) out of the garbage collector's reach: a full
    collection (Python's own, and the forward guard's before each memory count) then walks only
    what the tests have made since, 0.4 s less each time."""
    gc.freeze()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``both_cache_modes`` run once per storage mode (``cache_mode`` fixture)."""
    if metafunc.definition.get_closest_marker("both_cache_modes") is not None:
        metafunc.parametrize("cache_mode", list(CACHE_MODES), indirect=True)


@pytest.fixture(autouse=True)
def cache_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """The storage mode of this test's caches (see :data:`CACHE_MODES`); "buffer" unless the test
    is marked ``both_cache_modes`` or sets its own limit with ``kv_storage.small_cache_limit``."""
    mode = getattr(request, "param", "buffer")
    with kv_storage.small_cache_limit(CACHE_MODES[mode]):
        yield mode


@pytest.fixture
def patched() -> Iterator[safelens_tl.activation.Status]:
    """Activate safelens-tl for the test."""
    yield safelens_tl.activate()


@pytest.fixture
def entry_class() -> type:
    """The installed release's KV-cache entry class."""
    return LAYOUT.entry_class


@pytest.fixture
def cache_class() -> type:
    """The installed release's KV-cache class."""
    return LAYOUT.cache_class


# Under tox (TOX_ENV_NAME set), two environments run at once and their output interleaves: name
# the environment in the first and the last line, so that each one's result can be read off.
_ENVIRONMENT = os.environ.get("TOX_ENV_NAME")


def pytest_report_header(config: pytest.Config) -> str | None:
    """``[tl300] TransformerLens 3.0.0, transformers 5.24.0, torch ...`` under tox."""
    if _ENVIRONMENT is None:
        return None
    from importlib import metadata

    transformers = metadata.version("transformers")
    versions = f"TransformerLens {RELEASE}, transformers {transformers}, torch {torch.__version__}"
    return f"[{_ENVIRONMENT}] {versions}"


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(reason).removeprefix("Skipped: ")


def _mutation_score(terminalreporter: Any) -> None:
    """``safelens-tl verify``'s mutation score (tests/test_verify_mutants.py), where it ran."""
    mutants = sys.modules.get("tests.mutants")
    for api, results in getattr(mutants, "RESULTS", {}).items():
        caught = sum(results.values())
        terminalreporter.write_sep("-", f"verify mutation score, {api}: {caught}/{len(results)}")
        for mutant, found in results.items():
            terminalreporter.write_line(f"  {'caught' if found else 'MISSED'}  {mutant}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The verifier's mutation score where its mutants ran; skips summarised by reason, most
    frequent first (one line each, not one per test); under tox, one line per environment with
    its counts: ``[tl300] 352 passed, 6 skipped, 0 failed``."""
    _mutation_score(terminalreporter)
    reasons = Counter(_skip_reason(report) for report in terminalreporter.stats.get("skipped", []))
    if reasons:
        terminalreporter.write_sep("-", f"{sum(reasons.values())} skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")
    if _ENVIRONMENT is None:
        return
    counts = {
        outcome: len(terminalreporter.stats.get(outcome, []))
        for outcome in ("passed", "skipped", "failed", "error")
    }
    line = ", ".join(f"{number} {outcome}" for outcome, number in counts.items())
    terminalreporter.write_line(f"[{_ENVIRONMENT}] {line} (exit status {exitstatus})")


@pytest.fixture
def corrupt_past(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Scale the cached part of what each attention bridge attends over by 1.01 once switched on
    (``switch["part"] = "keys"`` or ``"values"``): a cache that is slightly wrong."""
    attention = targets.locate_bridge().attention_class
    original = attention._update_kv_cache  # the patched or the stock one, as installed
    switch: dict[str, Any] = {"part": None}

    def update(self: Any, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        keys, values = original(self, k, v, **kwargs)
        new = k.shape[-2]
        if switch["part"] is not None and keys.shape[-2] > new:
            if switch["part"] == "keys":
                keys = torch.cat([keys[..., :-new, :] * 1.01, keys[..., -new:, :]], dim=-2)
            else:
                values = torch.cat([values[..., :-new, :] * 1.01, values[..., -new:, :]], dim=-2)
        return keys, values

    monkeypatch.setattr(attention, "_update_kv_cache", update)
    yield switch


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[kv_storage.KVStorage]]:
    """Every storage the patched entries allocate (a spy around our own function; TL is real)."""
    made: list[kv_storage.KVStorage] = []
    real = kv_storage.allocate

    def spy(*args: Any, **kwargs: Any) -> kv_storage.KVStorage:
        storage = real(*args, **kwargs)
        made.append(storage)
        return storage

    monkeypatch.setattr(kv_storage, "allocate", spy)
    yield made
