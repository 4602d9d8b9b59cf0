"""``HookedTransformer.generate``'s mask of zeros is computed once per ``generate`` instead of at
every step (TransformerLens 2.13 to 3.0.0: :mod:`safelens_tl.fixes.hooked.zeros_mask`), and gives
what the release's own ``get_attention_mask`` gives, for every tokenizer setting. Real models, the
real ``generate`` and the release's real ``get_attention_mask``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.hooked import zeros_mask as hooked_zeros_mask
from safelens_tl.fixes.hooked.zeros_mask import ZerosAnswer
from safelens_tl.verify import checks
from safelens_tl.verify.models import load_tokenizer
from tests.conftest import RELEASE, generate_recording, requires_hooked_transformer, tiny_model

UTILS = targets.optional_module(targets.HOOKED_UTILS_MODULE)
_MASK = None if UTILS is None else getattr(UTILS, "get_attention_mask", None)
#: The release's own ``get_attention_mask`` (under safelens-tl's wrapper where it is installed).
ORIGINAL = None if _MASK is None else inspect.unwrap(_MASK)

has_mask_function = pytest.mark.skipif(
    ORIGINAL is None, reason=f"TransformerLens {RELEASE} has no utils.get_attention_mask"
)
builds_zeros = pytest.mark.skipif(
    not targets.hooked_generate_masks_no_padding(RELEASE),
    reason=f"TransformerLens {RELEASE}'s generate builds no mask of zeros",
)
NEW = 6


def _tokenizer(pad_is_zero: bool, bos_is_pad: bool, side: str) -> Any:
    """The verifier's tokenizer (``<pad>`` is id 0, ``<bos>`` id 1) set up as asked."""
    tokenizer = copy.deepcopy(load_tokenizer())
    tokenizer.padding_side = side
    pad = "<pad>" if pad_is_zero else "<eos>"
    tokenizer.pad_token = pad
    tokenizer.bos_token = pad if bos_is_pad else "<bos>"
    return tokenizer


@has_mask_function
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    ("pad_is_zero", "bos_is_pad", "side", "prepend_bos"),
    list(itertools.product([True, False], [True, False], ["left", "right"], [True, False])),
)
def test_the_answer_for_zeros_is_the_release_s_at_every_length(
    pad_is_zero: bool, bos_is_pad: bool, side: str, prepend_bos: bool, batch: int
) -> None:
    """Zeros of a growing length, as ``generate`` passes them: equal to the original's answer,
    in value, dtype and shape, including where a prepended BOS that is also the pad token keeps
    the last position (the one answer that is not one value throughout)."""
    assert ORIGINAL is not None
    tokenizer = _tokenizer(pad_is_zero, bos_is_pad, side)
    record = ZerosAnswer()
    for length in range(1, 7):
        zeros = torch.zeros((batch, length)).to(torch.int)
        expected = ORIGINAL(tokenizer, zeros, prepend_bos)
        answer = record.answer(ORIGINAL, tokenizer, zeros, prepend_bos)
        assert answer.dtype == expected.dtype
        assert torch.equal(answer, expected), length
    kept_bos = pad_is_zero and bos_is_pad and side == "left" and prepend_bos
    assert (record.value is None) == kept_bos


@has_mask_function
def test_tokens_other_tokenizers_and_other_prepend_bos_get_the_original_s_answer() -> None:
    """A recorded answer is used for zeros with the same tokenizer and ``prepend_bos`` only."""
    assert ORIGINAL is not None
    tokenizer = _tokenizer(pad_is_zero=True, bos_is_pad=True, side="left")
    record = ZerosAnswer()
    record.answer(ORIGINAL, tokenizer, torch.zeros((2, 3), dtype=torch.int32), False)
    assert record.value == 0
    padded = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    other = _tokenizer(pad_is_zero=False, bos_is_pad=False, side="left")
    zeros = torch.zeros((2, 4), dtype=torch.int32)
    for arguments in ((tokenizer, padded, False), (other, zeros, False), (tokenizer, zeros, True)):
        expected = ORIGINAL(*arguments)
        assert torch.equal(record.answer(ORIGINAL, *arguments), expected)
        # Each differs from the recorded answer, so a wrongly used record would show.
        assert not torch.equal(expected, torch.full_like(expected, record.value))


@contextlib.contextmanager
def _counting_original() -> Iterator[list[tuple[int, ...]]]:
    """The release's ``get_attention_mask`` behind a counter, under safelens-tl's wrapper while
    active; the exact original is put back afterwards."""
    assert UTILS is not None and ORIGINAL is not None
    shapes: list[tuple[int, ...]] = []

    def counted(tokenizer: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(tokens.shape))
        return ORIGINAL(tokenizer, tokens, *args, **kwargs)

    safelens_tl.deactivate()
    UTILS.get_attention_mask = counted
    try:
        yield shapes
    finally:
        safelens_tl.deactivate()
        UTILS.get_attention_mask = ORIGINAL
        safelens_tl.activate()


