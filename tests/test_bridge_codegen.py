"""CodeGen models generate through TransformerBridge with transformers 5.24 and in half precision.

TransformerLens's CodeGen attention bridge read two attributes transformers 5.24 removed from
Hugging Face's ``CodeGenAttention`` (``embed_positions``, ``scale_attn``), so every forward raised;
with older transformers it kept float32 rotated keys beside half-precision values and failed in
float16 and bfloat16 (:mod:`safelens_tl.fixes.bridge.codegen`). Real bridges on a tiny random
checkpoint, against the bridge's own uncached forward and Hugging Face's.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import codegen as bridge_codegen
from safelens_tl.verify import bridge, checks, runner
from tests.conftest import architecture_folder, requires_bridge

ARCHITECTURE = "CodeGenForCausalLM"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _hugging_face_codegen() -> object:
    return importlib.import_module(targets.CODEGEN_MODULE)


@requires_bridge
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_codegen_model_generates_right(
    dtype: torch.dtype, patched: safelens_tl.activation.Status
) -> None:
    """Cached generation equals the uncached forward, stays within the verifier's bound of
    Hugging Face's own forward, and the cache holds the model's dtype."""
    folder = architecture_folder(ARCHITECTURE)
    for run in bridge.run_folder(folder, dtype):
        assert run.max_rel_err <= runner.tolerance_for(dtype), run
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[dtype], run
        assert run.cache_dtype == dtype, run


@requires_bridge
def test_stock_codegen_fails_in_bfloat16() -> None:
    """What the patch removes: with transformers 5.24 stock reads attributes Hugging Face's
    CodeGen no longer has; with 5.23 it mixes float32 keys with bfloat16 values. (With 5.20,
    what Python 3.10 gets, stock raises neither.)"""
    import transformers

    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < (5, 23):
        pytest.skip(f"stock CodeGen runs in bfloat16 with transformers {transformers.__version__}")
    folder = architecture_folder(ARCHITECTURE)
    safelens_tl.deactivate()
    try:
        with pytest.raises((AttributeError, RuntimeError)) as raised:
            bridge.run_folder(folder, torch.bfloat16)
    finally:
        safelens_tl.activate()
    assert any(part in str(raised.value) for part in ("embed_positions", "scale_attn", "dtype")), (
        raised.value
    )


@requires_bridge
def test_float32_is_the_bridge_s_own_to_the_bit(patched: safelens_tl.activation.Status) -> None:
    """In float32 the logits, the hooks' values and the gradients are stock's exactly, where
    stock runs (transformers 5.23 and older); with 5.24, where it cannot, the patched bridge's
    logits match Hugging Face's own forward."""
    folder = architecture_folder(ARCHITECTURE)
    model = bridge.boot_folder(folder, torch.float32)
    tokens = model.to_tokens(list(checks.PROMPTS[:2]), padding_side="left")
    mask, positions = bridge.mask_and_positions(model, tokens)

    def observe() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        model = bridge.boot_folder(folder, torch.float32)
        logits, cache = model.run_with_cache(
            tokens,
            attention_mask=mask,
            position_ids=positions,
            names_filter=lambda name: name.endswith(("hook_q", "hook_k", "hook_pattern")),
        )
        logits.logsumexp(-1).sum().backward()
        gradient = model.embed.W_E.grad
        assert gradient is not None
        return logits.detach(), dict(cache.items()), gradient

    logits, hooks, gradient = observe()
    assert {name.rsplit(".", 1)[-1] for name in hooks} == {"hook_q", "hook_k", "hook_pattern"}
    safelens_tl.deactivate()
    try:
        stock = observe()
    except AttributeError as missing:  # transformers 5.24+: stock cannot run at all
        assert "embed_positions" in str(missing), missing
        reference = bridge.reference_from(folder, torch.float32)
        with torch.no_grad():
            expected = reference(
                input_ids=tokens, attention_mask=mask, position_ids=positions
            ).logits
        keep = mask.bool()  # padding positions' logits are nobody's output
        torch.testing.assert_close(logits[keep], expected[keep], rtol=1e-4, atol=1e-4)
        return
    finally:
        safelens_tl.activate()
    assert torch.equal(logits, stock[0])
    assert hooks.keys() == stock[1].keys()
    for name, value in hooks.items():
        assert torch.equal(value, stock[1][name]), name
    assert torch.equal(gradient, stock[2])


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_the_rotation_is_hugging_face_s(rotary_dim: int | None) -> None:
    """:func:`~safelens_tl.fixes.bridge.codegen.rotate` equals Hugging Face's CodeGen rotation, on
    the first ``rotary_dim`` features, the rest passed through."""
    codegen = _hugging_face_codegen()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=generator)
    width = 8 if rotary_dim is None else rotary_dim
    angles = torch.randn(2, 5, width // 2, generator=generator)
    sin, cos = angles.sin(), angles.cos()
    turned = codegen.apply_rotary_pos_emb(x[..., :width], sin, cos)  # type: ignore[attr-defined]
    expected = torch.cat((turned, x[..., width:]), dim=-1)
    assert torch.equal(bridge_codegen.rotate(x, sin, cos, rotary_dim), expected)


def test_scale_attn_is_the_instance_s_own_first() -> None:
    """``scale_attn`` as transformers 5.23 set it: ``sqrt(head_dim)``; an instance's own value
    (5.23 and older) wins; without a head size, the usual ``AttributeError``."""

    class Attention:
        scale_attn = bridge_codegen.HeadSizeScale()

        def __init__(self, head_dim: object) -> None:
            self.head_dim = head_dim

    assert Attention(16).scale_attn == math.sqrt(16)
    assert Attention(24).scale_attn == math.sqrt(24)
    own = Attention(16)
    own.scale_attn = 3.0  # type: ignore[misc]
    assert own.scale_attn == 3.0
    with pytest.raises(AttributeError, match="scale_attn"):
        _ = Attention(None).scale_attn
    assert isinstance(Attention.__dict__["scale_attn"], bridge_codegen.HeadSizeScale)


@requires_bridge
def test_hugging_face_codegen_answers_scale_attn_only_while_active() -> None:
    """The descriptor goes on Hugging Face's class once its module is imported, and comes off on
    :func:`safelens_tl.deactivate`."""
    codegen = _hugging_face_codegen()
    attention_class = codegen.CodeGenAttention  # type: ignore[attr-defined]
    safelens_tl.activate()
    patched = attention_class.__dict__.get("scale_attn")
    assert isinstance(patched, bridge_codegen.HeadSizeScale)
    safelens_tl.deactivate()
    try:
        assert "scale_attn" not in attention_class.__dict__
    finally:
        safelens_tl.activate()
    assert isinstance(attention_class.__dict__.get("scale_attn"), bridge_codegen.HeadSizeScale)
