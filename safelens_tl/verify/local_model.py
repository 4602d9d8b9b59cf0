"""``verify --model FOLDER``: a local Hugging Face checkpoint (config, weights, tokenizer), offline.

On TransformerLens 2.x/3.x the checkpoint becomes a ``HookedTransformer`` through TransformerLens's
own weight converters (``transformer_lens.pretrained.weight_conversions``). The configuration is
mapped here from the checkpoint's ``config.json``: TransformerLens's own config conversion expects
an official model name and trips on local folders (a folder whose name contains "llama" takes a
branch that never reads the config; GPT-2 configs of transformers 5 have no ``n_ctx``).
On TransformerLens 4.x a folder boots through ``TransformerBridge.boot_transformers``
(:mod:`safelens_tl.verify.bridge`), which supports far more architectures.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class UnsupportedCheckpointError(ValueError):
    """The folder is not a checkpoint this release can turn into a ``HookedTransformer``."""


def is_checkpoint_folder(name: str) -> bool:
    """Whether ``name`` is a folder holding a Hugging Face ``config.json``."""
    return (Path(name) / "config.json").is_file()


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    parameters = getattr(config, "rope_parameters", None) or {}
    if theta is None:
        theta = parameters.get("rope_theta", 10000.0)
    rope_type = parameters.get("rope_type") or (getattr(config, "rope_scaling", None) or {}).get(
        "rope_type", "default"
    )
    if rope_type not in (None, "default"):
        raise UnsupportedCheckpointError(
            f"rope scaling {rope_type!r} is not supported for a local checkpoint on this "
            "TransformerLens release; only the default rotary embedding is"
        )
    return float(theta)


def _llama(config: Any) -> dict[str, Any]:
    heads = int(config.num_attention_heads)
    d_head = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return {
        "d_model": int(config.hidden_size),
        "d_head": d_head,
        "n_heads": heads,
        "n_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "d_mlp": int(config.intermediate_size),
        "n_layers": int(config.num_hidden_layers),
        "n_ctx": int(config.max_position_embeddings),
        "eps": float(config.rms_norm_eps),
        "d_vocab": int(config.vocab_size),
        "act_fn": str(config.hidden_act),
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_dim": d_head,
        "rotary_base": _rope_theta(config),
        "rotary_adjacent_pairs": False,
        "gated_mlp": True,
        "final_rms": True,
        "original_architecture": "LlamaForCausalLM",
    }


def _gpt2(config: Any) -> dict[str, Any]:
    heads = int(config.n_head)
    return {
        "d_model": int(config.n_embd),
        "d_head": int(config.n_embd) // heads,
        "n_heads": heads,
        "d_mlp": int(getattr(config, "n_inner", None) or 4 * config.n_embd),
        "n_layers": int(config.n_layer),
        "n_ctx": int(config.n_positions),
        "eps": float(config.layer_norm_epsilon),
        "d_vocab": int(config.vocab_size),
        "act_fn": str(config.activation_function),
        "normalization_type": "LN",
        "positional_embedding_type": "standard",
        "original_architecture": "GPT2LMHeadModel",
    }


#: Architecture -> (config mapping, name of TransformerLens's weight converter).
ARCHITECTURES: dict[str, tuple[Callable[[Any], dict[str, Any]], str]] = {
    "LlamaForCausalLM": (_llama, "convert_llama_weights"),
    "GPT2LMHeadModel": (_gpt2, "convert_gpt2_weights"),
}


def load_hooked(folder: str, dtype: torch.dtype, device: str) -> Any:
    """The checkpoint in ``folder`` as a ``HookedTransformer`` in ``dtype`` on ``device``.

    Weights are used as they are (no LayerNorm folding, no centering), so the model computes what
    the checkpoint computes. Raises :class:`UnsupportedCheckpointError` for other architectures.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from safelens_tl import targets
    from safelens_tl.verify import models

    auto_config: Any = AutoConfig
    config = auto_config.from_pretrained(folder)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if architecture not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedCheckpointError(
            f"{folder}: architecture {architecture} cannot be converted here; with this "
            f"TransformerLens a local checkpoint may be {supported} (TransformerLens 4.x boots "
            f"any architecture TransformerBridge supports)"
        )
    mapping, converter_name = ARCHITECTURES[architecture]
    fields = mapping(config)
    layout = targets.locate()
    model_class = layout.model_class()
    if model_class is None:
        raise UnsupportedCheckpointError("this TransformerLens release has no HookedTransformer")
    converters = importlib.import_module(targets.WEIGHT_CONVERSIONS_MODULE)
    convert = getattr(converters, converter_name)
    cfg = models.hooked_config_class()(**fields, dtype=torch.float32, device=device)
    auto_model: Any = AutoModelForCausalLM
    hf_model = auto_model.from_pretrained(folder, dtype=torch.float32)
    auto_tokenizer: Any = AutoTokenizer
    tokenizer = auto_tokenizer.from_pretrained(folder)
    model = model_class(cfg, tokenizer=tokenizer, default_padding_side="left")
    model.load_and_process_state_dict(
        convert(hf_model, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    # model.to(dtype) updates cfg.dtype as well; .half() would not (the model.half() trap).
    return model.to(dtype).to(device)
