"""The verifier's oracle (:mod:`safelens_tl.verify.oracle`): the allowance, its limits, and what
the yardstick is made of.

The allowance comes from uncached forwards only (never from a cached path), has a floor per
dtype and a hard ceiling; a row whose greedy picks collapse fails whatever its error. The
yardstick itself is an uncached forward that writes no cache: a bug in a cache class cannot move
it. The teacher-forced HookedTransformer run passes through every storage path of safelens-tl's
cache.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.kv import storage as kv_storage
from safelens_tl.verify import checks, oracle
from tests.conftest import (
    architecture_folder,
    requires_bridge,
    requires_hooked_transformer,
    tiny_model,
)


def test_the_allowance_is_the_floor_twice_the_order_or_the_ceiling() -> None:
    floor = oracle.FLOORS[torch.bfloat16]
    assert oracle.allowance(torch.bfloat16, None).value == floor
    assert oracle.allowance(torch.bfloat16, 0.0).value == floor
    assert oracle.allowance(torch.bfloat16, 1e-3).value == floor
    assert oracle.allowance(torch.bfloat16, 2e-2).value == oracle.ORDER_FACTOR * 2e-2
    assert oracle.allowance(torch.bfloat16, 0.3).value == oracle.CEILING
    # NaN measurements leave the floor; they never open the bound.
    assert oracle.allowance(torch.float16, math.nan).value == oracle.FLOORS[torch.float16]
    # float64 and other dtypes without a floor take float32's.
    assert oracle.allowance(torch.float64, None).value == oracle.FLOORS[torch.float32]


def test_rounding_counts_only_for_a_recurrent_state() -> None:
    """The dtype's rounding against float32 is far larger than what a cache adds in attention
    models (the cached and uncached paths share nearly all of their rounding): it must not open
    their bound."""
    attention = oracle.allowance(torch.bfloat16, 0.0, rounding=4e-2)
    state = oracle.allowance(torch.bfloat16, 0.0, rounding=4e-2, recurrent=True)
    assert attention.value == oracle.FLOORS[torch.bfloat16]
    assert state.value == oracle.STATE_FACTOR * 4e-2
    assert "recurrent state" in state.basis() and "floor" in attention.basis()


def test_the_reference_bound_is_its_floor_or_twice_the_rounding() -> None:
    assert oracle.reference_bound(torch.float16, None) == oracle.REFERENCE_FLOORS[torch.float16]
    assert oracle.reference_bound(torch.bfloat16, 1e-2) == oracle.REFERENCE_FLOORS[torch.bfloat16]
    assert oracle.reference_bound(torch.bfloat16, 8e-2) == oracle.REFERENCE_FACTOR * 8e-2


def test_judge_fails_an_error_over_the_allowance_a_nan_and_a_collapsed_agreement() -> None:
    bound = oracle.allowance(torch.float16, 1e-3)
    assert oracle.judge(bound.value, bound, 1.0, "x") == []
    over = oracle.judge(bound.value * 1.01, bound, 1.0, "cached logits differ")
    assert len(over) == 1 and over[0].startswith("cached logits differ by ")
    assert "allowance 2.0e-03 (the float16 floor)" in over[0]
    assert len(oracle.judge(math.nan, bound, 1.0, "x")) == 1
    collapsed = oracle.judge(0.0, bound, 0.5, "x")
    assert len(collapsed) == 1 and "50% of the steps" in collapsed[0]
    # Above the ceiling fails whatever the order says.
    wide = oracle.allowance(torch.bfloat16, 1.0)
    assert wide.value == oracle.CEILING and oracle.judge(0.11, wide, 1.0, "x")


def test_relative_error_is_over_the_marked_positions_and_nan_shows() -> None:
    expected = torch.tensor([[[10.0, 0.0], [1.0, 0.0]]])
    logits = torch.tensor([[[10.0, 0.0], [3.0, 0.0]]])
    assert oracle.relative_error(logits, expected) == pytest.approx(0.2)
    assert oracle.relative_error(logits, expected, torch.tensor([[1, 0]])) == 0.0
    assert oracle.relative_error(logits, expected, scale=1.0) == pytest.approx(2.0)
    assert math.isnan(oracle.relative_error(logits * math.nan, expected))
    assert math.isnan(oracle.worst_error([0.0, math.nan])) and oracle.worst_error([]) == 0.0


def test_agreement_counts_equal_top_tokens() -> None:
    expected = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])
    logits = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert oracle.agreement(logits, expected) == 0.75
    assert oracle.agreement(logits, expected, torch.tensor([[1, 0, 1, 1]])) == 1.0


def test_the_order_steps_are_spread_and_end_at_the_last() -> None:
    assert oracle.order_steps(64, 8) == [0, 9, 18, 27, 36, 45, 54, 63]
    assert oracle.order_steps(5, 8) == [0, 1, 2, 3, 4]
    assert oracle.order_steps(5, None) == [0, 1, 2, 3, 4]
    assert oracle.order_steps(5, 1) == [4]
    assert oracle.order_steps(0, 8) == []


@requires_bridge
def test_the_yardstick_writes_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face model's forward builds a cache and writes every layer's keys into it even
    with nothing cached yet: through the very class a cached step uses. The verifier's uncached
    forwards (bridge and reference) must not touch it, or a bug there would move the yardstick
    with the error."""
    from transformers import cache_utils

    from safelens_tl.verify import bridge

    safelens_tl.activate()
    model = bridge.boot("llama-like-gqa", torch.float32)
    reference = bridge.reference_model("llama-like-gqa", torch.float32)
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    mask, positions = torch.ones_like(tokens), torch.arange(5).unsqueeze(0)
    calls: list[Any] = []
    real = cache_utils.DynamicLayer.update

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", update)
    with torch.inference_mode():
        model(tokens, attention_mask=mask, position_ids=positions, return_type="logits")
    assert calls, "the forward no longer writes a cache by default: revisit uncached_forward"
    calls.clear()
    bridge.uncached_forward(model, tokens, attention_mask=mask, position_ids=positions)
    bridge.uncached_forward(
        reference, input_ids=tokens, attention_mask=mask, position_ids=positions
    )
    assert calls == []


