"""``HookedTransformer.generate`` returns with safelens-tl exactly what it returns in stock, for
every way users call it: sampling under a seed (temperature, top-k, top-p, frequency penalty),
stopping rows at EOS, strings and lists of strings, embeddings as input, and a generation long
long enough to move the cache from ``torch.cat`` to buffers.

Stock and patched run the same call on the same model, one after the other, with the same seed.
Where stock masks no padding (TransformerLens 2.13 to 3.0.0), a list of strings of different
lengths is held to stock's answer for each string alone, a batch of token rows is of one length,
and the GPT-2-like model (learned positions, pad token id 0) is held to stock's answer with
another pad id: what safelens-tl returns on purpose (``conftest.stock_with_positions``).
Float32 on every release; float16 where stock generates in it (TransformerLens 3.0.0's stock
cache fails in half precision: ``test_generate.py``). Both storage modes (``torch.cat`` and
buffers) run every case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.kv import storage as kv_storage
from safelens_tl.verify import checks
from tests.conftest import RELEASE, requires_hooked_transformer, stock_with_positions

pytestmark = [requires_hooked_transformer, pytest.mark.both_cache_modes]

MODELS = ["gpt2-like", "llama-like-gqa"]
DTYPES = [torch.float32] if RELEASE == "3.0.0" else [torch.float32, torch.float16]
NEW_TOKENS = 12
#: Within the tiny models' 128 positions of context.
LONG_NEW_TOKENS = 100
#: Where the long case's small cache moves to a buffer (then grows twice in it).
LONG_SMALL_POSITIONS = 32
_models: dict[tuple[str, torch.dtype], Any] = {}


def model_for(name: str, dtype: torch.dtype) -> Any:
    """Build each tiny model once per pytest session."""
    if (name, dtype) not in _models:
        from safelens_tl.verify.models import build_model

        _models[name, dtype] = build_model(name, dtype)
    return _models[name, dtype]


#: Two prompts of different lengths, padded (on the left: the tiny models' tokenizer pads there).
#: Where stock masks no padding (TransformerLens 2.13 to 3.0.0) its padded rows are wrong and
#: safelens-tl's are not (tests/test_hooked_generate_mask.py), so there the batch is of one length.
BATCH = (
    ["the cat runs", "the dog runs"]
    if targets.hooked_generate_masks_no_padding(RELEASE)
    else ["the cat runs", "a big old dog sleeps in the quiet house"]
)


def _batch(model: Any) -> torch.Tensor:
    return model.to_tokens(BATCH)


def _one(model: Any) -> torch.Tensor:
    return model.to_tokens("the cat runs")


def _embeddings(model: Any) -> torch.Tensor:
    tokens = _one(model)
    embedded = model.embed(tokens)
    if model.cfg.positional_embedding_type == "standard":
        embedded = embedded + model.pos_embed(tokens)
    return embedded


#: Each case: the arguments of one ``generate`` call, from the model.
CASES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "greedy batch": lambda m: {"input": _batch(m), "do_sample": False},
    "temperature and top-k": lambda m: {
        "input": _batch(m),
        "do_sample": True,
        "temperature": 0.9,
        "top_k": 20,
    },
    "top-p": lambda m: {"input": _one(m), "do_sample": True, "top_p": 0.8},
    "frequency penalty": lambda m: {"input": _one(m), "do_sample": True, "freq_penalty": 1.0},
    "a string": lambda m: {"input": "the cat runs and", "do_sample": False},
    "a list of strings": lambda m: {
        "input": ["the cat", "a dog sleeps in the"],
        "do_sample": False,
    },
    "embeddings": lambda m: {"input": _embeddings(m), "do_sample": False},
    "long": lambda m: {
        "input": _one(m),
        "do_sample": False,
        "max_new_tokens": LONG_NEW_TOKENS,
    },
}


def _generate(model: Any, arguments: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    call = {"max_new_tokens": NEW_TOKENS, "stop_at_eos": False, "verbose": False, **arguments}
    return model.generate(**call)


def _assert_same(stock: Any, patched: Any) -> None:
    assert type(patched) is type(stock)
    if isinstance(stock, torch.Tensor):
        assert patched.shape == stock.shape and patched.dtype == stock.dtype
        assert torch.equal(patched, stock)
    else:
        assert patched == stock


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_every_generate_option_returns_what_stock_returns(
    name: str, dtype: torch.dtype, case: str, cache_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_for(name, dtype)
    arguments = CASES[case](model)
    with stock_with_positions(model):
        stock = _generate(model, arguments)
        if case == "a list of strings" and targets.hooked_generate_masks_no_padding(RELEASE):
            # Stock attends to the padding here (tests/test_hooked_generate_mask.py);
            # safelens-tl returns on purpose what stock gives each prompt alone.
            stock = [_generate(model, {**arguments, "input": text}) for text in arguments["input"]]
    safelens_tl.activate()
    if case != "long":
        _assert_same(stock, _generate(model, arguments))
        return
    # The default limit would keep these tiny models' caches in torch.cat throughout.
    small_positions = LONG_SMALL_POSITIONS if cache_mode == "small" else 0
    limit = small_positions * checks.position_bytes(model.cfg, batch=1)
    buffers: list[kv_storage.KVStorage] = []
    allocate = kv_storage.allocate

    def spy(*args: Any, **kwargs: Any) -> kv_storage.KVStorage:
        buffers.append(allocate(*args, **kwargs))
        return buffers[-1]

    with kv_storage.small_cache_limit(limit), monkeypatch.context() as patch:
        patch.setattr(kv_storage, "allocate", spy)
        patched = _generate(model, arguments)
    _assert_same(stock, patched)
    assert buffers, "the long case never left torch.cat"
    assert max(storage.length for storage in buffers) > small_positions


@pytest.mark.parametrize("name", MODELS)
def test_rows_stop_at_eos_where_stock_stops_them(name: str) -> None:
    """The EOS token is the one stock's greedy decoding of the first row picks third, so that
    row stops early and the other goes on: the batch ends before ``max_new_tokens``."""
    model = model_for(name, torch.float32)
    tokens = _batch(model)
    with stock_with_positions(model):
        free = _generate(model, {"input": tokens, "do_sample": False})
        eos = int(free[0, tokens.shape[1] + 2])
        arguments = {"input": tokens, "do_sample": False, "stop_at_eos": True, "eos_token_id": eos}
        stock = _generate(model, arguments)
    assert stock.shape[1] <= free.shape[1]
    safelens_tl.activate()
    patched = _generate(model, arguments)
    _assert_same(stock, patched)
