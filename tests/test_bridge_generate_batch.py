"""``TransformerBridge.generate`` on text prompts of different lengths gives each prompt the text
it gets alone, where TransformerLens's own uses no attention mask (3.0 to 3.7:
:mod:`safelens_tl.bridge_generate_batch`). Real bridges on the sweep's tiny checkpoints; on
releases with a mask the same assertions hold of the original method."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

import safelens_tl
from safelens_tl import bridge_generate_batch, bridge_hf_generate_mask, targets
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

pytestmark = requires_bridge

PROMPTS = ["the cat runs", "a big old dog sleeps in the quiet house"]
GREEDY = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False, "verbose": False}


def _maskless_release() -> bool:
    generate = targets.locate_bridge().bridge_class.__dict__["generate"]
    return bridge_hf_generate_mask.drops_the_attention_mask(inspect.unwrap(generate))


def _boot() -> Any:
    folder = str(architecture_folder("LlamaForCausalLM"))
    return benchmark_module("bridge_architectures").boot(folder)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_a_batch_of_prompts_generates_what_each_prompt_generates_alone(
    cached: bool, patched: safelens_tl.activation.Status
) -> None:
    """Decoded text, batch against one prompt at a time. On a release without the mask, stock
    gives the shorter prompt other text in the batch than alone."""
    model = _boot()
    arguments = {**GREEDY, "use_past_kv_cache": cached}
    alone = [model.generate(prompt, **arguments) for prompt in PROMPTS]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # text back: no warning needed
        assert model.generate(PROMPTS, **arguments) == alone
    if not _maskless_release():
        pytest.skip("this TransformerLens masks a batch itself: no stock failure to show")
    safelens_tl.deactivate()
    try:
        stock = _boot()
        stock_alone = [stock.generate(prompt, **arguments) for prompt in PROMPTS]
        stock_batch = stock.generate(PROMPTS, **arguments)
    finally:
        safelens_tl.activate()
    assert stock_batch[0] != stock_alone[0] and stock_batch[1] == stock_alone[1], stock_batch


def test_prompts_of_one_length_are_generated_as_one_batch(
    patched: safelens_tl.activation.Status, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts, two of one token count: two calls of TransformerLens's ``generate`` where
    it uses no mask (counted by its tokenizations of the input), one elsewhere; every text is
    what its prompt gives alone, in the prompts' order."""
    model = _boot()
    prompts = [PROMPTS[0], PROMPTS[1], "the dog runs"]
    counts = [len(model.tokenizer(prompt)["input_ids"]) for prompt in prompts]
    assert counts[0] == counts[2] != counts[1], counts
    alone = [model.generate(prompt, **GREEDY) for prompt in prompts]
    calls: list[Any] = []
    to_tokens = model.to_tokens
    monkeypatch.setattr(
        model, "to_tokens", lambda *a, **k: (calls.append(a[:1]), to_tokens(*a, **k))[1]
    )
    model.generate(prompts[0], **GREEDY)
    per_generate = len(calls)
    assert per_generate >= 1
    calls.clear()
    assert model.generate(prompts, **GREEDY) == alone
    assert len(calls) == per_generate * (2 if _maskless_release() else 1), calls


def test_tokens_of_prompts_of_different_lengths_come_with_a_warning(
    patched: safelens_tl.activation.Status,
) -> None:
    """Tokens cannot be returned one prompt at a time as one batch: the original runs, and on a
    release without the mask a warning says why the shorter rows are wrong and what to do."""
    model = _boot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(PROMPTS, return_type="tokens", **GREEDY)
        model.generate(PROMPTS[:1] * 2, return_type="tokens", **GREEDY)  # one length: no warning
    assert tokens.shape[0] == len(PROMPTS)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    ours = [m for m in messages if "uses no attention mask" in m]
    assert len(ours) == (1 if _maskless_release() else 0), messages
    if ours:
        assert "return_type='str'" in ours[0] and "3.8" in ours[0]


def test_the_wrapper_is_installed_exactly_where_generate_uses_no_mask(
    patched: safelens_tl.activation.Status,
) -> None:
    """Each layer of the patched ``generate`` is told apart by the file of its code
    (``functools.wraps`` copies the names)."""
    layer = targets.locate_bridge().bridge_class.__dict__["generate"]
    files = [layer.__code__.co_filename]
    while hasattr(layer, "__wrapped__"):
        layer = layer.__wrapped__
        files.append(layer.__code__.co_filename)
    ours = bridge_generate_batch.__file__
    assert (ours in files) == _maskless_release(), files
    # generate_alone.batch_to_split looks for the prompts there before binding the arguments.
    assert list(inspect.signature(layer).parameters)[:2] == ["self", "input"]
