"""``HookedTransformer.generate`` on a padded batch gives each prompt what it gets alone, where
TransformerLens's own masks no padding (2.13 to 3.0.0:
:mod:`safelens_tl.fixes.hooked.generate_mask`). Real models and the real ``generate``; on releases
that mask the padding (3.1 and later) the same assertions hold of the original method, which is what
makes them the reference, except for tensors that 3.1's mask leaves attending to a pad (padded
against the tokenizer's side, or GPT-2-style rows without BOS): those tests skip there."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.hooked import generate_mask as hooked_generate_mask
from safelens_tl.kv import entry as kv_cache
from safelens_tl.verify import checks
from tests.conftest import LAYOUT, RELEASE, fixes_patching, requires_hooked_transformer, tiny_model

pytestmark = requires_hooked_transformer

PROMPTS = list(checks.PROMPTS)  # 4 and 10 tokens with the BOS
NEW = 6


def _generate(model: Any, prompt: Any, **options: Any) -> Any:
    settings = {"max_new_tokens": NEW, "do_sample": False, "verbose": False, **options}
    return model.generate(prompt, **settings)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like-gqa"])
def test_a_batch_of_texts_generates_what_each_prompt_generates_alone(
    name: str, cached: bool, padding_side: str, patched: safelens_tl.activation.Status
) -> None:
    """Stock 2.13-3.0.0 gives the shorter prompt other text in the batch than alone, whichever
    side it pads."""
    model = tiny_model(name)
    options = {"use_past_kv_cache": cached, "padding_side": padding_side}
    alone = [_generate(model, prompt, **options) for prompt in PROMPTS]
    assert _generate(model, PROMPTS, **options) == alone


@pytest.mark.parametrize("stops_early", [False, True], ids=["to-the-end", "one-row-at-eos"])
def test_tokens_come_back_as_a_masked_batch_lays_them_out(
    stops_early: bool, patched: safelens_tl.activation.Status
) -> None:
    """Prompts left-padded with the pad token, each generation after its prompt, a row that
    stopped at EOS filled up with it: TransformerLens 3.1's layout, expected here from each prompt
    generated alone."""
    model = tiny_model("llama-like-gqa")
    options: dict[str, Any] = {"return_type": "tokens", "use_past_kv_cache": True}
    if stops_early:
        # A token the short prompt generates at its third step ends that row there.
        third = int(_generate(model, PROMPTS[0], **options)[0, -NEW + 2])
        options["eos_token_id"] = third
    alone = [_generate(model, prompt, **options)[0] for prompt in PROMPTS]
    lengths = [int(model.to_tokens(prompt).shape[1]) for prompt in PROMPTS]
    added = [len(row) - length for row, length in zip(alone, lengths, strict=True)]
    if stops_early:
        assert added[0] == 3 and added[1] == NEW, added  # the two rows end apart
    pad = model.tokenizer.pad_token_id
    fill = options.get("eos_token_id", 0)
    expected = torch.stack(
        [
            torch.cat(
                (
                    torch.full((max(lengths) - length,), pad),
                    row,
                    torch.full((max(added) - new,), fill),
                )
            )
            for row, length, new in zip(alone, lengths, added, strict=True)
        ]
    )
    batch = _generate(model, PROMPTS, **options)
    assert batch.tolist() == expected.tolist()


@pytest.mark.parametrize("return_type", ["str", "tokens"])
def test_a_padded_batch_is_generated_as_one_batch(
    return_type: str, patched: safelens_tl.activation.Status, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts, two of one length: one cached generation (one cache), each row what its
    prompt gives alone, in the prompts' order."""
    model = tiny_model("llama-like-gqa")
    prompts = [PROMPTS[0], PROMPTS[1], "the dog runs"]
    options = {"return_type": return_type, "use_past_kv_cache": True, "stop_at_eos": False}
    caches: list[Any] = []
    label = kv_cache.label_layers
    monkeypatch.setattr(
        kv_cache, "label_layers", lambda cache: (caches.append(cache), label(cache))
    )
    batch = _generate(model, prompts, **options)
    assert len(caches) == 1
    alone = [_generate(model, prompt, **options) for prompt in prompts]
    if return_type == "str":
        assert batch == alone
        return
    longest = max(row.shape[1] for row in alone)
    for row, single in zip(batch, alone, strict=True):
        assert row[longest - single.shape[1] :].tolist() == single[0].tolist()


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_token_rows_padded_on_the_tokenizer_s_side_are_masked(
    cached: bool, patched: safelens_tl.activation.Status
) -> None:
    """A tensor of left-padded rows, the tokenizer padding on the left: its padding is masked
    as 3.1 masks it (stock 2.13-3.0.0 attends to it)."""
    model = tiny_model("llama-like-gqa")
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "left"
    try:
        tokens = model.to_tokens(PROMPTS)
        options = {"return_type": "tokens", "use_past_kv_cache": cached, "stop_at_eos": False}
        batch = _generate(model, tokens, **options)
    finally:
        model.tokenizer.padding_side = side
    for row, prompt in zip(batch, PROMPTS, strict=True):
        alone = _generate(model, prompt, **options)[0]
        assert row[-len(alone) :].tolist() == alone.tolist()


