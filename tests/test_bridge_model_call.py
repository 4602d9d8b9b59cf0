"""What users do around cached ``TransformerBridge.generate``, with safelens-tl active.

Generating again on the same bridge, streaming, generating under hooks and stopping a row at EOS
must each give what the bridge's own uncached forward gives over the generated tokens
(teacher-forced, same hooks). Llama stands for the KV cache, Mamba for a recurrent state; greedy,
float32, the tiny checkpoints of ``benchmarks/bridge_architectures.py``. With transformers 5.24
stock fails all of these (its cache is ignored); the tests are about safelens-tl's patches not
breaking these paths.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl.verify import bridge, checks
from tests.conftest import architecture_folder, benchmark_module, requires_bridge

pytestmark = requires_bridge

NEW_TOKENS = 8
PROMPTS = list(checks.PROMPTS)
Hook = tuple[str, Callable[..., torch.Tensor]]


@pytest.fixture(params=["LlamaForCausalLM", "MambaForCausalLM"])
def model(request: pytest.FixtureRequest, patched: safelens_tl.activation.Status) -> Any:
    """A patched TransformerBridge of the tiny checkpoint, booted with the tiny tokenizer."""
    booted = benchmark_module("bridge_architectures").boot(str(architecture_folder(request.param)))
    try:
        booted.generate(PROMPTS[:1], **_greedy(max_new_tokens=1))
    except ImportError as missing:
        # TransformerLens 3.0's Mamba adapter imports MambaCache, which transformers 5.24 removed:
        # it cannot generate, stock or patched (asserted in test_bridge_state_mask.py).
        if "MambaCache" not in str(missing):
            raise
        pytest.skip(f"this TransformerBridge cannot generate {request.param}: {missing}")
    return booted


def _greedy(**changes: Any) -> dict[str, Any]:
    arguments = checks.greedy_arguments(NEW_TOKENS)
    arguments.update(changes)
    return arguments


def _uncached_logits(model: Any, sequences: torch.Tensor, hooks: Sequence[Hook] = ()) -> Any:
    """Logits of one uncached forward over left-padded ``sequences``, under ``hooks``."""
    mask, positions = bridge.mask_and_positions(model, sequences)
    with torch.inference_mode():
        return model.run_with_hooks(
            sequences,
            attention_mask=mask,
            position_ids=positions,
            return_type="logits",
            fwd_hooks=list(hooks),
        )


def _uncached_choices(model: Any, sequences: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The token the uncached forward picks at each of the last ``new_tokens`` steps."""
    logits: torch.Tensor = _uncached_logits(model, sequences)
    return logits[:, -new_tokens - 1 : -1].argmax(dim=-1)


def test_generating_again_gives_the_same_tokens(model: Any) -> None:
    """Nothing of one generation (a cache, a state, a plan) reaches the next."""
    first = model.generate(PROMPTS, **_greedy())
    model.generate(["the red bird sings while", "dog"], **_greedy())
    again = model.generate(PROMPTS, **_greedy())
    assert torch.equal(first, again)
    assert torch.equal(first[:, -NEW_TOKENS:], _uncached_choices(model, first, NEW_TOKENS))


def test_a_stream_yields_what_generate_returns(model: Any) -> None:
    if not hasattr(model, "generate_stream"):
        pytest.skip("this TransformerBridge has no generate_stream")
    whole = model.generate(PROMPTS, **_greedy())
    # The first piece holds the prompt and the first token, each later one the tokens since.
    pieces = list(model.generate_stream(PROMPTS, max_tokens_per_yield=3, **_greedy()))
    assert len(pieces) > 1
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_hooks_act_on_cached_steps_as_on_the_uncached_forward(model: Any) -> None:
    """A hook that edits the residual stream of layer 0 feeds its edit into the cache (keys and
    values, or the state) of layer 1: the cached logits must be the hooked uncached ones."""
    shift = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0)) * 2

    def add_shift(activation: torch.Tensor, hook: Any) -> torch.Tensor:
        return activation + shift.to(activation.dtype)

    hooks: list[Hook] = [("blocks.0.hook_resid_post", add_shift)]
    with model.hooks(fwd_hooks=hooks):
        output = model.generate(PROMPTS, output_logits=True, **_greedy())
    cached = torch.stack(list(output.logits), dim=1)
    hooked = _uncached_logits(model, output.sequences, hooks)[:, -NEW_TOKENS - 1 : -1]
    plain = _uncached_logits(model, output.sequences)[:, -NEW_TOKENS - 1 : -1]
    scale = hooked.abs().max()
    assert (plain - hooked).abs().max() / scale > 0.01  # the hook changes what is computed
    assert (cached - hooked).abs().max() / scale <= checks.TOLERANCES[torch.float32]