@requires_hooked_transformer
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like-gqa"])
def test_the_teacher_forced_run_takes_every_storage_path(
    patched: safelens_tl.activation.Status,
    allocations: list[kv_storage.KVStorage],
    name: str,
) -> None:
    """The small cache (``torch.cat``) over the prompt, a move into a buffer written in place,
    and growths of that buffer, over at least 64 cached positions, in both batches: what the
    verifier's rows claim to cover."""
    if not kv_storage.in_place_appends():
        pytest.skip("this torch cannot count a storage's tensors: every cache uses torch.cat")
    model = tiny_model(name, torch.float16)
    for batch in checks.BATCHES:
        allocations.clear()
        run = checks.teacher_forced(model, batch=batch)
        assert run.cached_positions >= 64
        layers = model.cfg.n_layers
        # One move out of the small cache per layer, then growths: more than one buffer each.
        assert len(allocations) >= 3 * layers, len(allocations)
        capacities = sorted({storage.capacity for storage in allocations})
        # The first buffer holds the prompt, two small steps and the step that moved it, plus a
        # quarter; the last one every position.
        assert capacities[0] == (run.prompt_positions + 3) * 5 // 4, capacities
        assert len(capacities) >= 3 and capacities[-1] >= run.cached_positions + 1
        for entry in run.cache.entries:
            assert entry.past_keys.shape[1] == run.cached_positions + 1
            assert getattr(entry, "_safelens_storage", None) is not None


def test_order_leaves_out_a_forward_that_computes_something_else() -> None:
    """Another order of the same sums moves the logits by rounding; a forward whose top tokens
    differ from the whole one's on more than a tenth of its positions is not that, and must not
    widen the allowance."""
    whole = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0], [0.0, 4.0]])
    rounded = whole + 0.01
    other = whole.flip(-1)  # every top token changed
    expected = pytest.approx(0.0025, rel=1e-4)
    assert oracle.order_error([rounded], [whole], 4.0) == expected
    assert oracle.order_error([rounded, other], [whole, whole], 4.0) == expected
    assert oracle.order_error([], [], 4.0) == 0.0
    # NaN logits never widen it either (left out, or NaN, which leaves the floor).
    assert not oracle.order_error([rounded * math.nan], [whole], 4.0) > 0


