"""OLMo-family models generate through TransformerBridge in float16 and bfloat16.

Their rotary modules hand out ``cos``/``sin`` in float32, and the bridge's rotary attention
rotated with Llama's function, which keeps the wider dtype: float32 queries and keys beside
half-precision values; the first forward failed (transformers 5.24) or the KV cache held float32
keys (5.23) (:mod:`safelens_tl.fixes.bridge.rotary_dtype`).
Real bridges on tiny random checkpoints, against the bridge's own uncached forward and Hugging
Face's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.bridge import rotary_dtype as bridge_rotary_dtype
from safelens_tl.verify import bridge, checks, runner
from tests.conftest import architecture_folder, requires_bridge

HALF = (torch.float16, torch.bfloat16)
#: Hugging Face's OLMo, OLMo 2 and OLMo 3 (FlexOlmo and OLMo-Hybrid are the same attention).
OLMO = ("OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


@requires_bridge
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("architecture", OLMO)
def test_an_olmo_model_generates_right_in_half_precision(
    architecture: str, dtype: torch.dtype, patched: safelens_tl.activation.Status
) -> None:
    """Cached generation equals the uncached forward, stays within the verifier's bound of
    Hugging Face's own forward, and the cache holds the model's dtype."""
    folder = architecture_folder(architecture)
    for run in bridge.run_folder(folder, dtype):
        assert run.max_rel_err <= runner.tolerance_for(dtype), run
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[dtype], run
        assert run.cache_dtype == dtype and run.cache_heads == run.expected_cache_heads, run


@requires_bridge
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stock_olmo_fails_or_caches_float32_in_half_precision(dtype: torch.dtype) -> None:
    """What the patch removes. With transformers 5.24 stock's first forward mixes float32 queries
    with half-precision values and fails; with 5.23 it runs, and the KV cache of a half-precision
    model holds float32 keys (twice the bytes)."""
    folder = architecture_folder("Olmo2ForCausalLM")
    safelens_tl.deactivate()
    try:
        runs = bridge.run_folder(folder, dtype)
    except RuntimeError as error:
        assert "dtype" in str(error) or "scalar type" in str(error), error
    else:
        assert {run.cache_dtype for run in runs} == {torch.float32}, runs
    finally:
        safelens_tl.activate()


@requires_bridge
def test_the_rotary_hooks_see_the_model_s_dtype(patched: safelens_tl.activation.Status) -> None:
    """Where safelens-tl differs on purpose (README): the attention's ``hook_cos``/``hook_sin`` of
    a bfloat16 OLMo see bfloat16 values (Hugging Face hands float32 ones to its own rotation); the
    rotary module's own hooks still see what it computed, float32; in float32 nothing changes."""
    folder = architecture_folder("Olmo2ForCausalLM")
    for dtype in (torch.bfloat16, torch.float32):
        model = bridge.boot_folder(folder, dtype)
        tokens = model.to_tokens(list(checks.PROMPTS[:1]))
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: "hook_cos" in name)
        attention = {tensor.dtype for name, tensor in cache.items() if ".attn." in name}
        assert attention == {dtype}, (dtype, sorted(cache.keys()))
        assert cache["rotary_emb.hook_cos"].dtype == torch.float32


def _recording_forward(calls: list[dict[str, Any]]) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)

    return forward


class _Attention:
    """Stands in for the bridge instance: only its ``config`` flags are read."""

    def __init__(self, **flags: bool) -> None:
        self.config = type("Config", (), flags)()


def test_wider_embeddings_arrive_in_the_hidden_states_dtype() -> None:
    calls: list[dict[str, Any]] = []
    forward = bridge_rotary_dtype.rotating_in_model_dtype(_recording_forward(calls))
    hidden = torch.zeros(1, 3, 8, dtype=torch.bfloat16)
    cos, sin = torch.rand(1, 3, 4), torch.rand(1, 3, 4)
    forward(_Attention(), hidden, position_embeddings=(cos, sin))
    forward(_Attention(), hidden_states=hidden, position_embeddings=(cos, sin))
    for call in calls:
        narrowed_cos, narrowed_sin = call["position_embeddings"]
        assert narrowed_cos.dtype == narrowed_sin.dtype == torch.bfloat16
        assert torch.equal(narrowed_cos, cos.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("hidden_dtype", "attention"),
    [
        (torch.float32, _Attention()),  # already the same dtype
        (torch.float64, _Attention()),  # narrower embeddings are never widened
        (torch.bfloat16, _Attention(rotary_adjacent_pairs=True)),  # GLM/ERNIE cast back
        (torch.bfloat16, _Attention(rotary_interleaved_cos_sin=True)),  # Cohere casts back
    ],
)
def test_other_embeddings_pass_unchanged(hidden_dtype: torch.dtype, attention: Any) -> None:
    calls: list[dict[str, Any]] = []
    forward = bridge_rotary_dtype.rotating_in_model_dtype(_recording_forward(calls))
    embeddings = (torch.rand(1, 3, 4), torch.rand(1, 3, 4))
    forward(attention, torch.zeros(1, 3, 8, dtype=hidden_dtype), position_embeddings=embeddings)
    assert calls[0]["position_embeddings"] is embeddings
