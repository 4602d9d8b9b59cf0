"""An uncached ``generate`` of a state-space model keeps what it was asked.

TransformerBridge hands such a call to ``hf_generate``; TransformerLens 3.x drops
``stop_at_eos`` and ``repetition_penalty`` on the way, 3.x and 4.3 ``return_type``, and 3.x's
``hf_generate`` stops at the end-of-sequence token even when told not to
(:mod:`safelens_tl.fixes.bridge.stateful_generate`). The tiny Bamba checkpoint picks the
end-of-sequence token first after the prompt below, which is what makes the difference show.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, models
from tests.conftest import architecture_folder, requires_bridge

pytestmark = requires_bridge

NEW_TOKENS = 4
GREEDY = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "verbose": False}


def _bamba_and_a_prompt_it_ends() -> tuple[Any, torch.Tensor]:
    """The tiny Bamba bridge (a stateful model) and a prompt after which its first greedy token
    is the end-of-sequence token."""
    folder = architecture_folder("BambaForCausalLM")
    model = bridge.boot_folder(folder, torch.float32, tokenizer=models.load_tokenizer())
    if not getattr(model.cfg, "is_stateful", False):
        pytest.skip("this TransformerBridge runs Bamba through its own loop")
    eos = models.load_tokenizer().eos_token_id
    for first in range(3, models.vocab_size()):
        for second in range(3, 12):
            prompt = torch.tensor([[first, second]])
            with torch.no_grad():
                if int(model(prompt, return_type="logits")[0, -1].argmax()) == eos:
                    return model, prompt
    pytest.skip("no two-token prompt of the tiny Bamba ends at once")


def test_an_uncached_generate_told_not_to_stop_at_eos_goes_on_as_the_cached_one(
    patched: safelens_tl.activation.Status,
) -> None:
    """``stop_at_eos=False``: as many tokens as asked, the cached generate's. (Stock 3.9: one
    token, the end-of-sequence one.)"""
    model, prompt = _bamba_and_a_prompt_it_ends()
    options = {**GREEDY, "stop_at_eos": False, "return_type": "tokens"}
    cached = model.generate(prompt, use_past_kv_cache=True, **options)
    uncached = model.generate(prompt, use_past_kv_cache=False, **options)
    assert cached.shape == (1, prompt.shape[1] + NEW_TOKENS)
    assert uncached.tolist() == cached.tolist()


def test_hf_generate_told_not_to_stop_at_eos_goes_on(
    patched: safelens_tl.activation.Status,
) -> None:
    """``hf_generate(stop_at_eos=False)`` itself: as many tokens as asked."""
    model, prompt = _bamba_and_a_prompt_it_ends()
    generated = model.hf_generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, stop_at_eos=False, return_type="tokens"
    )
    assert generated.shape == (1, prompt.shape[1] + NEW_TOKENS)


def test_an_uncached_generate_that_stops_at_eos_still_stops(
    patched: safelens_tl.activation.Status,
) -> None:
    """The default ``stop_at_eos=True`` is left as it was: the end-of-sequence token ends it."""
    model, prompt = _bamba_and_a_prompt_it_ends()
    generated = model.generate(prompt, use_past_kv_cache=False, return_type="tokens", **GREEDY)
    assert generated[0, prompt.shape[1] :].tolist() == [models.load_tokenizer().eos_token_id]


def test_an_uncached_generate_returns_tokens_when_asked_for_tokens(
    patched: safelens_tl.activation.Status,
) -> None:
    """``return_type="tokens"`` of a string prompt: the cached generate's token tensor, not a
    string (stock 3.9 and 4.3 return the string)."""
    model, _ = _bamba_and_a_prompt_it_ends()
    options = {**GREEDY, "stop_at_eos": False, "return_type": "tokens"}
    cached = model.generate("the cat runs", use_past_kv_cache=True, **options)
    uncached = model.generate("the cat runs", use_past_kv_cache=False, **options)
    assert isinstance(uncached, torch.Tensor)
    assert uncached.tolist() == cached.tolist()


def test_an_uncached_generate_applies_the_repetition_penalty(
    patched: safelens_tl.activation.Status,
) -> None:
    """``repetition_penalty`` reaches Hugging Face's ``generate``, which the uncached call
    runs: its tokens, which the penalty changes. (The prompt is what the model would generate
    anyway, so that the penalty has tokens to act on. TransformerLens's own cached loop
    penalizes in its own way, and picks other tokens.)"""
    model, _ = _bamba_and_a_prompt_it_ends()
    options = {**GREEDY, "max_new_tokens": 12, "stop_at_eos": False, "return_type": "tokens"}
    generated = model.generate("the cat runs", use_past_kv_cache=True, **options)
    # Without the end-of-sequence token, which hf_generate's own padding id is: Hugging Face
    # would mask it out as padding.
    prompt = generated[generated != models.load_tokenizer().eos_token_id].unsqueeze(0)
    reference = bridge.reference_from(architecture_folder("BambaForCausalLM"), torch.float32)
    config = copy.deepcopy(reference.generation_config)
    config.eos_token_id = []  # None would fall back to the model config's
    with torch.no_grad():
        expected = reference.generate(
            prompt, generation_config=config, max_new_tokens=12, repetition_penalty=50.0
        )
    penalized = model.generate(prompt, use_past_kv_cache=False, repetition_penalty=50.0, **options)
    assert penalized.tolist() == expected.tolist()
    assert penalized.tolist() != model.generate(prompt, use_past_kv_cache=False, **options).tolist()


def test_an_uncached_sampling_generate_refuses_a_frequency_penalty_it_cannot_apply(
    patched: safelens_tl.activation.Status,
) -> None:
    """Hugging Face's ``generate`` has no frequency penalty: the uncached fallback would sample
    without it. Stock 3.9 drops it silently; 4.3 and safelens-tl refuse it, naming the way out,
    and the cached ``generate``, which applies it, still runs."""
    model, prompt = _bamba_and_a_prompt_it_ends()
    options = {"max_new_tokens": NEW_TOKENS, "verbose": False, "stop_at_eos": False}
    with pytest.raises(NotImplementedError, match="freq_penalty"):
        model.generate(prompt, use_past_kv_cache=False, do_sample=True, freq_penalty=0.5, **options)
    torch.manual_seed(0)
    cached = model.generate(
        prompt, do_sample=True, freq_penalty=0.5, return_type="tokens", **options
    )
    assert cached.shape == (1, prompt.shape[1] + NEW_TOKENS)


def test_an_uncached_greedy_generate_lets_a_frequency_penalty_through(
    patched: safelens_tl.activation.Status,
) -> None:
    """Greedy ``generate`` never applies a frequency penalty (TransformerLens applies it when it
    samples): the uncached one runs with one, as the cached one does (TransformerLens 3.9; 4.3
    refuses it whatever the sampling)."""
    model, prompt = _bamba_and_a_prompt_it_ends()
    options = {**GREEDY, "stop_at_eos": False, "return_type": "tokens", "freq_penalty": 0.5}
    try:
        uncached = model.generate(prompt, use_past_kv_cache=False, **options)
    except NotImplementedError as error:
        if "freq_penalty requires use_past_kv_cache=True" not in str(error):
            raise
        pytest.skip(f"this TransformerLens refuses it itself: {error}")
    cached = model.generate(prompt, use_past_kv_cache=True, **options)
    assert uncached.tolist() == cached.tolist()
