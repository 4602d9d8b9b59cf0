"""Tiny offline models with random weights and an in-process tokenizer: nothing is downloaded.

TransformerLens's ``set_tokenizer`` reloads the tokenizer from ``tokenizer.name_or_path``, so the
tokenizer is built with the ``tokenizers`` library, saved to a folder and loaded from it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "at",
    "for",
    "with",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "river",
    "stone",
    "cloud",
    "light",
    "runs",
    "sleeps",
    "sings",
    "swims",
    "grows",
    "stands",
    "flows",
    "falls",
    "shines",
    "waits",
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "new",
    "quiet",
    "loud",
    "fast",
    "slow",
    "and",
    "but",
    "or",
    "then",
    "so",
    "because",
    "when",
    "while",
    "if",
    "not",
]
SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>")

_tokenizer_folder: Path | None = None
_scratch: tempfile.TemporaryDirectory[str] | None = None


def scratch_folder(name: str) -> Path:
    """A new folder ``name`` (``name-2``, ... when taken) inside this process's scratch directory.

    The scratch directory is removed when the process exits (``TemporaryDirectory`` finalizes
    at interpreter exit), so verifying leaves no model or tokenizer folders behind.
    """
    global _scratch
    if _scratch is None:
        _scratch = tempfile.TemporaryDirectory(prefix="safelens-tl-")
    base = Path(_scratch.name)
    folder, copies = base / name, 1
    while folder.exists():
        copies += 1
        folder = base / f"{name}-{copies}"
    folder.mkdir()
    return folder


def tokenizer_folder() -> Path:
    """Build the word-level tokenizer once per process and return the folder it is saved in."""
    global _tokenizer_folder
    if _tokenizer_folder is None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {token: index for index, token in enumerate((*SPECIAL, *WORDS))}
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
        wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=core,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            unk_token="<unk>",
        )
        folder = scratch_folder("tokenizer")
        wrapped.save_pretrained(folder)
        _tokenizer_folder = folder
    return _tokenizer_folder


def load_tokenizer() -> Any:
    """Return the tiny tokenizer, loaded from its folder as TransformerLens expects."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_folder()))


def vocab_size() -> int:
    """Number of tokens of the tiny tokenizer."""
    return len(SPECIAL) + len(WORDS)


GPT2_LIKE: dict[str, Any] = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "d_head": 16,
    "d_mlp": 128,
    "n_ctx": 128,
    "act_fn": "gelu_new",
    "normalization_type": "LN",
    "positional_embedding_type": "standard",
}

LLAMA_LIKE: dict[str, Any] = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "n_key_value_heads": 2,
    "d_head": 16,
    "d_mlp": 128,
    "n_ctx": 128,
    "act_fn": "silu",
    "normalization_type": "RMS",
    "positional_embedding_type": "rotary",
    "rotary_dim": 16,
    "gated_mlp": True,
    "final_rms": True,
}

BUILTIN_MODELS: dict[str, dict[str, Any]] = {"gpt2-like": GPT2_LIKE, "llama-like-gqa": LLAMA_LIKE}


def hooked_config_class() -> Any:
    """``HookedTransformerConfig``; ``RuntimeError`` where the release has none (4.x)."""
    try:
        from transformer_lens import HookedTransformerConfig
    except ImportError as error:  # TransformerLens 4.x removed it
        raise RuntimeError(
            "this TransformerLens release has no HookedTransformer; the tiny models need it"
        ) from error
    return HookedTransformerConfig


def build_model(
    name: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0, n_devices: int = 1
) -> Any:
    """Build a built-in model (``gpt2-like`` or ``llama-like-gqa``) with fixed random weights.

    The weights are sampled in float32 and then cast, so every dtype sees the same model.
    ``n_devices`` > 1 splits the blocks over that many GPUs, as TransformerLens does.
    """
    from transformer_lens import HookedTransformer

    config_class = hooked_config_class()
    torch.manual_seed(seed)
    cfg = config_class(
        **BUILTIN_MODELS[name],
        d_vocab=vocab_size(),
        dtype=torch.float32,
        device=device,
        seed=seed,
        n_devices=n_devices,
        tokenizer_prepends_bos=True,
        default_prepend_bos=True,
    )
    model = HookedTransformer(cfg, tokenizer=load_tokenizer(), default_padding_side="left")
    # The default init leaves some weights at zero/one (biases, norms); perturb everything so that
    # positional and cache errors are visible in the logits.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    # model.to(dtype) updates cfg.dtype too; model.half() would not (the model.half() trap).
    model = model.to(dtype).to(device)
    if n_devices > 1:
        model.move_model_modules_to_device()
    return model
