"""OLMo-Hybrid generates through TransformerBridge where transformers lacks the cache class
TransformerLens's adapter imports (transformers after 5.9:
:mod:`safelens_tl.fixes.bridge.hybrid_cache`). A real bridge on a tiny random checkpoint, against
its own uncached forward and Hugging Face's.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.bridge import hybrid_cache as bridge_hybrid_cache
from safelens_tl.verify import bridge, oracle
from tests.conftest import architecture_folder, requires_bridge

ARCHITECTURE = "OlmoHybridForCausalLM"
MISSING_CLASS = "OlmoHybridDynamicCache"


def _transformers_has_the_class() -> bool:
    try:
        module = importlib.import_module("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    except ImportError:
        return False
    return hasattr(module, MISSING_CLASS)


@requires_bridge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_olmo_hybrid_model_generates_right(
    dtype: torch.dtype, patched: safelens_tl.activation.Status
) -> None:
    """Cached generation (its own generate loop, which asks the adapter for the cache) equals the
    uncached forward within the verifier's bound (which, for a cache that rounds its recurrent
    state to the dtype at every step, takes twice the dtype's rounding against float32: 9.8e-3 in
    bfloat16 with transformers 5.9), and stays within the verifier's bound of Hugging Face's own
    forward."""
    folder = architecture_folder(ARCHITECTURE)
    model = bridge.boot_folder(folder, dtype)
    runs = bridge.run_batches(
        model, bridge.reference_from(folder, dtype), order_steps=oracle.ORDER_STEPS
    )
    runs = bridge.add_float32_rounding(model, runs)
    bound = bridge.allowance_of(runs, dtype)
    for run in runs:
        assert torch.equal(run.cached_tokens, run.uncached_tokens), run
        assert run.max_rel_err <= bound.value, (run, bound)
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[dtype], run


@requires_bridge
def test_stock_fails_only_where_transformers_lacks_the_class() -> None:
    """What the patch removes: stock's cached generation raises ``ImportError`` where the class
    is gone, and runs where it exists (transformers 5.9), which the patch then leaves alone."""
    folder = architecture_folder(ARCHITECTURE)
    safelens_tl.deactivate()
    try:
        if _transformers_has_the_class():
            assert bridge.run_folder(folder, torch.float32)
        else:
            with pytest.raises(ImportError, match=MISSING_CLASS):
                bridge.run_folder(folder, torch.float32)
    finally:
        safelens_tl.activate()


class _Model:
    config = None


def test_the_fallback_only_replaces_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the adapter returns is kept; an ``ImportError`` gives the model's own cache; any
    other error reaches the caller."""
    made: list[Any] = []
    monkeypatch.setattr(bridge_hybrid_cache, "model_s_own_cache", lambda model: made.append(model))

    def returning(self: Any, hf_model: Any, *args: Any) -> Any:
        return ("adapter's", args)

    def missing(self: Any, hf_model: Any, *args: Any) -> Any:
        raise ImportError(f"cannot import name {MISSING_CLASS!r}")

    def broken(self: Any, hf_model: Any, *args: Any) -> Any:
        raise ValueError("bad config")

    model = _Model()
    wrap = bridge_hybrid_cache.falling_back_to_the_model_s_cache
    assert wrap(returning)(None, model, 2, "cpu") == ("adapter's", (2, "cpu"))
    assert made == []
    wrap(missing)(None, model, 2, "cpu")
    assert made == [model]
    with pytest.raises(ValueError, match="bad config"):
        wrap(broken)(None, model, 2, "cpu")


@requires_bridge
def test_the_model_s_own_cache_is_what_hugging_face_builds() -> None:
    """The fallback is the class Hugging Face's OLMo-Hybrid builds for itself without one."""
    folder = architecture_folder(ARCHITECTURE)
    reference = bridge.reference_from(folder, torch.float32)
    tokens = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        output = reference(input_ids=tokens, use_cache=True)
    own = getattr(output, "cache", None) or output.past_key_values
    made = bridge_hybrid_cache.model_s_own_cache(reference)
    assert type(made) is type(own) or _transformers_has_the_class()
