"""``TransformerBridge.generate`` on text prompts of different lengths gives each prompt the text
it gets alone, and hooks see the batch as it was passed, where TransformerLens's own uses no
attention mask (3.0 to 3.7: :mod:`safelens_tl.fixes.bridge.generate_batch`). Real bridges on the
sweep's tiny checkpoints; on releases with a mask the same assertions hold of the original
method, and the stock halves are skipped there."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import generate_batch as bridge_generate_batch
from safelens_tl.fixes.bridge import hf_generate_mask as bridge_hf_generate_mask
from tests.conftest import architecture_folder, benchmark_module, fixes_patching, requires_bridge

pytestmark = requires_bridge

PROMPTS = ["the cat runs in the river and", "a dog", "the big bird"]
GREEDY = {"max_new_tokens": 5, "do_sample": False, "stop_at_eos": False, "verbose": False}
HOOK = "blocks.0.hook_resid_post"
ARCHITECTURES = ["LlamaForCausalLM", "GPT2LMHeadModel"]


def _maskless_release() -> bool:
    generate = targets.locate_bridge().bridge_class.__dict__["generate"]
    return bridge_hf_generate_mask.drops_the_attention_mask(inspect.unwrap(generate))


def _boot(architecture: str = "LlamaForCausalLM") -> Any:
    folder = str(architecture_folder(architecture))
    return benchmark_module("bridge_architectures").boot(folder)


def _generate_seeing_batches(model: Any, prompts: Any, **options: Any) -> tuple[Any, list[int]]:
    """``generate``'s result and the batch size of every forward, as a hook sees it."""
    sizes: list[int] = []

    def record(activation: torch.Tensor, hook: Any) -> torch.Tensor:
        sizes.append(int(activation.shape[0]))
        return activation

    with model.hooks(fwd_hooks=[(HOOK, record)]):
        result = model.generate(prompts, **{**GREEDY, **options})
    return result, sizes


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_a_batch_of_prompts_generates_what_each_prompt_generates_alone(
    architecture: str, cached: bool, patched: safelens_tl.activation.Status
) -> None:
    """Decoded text, batch against one prompt at a time, and one forward of the whole batch per
    step as hooks see it."""
    model = _boot(architecture)
    options = {"use_past_kv_cache": cached}
    alone = [model.generate(prompt, **GREEDY, **options) for prompt in PROMPTS]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # text back: no warning needed
        batch, sizes = _generate_seeing_batches(model, PROMPTS, **options)
    assert batch == alone
    assert sizes == [len(PROMPTS)] * GREEDY["max_new_tokens"], sizes


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_stock_gives_the_shorter_prompts_other_text_with_the_same_view_to_hooks(
    architecture: str,
) -> None:
    """The stock half: on a release without the mask, the shorter prompts generate other text in
    the batch than alone (uncached, where stock's cache is not in question), and hooks see one
    forward of the whole batch per step, as patched shows them."""
    if not _maskless_release():
        pytest.skip("this TransformerBridge.generate masks a batch itself")
    stock = _boot(architecture)
    options = {"use_past_kv_cache": False}
    alone = [stock.generate(prompt, **GREEDY, **options) for prompt in PROMPTS]
    batch, sizes = _generate_seeing_batches(stock, PROMPTS, **options)
    assert sizes == [len(PROMPTS)] * GREEDY["max_new_tokens"], sizes
    assert batch[0] == alone[0]  # the longest prompt needs no padding
    assert batch[1:] != alone[1:], batch


def test_a_hook_on_one_row_changes_that_prompt_alone(
    patched: safelens_tl.activation.Status,
) -> None:
    """An intervention written for row 0 of the batch passed hits the first prompt only: the
    other rows generate what they generate without the hook."""
    model = _boot()
    plain = model.generate(PROMPTS, **GREEDY)

    def zero_row_0(activation: torch.Tensor, hook: Any) -> torch.Tensor:
        activation[0] = activation[0] * 0.0
        return activation

    with model.hooks(fwd_hooks=[(HOOK, zero_row_0)]):
        hit = model.generate(PROMPTS, **GREEDY)
    assert hit[0] != plain[0]
    assert hit[1:] == plain[1:]


def test_a_steering_tensor_of_the_batch_size_broadcasts(
    patched: safelens_tl.activation.Status,
) -> None:
    """A per-prompt tensor of the batch's size adds to the residual at every step (it would fail
    to broadcast against a batch split by length)."""
    model = _boot()
    steering = torch.zeros(len(PROMPTS), 1, model.cfg.d_model)

    def steer(activation: torch.Tensor, hook: Any) -> torch.Tensor:
        return activation + steering.to(activation.dtype)

    with model.hooks(fwd_hooks=[(HOOK, steer)]):
        steered = model.generate(PROMPTS, **GREEDY)
    assert steered == model.generate(PROMPTS, **GREEDY)


