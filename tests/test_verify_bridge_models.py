"""The verifier on TransformerBridge checkpoints beyond pure attention: hybrid, state-space and
vision-language.

A hybrid model's cache starts with linear-attention layers that hold no keys; a state-space
model's holds none at all, TransformerLens cannot generate it without a cache, and its own cached
path rounds its recurrent state at every step. A vision-language checkpoint keeps its language
model's sizes in a sub-config, and TransformerLens installs torchvision to boot it. Real tiny
checkpoints, real verifier.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import safelens_tl
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.verify import bridge, oracle, runner
from tests.conftest import HAS_HOOKED_TRANSFORMER, architecture_folder, requires_bridge

pytestmark = [requires_bridge, pytest.mark.media]

#: ``--model FOLDER`` boots through TransformerBridge where there is no HookedTransformer (4.x).
requires_folder_bridge = pytest.mark.skipif(
    HAS_HOOKED_TRANSFORMER, reason="--model FOLDER is converted to a HookedTransformer here"
)
HALF = (torch.float16, torch.bfloat16)


def _prompt_cache(architecture: str) -> object:
    folder = architecture_folder(architecture)
    reference = bridge.reference_from(folder, torch.float32)
    with torch.inference_mode():
        output = reference(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True)
    return getattr(output, "cache", None) or output.past_key_values


def test_the_first_layer_with_keys_is_inspected_in_a_hybrid_cache() -> None:
    """Qwen3-Next starts with a linear-attention layer (recurrent state, no keys)."""
    cache = _prompt_cache("Qwen3NextForCausalLM")
    keys = bridge.first_cache_layer(cache)
    assert keys is not None and keys.shape[2] == 4  # [batch, heads, positions, d_head]
    assert bridge.holds_recurrent_state(cache)


def test_an_attention_cache_holds_no_recurrent_state() -> None:
    cache = _prompt_cache("LlamaForCausalLM")
    assert bridge.first_cache_layer(cache) is not None
    assert not bridge.holds_recurrent_state(cache)


@requires_folder_bridge
def test_a_hybrid_checkpoint_folder_verifies(patched: safelens_tl.activation.Status) -> None:
    """It failed with "the cache is still empty": layer 0 holds no keys. In float32: the gated
    delta rule takes about a minute per half-precision dtype on a CPU, and the layout of the
    cache, not its dtype, was the bug."""
    folder = str(architecture_folder("Qwen3NextForCausalLM"))
    report = runner.verify_pretrained(folder, [torch.float32])
    assert report.passed, [check.error for check in report.checks]
    for check in report.checks:
        assert check.cache_dtype == check.dtype
        assert check.cache_heads == check.expected_cache_heads == 2
        assert check.order_rel_err is not None and check.cached_positions >= 64


@requires_folder_bridge
def test_a_state_space_checkpoint_folder_verifies_patched_and_fails_stock() -> None:
    """Mamba: no KV cache to inspect and no uncached generate to time, both reported as absent;
    its cached path rounds the recurrent state to the dtype at every step, which the uncached
    forward never does, so the bound takes twice the dtype's rounding against float32 as well
    (in bfloat16 above the floor). Stock gets a batch of prompts wrong (see
    ``test_bridge_state_mask.py``)."""
    folder = str(architecture_folder("MambaForCausalLM"))
    safelens_tl.activate()
    report = runner.verify_pretrained(folder, HALF)
    assert report.passed, [check.error for check in report.checks]
    for check in report.checks:
        assert check.cache_dtype is None and check.cache_heads is None
        assert check.ms_per_token_uncached is None and check.speedup is None
        dtype = getattr(torch, check.dtype)
        bound = oracle.allowance(dtype, check.order_rel_err, check.rounding_rel_err, True)
        assert check.rounding_rel_err is not None and check.tolerance == bound.value
        # Rounding the state to the dtype at every step moves it past the floor.
        assert check.tolerance > bound.floor, check
    safelens_tl.deactivate()
    stock = runner.verify_pretrained(folder, HALF)
    assert not stock.passed
    assert all("differ" in (check.error or "") for check in stock.checks)


def test_a_state_without_attention_is_not_read_as_keys() -> None:
    """RWKV's cache is its ``state``: five tensors over every layer, not (keys, values) per layer.
    Read as a legacy tuple cache, a row of its first tensor passed for keys."""
    folder = architecture_folder("RwkvForCausalLM")
    reference = bridge.reference_from(folder, torch.float32)
    with torch.inference_mode():
        state = reference(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True).state
    assert bridge.first_cache_layer(state) is None
    assert bridge.holds_recurrent_state(state)
    assert bridge.expected_heads(reference.config) is None


@requires_folder_bridge
def test_a_checkpoint_without_attention_heads_verifies(
    patched: safelens_tl.activation.Status,
) -> None:
    """``safelens-tl verify --model FOLDER`` on RWKV raised ``AttributeError: 'RwkvConfig' object
    has no attribute 'num_attention_heads'`` before checking anything, then failed on the padded
    batch, which TransformerBridge refuses for a model that takes no attention mask: it is now
    checked on the prompt it can generate."""
    folder = str(architecture_folder("RwkvForCausalLM"))
    report = runner.verify_pretrained(folder, (torch.float32,))
    assert report.passed, [check.error for check in report.checks]
    (check,) = report.checks
    assert check.cache_heads is None and check.expected_cache_heads is None
    model = bridge.boot_folder(folder, torch.float32)
    assert not bridge.generates_padded_batches(model)
    assert [
        run.batch for run in bridge.run_batches(model, bridge.reference_from(folder, torch.float32))
    ] == [1]


class _Run:
    def __init__(self, rel_err: float | None, error: str | None = None, batch: int = 2) -> None:
        self.hf_generate_rel_err, self.hf_generate_error, self.batch = rel_err, error, batch


def test_hf_generate_is_held_to_the_bound_of_generate() -> None:
    """A NaN error, an error above the bound and an ``hf_generate`` that raised each make the
    check fail, naming the batch; none where it is missing (``None``) or within the bound."""
    problems = runner._hf_generate_problems(
        [
            _Run(1e-3),
            _Run(None),
            _Run(float("nan"), batch=1),
            _Run(5e-2),
            _Run(None, "TypeError: no"),
        ],
        2e-3,
    )
    assert len(problems) == 3, problems
    assert "nan (relative, batch of 1)" in problems[0]
    assert "5.00e-02" in problems[1] and "above 2.0e-03" in problems[1]
    assert problems[2] == "hf_generate (batch of 2) raised TypeError: no"


def test_attention_models_keep_the_tolerance_of_their_dtype() -> None:
    """The built-in models' rounding in bfloat16 against float32 is several times a cache 1% off;
    it must not loosen the bound for attention-only models, or such a cache would pass
    (``test_verify_tolerances.py``): their bound stays the dtype's floor."""
    safelens_tl.activate()
    report = runner.verify_builtin([torch.bfloat16], ["cpu"])
    bridge_checks = [check for check in report.checks if check.kind == "bridge"]
    assert bridge_checks and report.passed
    for check in bridge_checks:
        assert check.rounding_rel_err is not None and check.rounding_rel_err > 2e-2
        assert check.tolerance == runner.tolerance_for(torch.bfloat16)