requires_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


def _forwards_without_onednn(module: torch.nn.Module) -> tuple[list[bool], Any]:
    """Records, at each forward of ``module``, whether oneDNN was enabled; returns the record and
    the hook's handle."""
    seen: list[bool] = []
    handle = module.register_forward_pre_hook(
        lambda _module, _args: seen.append(bool(torch.backends.mkldnn.enabled))
    )
    return seen, handle


@requires_onednn
def test_other_kernels_switch_only_onednn_and_put_it_back() -> None:
    """The user's setting comes back, after an error too; where the user turned oneDNN off, the
    cached and uncached paths take the same kernels and there is no other forward to run."""
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert torch.backends.mkldnn.enabled
    assert oracle.other_kernels_apply(model)
    assert not oracle.other_kernels_apply(torch.nn.Linear(4, 4))  # float32
    mkldnn: Any = torch.backends.mkldnn
    # A setting of the user's that is not the default (torch >= 2.1 has it) stays as it is.
    deterministic = getattr(mkldnn, "deterministic", None)
    if deterministic is not None:
        mkldnn.deterministic = True
    try:
        with pytest.raises(RuntimeError, match="inside"), oracle.other_kernels():
            assert not torch.backends.mkldnn.enabled
            assert deterministic is None or mkldnn.deterministic
            raise RuntimeError("inside")
    finally:
        if deterministic is not None:
            mkldnn.deterministic = deterministic
    assert torch.backends.mkldnn.enabled
    with torch.backends.mkldnn.flags(enabled=False):
        assert not oracle.other_kernels_apply(model)
        with oracle.other_kernels():
            pass
        assert not torch.backends.mkldnn.enabled


@requires_onednn
@requires_hooked_transformer
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_hooked_order_counts_the_forward_through_torch_s_own_kernels(
    patched: safelens_tl.activation.Status, dtype: torch.dtype
) -> None:
    """On a CPU with native half-precision dot products, torch hands the uncached forward's
    products to oneDNN and a cached step's one-row products to its own kernels: the uncached
    forward without oneDNN is one more order of the same sums, run once per batch in half
    precision (never in float32, where both paths take the same kernel), and ``order`` is at
    least its distance from the yardstick."""
    model = tiny_model("gpt2-like", dtype)
    seen, handle = _forwards_without_onednn(model)
    try:
        run = checks.teacher_forced(model, order_steps=2)
    finally:
        handle.remove()
    assert torch.backends.mkldnn.enabled
    assert seen.count(False) == (0 if dtype == torch.float32 else 1), seen
    tokens, mask = checks.padded_batch(model, checks.LONG_CONTINUATION, checks.BATCHES[2])
    with torch.inference_mode(), oracle.other_kernels():
        own_kernels = model(tokens, attention_mask=mask)
    valid = mask.bool()
    scale = float(run.uncached.float().abs()[valid].max())
    distance = oracle.relative_error(own_kernels[valid], run.uncached[valid], scale=scale)
    assert run.order is not None and run.order >= distance


@requires_onednn
@requires_bridge
@pytest.mark.parametrize("architecture", ["llama-like-gqa", "BartForConditionalGeneration"])
def test_bridge_order_counts_the_forward_through_torch_s_own_kernels(
    patched: safelens_tl.activation.Status, architecture: str
) -> None:
    """The same for TransformerBridge's runs, decoder-only and encoder-decoder (whose decoder
    Florence-2 shares: 1.1e-2 cached against uncached in bfloat16 on an AMD EPYC with
    AVX512-BF16, above the floor, with every prefix forward at 0 from the yardstick)."""
    from safelens_tl.verify import bridge

    if architecture == "llama-like-gqa":
        folder = bridge.model_folder(architecture)
    else:
        folder = str(architecture_folder(architecture))
    model = bridge.boot_folder(folder, torch.bfloat16)
    reference = bridge.reference_from(folder, torch.bfloat16)
    seen, handle = _forwards_without_onednn(model.original_model)
    try:
        runs = bridge.run_batches(model, reference, 4, uncached_generate=False, order_steps=2)
    finally:
        handle.remove()
    assert torch.backends.mkldnn.enabled
    assert seen.count(False) == len(runs) >= 1, seen