def test_tokens_of_prompts_of_different_lengths_come_left_padded_without_a_warning(
    patched: safelens_tl.activation.Status,
) -> None:
    """``return_type="tokens"``: one row per prompt, in order, each ending in what the prompt
    generates alone, padded on the left as TransformerLens 3.8 returns them."""
    model = _boot()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tokens = model.generate(PROMPTS, return_type="tokens", **GREEDY)
    assert tokens.shape[0] == len(PROMPTS)
    for row, prompt in zip(tokens, PROMPTS, strict=True):
        alone = model.generate(prompt, return_type="tokens", **GREEDY)[0]
        assert torch.equal(row[-alone.shape[0] :], alone)


def test_a_batch_that_cannot_be_masked_runs_as_stock_with_a_warning(
    patched: safelens_tl.activation.Status, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the model cannot be given positions (standing in here: the detector answers no for
    this Llama), the release's own generate runs, hooks see what stock shows them, and a warning
    says what to do."""
    if not _maskless_release():
        pytest.skip("this TransformerBridge.generate masks a batch itself")
    monkeypatch.setattr(bridge_generate_batch, "_takes_position_ids", lambda model: False)
    model = _boot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, sizes = _generate_seeing_batches(model, PROMPTS, use_past_kv_cache=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    ours = [m for m in messages if "uses no attention mask" in m]
    assert len(ours) == 1 and "one at a time" in ours[0] and "3.8" in ours[0], messages
    safelens_tl.deactivate()
    stock_result, stock_sizes = _generate_seeing_batches(_boot(), PROMPTS, use_past_kv_cache=False)
    assert (result, sizes) == (stock_result, stock_sizes)


def test_the_wrapper_is_installed_exactly_where_generate_uses_no_mask(
    patched: safelens_tl.activation.Status,
) -> None:
    """The fix's patch stands on ``generate`` exactly where the release's needs it."""
    bridge_class = targets.locate_bridge().bridge_class
    fixes = fixes_patching(bridge_class, "generate")
    assert ("bridge_generate_batch" in fixes) == _maskless_release(), fixes
    layer = inspect.unwrap(bridge_class.__dict__["generate"])
    # generating_padded_batch looks for the prompts there before binding the arguments.
    assert list(inspect.signature(layer).parameters)[:2] == ["self", "input"]


def _generate_probing(
    model: Any, prompts: list[str], probe: torch.Tensor, cached: bool
) -> tuple[Any, list[torch.Tensor]]:
    """``generate``'s result, and the logits of ``probe`` from a forward that a hook runs on the
    model at the first two steps (not again from inside its own forward)."""
    logits: list[torch.Tensor] = []
    running: list[bool] = []

    def run_the_probe(activation: torch.Tensor, hook: Any) -> torch.Tensor:
        if not running and len(logits) < 2:
            running.append(True)
            try:
                logits.append(model(probe, return_type="logits"))
            finally:
                running.pop()
        return activation

    with model.hooks(fwd_hooks=[(HOOK, run_the_probe)]):
        result = model.generate(prompts, use_past_kv_cache=cached, **GREEDY)
    return result, logits


#: Two prompts of different lengths, and probes of their batch size: shorter (4) and longer (10)
#: than the padded prompts (8 tokens with Llama's BOS).
PROBED_PROMPTS = PROMPTS[:2]
PROBE_TEXTS = [
    "the big bird sings in the river and the cat runs",
    "a dog runs in the big river and the bird sings",
]


@pytest.mark.parametrize("length", [4, 10])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_forward_a_hook_runs_during_a_batch_gets_no_mask_of_the_batch(
    architecture: str, cached: bool, length: int, patched: safelens_tl.activation.Status
) -> None:
    """A hook that runs the model on its own tokens of the batch's size, during the generation
    of prompts of different lengths, gets what a plain forward of them gives (not the batch's
    padding mask and positions: a size error for a shorter probe, other logits for a longer
    one), and the prompts still generate what each does alone."""
    model = _boot(architecture)
    probe = model.to_tokens(PROBE_TEXTS)[:, :length]
    assert probe.shape == (len(PROBED_PROMPTS), length)
    alone = [
        model.generate(prompt, use_past_kv_cache=cached, **GREEDY) for prompt in PROBED_PROMPTS
    ]
    with torch.no_grad():
        plain = model(probe, return_type="logits")
    result, logits = _generate_probing(model, PROBED_PROMPTS, probe, cached)
    assert len(logits) == 2
    for found in logits:
        assert torch.equal(found, plain), float((found - plain).abs().max())
    assert result == alone


@pytest.mark.parametrize("length", [4, 10])
def test_stock_gives_a_hook_s_forward_what_a_plain_forward_gives(length: int) -> None:
    """The stock half: the hook's forward during a batched ``generate`` is a plain forward of
    its tokens, bitwise."""
    model = _boot()
    probe = model.to_tokens(PROBE_TEXTS)[:, :length]
    with torch.no_grad():
        plain = model(probe, return_type="logits")
    _, logits = _generate_probing(model, PROBED_PROMPTS, probe, cached=True)
    assert len(logits) == 2
    for found in logits:
        assert torch.equal(found, plain)
