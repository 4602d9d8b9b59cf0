"""The verifier on TransformerBridge checkpoints beyond pure attention: hybrid and state-space.

A hybrid model's cache starts with linear-attention layers that hold no keys; a state-space
model's holds none at all, TransformerLens cannot generate it without a cache, and its own cached
path rounds its recurrent state at every step. Real tiny checkpoints, real verifier.
"""

from __future__ import annotations

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, runner
from tests.conftest import HAS_HOOKED_TRANSFORMER, requires_bridge
from tests.test_bridge_state_space import architecture_folder

pytestmark = requires_bridge

#: ``--model FOLDER`` boots through TransformerBridge where there is no HookedTransformer (4.x).
requires_folder_bridge = pytest.mark.skipif(
    HAS_HOOKED_TRANSFORMER, reason="--model FOLDER is converted to a HookedTransformer here"
)
HALF = (torch.float16, torch.bfloat16)


def _prompt_cache(architecture: str) -> object:
    folder = architecture_folder(architecture)
    reference = bridge.reference_from(folder, torch.float32)
    with torch.inference_mode():
        output = reference(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True)
    return getattr(output, "cache", None) or output.past_key_values


def test_the_first_layer_with_keys_is_inspected_in_a_hybrid_cache() -> None:
    """Qwen3-Next starts with a linear-attention layer (recurrent state, no keys)."""
    cache = _prompt_cache("Qwen3NextForCausalLM")
    keys = bridge.first_cache_layer(cache)
    assert keys is not None and keys.shape[2] == 4  # [batch, heads, positions, d_head]
    assert bridge.holds_recurrent_state(cache)


def test_an_attention_cache_holds_no_recurrent_state() -> None:
    cache = _prompt_cache("LlamaForCausalLM")
    assert bridge.first_cache_layer(cache) is not None
    assert not bridge.holds_recurrent_state(cache)


@requires_folder_bridge
def test_a_hybrid_checkpoint_folder_verifies(patched: safelens_tl.activation.Status) -> None:
    """It failed with "the cache is still empty": layer 0 holds no keys."""
    report = runner.verify_pretrained(str(architecture_folder("Qwen3NextForCausalLM")), HALF)
    assert report.passed, [check.error for check in report.checks]
    for check in report.checks:
        assert check.cache_dtype == check.dtype
        assert check.cache_heads == check.expected_cache_heads == 2
        assert check.hugging_face_cached_rel_err is not None


@requires_folder_bridge
def test_a_state_space_checkpoint_folder_verifies_patched_and_fails_stock() -> None:
    """Mamba: no KV cache to inspect and no uncached generate to time, both reported as absent;
    in bfloat16 its own cached path is off by more than the attention tolerance, which raises the
    bound. Stock gets a batch of prompts wrong (see ``test_bridge_state_space.py``)."""
    folder = str(architecture_folder("MambaForCausalLM"))
    safelens_tl.activate()
    report = runner.verify_pretrained(folder, HALF)
    assert report.passed, [check.error for check in report.checks]
    for check in report.checks:
        assert check.cache_dtype is None and check.cache_heads is None
        assert check.ms_per_token_uncached is None and check.speedup is None
        own = check.hugging_face_cached_rel_err
        assert own is not None and check.tolerance is not None
        assert check.tolerance == max(
            runner.tolerance_for(getattr(torch, check.dtype)), bridge.OWN_ROUNDING_FACTOR * own
        )
    safelens_tl.deactivate()
    stock = runner.verify_pretrained(folder, HALF)
    assert not stock.passed
    assert all("differ" in (check.error or "") for check in stock.checks)


def test_attention_models_keep_the_tolerance_of_their_dtype() -> None:
    """Hugging Face's own attention rounds differently with and without a cache, by up to about
    a unit of bfloat16; that must not loosen the bound for attention-only models, or a cache 1% off
    would pass (``test_verify_tolerances.py``)."""
    safelens_tl.activate()
    report = runner.verify_builtin([torch.bfloat16], ["cpu"])
    bridge_checks = [check for check in report.checks if check.kind == "bridge"]
    assert bridge_checks and report.passed
    for check in bridge_checks:
        assert check.hugging_face_cached_rel_err is not None
        assert check.tolerance == runner.tolerance_for(torch.bfloat16)
