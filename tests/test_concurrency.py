"""Threads: activation hammered from 8 threads ends consistent; concurrent generation is exact.

The model is a real ``HookedTransformer`` (random weights, built offline) and ``generate`` is
TransformerLens's own; each thread's ``generate`` creates its own cache.
"""

from __future__ import annotations

import importlib
import random
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.kv import entry as kv_cache
from safelens_tl.patching import MISSING
from tests.conftest import requires_hooked_transformer

THREADS = 8
ROUNDS = 20
EPOCHS = 6


def _resolve(target: str) -> tuple[Any, str]:
    """``module.Class.attribute`` -> (the class, the attribute name); ``module.function`` ->
    (the module, the function's name)."""
    owner_path, attribute = target.rsplit(".", 1)
    module_path, qualname = owner_path, ""
    while True:
        try:
            module = importlib.import_module(module_path)
            break
        except ImportError:
            module_path, _, head = module_path.rpartition(".")
            qualname = f"{head}.{qualname}".rstrip(".")
    owner: Any = module
    for part in qualname.split(".") if qualname else ():
        owner = getattr(owner, part)
    assert isinstance(owner, (type, types.ModuleType))
    return owner, attribute


def _patched_targets() -> tuple[dict[str, tuple[Any, str]], dict[str, object]]:
    """Activate once to learn what is patched; return the targets and their exact originals."""
    safelens_tl.deactivate()
    stock = {}
    report = safelens_tl.activate()
    assert report.active and report.patched
    targets = {target: _resolve(target) for target in report.patched}
    safelens_tl.deactivate()
    for target, (owner, attribute) in targets.items():
        stock[target] = owner.__dict__.get(attribute, MISSING)
    return targets, stock


def _assert_consistent(targets: dict[str, tuple[Any, str]], stock: dict[str, object]) -> None:
    """is_active() and status() agree with what the classes hold, attribute by attribute."""
    active = safelens_tl.is_active()
    report = safelens_tl.status()
    assert report.active == active
    assert set(report.patched) == (set(targets) if active else set())
    for target, (owner, attribute) in targets.items():
        current = owner.__dict__.get(attribute, MISSING)
        if not active:
            assert current is stock[target], f"{target} is not the exact original"
            continue
        assert current is not stock[target], f"{target} is not patched although active"
        wrapped = getattr(getattr(current, "__func__", current), "__wrapped__", None)
        if wrapped is not None:  # a wrapper of the original, never a wrapper of a wrapper
            original = stock[target]
            if original is MISSING:  # the class inherited it: the wrapper wraps the inherited one
                original = next(
                    base.__dict__[attribute]
                    for base in owner.__mro__[1:]
                    if attribute in base.__dict__
                )
            assert wrapped is getattr(original, "__func__", original)
    if active:
        entry_class, _ = next(v for t, v in targets.items() if t.endswith(".append"))
        assert entry_class.__dict__["append"] is kv_cache.append


@pytest.mark.parametrize("final", ["activate", "deactivate", "random"])
def test_activation_hammered_from_8_threads_ends_consistent(final: str) -> None:
    """8 threads call activate()/deactivate()/status() in random order; the end state is coherent.

    A race leaves traces only now and then, so the storm is repeated ``EPOCHS`` times, each
    followed by a full consistency check.
    """
    targets, stock = _patched_targets()
    barrier = threading.Barrier(THREADS)
    calls: dict[str, Callable[[], object]] = {
        "activate": safelens_tl.activate,
        "deactivate": safelens_tl.deactivate,
        "status": safelens_tl.status,
    }

    def hammer(seed: int) -> None:
        chooser = random.Random(seed)
        barrier.wait()
        for _ in range(ROUNDS):
            calls[chooser.choice(sorted(calls))]()
        if final != "random":
            calls[final]()

    with ThreadPoolExecutor(THREADS) as pool:
        for epoch in range(EPOCHS):
            list(pool.map(hammer, range(epoch * THREADS, (epoch + 1) * THREADS)))
            _assert_consistent(targets, stock)
            if final != "random":
                assert safelens_tl.is_active() == (final == "activate")
    # And it still switches cleanly both ways afterwards.
    safelens_tl.activate()
    _assert_consistent(targets, stock)
    safelens_tl.deactivate()
    _assert_consistent(targets, stock)


PROMPTS = (
    "the cat runs",
    "a big old dog sleeps in the quiet house",
    "the river flows",
    "red bird sings while the tree grows",
    "then the stone falls",
    "small fish swims",
)


def _greedy_tokens(model: Any, prompt: str | list[str]) -> torch.Tensor:
    """8 greedy tokens after ``prompt``, cached, as one tensor."""
    tokens: torch.Tensor = model.generate(
        prompt,
        max_new_tokens=8,
        do_sample=False,
        use_past_kv_cache=True,
        verbose=False,
        stop_at_eos=False,
        return_type="tokens",
    )
    return tokens


@requires_hooked_transformer
@pytest.mark.parametrize(
    ("model_name", "dtype"), [("gpt2-like", torch.float32), ("llama-like-gqa", torch.float16)]
)
def test_concurrent_generation_equals_single_thread(model_name: str, dtype: torch.dtype) -> None:
    """Threads generating at once, each with its own cache, give the single-thread tokens."""
    from safelens_tl.verify.models import build_model

    assert safelens_tl.activate().active
    model = build_model(model_name, dtype)

    def generate(prompt: str) -> torch.Tensor:
        return _greedy_tokens(model, prompt)

    alone = [generate(prompt) for prompt in PROMPTS]
    barrier = threading.Barrier(len(PROMPTS))

    def together(prompt: str) -> torch.Tensor:
        barrier.wait()
        return generate(prompt)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(together, PROMPTS))
    for prompt, single, threaded in zip(PROMPTS, alone, concurrent, strict=True):
        assert torch.equal(single, threaded), prompt


@requires_hooked_transformer
def test_threads_generating_padded_batches_and_single_prompts_at_once() -> None:
    """Each thread's ``generate`` masks its own batch (TransformerLens 2.13 to 3.0.0 get that
    mask from safelens-tl, through a per-thread ``ContextVar``): padded batches of two and
    single prompts, generated together on one model, give the single-thread tokens."""
    from safelens_tl.verify.models import build_model

    assert safelens_tl.activate().active
    model = build_model("llama-like-gqa", torch.float32)
    inputs: list[str | list[str]] = [
        [PROMPTS[0], PROMPTS[1]],
        PROMPTS[2],
        [PROMPTS[3], PROMPTS[4]],
        PROMPTS[5],
        [PROMPTS[1], PROMPTS[5]],
        PROMPTS[0],
    ]

    def generate(prompt: str | list[str]) -> torch.Tensor:
        return _greedy_tokens(model, prompt)

    alone = [generate(prompt) for prompt in inputs]
    barrier = threading.Barrier(len(inputs))

    def together(prompt: str | list[str]) -> torch.Tensor:
        barrier.wait()
        return generate(prompt)

    for _ in range(3):
        with ThreadPoolExecutor(len(inputs)) as pool:
            concurrent = list(pool.map(together, inputs))
        for prompt, single, threaded in zip(inputs, alone, concurrent, strict=True):
            assert torch.equal(single, threaded), prompt