@requires_hooked_transformer
@builds_zeros
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_generate_computes_the_mask_of_zeros_once_instead_of_at_every_step(cached: bool) -> None:
    """Stock calls ``get_attention_mask`` at each of the ``NEW`` steps; patched, once (for a
    one-token prompt, on two positions of zeros: one position cannot show a kept BOS)."""
    model = tiny_model("llama-like-gqa")
    options = {"max_new_tokens": NEW, "do_sample": False, "verbose": False}
    prompt = model.to_tokens(checks.PROMPTS[1])
    with _counting_original() as shapes:
        stock = model.generate(prompt, use_past_kv_cache=cached, **options)
        assert len(shapes) == NEW
        del shapes[:]
        safelens_tl.activate()
        ours = model.generate(prompt, use_past_kv_cache=cached, **options)
        assert shapes == [tuple(prompt.shape)]
        del shapes[:]
        model.generate(prompt[:, :1], use_past_kv_cache=cached, **options)
        assert shapes == [(1, 2)]
    assert torch.equal(ours, stock)


@contextlib.contextmanager
def _bos_is_pad_zero(model: Any, wanted: bool) -> Iterator[None]:
    """The model's tokenizer with BOS made the pad token (id 0), where ``wanted``."""
    tokenizer = model.tokenizer
    bos = tokenizer.bos_token
    if wanted:
        tokenizer.bos_token = tokenizer.pad_token
    try:
        yield
    finally:
        tokenizer.bos_token = bos


@requires_hooked_transformer
@builds_zeros
@pytest.mark.parametrize("bos_is_pad", [False, True], ids=["bos", "bos-is-pad"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like-gqa"])
def test_tokens_logits_and_every_activation_are_those_of_the_original_mask(
    name: str, cached: bool, bos_is_pad: bool, patched: Any
) -> None:
    """The patched ``generate`` with and without the answered mask: the same tokens and
    activations of every hook (the final norm's, which the logits are computed from, included),
    bitwise, for one prompt, a padded batch and one token."""
    assert UTILS is not None
    model = tiny_model(name)
    wrapper = UTILS.get_attention_mask
    assert wrapper is not ORIGINAL
    prompts = (checks.PROMPTS[1], ["the cat", "the dog runs far away"], "the")
    with _bos_is_pad_zero(model, bos_is_pad):
        for prompt in prompts:
            options = {"use_past_kv_cache": cached, "return_type": "tokens"}
            ours, ours_seen = generate_recording(model, prompt, NEW, **options)
            UTILS.get_attention_mask = ORIGINAL
            try:
                theirs, theirs_seen = generate_recording(model, prompt, NEW, **options)
            finally:
                UTILS.get_attention_mask = wrapper
            assert torch.equal(ours, theirs)
            assert [hook for hook, _ in ours_seen] == [hook for hook, _ in theirs_seen]
            pairs = zip(ours_seen, theirs_seen, strict=True)
            assert all(torch.equal(a, b) for (_, a), (_, b) in pairs)


@requires_hooked_transformer
@has_mask_function
def test_the_wrapper_is_installed_exactly_on_those_releases_and_removed_exactly(
    patched: safelens_tl.activation.Status,
) -> None:
    assert UTILS is not None
    expected = targets.hooked_generate_masks_no_padding(RELEASE)
    name = f"{targets.HOOKED_UTILS_MODULE}.get_attention_mask"
    assert (name in patched.patched) == expected
    here = UTILS.get_attention_mask.__code__.co_filename == hooked_zeros_mask.__file__
    assert here == expected
    safelens_tl.deactivate()
    try:
        assert UTILS.get_attention_mask is ORIGINAL
    finally:
        safelens_tl.activate()


@has_mask_function
def test_outside_a_patched_generate_every_call_is_the_original_s(patched: Any) -> None:
    """No record is open outside ``generate``: zeros get a freshly computed answer each time."""
    assert UTILS is not None and ORIGINAL is not None
    tokenizer = _tokenizer(pad_is_zero=True, bos_is_pad=False, side="left")
    calls = []

    def counted(*args: Any) -> Any:
        calls.append(args)
        return ORIGINAL(*args)

    wrapped = hooked_zeros_mask.answering_zeros(counted)
    for length in (2, 3):
        zeros = torch.zeros((1, length), dtype=torch.int32)
        assert torch.equal(wrapped(tokenizer, zeros, True), ORIGINAL(tokenizer, zeros, True))
    assert len(calls) == 2
