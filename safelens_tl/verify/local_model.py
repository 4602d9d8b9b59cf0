"""``verify --model FOLDER``: a local Hugging Face checkpoint (config, weights, tokenizer), offline;
and ``verify --model NAME`` for a Hub model that is not one of TransformerLens's official names
(a fine-tune), read through Hugging Face's cache.

On TransformerLens 2.x/3.x the checkpoint becomes a ``HookedTransformer`` by TransformerLens's own
loader, taking the steps ``HookedTransformer.from_pretrained(name, dtype=...)`` takes for a model
on the Hub: its config conversion, its weight converters, no folding or centering. So every
architecture that release converts can be checked, in the dtype it is loaded in.

``from_pretrained`` itself accepts official model names only. Its config conversion does read a
local folder's ``config.json``, but it first looks for words in the *path*: "llama" anywhere in
it (a folder named ``my-llama-finetune``) takes a branch that builds a Llama configuration without
reading the folder's config at all, and "gemma" picks a hard-coded one. So the conversion reads a
copy of ``config.json`` in a temporary folder of a neutral name. Gemma's configurations exist in
TransformerLens only per official name, so Gemma checkpoints are refused with the way to load them.

On TransformerLens 4.x a folder or a name boots through ``TransformerBridge.boot_transformers``
(:mod:`safelens_tl.verify.bridge`), which supports far more architectures; so does, on 3.x, a
folder ``HookedTransformer`` does not take (:func:`hooked_transformer_takes`) but TransformerBridge
boots (vision-language, audio-text and encoder-decoder checkpoints, Gemma).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# No torch at import: the command checks a --model path (checkpoint_problem) before it imports
# torch and TransformerLens.

#: Words TransformerLens's config conversion looks for in a model's name (case-insensitive): with
#: one of them in the path it picks a configuration by name and ignores the folder's config.
NAME_TRIGGERS = ("llama", "gemma")
#: Architectures whose TransformerLens configuration exists only per official model name.
NAMED_ONLY_ARCHITECTURES = (
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
#: How the class names of causal language models end (``LlamaForCausalLM``, ``GPT2LMHeadModel``).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
#: And those of every model that generates text (vision-language, audio-text, encoder-decoder:
#: ``LlavaForConditionalGeneration``, ``T5ForConditionalGeneration``, ``MarianMTModel``), not of
#: the masked language models, classifiers and encoders TransformerBridge also boots.
TEXT_GENERATOR_SUFFIXES = (*CAUSAL_LM_SUFFIXES, "ForConditionalGeneration", "MTModel")


def hooked_transformer_takes(architecture: str) -> bool:
    """Whether TransformerLens's own loader may turn a folder of ``architecture`` into a
    ``HookedTransformer``: a causal language model whose configuration it reads from the folder
    (not Gemma's, which it has per official name only)."""
    return (
        architecture.endswith(CAUSAL_LM_SUFFIXES) and architecture not in NAMED_ONLY_ARCHITECTURES
    )


def architecture_of(source: str) -> str | None:
    """The first architecture the folder's ``config.json`` names; ``None`` when unreadable."""
    try:
        architectures = read_config(source).get("architectures") or [None]
    except UnsupportedCheckpointError:
        return None
    return None if architectures[0] is None else str(architectures[0])


class UnsupportedCheckpointError(ValueError):
    """The folder is not a checkpoint this release can turn into a ``HookedTransformer``."""


#: Files that hold a Hugging Face checkpoint's weights.
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.pth", "tf_model.h5")
#: Endings of files people pass for a model that are no checkpoint folder.
FILE_ENDINGS = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json", ".ckpt")


def looks_like_a_path(name: str) -> bool:
    """Whether ``name`` is written as a local path rather than a Hub name (``org/model``)."""
    return (
        name.startswith(("/", "./", "../", "~", "."))
        or name.count("/") > 1
        or "\\" in name
        or name.lower().endswith(FILE_ENDINGS)
    )


def _heads_problem(config: dict[str, Any]) -> str | None:
    """Attention heads that are not a multiple of the key-value heads, in the config or one of
    its parts (``text_config``, ...); ``None`` otherwise."""
    for part in [config, *(v for v in config.values() if isinstance(v, dict))]:
        heads, kv_heads = part.get("num_attention_heads"), part.get("num_key_value_heads")
        if not isinstance(heads, int) or not isinstance(kv_heads, int) or kv_heads <= 0:
            continue
        if heads % kv_heads:
            return (
                f"its config.json has {heads} attention heads and {kv_heads} key-value "
                f"heads; the attention heads must be a multiple of the key-value heads"
            )
    return None


def checkpoint_problem(name: str) -> str | None:
    """Why ``--model name`` cannot be a checkpoint, told from the files before anything is
    loaded; ``None`` when nothing is wrong that way (or ``name`` is a Hub name).

    A path that exists is described as the local path it is (a file, a folder without
    ``config.json``, without weights, a config that cannot work), never as a Hub lookup; a name
    written as a path (``./x``, ``/x``, ``x.gguf``) that does not exist is said not to exist.
    """
    path = Path(name).expanduser()
    what = "a checkpoint folder holds config.json, the weights and the tokenizer files"
    if path.is_file():
        advice = (
            "; a GGUF file can be turned into one with transformers: "
            "AutoModelForCausalLM.from_pretrained(<its folder>, gguf_file=<its name>)"
            ".save_pretrained(<folder>), and the same for AutoTokenizer"
            if path.suffix.lower() == ".gguf"
            else ""
        )
        return f"--model {name}: is a file, not a checkpoint folder ({what}){advice}"
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"--model {name}: the folder has no config.json ({what})"
        try:
            config = read_config(str(path))
        except UnsupportedCheckpointError as error:
            return f"--model {name}: {error}"
        architecture = str((config.get("architectures") or [""])[0])
        if architecture and not architecture.endswith(TEXT_GENERATOR_SUFFIXES):
            return None  # the loader refuses it by its architecture, which says more
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            return (
                f"--model {name}: the folder has config.json but no weights (*.safetensors or "
                f"pytorch_model.bin); save the model into it with model.save_pretrained(folder)"
            )
        problem = _heads_problem(config)
        return None if problem is None else f"--model {name}: {problem}"
    if looks_like_a_path(name):
        return f"--model {name}: no such file or folder"
    return None


def is_checkpoint_folder(name: str) -> bool:
    """Whether ``name`` is a folder holding a Hugging Face ``config.json``."""
    return (Path(name) / "config.json").is_file()


def config_path(source: str) -> Path:
    """The ``config.json`` of ``source``: a checkpoint folder, or a Hugging Face Hub model name
    (downloaded once, then read from Hugging Face's cache; from the cache only when offline)."""
    if is_checkpoint_folder(source):
        return Path(source) / "config.json"
    from transformers.utils import cached_file

    path = cached_file(source, "config.json")
    if path is None:  # only when told not to raise; kept for the type
        raise UnsupportedCheckpointError(f"{source} has no config.json on the Hugging Face Hub")
    return Path(path)


def read_config(source: str) -> dict[str, Any]:
    """The ``config.json`` of ``source`` (a checkpoint folder or a Hub model name) as a dict.

    Raises :class:`UnsupportedCheckpointError` when it is not a JSON object.
    """
    path = config_path(source)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UnsupportedCheckpointError(f"{path} cannot be read as JSON ({error})") from error
    if not isinstance(config, dict):
        raise UnsupportedCheckpointError(f"{path} holds {type(config).__name__}, not an object")
    return config


def _refuse_unconvertible(source: str, architecture: str, release: str) -> None:
    """Raise for what TransformerLens's loader would get wrong or could not generate with."""
    if architecture in NAMED_ONLY_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{source}: TransformerLens {release} has Gemma configurations only per official "
            f"model name, not from a folder's config.json; load it with "
            f'HookedTransformer.from_pretrained("<official name, e.g. google/gemma-2-2b>", '
            f"hf_model=<the folder loaded with AutoModelForCausalLM>, tokenizer=<its tokenizer>) "
            f"and check that model with safelens_tl.verify.runner.verify_model(model)"
        )
    if not architecture.endswith(CAUSAL_LM_SUFFIXES):
        raise UnsupportedCheckpointError(
            f"{source}: architecture {architecture} is not a causal language model (its name "
            f"should end in {' or '.join(CAUSAL_LM_SUFFIXES)}, e.g. LlamaForCausalLM, "
            f"GPT2LMHeadModel), so there is no generation to check"
        )