@pytest.mark.parametrize("prepend_bos", [None, False, True], ids=["default", "no-bos", "bos"])
def test_a_list_is_tokenized_as_generate_tokenizes_it(
    prepend_bos: bool | None, patched: safelens_tl.activation.Status
) -> None:
    """BOS as the call or the model's default says (here a model that prepends none by
    default, as Bloom): each row is its prompt's tokens alone, left-padded, then what it gives
    alone."""
    model = tiny_model("llama-like-gqa")
    default = model.cfg.default_prepend_bos
    model.cfg.default_prepend_bos = False
    options: dict[str, Any] = {"return_type": "tokens", "stop_at_eos": False}
    if prepend_bos is not None:
        options["prepend_bos"] = prepend_bos
    try:
        batch = _generate(model, PROMPTS, **options)
        alone = [_generate(model, prompt, **options)[0] for prompt in PROMPTS]
    finally:
        model.cfg.default_prepend_bos = default
    assert (int(alone[1][0]) == model.tokenizer.bos_token_id) == bool(prepend_bos)
    for row, single in zip(batch, alone, strict=True):
        assert row[-len(single) :].tolist() == single.tolist()


def test_token_rows_padded_on_the_right_run_as_stock_runs_them(
    patched: safelens_tl.activation.Status,
) -> None:
    """They go on after their padding, masked (3.1) or not (2.13-3.0.0 stock): wrong either way,
    so safelens-tl changes nothing there."""
    model = tiny_model("llama-like-gqa")
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "right"
    options = {"return_type": "tokens", "use_past_kv_cache": True, "stop_at_eos": False}
    try:
        tokens = model.to_tokens(PROMPTS)
        assert int(tokens[0, -1]) == model.tokenizer.pad_token_id  # the short row is padded
        ours = _generate(model, tokens, **options)
        safelens_tl.deactivate()
        stock = _generate(model, tokens, **options)
    finally:
        safelens_tl.activate()
        model.tokenizer.padding_side = side
    assert ours.tolist() == stock.tolist()


def _gpt2_style(padding_side: str) -> Any:
    """A tiny model whose tokenizer has one token for BOS, EOS and pad (GPT-2's layout), learned
    positions, BOS prepended by default, padding on ``padding_side``."""
    from tests.test_differential_hooked import model_for

    point = {
        "tokenizer": "bos-eos-pad",
        "positions": "standard",
        "padding_side": padding_side,
        "dtype": torch.float32,
    }
    return model_for(point)


def _fixes_tensors_here() -> None:
    """Skip where the release's own ``generate`` builds the mask (3.1 on): a tensor's padding is
    then masked by the tokenizer's side and ``prepend_bos``, as stock masks it, untouched."""
    if not targets.hooked_generate_masks_no_padding(RELEASE):
        pytest.skip(f"TransformerLens {RELEASE}'s generate masks a tensor's padding itself")


