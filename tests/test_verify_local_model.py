"""``safelens-tl verify --model FOLDER`` on TransformerLens 2.x/3.x: a local checkpoint becomes a
``HookedTransformer`` by TransformerLens's own loader (``safelens_tl.verify.local_model``).

Tiny checkpoints of ``benchmarks/hooked_architectures.py`` (random weights, saved by the
transformers installed), loaded and checked in float16 and bfloat16 as a user's folder is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from safelens_tl import targets
from safelens_tl.verify import checks, local_model, runner
from tests.conftest import benchmark_module, requires_hooked_transformer

pytestmark = requires_hooked_transformer

#: Architectures TransformerLens 2.18, 3.0 and 3.9 all load from a folder, besides Llama (which
#: ``tests/test_verify_cli.py`` checks under a folder name containing "llama").
ARCHITECTURES = (
    "GPT2LMHeadModel",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "BloomForCausalLM",
    "OPTForCausalLM",
)

_folders: dict[str, Path] = {}


def checkpoint(architecture: str) -> Path:
    """The tiny checkpoint of ``architecture``, saved once per pytest session."""
    if architecture not in _folders:
        _folders[architecture] = Path(benchmark_module("hooked_architectures").build(architecture))
    return _folders[architecture]


def config_folder(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    """A folder ``name`` holding only ``config.json``."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_checkpoint_of_another_architecture_is_verified(patched: Any, architecture: str) -> None:
    """Before, only Llama and GPT-2 folders could be verified here; the rest were refused."""
    folder = checkpoint(architecture)
    report = runner.verify_pretrained(
        str(folder), dtypes=(torch.float16, torch.bfloat16), devices=["cpu"]
    )
    assert report.passed, [check.error for check in report.checks]
    assert [check.dtype for check in report.checks] == ["float16", "bfloat16"]
    for check in report.checks:
        assert check.model == folder.name
        assert check.cache_dtype == check.dtype
        assert check.max_rel_err is not None and check.max_rel_err <= check.tolerance


def test_a_llama_checkpoint_with_rope_scaling_is_verified(patched: Any) -> None:
    """Llama 3.1-style rope scaling was refused before; TransformerLens's loader takes it."""
    import transformers

    from safelens_tl.verify import bridge, models

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=models.vocab_size(),
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    config.architectures = ["LlamaForCausalLM"]
    folder = bridge.save_checkpoint(config, "llama-3-rope-scaling", models.load_tokenizer())
    report = runner.verify_pretrained(str(folder), dtypes=(torch.bfloat16,), devices=["cpu"])
    assert report.passed, [check.error for check in report.checks]
    assert report.checks[0].cache_heads == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_model_is_loaded_in_the_dtype_asked_for(patched: Any, dtype: torch.dtype) -> None:
    """As ``from_pretrained(..., dtype=...)`` loads it: config and every weight in ``dtype``."""
    folder = checkpoint("Qwen2ForCausalLM")
    model = local_model.load_hooked(str(folder), dtype, "cpu")
    assert model.cfg.dtype == dtype
    assert {parameter.dtype for parameter in model.parameters()} == {dtype}
    assert model.cfg.model_name == folder.name
    assert model.cfg.original_architecture == "Qwen2ForCausalLM"


def test_weights_are_the_checkpoint_s_as_they_are(patched: Any) -> None:
    """No folding or centering: the logits are Hugging Face's own model's."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint("MistralForCausalLM")
    model = local_model.load_hooked(str(folder), torch.float32, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.tensor([[1, 7, 9, 12, 4, 30]])
    with torch.no_grad():
        ours = model(tokens)
        theirs = reference(tokens).logits
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error <= checks.TOLERANCES[torch.float32]


def test_a_folder_named_like_llama_reads_its_own_config(tmp_path: Path) -> None:
    """TransformerLens picks Llama's and Gemma's configurations by words in the path; the copy
    it reads has none, and holds the folder's config."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64}
    folder = config_folder(tmp_path, "my-llama-gemma-finetune", config)
    with local_model._config_under_neutral_name(local_model.read_config(str(folder))) as neutral:
        assert not any(word in neutral.lower() for word in local_model.NAME_TRIGGERS)
        assert json.loads((Path(neutral) / "config.json").read_text()) == config
    assert not Path(neutral).exists()


def test_a_gpt2_config_without_n_ctx_gets_its_context_length(tmp_path: Path) -> None:
    """transformers 5 saves GPT-2 configs without ``n_ctx``, which TransformerLens reads."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": 77}
    folder = config_folder(tmp_path, "gpt2", config)
    with local_model._config_under_neutral_name(local_model.read_config(str(folder))) as neutral:
        copied = json.loads((Path(neutral) / "config.json").read_text())
    assert copied["n_ctx"] == 77
    assert "n_ctx" not in json.loads((folder / "config.json").read_text())


def test_a_gemma_folder_is_refused_with_the_way_to_load_it(tmp_path: Path) -> None:
    folder = config_folder(
        tmp_path, "gemma", {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
    )
    with pytest.raises(runner.ModelLoadError) as refused:
        runner.load_pretrained(str(folder), torch.float16, "cpu")
    message = str(refused.value)
    for words in ("official", "from_pretrained", "hf_model=", "verify_model"):
        assert words in message


def test_an_architecture_this_release_does_not_convert_is_named(tmp_path: Path) -> None:
    folder = config_folder(
        tmp_path, "unknown", {"architectures": ["FooForCausalLM"], "model_type": "llama"}
    )
    with pytest.raises(runner.ModelLoadError) as refused:
        runner.load_pretrained(str(folder), torch.float16, "cpu")
    message = str(refused.value)
    assert "FooForCausalLM" in message and targets.installed_release() in message
    assert "TransformerBridge" in message


def test_a_checkpoint_that_is_not_a_language_model_is_refused(tmp_path: Path) -> None:
    folder = config_folder(
        tmp_path, "bert", {"architectures": ["BertForMaskedLM"], "model_type": "bert"}
    )
    with pytest.raises(local_model.UnsupportedCheckpointError, match="not a causal language"):
        local_model.load_hooked(str(folder), torch.float16, "cpu")


def test_an_unreadable_config_is_one_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(runner.ModelLoadError, match="cannot be read as JSON"):
        runner.load_pretrained(str(folder), torch.float16, "cpu")


def test_official_names_go_to_from_pretrained_and_other_names_to_the_checkpoint_loader() -> None:
    """``gpt2`` is one of TransformerLens's official names (and ``from_pretrained`` loads it);
    a fine-tune's name is not, and is loaded as a checkpoint instead."""
    assert runner._is_official_name("gpt2")
    assert runner._is_official_name("meta-llama/Llama-3.2-1B")
    assert not runner._is_official_name("safelens-test/tiny-llama")