@contextlib.contextmanager
def _config_under_neutral_name(config: dict[str, Any]) -> Iterator[str]:
    """A temporary folder holding ``config`` (a checkpoint's ``config.json``), under a name in
    which TransformerLens finds none of :data:`NAME_TRIGGERS`; removed afterwards."""
    config = dict(config)
    # transformers 5 saves GPT-2 configs without n_ctx, which TransformerLens's conversion reads;
    # it is the same number as n_positions (the context length).
    if "n_positions" in config and "n_ctx" not in config:
        config["n_ctx"] = config["n_positions"]
    with tempfile.TemporaryDirectory(prefix="safelens-tl-config-") as workspace:
        neutral = Path(workspace) / "checkpoint"
        if any(word in str(neutral).lower() for word in NAME_TRIGGERS):
            raise UnsupportedCheckpointError(
                f"the temporary folder {workspace} has one of {NAME_TRIGGERS} in its path, which "
                f"TransformerLens would read as a model name; set TMPDIR to a folder without it"
            )
        neutral.mkdir()
        (neutral / "config.json").write_text(json.dumps(config), encoding="utf-8")
        yield str(neutral)


def load_hooked(source: str, dtype: torch.dtype, device: str) -> Any:
    """The checkpoint ``source`` as a ``HookedTransformer`` in ``dtype`` on ``device``.

    ``source`` is a local checkpoint folder or the name of a model on the Hugging Face Hub that
    is not one of TransformerLens's official names (a fine-tune: ``from_pretrained`` refuses
    those), read through Hugging Face's cache. Loaded as ``HookedTransformer.from_pretrained(...,
    dtype=dtype)`` loads an official model, but with the weights used as they are (no LayerNorm
    folding, no centering), so the model computes what the checkpoint computes. Raises
    :class:`UnsupportedCheckpointError` for an architecture this release does not convert, or
    that is not a causal language model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safelens_tl import targets

    layout = targets.locate()
    config = read_config(source)
    architecture = str((config.get("architectures") or ["?"])[0])
    _refuse_unconvertible(source, architecture, layout.release)
    model_class = layout.model_class()
    if model_class is None:
        raise UnsupportedCheckpointError("this TransformerLens release has no HookedTransformer")
    loading = importlib.import_module(targets.HOOKED_LOADING_MODULE)
    with _config_under_neutral_name(config) as neutral_name:
        try:
            cfg = loading.get_pretrained_model_config(neutral_name, dtype=dtype, device=device)
        except NotImplementedError as error:  # "<architecture> is not currently supported."
            raise UnsupportedCheckpointError(
                f"{source}: TransformerLens {layout.release} does not convert {architecture} to "
                f"a HookedTransformer ({error}); TransformerLens 4.x boots it through "
                f"TransformerBridge if TransformerBridge supports it"
            ) from error
        auto_model: Any = AutoModelForCausalLM
        hf_model = auto_model.from_pretrained(source, dtype=dtype)
        state_dict = loading.get_pretrained_state_dict(neutral_name, cfg, hf_model, dtype=dtype)
    cfg.model_name = Path(source).name if is_checkpoint_folder(source) else source.split("/")[-1]
    auto_tokenizer: Any = AutoTokenizer
    tokenizer = auto_tokenizer.from_pretrained(source)
    model = model_class(cfg, tokenizer=tokenizer, move_to_device=False, default_padding_side="left")
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return model.to(device)