def _rows_against_alone(
    model: Any, tokens: torch.Tensor, prepend_bos: bool, **options: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``generate`` on ``tokens`` (the prompts' rows) and on each prompt's tokens alone."""
    options = {"return_type": "tokens", "stop_at_eos": False, **options}
    batch = _generate(model, tokens, **options)
    rows = [model.to_tokens(prompt, prepend_bos=prepend_bos) for prompt in PROMPTS]
    return batch, [_generate(model, row, **options)[0] for row in rows]


def _each_row_is_alone(batch: torch.Tensor, alone: list[torch.Tensor]) -> bool:
    return all(
        row[-len(single) :].tolist() == single.tolist()
        for row, single in zip(batch, alone, strict=True)
    )


@contextlib.contextmanager
def _padding_on_the_right(name: str) -> Iterator[Any]:
    """The model, its tokenizer padding on the right (HookedTransformer's default side) for the
    block."""
    model = _gpt2_style("right") if name == "gpt2-style" else tiny_model(name)
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "right"
    try:
        yield model
    finally:
        model.tokenizer.padding_side = side


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("name", ["llama-like-gqa", "gpt2-style"])
def test_token_rows_padded_on_the_left_are_masked_whatever_side_the_tokenizer_pads(
    name: str, cached: bool, patched: safelens_tl.activation.Status
) -> None:
    """A tensor padded on the left, the tokenizer padding on the right: the rows' leading pad
    runs differ and their trailing ones do not, so the padding is on the left, and it is masked
    (BOS = pad kept where every row starts with it)."""
    _fixes_tensors_here()
    with _padding_on_the_right(name) as model:
        tokens = model.to_tokens(PROMPTS, padding_side="left")
        assert int(tokens[0, 0]) == model.tokenizer.pad_token_id  # the short row is padded
        batch, alone = _rows_against_alone(model, tokens, True, use_past_kv_cache=cached)
    assert _each_row_is_alone(batch, alone), (batch.tolist(), [a.tolist() for a in alone])


@pytest.mark.parametrize("name", ["llama-like-gqa", "gpt2-style"])
def test_stock_attends_to_the_left_padding_of_token_rows_when_the_tokenizer_pads_right(
    name: str,
) -> None:
    """The stock half: 2.13-3.0.0 gives the short row other tokens than its prompt alone."""
    _fixes_tensors_here()
    with _padding_on_the_right(name) as model:
        tokens = model.to_tokens(PROMPTS, padding_side="left")
        batch, alone = _rows_against_alone(model, tokens, True, use_past_kv_cache=True)
    assert not _each_row_is_alone(batch, alone)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_gpt2_style_rows_without_bos_have_every_leading_pad_masked(
    cached: bool, padding_side: str, patched: safelens_tl.activation.Status
) -> None:
    """BOS = EOS = pad, rows tokenized without BOS and padded on the left, ``prepend_bos`` left
    to the model's default (True): a row that starts with a word shows that no BOS was
    prepended, so the last leading pad is padding too, not a BOS to keep."""
    _fixes_tensors_here()
    model = _gpt2_style(padding_side)
    tokens = model.to_tokens(PROMPTS, padding_side="left", prepend_bos=False)
    assert int(tokens[1, 0]) != model.tokenizer.pad_token_id  # the long row starts with a word
    batch, alone = _rows_against_alone(model, tokens, False, use_past_kv_cache=cached)
    assert _each_row_is_alone(batch, alone), (batch.tolist(), [a.tolist() for a in alone])


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_stock_attends_to_a_pad_of_gpt2_style_rows_without_bos(padding_side: str) -> None:
    """The stock half: the short row's prompt alone generates other tokens."""
    _fixes_tensors_here()
    model = _gpt2_style(padding_side)
    tokens = model.to_tokens(PROMPTS, padding_side="left", prepend_bos=False)
    batch, alone = _rows_against_alone(model, tokens, False, use_past_kv_cache=True)
    assert not _each_row_is_alone(batch, alone)


def test_where_the_tensor_cannot_tell_the_tokenizer_s_side_decides(
    patched: safelens_tl.activation.Status,
) -> None:
    """The short prompt ends with EOS = pad: its row's leading and trailing pad runs both
    differ from the other row's, so either side could hold the padding. The tokenizer pads on
    the right, and the rows run as stock runs them, bitwise."""
    model = _gpt2_style("right")
    eos = model.tokenizer.eos_token
    prompts = [f"{PROMPTS[0]} {eos}", PROMPTS[1]]
    tokens = model.to_tokens(prompts, padding_side="left")
    assert int(tokens[0, -1]) == int(tokens[0, 0]) == model.tokenizer.pad_token_id
    assert hooked_generate_mask.padded_side(tokens, model.tokenizer.pad_token_id) is None
    options = {"return_type": "tokens", "stop_at_eos": False, "use_past_kv_cache": True}
    ours = _generate(model, tokens, **options)
    safelens_tl.deactivate()
    try:
        stock = _generate(model, tokens, **options)
    finally:
        safelens_tl.activate()
    assert ours.tolist() == stock.tolist()


P = 0  # the pad token in the rows below


@pytest.mark.parametrize(
    ("rows", "side"),
    [
        ([[P, P, 5, 6], [3, 4, 5, 6]], "left"),
        ([[P, P, P, 6], [P, 4, 5, 6]], "left"),  # BOS = pad at position 0 of every row
        ([[5, 6, P, P], [3, 4, 5, 6]], "right"),
        ([[P, 6, P, P], [P, 4, 5, 6]], "right"),  # BOS = pad, padded on the right
        ([[P, P, 5, P], [3, 4, 5, P]], "left"),  # every prompt ends with EOS = pad
        ([[P, P, 5, P], [3, 4, 5, 6]], None),  # one prompt ends with EOS = pad
        ([[P, P, P, P], [3, 4, 5, 6]], None),  # a row of nothing but pads
        ([[3, 4, 5, 6], [7, 4, 5, 6]], None),  # nothing padded
        ([[P, 4, 5, 6], [P, 8, 5, 6]], None),  # every row padded alike (or BOS = pad)
    ],
)
def test_the_padded_side_is_read_from_the_rows_where_they_show_it(
    rows: list[list[int]], side: str | None
) -> None:
    assert hooked_generate_mask.padded_side(torch.tensor(rows), P) == side


def test_embeddings_of_a_padded_batch_are_each_prompt_s(
    patched: safelens_tl.activation.Status,
) -> None:
    """``return_type="embeds"`` (which one call per length could not give back as one batch):
    the embeddings of each row's generated tokens are those its prompt generates alone, with no
    warning."""
    model = tiny_model("gpt2-like")
    options = {"return_type": "embeds", "use_past_kv_cache": True, "stop_at_eos": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        embeds = _generate(model, PROMPTS, **options)
    assert embeds.shape[0] == len(PROMPTS)
    for row, prompt in zip(embeds, PROMPTS, strict=True):
        alone = _generate(model, prompt, **options)[0]
        torch.testing.assert_close(row[-NEW:], alone[-NEW:])


def test_output_logits_of_a_padded_batch_are_each_prompt_s(
    patched: safelens_tl.activation.Status,
) -> None:
    """``output_logits=True`` (TransformerLens 3.0 on): every step's
    logits of each row are what its prompt gives alone."""
    model = tiny_model("llama-like-gqa")
    if "generation_kwargs" not in inspect.signature(model.generate).parameters:
        pytest.skip(f"TransformerLens {RELEASE}'s generate has no generation_kwargs")

    def logits(prompt: Any) -> torch.Tensor:
        output = _generate(
            model,
            prompt,
            return_type="tokens",
            stop_at_eos=False,
            output_logits=True,
        )
        return torch.stack(list(output.logits), dim=1)  # [batch, new, vocab]

    batch = logits(PROMPTS)
    for row, prompt in zip(batch, PROMPTS, strict=True):
        torch.testing.assert_close(row, logits(prompt)[0], rtol=1e-4, atol=1e-4)


def test_prompts_of_one_length_and_one_prompt_generate_as_alone(
    patched: safelens_tl.activation.Status,
) -> None:
    """Nothing to mask: one batched call, whose rows match the prompts alone."""
    model = tiny_model("gpt2-like")
    same_length = ["the cat runs", "the dog runs"]
    assert len({int(model.to_tokens(p).shape[1]) for p in same_length}) == 1
    options = {"return_type": "tokens", "use_past_kv_cache": True, "stop_at_eos": False}
    batch = _generate(model, same_length, **options)
    assert batch.shape == (2, 4 + NEW)
    for row, prompt in zip(batch, same_length, strict=True):
        alone = _generate(model, prompt, **options)
        assert row.tolist() == alone[0].tolist()


def test_calls_outside_generate_keep_their_mask(patched: safelens_tl.activation.Status) -> None:
    """``forward`` from a residual without a mask, as ``generate`` calls it, is unmasked outside
    ``generate``: the wrapper adds nothing there, nor after a ``generate`` that failed."""
    model = tiny_model("llama-like-gqa")
    tokens = model.to_tokens(PROMPTS, padding_side="left")
    residual, _ = model.get_residual(model.embed(tokens), 0)
    unmasked = model(residual, start_at_layer=0)

    def fail(activation: torch.Tensor, hook: Any) -> None:
        raise RuntimeError("stop here")

    with (
        pytest.raises(RuntimeError, match="stop here"),
        model.hooks([("blocks.0.hook_attn_out", fail)]),
    ):
        _generate(model, PROMPTS, use_past_kv_cache=True)
    assert torch.equal(model(residual, start_at_layer=0), unmasked)
    masked = model(residual, start_at_layer=0, attention_mask=(tokens != 0).long())
    assert not torch.allclose(masked[0], unmasked[0])  # a mask there would have shown


def _builds_the_mask_from_zeros() -> bool:
    """Whether the installed ``generate`` builds its step mask from a tensor of zeros (what
    :data:`safelens_tl.targets.HOOKED_GENERATE_MASKS_NO_PADDING` says by release)."""
    model_class = LAYOUT.model_class()
    assert model_class is not None
    source = inspect.getsource(inspect.unwrap(model_class.__dict__["generate"]))
    return "torch.zeros((embeds.size(0), embeds.size(1)))" in source


def test_the_wrapper_is_installed_exactly_where_generate_masks_no_padding(
    patched: safelens_tl.activation.Status,
) -> None:
    """The release range in ``targets`` agrees with the installed code, and the wrapper is there
    exactly on those releases."""
    masks_nothing = targets.hooked_generate_masks_no_padding(RELEASE)
    assert masks_nothing == _builds_the_mask_from_zeros()
    model_class = LAYOUT.model_class()
    assert model_class is not None
    assert ("hooked_generate_mask" in fixes_patching(model_class, "generate")) == masks_nothing
    # get_residual and forward are wrapped on the model, only while its generate runs.
    for name in ("get_residual", "forward"):
        assert fixes_patching(model_class, name) == (), name
    # masking_generate looks for the prompts there before binding the arguments.
    assert list(inspect.signature(model_class.generate).parameters)[:2] == ["self", "input"]


@pytest.mark.parametrize(
    ("release", "masks_nothing"),
    [
        ("2.11.0", False),
        ("2.13.0", True),
        ("2.18.0", True),
        ("3.0.0", True),
        ("3.0.1rc1", True),
        ("3.1.0", False),
        ("3.9.0", False),
        ("4.3.0", False),
        ("3.0", False),
        ("main", False),
    ],
)
def test_the_releases_that_mask_no_padding(release: str, masks_nothing: bool) -> None:
    assert targets.hooked_generate_masks_no_padding(release) == masks_nothing