def test_compatibility_mode_generates_what_its_uncached_forward_picks(model: Any) -> None:
    """``enable_compatibility_mode()`` folds the layer norms into the weights and centres them,
    as ``HookedTransformer`` loads models, and renames the hooks: the cached steps must then give
    the processed model's uncached logits, and the tokens the bridge gave before (folding and
    centring move each position's logits by one constant, which greedy decoding ignores). (Stock
    fails this with transformers 5.24: its cache is ignored.)"""
    before = model.generate(PROMPTS, **_greedy())
    unprocessed = _uncached_logits(model, before)[:, -NEW_TOKENS - 1 : -1]
    with contextlib.redirect_stdout(None):
        model.enable_compatibility_mode(disable_warnings=True)
    output = model.generate(PROMPTS, output_logits=True, **_greedy())
    cached = torch.stack(list(output.logits), dim=1)
    processed = _uncached_logits(model, output.sequences)[:, -NEW_TOKENS - 1 : -1]
    scale = processed.abs().max()
    assert (unprocessed - processed).abs().max() / scale > 0.01  # the weights were processed
    assert (cached - processed).abs().max() / scale <= checks.TOLERANCES[torch.float32]
    assert torch.equal(output.sequences, before)


def test_a_row_that_ends_early_stops_where_the_uncached_forward_does(model: Any) -> None:
    """The first row's third token is made the EOS: that row ends there while the other goes on,
    and every token up to each row's EOS is the uncached forward's choice."""
    plain = model.generate(PROMPTS, **_greedy())
    eos = int(plain[0, -NEW_TOKENS + 2])
    ended = model.generate(PROMPTS, **_greedy(stop_at_eos=True, eos_token_id=eos))
    generated = ended.shape[1] - (plain.shape[1] - NEW_TOKENS)
    choices = _uncached_choices(model, ended, generated)
    assert (ended[0, -generated:] == eos).any()
    for row in range(ended.shape[0]):
        for step in range(generated):
            token = int(ended[row, step - generated])
            assert token == int(choices[row, step]), (row, step, ended, choices)
            if token == eos:
                break


def _requires_generate_parameter(model: Any, name: str) -> None:
    if name not in inspect.signature(model.generate).parameters:
        pytest.skip(f"this TransformerBridge.generate has no {name}")


def test_a_padded_token_tensor_with_its_mask_generates_what_its_strings_generate(
    model: Any,
) -> None:
    """Prompts tokenized and left-padded by the user, passed as one tensor with their
    ``attention_mask`` (TransformerLens 4.3), generate the tokens the same prompts as strings
    generate, and the cached steps pick what the uncached forward picks. (Stock fails this with
    transformers 5.25: its cache is ignored.)"""
    _requires_generate_parameter(model, "attention_mask")
    model.tokenizer.padding_side = "left"
    encoded = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert not bool(encoded["attention_mask"].all()), "the prompts must need padding"
    from_strings = model.generate(PROMPTS, **_greedy())
    from_tensor = model.generate(
        encoded["input_ids"], attention_mask=encoded["attention_mask"], **_greedy()
    )
    assert torch.equal(from_tensor, from_strings)
    assert torch.equal(
        from_tensor[:, -NEW_TOKENS:], _uncached_choices(model, from_tensor, NEW_TOKENS)
    )