#: Published as vision-language checkpoints, used for text: Gemma 3 from 4B up (Hugging Face's
#: causal-LM class loads it), Llava (only the image-text-to-text class does), and Gemma 4 E2B/E4B
#: and Gemma 3n, whose last layers share the keys and values of earlier ones (the sweep's
#: checkpoints do, two of four layers). Gemma 3n's vision tower needs timm. Then the audio-text
#: decoders (only the sequence-to-sequence class loads them, as TransformerLens does).
MULTIMODAL = (
    "Gemma3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Gemma3nForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration",
    "AudioFlamingo3ForConditionalGeneration",
    "GlmAsrForConditionalGeneration",
    # Its composite is also in the causal-LM mapping, as its bare language model: a reference
    # loaded with AutoModelForCausalLM had none of the checkpoint's weights.
    "Emu3ForConditionalGeneration",
)
NEEDS = {"Gemma3nForConditionalGeneration": "timm"}
KV_SHARED_LAYERS = {"Gemma4ForConditionalGeneration": 2, "Gemma3nForConditionalGeneration": 2}


@pytest.mark.parametrize("architecture", MULTIMODAL)
def test_a_multimodal_checkpoint_generates_right_and_reports_its_heads(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """The verifier's bridge run read the heads from the top-level config (Gemma 3:
    ``AttributeError: ... no attribute 'num_attention_heads'``) and loaded the reference with
    ``AutoModelForCausalLM`` (Llava, Qwen2-Audio: "Unrecognized configuration class"). Text
    only: the language model's two key/value heads are what the cache must hold."""
    if architecture in NEEDS:
        pytest.importorskip(NEEDS[architecture])
    folder = architecture_folder(architecture)
    with open(folder / "config.json", encoding="utf-8") as handle:
        text_config = json.load(handle)["text_config"]
    assert text_config.get("num_kv_shared_layers", 0) == KV_SHARED_LAYERS.get(architecture, 0)
    safelens_tl.deactivate()
    try:
        bridge.boot_folder(folder, torch.float32)
    except Exception as error:  # TransformerLens 3.0 boots neither (its own vision-tower errors)
        pytest.skip(f"stock TransformerBridge cannot boot {architecture} here: {error!r}")
    finally:
        safelens_tl.activate()
    runs = bridge.run_folder(folder, torch.float32)
    for run in runs:
        assert run.architecture == architecture
        assert run.cache_heads == run.expected_cache_heads == 2
        assert run.max_rel_err <= runner.tolerance_for(torch.float32), run
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[torch.float32], run
        assert torch.equal(run.cached_tokens, run.uncached_tokens)


@requires_folder_bridge
@pytest.mark.parametrize(
    "architecture",
    [
        "LlavaForConditionalGeneration",
        "Qwen2AudioForConditionalGeneration",
        "Emu3ForConditionalGeneration",
    ],
)
def test_a_multimodal_checkpoint_folder_verifies(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """``safelens-tl verify --model FOLDER`` on Llava and Qwen2-Audio, which failed before
    reaching a check, and on Emu3, which failed in it (``TypeError: 'NoneType' object is not
    subscriptable``: its reference, loaded as the bare language model, had no architecture)."""
    folder = str(architecture_folder(architecture))
    report = runner.verify_pretrained(folder, (torch.float32,))
    assert report.passed, [check.error for check in report.checks]
    assert [check.cache_heads for check in report.checks] == [2]


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="4.x boots every folder as a bridge")
@pytest.mark.parametrize(
    "architecture", ["Qwen2AudioForConditionalGeneration", "LlavaForConditionalGeneration"]
)
def test_where_both_apis_exist_a_folder_hooked_transformer_refuses_boots_as_a_bridge(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """TransformerLens 3.x: ``verify --model FOLDER`` refused these ("not a causal language
    model, so there is no generation to check"), although its TransformerBridge generates them
    (and, with transformers 5.24, wrongly in stock)."""
    folder = str(architecture_folder(architecture))
    safelens_tl.deactivate()
    try:
        bridge.boot_folder(folder, torch.float32)
    except Exception as error:  # TransformerLens 3.0's Llava bridge fails in its vision tower
        pytest.skip(f"this TransformerBridge cannot boot {architecture}: {error!r}")
    finally:
        safelens_tl.activate()
    report = runner.verify_pretrained(folder, (torch.float32,))
    (check,) = report.checks
    assert check.kind == "bridge" and check.architecture == architecture, check
    assert check.passed, check.error


@requires_folder_bridge
@pytest.mark.parametrize(
    ("architecture", "heads"),
    [
        ("T5ForConditionalGeneration", 4),
        ("BartForConditionalGeneration", 4),
        # Vision-language encoder-decoders, on text: a DaViT tower before BART, and Gemma 3
        # stacks whose decoder merges self- and cross-attention.
        ("Florence2ForConditionalGeneration", 4),
        ("T5Gemma2ForConditionalGeneration", 2),
    ],
)
def test_an_encoder_decoder_checkpoint_folder_verifies_through_hf_generate(
    architecture: str, heads: int, patched: safelens_tl.activation.Status
) -> None:
    """``safelens-tl verify --model FOLDER`` on T5 and BART failed every check ("Unrecognized
    configuration class ... AutoModelForCausalLM"). Only ``hf_generate`` caches their decoder,
    so that is what is checked: against the bridge's uncached forward in every dtype, against
    Hugging Face's own in float32 only (``bridge.run_seq2seq_batch``: in half precision it is
    reported).
    Florence-2 is in no sequence-to-sequence mapping: its reference is the class it names."""
    folder = str(architecture_folder(architecture))
    report = runner.verify_pretrained(folder, (torch.float32, torch.bfloat16))
    assert report.passed, [check.error for check in report.checks]
    full, half = report.checks
    assert (full.kind, full.architecture) == ("bridge", architecture)
    assert full.reference_tolerance is not None and half.reference_tolerance is None
    assert half.reference_rel_err is not None
    for check in report.checks:
        assert check.cache_heads == check.expected_cache_heads == heads
        assert check.greedy_agreement == 1.0


@requires_folder_bridge
def test_stock_fails_the_encoder_decoder_check_where_t5_loses_its_cache() -> None:
    """The check can fail: stock TransformerLens 4.3's T5 block drops the cache transformers
    5.24 passes as ``cache``, so every cached decoding step attends to itself alone."""
    if bridge_cache.attention_cache_argument() != bridge_cache.NEW_NAME:
        pytest.skip("this transformers passes the cache as past_key_values: stock is right")
    folder = str(architecture_folder("T5ForConditionalGeneration"))
    report = runner.verify_pretrained(folder, (torch.float32,))
    (check,) = report.checks
    assert not check.passed and check.max_rel_err is not None and check.max_rel_err > 0.1


@requires_folder_bridge
@pytest.mark.parametrize(
    ("architecture", "heads"), [("FalconForCausalLM", 1), ("DeepseekV4ForCausalLM", 1)]
)
def test_a_checkpoint_is_held_to_the_heads_hugging_face_itself_caches(
    architecture: str, heads: int, patched: safelens_tl.activation.Status
) -> None:
    """Multi-query Falcon (Falcon-7B; Falcon's default config) and DeepSeek-V4 cache one key/value
    head whatever their configs' head counts say (4 and 2 here), and the verifier failed their
    correct caches ("the cache has 1 heads, 4 expected"). Expected heads now come from the cache
    Hugging Face's own model fills. (TransformerLens 3.0's Falcon generates wrong anyway; the
    heads are checked all the same.)"""
    folder = str(architecture_folder(architecture))
    report = runner.verify_pretrained(folder, (torch.float32,))
    (check,) = report.checks
    assert (check.cache_heads, check.expected_cache_heads) == (heads, heads), check
    assert "heads" not in (check.error or ""), check.error


def test_the_heads_of_a_composite_config_are_its_language_model_s() -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3")
    text = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    assert bridge.expected_heads(transformers.Gemma3Config(text_config=text)) == 2
    assert bridge.expected_heads(transformers.LlamaConfig(num_attention_heads=4)) == 4


def test_booting_a_vision_language_checkpoint_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TransformerLens 3.x/4.x run ``pip install torchvision`` (or ``uv pip install``) when they
    boot a vision-language checkpoint; here pip then replaced the CPU torch 2.13 with a CUDA 2.14
    of several GB. The install TransformerLens starts is recorded here instead of run (running it
    unguarded is what this test must never do); it has to see installs refused."""
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: TransformerLens installs nothing")
    attempts: list[tuple[list[str], dict[str, str | None]]] = []
    watched = ("PIP_NO_INDEX", "PIP_FIND_LINKS", "UV_OFFLINE")

    def record(command: list[str], *args: object, **kwargs: object) -> int:
        attempts.append((list(command), {name: os.environ.get(name) for name in watched}))
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(subprocess, "check_call", record)
    before = {name: os.environ.get(name) for name in watched}
    folder = architecture_folder("LlavaForConditionalGeneration")
    failed: Exception | None = None
    try:
        bridge.boot_folder(folder, torch.float32)
    except Exception as error:  # TransformerLens 3.0 then fails on Llava's vision tower
        failed = error
    assert {name: os.environ.get(name) for name in watched} == before  # restored
    if failed is not None and not attempts:
        pytest.skip(f"TransformerLens failed to boot Llava before installing: {failed!r}")
    assert attempts, "TransformerLens no longer installs torchvision: revisit the guard"
    for command, environment in attempts:
        assert "torchvision" in command
        assert environment["PIP_NO_INDEX"] == "1" and environment["UV_OFFLINE"] == "1"
        assert environment["PIP_FIND_LINKS"] != before["PIP_FIND_LINKS"]


def test_pip_refuses_to_install_while_installs_are_refused() -> None:
    """The guard above, against the real pip (``--dry-run``: nothing is installed either way)."""
    with bridge.package_installs_refused():
        done = subprocess.run(
            # --ignore-installed: where torchvision is installed, pip must still look for it.
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--ignore-installed",
                "torchvision",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    # pip words it by what else it knows ("no matching distribution", or a conflict with a
    # constraints file); either way it fails on torchvision, not on something unrelated.
    assert done.returncode != 0, done.stdout
    assert "torchvision" in done.stderr, done.stderr
