"""``TransformerBridge.hf_generate`` on a batch of prompts gives each prompt the tokens it gets
alone, where TransformerLens's own drops the batch's attention mask (3.0 to 3.8.1:
:mod:`safelens_tl.fixes.bridge.hf_generate_mask`). Real bridges on the sweep's tiny checkpoints."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.builtin_plugins import bridge as bridge_plugin
from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask
from tests.conftest import RELEASE, architecture_folder, benchmark_module, requires_bridge

PROMPTS = ["the cat runs", "a big old dog sleeps in the quiet house"]
GREEDY = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False}


def _dropping_release() -> bool:
    bridge = targets.locate_bridge().bridge_class
    hf_generate = bridge.__dict__.get("hf_generate")
    return bridge_hf_generate_mask.drops_the_attention_mask(inspect.unwrap(hf_generate))


def _boot(architecture: str) -> Any:
    return benchmark_module("bridge_architectures").boot(str(architecture_folder(architecture)))


@requires_bridge
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "T5ForConditionalGeneration"])
def test_a_batch_of_prompts_generates_what_each_prompt_generates_alone(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """Decoded text, batch against one prompt at a time, decoder-only and encoder-decoder. On a
    release that drops the mask, stock gives the shorter prompt of a batch other text than it
    gives that prompt alone (Llama; stock TransformerLens 3.x cannot run T5 with transformers
    5.15+, :mod:`safelens_tl.fixes.bridge.t5_legacy_block`)."""
    model = _boot(architecture)
    alone = [model.hf_generate(prompt, **GREEDY) for prompt in PROMPTS]
    assert model.hf_generate(PROMPTS, **GREEDY) == alone
    if architecture != "LlamaForCausalLM":
        pytest.skip("stock half on Llama only: stock TL 3.x cannot run T5 on transformers 5.15+")
    if not _dropping_release():
        pytest.skip(f"TransformerLens {RELEASE} passes the batch's mask: no stock failure to show")
    safelens_tl.deactivate()
    try:
        stock = _boot(architecture)
        stock_alone = [stock.hf_generate(prompt, **GREEDY) for prompt in PROMPTS]
        stock_batch = stock.hf_generate(PROMPTS, **GREEDY)
    finally:
        safelens_tl.activate()
    assert stock_batch[0] != stock_alone[0] and stock_batch[1] == stock_alone[1], stock_batch


@requires_bridge
def test_tokens_of_a_batch_are_left_padded_and_each_row_is_its_prompt_s(
    patched: safelens_tl.activation.Status,
) -> None:
    """``return_type="tokens"``: a decoder-only batch comes back left-padded (as TransformerLens
    3.9 returns it), each row ending in the tokens its prompt generates alone."""
    model = _boot("LlamaForCausalLM")
    batch = model.hf_generate(PROMPTS, return_type="tokens", **GREEDY)
    for row, prompt in zip(batch, PROMPTS, strict=True):
        alone = model.hf_generate(prompt, return_type="tokens", **GREEDY)[0]
        assert torch.equal(row[-alone.shape[0] :], alone)
    assert batch.shape[1] == model.hf_generate(PROMPTS[1], return_type="tokens", **GREEDY).shape[1]


@requires_bridge
def test_the_patch_is_where_the_release_drops_the_mask_and_only_there(
    patched: safelens_tl.activation.Status,
) -> None:
    """The mask's wrapper is among ``hf_generate``'s on 3.0-3.8 only; 3.9 and 4.x pass the mask
    themselves. (``hf_generate`` is patched on every release for state-space models' options,
    :mod:`safelens_tl.fixes.bridge.stateful_generate`; ``deactivate()`` removes it.)"""
    bridge = targets.locate_bridge().bridge_class
    target = f"{bridge.__module__}.{bridge.__qualname__}.hf_generate"
    assert target in safelens_tl.status().patched
    original = inspect.unwrap(bridge.__dict__["hf_generate"])
    wrappers = bridge_plugin.hf_generate_wrappers(original)
    passing_the_mask = bridge_hf_generate_mask.passing_the_attention_mask
    assert (passing_the_mask in wrappers) == _dropping_release()
    major, minor = (int(part) for part in RELEASE.split(".")[:2])
    assert _dropping_release() == ((3, 0) <= (major, minor) < (3, 9))
    safelens_tl.deactivate()
    try:
        assert target not in safelens_tl.status().patched
        assert not hasattr(bridge.__dict__.get("hf_generate"), "__wrapped__")
    finally:
        safelens_tl.activate()


class _Bridge:
    """Records what reaches ``hf_generate``; stands in for the bridge's tokenizer-facing side
    only (the real bridges are tested above)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.tokenizer = None

    def hf_generate(
        self, input: Any = "", return_type: str | None = "input", **generation_kwargs: Any
    ) -> Any:
        self.calls.append((input, generation_kwargs))
        return input


def test_which_calls_are_left_to_the_original() -> None:
    """A single prompt, tokens, a mask of the caller's own, or no tokenizer: unchanged."""
    assert bridge_hf_generate_mask.drops_the_attention_mask(_Bridge.hf_generate)

    def passes(input: Any, **generation_kwargs: Any) -> Any:
        attention_mask = None
        return input, attention_mask

    assert not bridge_hf_generate_mask.drops_the_attention_mask(passes)
    wrapped = bridge_hf_generate_mask.passing_the_attention_mask(_Bridge.hf_generate)
    bridge = _Bridge()
    tokens = torch.tensor([[1, 2]])
    mask = torch.ones(1, 2)
    assert wrapped(bridge, "one prompt") == "one prompt"
    assert wrapped(bridge, tokens) is tokens
    assert wrapped(bridge, PROMPTS, attention_mask=mask) == PROMPTS
    assert wrapped(bridge, PROMPTS) == PROMPTS  # no tokenizer to pad with
    assert [kwargs for _, kwargs in bridge.calls] == [{}, {}, {"attention_mask": mask}, {}]
