"""Patched against stock ``HookedTransformer.generate`` on a seeded sample of generated calls
(:mod:`tests.differential`): every difference is one a fix claims, and otherwise patched is
stock, bitwise, with the same view to hooks.

The grid: three kinds of tokenizer (a pad token of its own, a pad token of id 0, and BOS = EOS =
pad as GPT-2's), learned or rotary positions, the model's padding side, prompts of equal or
different lengths, a list, one string or a tensor (padded on the model's side with BOS, on the
left with BOS, or on the left without), cached or not, greedy or seeded sampling, float32 or
bfloat16. Tiny models from configs, the tokenizers built offline.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from safelens_tl.verify import models
from tests import differential
from tests.conftest import requires_hooked_transformer

pytestmark = requires_hooked_transformer

TOKENIZER_KINDS = ("pad-apart", "pad-zero", "bos-eos-pad")

AXES: dict[str, tuple[Any, ...]] = {
    "tokenizer": TOKENIZER_KINDS,
    "positions": ("standard", "rotary"),
    "padding_side": ("left", "right"),
    "lengths": ("equal", "different"),
    "input": ("list", "str", *differential.TENSOR_INPUTS),
    "cached": ("cached", "uncached"),
    "sampling": ("greedy", "sampled"),
    "dtype": (torch.float32, torch.bfloat16),
}
POINTS = differential.sample_grid(AXES)
HOOKS = ("blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern")
#: Largest difference from the forward of each prompt alone, relative to its largest logit, that
#: is rounding: a batch's other shapes and its padding's masked scores against one prompt's.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

_tokenizers: dict[str, Any] = {}
_models: dict[tuple[Any, ...], Any] = {}


def tokenizer(kind: str) -> Any:
    """The tiny word-level tokenizer with special tokens laid out as ``kind`` says, saved and
    loaded from a folder as TransformerLens needs."""
    if kind not in _tokenizers:
        from tokenizers import Tokenizer, pre_tokenizers
        from tokenizers import models as tokenizer_models
        from transformers import PreTrainedTokenizerFast

        specials: dict[str, Any]
        if kind == "pad-zero":
            words = ["<pad>", "<bos>", "<eos>", "<unk>"]
            specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
        elif kind == "pad-apart":
            words = ["<unk>", "<pad>", "<bos>", "<eos>"]
            specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
        else:  # GPT-2's layout: one token is BOS, EOS and pad, and its id is not 0
            words = ["<unk>", "<|endoftext|>"]
            specials = dict.fromkeys(("pad_token", "bos_token", "eos_token"), "<|endoftext|>")
        vocab = {token: index for index, token in enumerate([*words, *models.WORDS])}
        core = Tokenizer(tokenizer_models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
        wrapped = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", **specials)
        folder = models.scratch_folder(f"tokenizer-{kind}")
        wrapped.save_pretrained(folder)
        _tokenizers[kind] = folder
    from transformers import AutoTokenizer

    # A tokenizer object per model: TransformerLens sets the model's padding side on it.
    return AutoTokenizer.from_pretrained(str(_tokenizers[kind]))


def model_for(point: dict[str, Any]) -> Any:
    """A tiny HookedTransformer for the point's tokenizer, positions, padding side and dtype,
    built once per test run."""
    key = (point["tokenizer"], point["positions"], point["padding_side"], point["dtype"])
    if key not in _models:
        from transformer_lens import HookedTransformer

        rotary = point["positions"] == "rotary"
        torch.manual_seed(0)
        cfg = models.hooked_config_class()(
            n_layers=2,
            d_model=64,
            n_heads=4,
            d_head=16,
            d_mlp=128,
            n_ctx=64,
            act_fn="gelu_new",
            normalization_type="LN",
            positional_embedding_type=point["positions"],
            **({"rotary_dim": 16} if rotary else {}),
            d_vocab=len(tokenizer(point["tokenizer"])),
            default_prepend_bos=True,
            tokenizer_prepends_bos=True,
        )
        model = HookedTransformer(
            cfg,
            tokenizer=tokenizer(point["tokenizer"]),
            default_padding_side=point["padding_side"],
        )
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
        _models[key] = model.to(point["dtype"])
    return _models[key]


def outcome(point: dict[str, Any], active: bool) -> differential.Outcome:
    """The point's ``generate`` call, stock or patched."""
    return differential.generate_outcome(model_for(point), point, active, HOOKS)


def verdict(point: dict[str, Any]) -> differential.Verdict:
    """The rule applied to one grid point."""
    model = model_for(point)
    prompts = differential.prompt_rows(model, point)
    if point["input"] == "tensor" and point["padding_side"] == "right":
        # Rows padded on the right go on after their padding in every release (no mask can
        # say otherwise): each row's own forward is the padded row as given.
        prompts = list(differential.given_of(model, point).split(1))
    return differential.judge(
        outcome(point, active=False),
        outcome(point, active=True),
        lambda found: differential.teacher_forced_error(
            found, prompts, differential.uncached_forward(model)
        ),
        TOLERANCE[point["dtype"]],
    )


@pytest.mark.parametrize("point", POINTS, ids=[differential.point_id(p) for p in POINTS])
def test_patched_is_stock_unless_stock_is_wrong(point: dict[str, Any]) -> None:
    found = verdict(point)
    assert found.kind != "regression", found.detail


def test_the_sample_covers_every_axis_value() -> None:
    """The seeded sample is no narrower than the grid: each value of each axis is in it."""
    for axis, values in AXES.items():
        sampled = {point[axis] for point in POINTS}
        assert sampled == set(values), (axis, sampled)


def test_a_gpt2_style_batch_of_equal_lengths_is_stock_bitwise() -> None:
    """The case the rule was written for: BOS = EOS = pad, prompts of one length, a list of
    texts. Stock is right (each row is what its prompt gives alone), and patched is stock."""
    point = {
        "tokenizer": "bos-eos-pad",
        "positions": "standard",
        "padding_side": "right",
        "lengths": "equal",
        "input": "list",
        "cached": "cached",
        "sampling": "greedy",
        "dtype": torch.float32,
    }
    model = model_for(point)
    prompts = [model.to_tokens(prompt) for prompt in differential.prompts_of(point)]
    stock = outcome(point, active=False)
    error = differential.teacher_forced_error(stock, prompts, differential.uncached_forward(model))
    assert error < TOLERANCE[torch.float32]
    patched = outcome(point, active=True)
    assert patched.same_as(stock), (stock.describe(), patched.describe())