def test_a_stopping_criterion_stops_the_cached_generation_where_the_uncached_one_stops(
    attention_model: Any,
) -> None:
    """``stopping_criteria`` (TransformerLens 4.3: Hugging Face's, called with the tokens so far
    and the step's logits) sees the same tokens and logits cached as uncached: a criterion that
    ends a row at the token the uncached generation picks third stops the cached one there too.
    (``stop_strings`` cannot be checked here: Hugging Face's matcher does not take the tiny
    word-level tokenizer.)"""
    _requires_generate_parameter(attention_model, "stopping_criteria")
    arguments = _greedy(input=PROMPTS[:1], use_past_kv_cache=False)
    plain = attention_model.generate(**arguments)
    third = int(plain[0, -NEW_TOKENS + 2])
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}

    def stops(cached: bool) -> Callable[..., torch.Tensor]:
        def criterion(input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
            seen[cached].append(scores.detach().clone())
            return input_ids[:, -1] == third

        return criterion

    uncached = attention_model.generate(**arguments, stopping_criteria=[stops(False)])
    cached = attention_model.generate(
        **{**arguments, "use_past_kv_cache": True}, stopping_criteria=[stops(True)]
    )
    assert uncached.shape[1] == plain.shape[1] - NEW_TOKENS + 3, "the criterion must stop it"
    assert torch.equal(cached, uncached)
    assert len(seen[True]) == len(seen[False]) == 3
    for got, want in zip(seen[True], seen[False], strict=True):
        assert _relative_error(got, want) <= checks.TOLERANCES[torch.float32]


def test_hugging_face_generate_through_the_bridge_uses_the_cache_right(model: Any) -> None:
    """``hf_generate`` runs Hugging Face's own loop over the bridge's modules: its cached steps
    must pick what the uncached forward picks, and what its uncached loop picks. (Stock fails
    this with transformers 5.24: the modules ignore the cache Hugging Face hands them.)"""
    hugging_face = benchmark_module("bridge_hf_generate")
    new_tokens = hugging_face.NEW_TOKENS
    cached = hugging_face.generate(model, cached=True)
    assert cached.shape[0] == len(hugging_face.PROMPTS)
    assert torch.equal(cached[:, -new_tokens:], _uncached_choices(model, cached, new_tokens))
    assert torch.equal(cached, hugging_face.generate(model, cached=False))


@pytest.mark.parametrize("decoding", ["beam", "sample", "lookup"])
def test_hugging_face_decoding_strategies_through_the_bridge_use_the_cache_right(
    model: Any, decoding: str, request: pytest.FixtureRequest
) -> None:
    """Beam search (which reorders the cache between steps), seeded sampling and prompt-lookup
    decoding (several candidate tokens in one cached step, the cache cropped back where they are
    rejected) give the same tokens with the cache as without it (``bridge_hf_generate.decode``).
    Stock fails each with transformers 5.24 on Llama: its cache is ignored.

    transformers 5.25 runs prompt lookup on state-space models too, cropping their recurrent
    states, and its own Mamba then picks other tokens than without a cache (on the CPU). Where
    Hugging Face's own model, given the bridge's prompt tokens, is wrong that way, the bridge is
    held to exactly Hugging Face's own tokens instead."""
    if not callable(getattr(model, "hf_generate", None)):
        pytest.skip("this TransformerBridge has no hf_generate")
    if decoding == "lookup" and getattr(model.original_model, "_is_stateful", False):
        pytest.skip("Hugging Face refuses assisted generation for models with a state")
    hugging_face = benchmark_module("bridge_hf_generate")
    cached = hugging_face.decode(model, decoding, cached=True)
    uncached = hugging_face.decode(model, decoding, cached=False)
    if decoding == "lookup" and not torch.equal(cached, uncached):
        folder = str(architecture_folder(request.node.callspec.params["model"]))
        prompt = cached[:, : -hugging_face.NEW_TOKENS]
        own_cached = hugging_face.hugging_face_decode(folder, prompt, decoding, cached=True)
        own_uncached = hugging_face.hugging_face_decode(folder, prompt, decoding, cached=False)
        assert torch.equal(own_uncached, uncached), "the bridge's uncached tokens are not HF's"
        assert not torch.equal(own_cached, own_uncached), "HF's own is right: the bridge is not"
        assert torch.equal(cached, own_cached)
        return
    assert torch.equal(cached, uncached)


#: Ways of calling ``generate`` beyond greedy decoding, each compared cached against uncached.
#: TransformerLens returns the activations of one prompt only.
OPTIONS: dict[str, dict[str, Any]] = {
    "temperature and top-k": {"do_sample": True, "temperature": 0.9, "top_k": 20},
    "top-p": {"do_sample": True, "top_p": 0.8},
    "frequency penalty": {"do_sample": True, "freq_penalty": 1.0},
    "repetition penalty": {"repetition_penalty": 1.3},
    "strings returned": {"return_type": "str"},
    "logits returned": {"output_logits": True},
    "activations returned": {"return_cache": True, "input": PROMPTS[:1]},
    "prompt tokens returned": {"return_input_tokens": True},
}
_attention_models: list[Any] = []


@pytest.fixture
def attention_model(patched: safelens_tl.activation.Status) -> Any:
    """The patched TransformerBridge of the tiny Llama (a KV cache), booted once per module.

    Not Mamba: a state-space bridge's uncached ``generate`` hands over to Hugging Face's own
    loop, which samples and returns differently, so there is nothing like-for-like to compare.
    """
    if not _attention_models:
        folder = str(architecture_folder("LlamaForCausalLM"))
        _attention_models.append(benchmark_module("bridge_architectures").boot(folder))
    return _attention_models[0]


def _generate_seeded(model: Any, cached: bool, option: dict[str, Any]) -> Any:
    arguments = {"input": PROMPTS, **_greedy(use_past_kv_cache=cached), **option}
    torch.manual_seed(0)
    return model.generate(**arguments)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_generate_option_gives_what_the_uncached_generate_gives(
    attention_model: Any, option: str
) -> None:
    """Sampling under a seed, penalties, and what ``generate`` can return besides tokens (text,
    the logits of every step, the activations of the whole generation): with the cache, the same
    as ``use_past_kv_cache=False``, which runs the whole sequence again at every step. (Stock
    fails this with transformers 5.24: its cache is ignored.)"""
    parameters = inspect.signature(attention_model.generate).parameters
    missing = set(OPTIONS[option]) - set(parameters)
    if missing:
        pytest.skip(f"this TransformerBridge.generate has no {sorted(missing)}")
    uncached = _generate_seeded(attention_model, False, OPTIONS[option])
    cached = _generate_seeded(attention_model, True, OPTIONS[option])
    tolerance = checks.TOLERANCES[torch.float32]
    if option == "logits returned":
        assert torch.equal(cached.sequences, uncached.sequences)
        logits = torch.stack(list(cached.logits), dim=1)
        assert _relative_error(logits, torch.stack(list(uncached.logits), dim=1)) <= tolerance
    elif option == "activations returned":
        tokens, activations = cached
        expected_tokens, expected_activations = uncached
        assert torch.equal(tokens, expected_tokens)
        names = sorted(expected_activations.keys())
        assert sorted(activations.keys()) == names
        for name in names:
            got, want = activations[name], expected_activations[name]
            assert got.shape == want.shape, name
            assert _relative_error(got.float(), want.float()) <= tolerance, name
    elif option == "prompt tokens returned":
        assert all(map(torch.equal, cached, uncached)) and len(cached) == len(uncached) == 2
    elif option == "strings returned":
        assert isinstance(cached, list) and cached == uncached
    else:
        assert torch.equal(cached, uncached)
