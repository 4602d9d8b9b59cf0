"""TransformerBridge conversions keep ``cfg`` and the rotary frequencies right (real bridges)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import conversion as bridge_conversion
from safelens_tl.verify import bridge, checks
from tests.conftest import requires_bridge

pytestmark = requires_bridge

CONVERSIONS: dict[str, tuple[Callable[[Any], Any], torch.dtype]] = {
    "half()": (lambda model: model.half(), torch.float16),
    "bfloat16()": (lambda model: model.bfloat16(), torch.bfloat16),
    "to(float16)": (lambda model: model.to(torch.float16), torch.float16),
    "type(bfloat16)": (lambda model: model.type(torch.bfloat16), torch.bfloat16),
    "double()": (lambda model: model.double(), torch.float64),
}


def rotary_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Every rotary frequency buffer of the bridge, by name."""
    return {
        name: buffer
        for name, buffer in model.named_buffers()
        if name.rpartition(".")[2] in bridge_conversion.ROTARY_BUFFERS
    }


@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_every_conversion_leaves_cfg_dtype_at_the_weights_dtype(
    patched: safelens_tl.activation.Status, conversion: str
) -> None:
    convert, dtype = CONVERSIONS[conversion]
    model = convert(bridge.boot("llama-like-gqa", torch.float32))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.cfg.dtype == dtype


def test_stock_half_leaves_cfg_dtype_behind() -> None:
    """The trap the patch removes: weights in float16, cfg still float32."""
    model = bridge.boot("llama-like-gqa", torch.float32).half()
    assert next(model.parameters()).dtype == torch.float16
    assert model.cfg.dtype == torch.float32


@pytest.mark.parametrize("conversion", ["half()", "bfloat16()", "to(float16)", "type(bfloat16)"])
def test_rotary_frequencies_stay_float32_exactly_as_when_booted(
    patched: safelens_tl.activation.Status, conversion: str
) -> None:
    """Deliberately unlike stock ``.to()``: the README says so. Booted in the same dtype, the
    frequencies are float32; after conversion they are now the very same values."""
    convert, dtype = CONVERSIONS[conversion]
    converted = rotary_buffers(convert(bridge.boot("llama-like-gqa", torch.float32)))
    booted = rotary_buffers(bridge.boot("llama-like-gqa", dtype))
    assert converted and converted.keys() == booted.keys()
    for name, buffer in converted.items():
        assert buffer.dtype == torch.float32, name
        assert torch.equal(buffer, booted[name]), name


def test_double_keeps_its_float64_rotary_frequencies(
    patched: safelens_tl.activation.Status,
) -> None:
    """Only a narrowing conversion is undone: float64 is more precise than the float32 original."""
    model = bridge.boot("llama-like-gqa", torch.float32).double()
    assert {b.dtype for b in rotary_buffers(model).values()} == {torch.float64}


def long_prompt_error(model: Any, reference: torch.Tensor, tokens: torch.Tensor) -> float:
    """Largest |logit - reference| over the last 64 positions, relative to max |reference|."""
    with torch.inference_mode():
        logits = model(tokens, return_type="logits")[:, -64:].float()
    return float((logits - reference).abs().max() / reference.abs().max())


def test_converted_float16_bridge_is_as_accurate_at_long_positions_as_a_booted_one() -> None:
    """Positions 1984-2047 of a rotary model: stock ``.to(torch.float16)`` loses accuracy there
    against a bridge booted in float16; patched, the two are the same model."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 50, (1, 2048), generator=generator)
    with torch.inference_mode():
        reference = bridge.boot("llama-like-gqa", torch.float32)(tokens, return_type="logits")
    reference = reference[:, -64:].float()
    booted = long_prompt_error(bridge.boot("llama-like-gqa", torch.float16), reference, tokens)
    stock = long_prompt_error(
        bridge.boot("llama-like-gqa", torch.float32).to(torch.float16), reference, tokens
    )
    safelens_tl.activate()
    converted = long_prompt_error(
        bridge.boot("llama-like-gqa", torch.float32).to(torch.float16), reference, tokens
    )
    assert converted == booted
    assert stock > 3 * booted, (stock, booted)


def test_a_stale_cfg_device_follows_the_weights_after_a_conversion(
    patched: safelens_tl.activation.Status,
) -> None:
    """``cfg.device`` naming a device the weights are not on, as ``to(torch.device("cuda", 1))``
    leaves it (TransformerLens records only ``"cuda"``). No second device exists here, so
    ``meta`` stands in for the stale one; the weights stay on the CPU."""
    model = bridge.boot("llama-like-gqa", torch.float32)
    model.cfg.device = "meta"
    model = model.float()
    assert model.cfg.device == "cpu"
    tokens = model.generate("the cat runs", use_past_kv_cache=True, **checks.greedy_arguments(3))
    assert tokens.device.type == "cpu"


def test_stock_conversion_leaves_a_stale_cfg_device() -> None:
    """Without the sync the stale device stays; TransformerLens 4.3's batched generate then builds
    its attention mask there and fails."""
    model = bridge.boot("llama-like-gqa", torch.float32)
    model.cfg.device = "meta"
    model = model.float()
    assert model.cfg.device == "meta"
    if targets.locate_bridge().driver_class is not None:  # 4.x
        with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
            model.generate(
                ["the cat runs", "a dog"], use_past_kv_cache=True, **checks.greedy_arguments(3)
            )
