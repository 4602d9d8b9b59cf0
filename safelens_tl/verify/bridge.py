"""Cached generation through ``TransformerBridge``: the subject of the verifier's bridge rows.

(Encoder-decoder checkpoints are checked through ``hf_generate`` instead: :func:`run_seq2seq_batch`,
at the end of this module.)

Two tiny Hugging Face models with random weights, a Llama with grouped-query attention and rotary
positions and a GPT-2, are saved once per process with the in-process tokenizer to a temporary
folder and booted from there with ``TransformerBridge.boot_transformers`` (nothing is downloaded).

:func:`run_batch` measures, for one batch of prompts, what :mod:`safelens_tl.verify.oracle` judges:
the logits the bridge's cached ``generate`` produced at each step, replayed against

- the bridge's own uncached forward over the generated sequence in the same dtype (attention mask
  of the left-padded prompts, positions derived from it, ``use_cache=False``): the yardstick;
- the bridge's uncached forwards over prefixes of that sequence, against the same forward over the
  whole of it: ``order``, what the allowance is made of;
- an independent reference, the same checkpoint loaded with ``AutoModelForCausalLM`` (or
  ``AutoModelForImageTextToText`` for a vision-language checkpoint, ``AutoModelForSeq2SeqLM`` for
  an audio-text one; the class the checkpoint names where transformers has it: :func:`model_class`;
  no TransformerLens at all), uncached: it catches what the bridge itself gets wrong;

and ``hf_generate`` (Hugging Face's generate loop over the bridge's modules) against the same
yardstick. :func:`add_float32_rounding` then converts the bridge to float32 for ``rounding``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from safelens_tl.verify import checks, models, oracle

#: Tokens :func:`run_batch` generates unless told otherwise (the fixes' tests and benchmarks).
NEW_TOKENS = 8
#: Least bound against the independent Hugging Face forward (relative to its largest logit); see
#: :data:`safelens_tl.verify.oracle.REFERENCE_FLOORS`.
REFERENCE_TOLERANCES: dict[torch.dtype, float] = oracle.REFERENCE_FLOORS
#: How a bridge reaches its dtype: booted in it, or booted in float32 and then converted.
CONVERSIONS = ("boot", "half", "to")
#: Prompts per batch size: one prompt, and two of different lengths (left-padded).
BATCHES: dict[int, tuple[str, ...]] = {1: checks.PROMPTS[1:], 2: checks.PROMPTS}


def _llama_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=models.vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # Larger than the default 0.02 so the logits are well apart and a cache error shows.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _gpt2_config(tokenizer: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=models.vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


#: The built-in bridge models: name -> Hugging Face config builder.
BRIDGE_MODELS: dict[str, Callable[[Any], Any]] = {
    "llama-like-gqa": _llama_config,
    "gpt2-like": _gpt2_config,
}

_folders: dict[str, Path] = {}


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Hide transformers' "Loading weights" bars; restore the user's setting afterwards."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def auto_model_class(config: Any) -> Any:
    """The Auto class that builds a text-generating model of ``config``.

    ``AutoModelForCausalLM`` for language models; for the multimodal checkpoints it does not
    take, which generate text from text alone as well: ``AutoModelForImageTextToText`` for
    vision-language ones (Llava, Mistral 3, Qwen-VL), and ``AutoModelForSeq2SeqLM`` for audio-text
    decoders (Qwen2-Audio, Audio Flamingo 3, GLM-ASR), which is where transformers lists them and
    how TransformerLens loads them, although they have no encoder-decoder stack. Encoder-decoder
    models (T5, BART, ...) take ``AutoModelForSeq2SeqLM`` too.
    """
    import transformers

    kind = type(config)
    seq2seq: Any = getattr(transformers, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", {})
    # First: BART's config is in the causal-LM mapping too, for its decoder alone.
    if getattr(config, "is_encoder_decoder", False) and kind in seq2seq:
        return transformers.AutoModelForSeq2SeqLM
    if kind in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    image_text: Any = getattr(transformers, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", {})
    if kind in image_text:
        return transformers.AutoModelForImageTextToText
    if hasattr(config, "audio_config") and kind in seq2seq:
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def model_class(config: Any) -> Any:
    """The class that builds, saves and loads the text generator of ``config``.

    The generating class the config's ``architectures`` names, where transformers has one; else
    :func:`auto_model_class`. Emu3's composite checkpoint (``Emu3ForConditionalGeneration``) is
    in the causal-LM mapping for its bare language model, whose weights sit under another prefix:
    loaded with ``AutoModelForCausalLM``, the reference had every weight newly initialized.
    A name transformers lacks (a remote-code one, such as ``PhiMoEForCausalLM``) falls back.
    """
    import transformers

    for name in getattr(config, "architectures", None) or ():
        named = getattr(transformers, name, None)
        if isinstance(named, type) and issubclass(named, transformers.GenerationMixin):
            return named
    return auto_model_class(config)


def save_checkpoint(config: Any, name: str, tokenizer: Any) -> Path:
    """Save a model of ``config`` with random weights (seed 0) and ``tokenizer`` to a new scratch
    folder ``hf-<name>``, removed at exit; return the folder."""
    torch.manual_seed(0)
    folder = models.scratch_folder(f"hf-{name}")
    with no_progress_bars():
        build_model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_model(config: Any) -> Any:
    """A model of ``config`` with newly initialized weights, of :func:`model_class`."""
    chosen = model_class(config)
    # An Auto class builds with from_config; a model class with _from_config, what that calls.
    build = getattr(chosen, "from_config", None) or chosen._from_config
    return build(config)


@contextlib.contextmanager
def package_installs_refused() -> Iterator[None]:
    """Make ``pip`` and ``uv`` refuse to install anything while booting.

    TransformerLens 3.x and 4.x install torchvision with pip (or uv) when they boot a
    vision-language checkpoint, to load its image processor. pip then resolves torchvision's
    pinned torch, which here replaced the CPU torch 2.13 with a CUDA build of 2.14 (several GB).
    Generating text needs no image processor, and a check must not change the installation it
    checks, so pip gets no index and an empty folder of packages, and uv no network (it could
    still install from its own cache); the boot then goes on without the processor, as
    TransformerLens does whenever the install fails. Not thread-safe: it sets ``os.environ``.
    """
    refusal = {"PIP_NO_INDEX": "1", "UV_OFFLINE": "1"}
    saved = {name: os.environ.get(name) for name in (*refusal, "PIP_FIND_LINKS")}
    with tempfile.TemporaryDirectory(prefix="safelens-tl-no-packages-") as empty:
        os.environ.update(refusal, PIP_FIND_LINKS=empty)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def model_folder(name: str = "llama-like-gqa") -> Path:
    """Save the tiny Hugging Face model ``name`` and the tokenizer once per process."""
    if name not in _folders:
        tokenizer = models.load_tokenizer()
        _folders[name] = save_checkpoint(BRIDGE_MODELS[name](tokenizer), name, tokenizer)
    return _folders[name]


def boot(name: str, dtype: torch.dtype, device: str = "cpu", conversion: str = "boot") -> Any:
    """Boot the built-in model ``name`` as a TransformerBridge; see :func:`boot_folder`."""
    return boot_folder(model_folder(name), dtype, device, conversion)


def boot_folder(
    folder: str | Path,
    dtype: torch.dtype,
    device: str = "cpu",
    conversion: str = "boot",
    tokenizer: Any = None,
) -> Any:
    """Boot the Hugging Face checkpoint in ``folder`` as a TransformerBridge in ``dtype``.

    ``conversion``: ``"boot"`` boots in ``dtype``; ``"half"`` boots in float32 and calls
    ``.half()`` / ``.bfloat16()`` / ``.float()``; ``"to"`` boots in float32, then ``.to(dtype)``.
    ``tokenizer``: used instead of the folder's own when given.
    """
    from transformer_lens.model_bridge import TransformerBridge

    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion must be one of {CONVERSIONS}; received {conversion!r}")
    first = dtype if conversion == "boot" else torch.float32
    with no_progress_bars(), contextlib.redirect_stdout(None), package_installs_refused():
        bridge = TransformerBridge.boot_transformers(
            str(folder), dtype=first, device=device, tokenizer=tokenizer
        )
        if conversion == "to":
            bridge = bridge.to(dtype)
        elif conversion == "half":
            method = {torch.float16: "half", torch.bfloat16: "bfloat16"}.get(dtype, "float")
            bridge = getattr(bridge, method)()
    return bridge


def reference_model(name: str, dtype: torch.dtype, device: str = "cpu") -> Any:
    """The built-in checkpoint ``name`` as a plain Hugging Face model (no TransformerLens)."""
    return reference_from(model_folder(name), dtype, device)


def reference_from(folder: str | Path, dtype: torch.dtype, device: str = "cpu") -> Any:
    """The checkpoint in ``folder`` as a plain Hugging Face model: no TransformerLens involved."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    with no_progress_bars():
        model = model_class(config).from_pretrained(str(folder), config=config, dtype=dtype)
    return model.to(device).eval()


@dataclass(frozen=True)
class BridgeRun:
    """What one cached ``generate`` of one batch measured (:mod:`~safelens_tl.verify.oracle`)."""

    architecture: str
    batch: int
    #: Against the bridge's own uncached forward in the same dtype: the yardstick.
    max_rel_err: float
    #: Against the independent Hugging Face forward.
    reference_rel_err: float
    cached_tokens: torch.Tensor
    #: Greedy without the cache: ``generate``'s own where it ran, else the uncached forward's top
    #: token at each step of the cached sequence (what greedy generation without a cache picks
    #: while it agrees).
    uncached_tokens: torch.Tensor
    seconds_cached: float
    #: ``None`` where nothing uncached was timed (state-space models: TransformerLens cannot
    #: generate them without a cache).
    seconds_uncached: float | None
    #: Of the first attention layer's keys after a cached forward over the prompt; ``None`` when
    #: no layer holds keys.
    cache_dtype: torch.dtype | None
    cache_device: torch.device | None
    cache_heads: int | None
    #: The config's count or as many as Hugging Face's own cache holds, whichever the bridge's
    #: cache matches (:func:`heads_to_expect`).
    expected_cache_heads: int | None
    #: Some layers keep a recurrent state (:func:`holds_recurrent_state`).
    recurrent_state: bool = False
    #: The cache holds recurrent state only (no attention layer): nothing for the KV checks.
    state_only: bool = False
    #: ``hf_generate`` (Hugging Face's generate loop over the bridge's modules, with the cache)
    #: against the bridge's own uncached forward (:func:`hf_generate_against_uncached`);
    #: ``None`` where this TransformerLens has no ``hf_generate``.
    hf_generate_rel_err: float | None = None
    #: Why ``hf_generate`` could not run, where it raised.
    hf_generate_error: str | None = None
    #: Whether ``reference_rel_err`` is held to a bound (not for encoder-decoder models in half
    #: precision: :func:`run_seq2seq_batch`).
    reference_held: bool = True
    #: The uncached forwards over prefixes against over the whole sequence
    #: (:func:`safelens_tl.verify.oracle.order_error`); ``None`` where not measured.
    order_rel_err: float | None = None
    #: The uncached forward in the dtype against float32 on the same tokens
    #: (:func:`add_float32_rounding`); ``None`` until measured.
    rounding_rel_err: float | None = None
    #: Cached positions the last compared step attended over (prompt, padding included, and the
    #: tokens generated before it); every step up to it is compared.
    cached_positions: int = 0
    #: Share of cached steps whose logits pick the uncached forward's top token on the same tokens.
    top1_agreement: float = 1.0
    #: What the float32 forward needs: the generated sequences, their mask and positions (or, for
    #: an encoder-decoder checkpoint, the encoder's input), the dtype's logits of the compared
    #: steps, and which steps they are.
    replay: Any = None

    @property
    def agreement(self) -> float:
        """Share of new tokens equal with and without the cache (greedy)."""
        return float((self.cached_tokens == self.uncached_tokens).float().mean())


def _step_logits(output: Any) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output[1]
    stacked: torch.Tensor = (
        torch.stack(list(logits), dim=1) if isinstance(logits, (tuple, list)) else logits
    )
    return stacked


def first_cache_layer(cache: Any) -> torch.Tensor | None:
    """Keys of the first layer of a Hugging Face cache that holds any, ``[batch, heads, pos,
    d_head]``, any release.

    Hybrid models (Qwen3-Next, Qwen3.5, Jamba, ...) may start with linear-attention layers, whose
    recurrent state has no keys. ``None`` when no layer holds keys (nothing was written, or the
    model has no attention layer).
    """
    if cache is None:
        return None
    candidates: Iterable[Any]
    layers = getattr(cache, "layers", None)
    if layers is not None:
        candidates = (getattr(layer, "keys", None) for layer in layers)
    elif getattr(cache, "key_cache", None) is not None:
        candidates = cache.key_cache
    else:
        # Legacy tuples hold a (keys, values) pair per layer; RWKV's state is a list of bare
        # tensors, which hold no keys.
        candidates = (entry[0] for entry in cache if isinstance(entry, (tuple, list)) and entry)
    for keys in candidates:
        if isinstance(keys, torch.Tensor) and keys.numel():
            return keys
    return None


def holds_recurrent_state(cache: Any) -> bool:
    """Whether ``cache`` has layers that keep a recurrent state rather than keys and values: the
    state-space or linear-attention layers of Mamba, Mamba-2, FalconMamba and hybrid models."""
    if cache is None:
        return False
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return any(not hasattr(layer, "keys") for layer in layers)
    if isinstance(cache, (tuple, list)):
        # RWKV's state: a list of tensors (each over every layer), not per-layer pairs.
        return any(isinstance(entry, torch.Tensor) for entry in cache)
    # MambaCache of transformers releases before the unified cache layers.
    return hasattr(cache, "ssm_states")


def expected_heads(config: Any) -> int | None:
    """Key/value heads a cache of this Hugging Face config stores, as the config counts them
    (:func:`heads_to_expect` also accepts Hugging Face's own count); ``None`` for a config that
    counts no attention heads (RWKV, whose cache is a recurrent state).

    A vision-language checkpoint (Gemma 3 from 4B up, Llava, Qwen-VL) keeps its language model's
    sizes in ``text_config``; ``get_text_config()`` finds them there and is the config itself
    otherwise. Some models store fewer heads than any config field says (multi-query Falcon, as
    Falcon-7B: one; DeepSeek-V4: always one), which only :func:`hugging_face_cache_heads` sees.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None)
    if heads is None:
        heads = getattr(text, "num_attention_heads", None)
    return None if heads is None else int(heads)


def cache_of(output: Any) -> Any:
    """The cache a Hugging Face model's output carries, under whichever name its release uses."""
    for name in ("cache", "past_key_values", "cache_params", "state"):
        found = getattr(output, name, None)
        if found is not None:
            return found
    return None


def hugging_face_cache_heads(
    reference: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> int | None:
    """Key/value heads of the first attention layer of the cache Hugging Face's own model (no
    TransformerLens involved) fills over the prompt: how many a correct cache holds, whatever
    the config calls them. ``None`` when no layer holds keys (state-space models)."""
    with torch.inference_mode():
        output = reference(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=_positions(prompt_mask),
            use_cache=True,
        )
    keys = first_cache_layer(cache_of(output))
    return None if keys is None else int(keys.shape[1])


def heads_to_expect(config: Any, own_heads: int | None, keys: torch.Tensor | None) -> int | None:
    """The key/value heads a correct cache of the bridge holds: the config's count, or as many as
    Hugging Face's own cache holds (``own_heads``), whichever the bridge's ``keys`` match, else
    Hugging Face's.

    Either is right: multi-query Falcon and DeepSeek-V4 cache one head whatever their configs
    count, while multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite) caches one latent
    in Hugging Face (one "head") and per-head keys, as the config counts them, in TransformerLens.
    A cache that repeats grouped-query heads matches neither.
    """
    counted = expected_heads(config)
    if counted is None:
        return own_heads
    if own_heads is None or (keys is not None and int(keys.shape[1]) == counted):
        return counted
    return own_heads


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(dim=1) - 1).clamp_min(0)


def mask_and_positions(bridge: Any, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and positions of left-padded ``sequences`` as ``bridge`` tokenized them:
    what an uncached forward over a generated sequence needs to see what generation saw."""
    prepend_bos = bool(getattr(bridge.cfg, "default_prepend_bos", True))
    mask = checks.left_padding_mask(sequences, bridge.tokenizer, prepend_bos)
    return mask, _positions(mask)


def uncached_forward(model: Any, *args: Any, **inputs: Any) -> torch.Tensor:
    """The logits of one forward of ``model`` (a bridge or a Hugging Face model) without any cache.

    ``use_cache=False``: a Hugging Face model's forward otherwise builds a ``DynamicCache`` and
    writes every layer's keys into it even when nothing is cached yet, through the very code a
    cached step uses, which would then move the yardstick along with the error it measures. A
    model whose forward takes no ``use_cache`` is called without it.
    """
    call = (
        functools.partial(model, return_type="logits")
        if hasattr(model, "original_model")
        else model
    )
    with torch.inference_mode():
        try:
            output = call(*args, **inputs, use_cache=False)
        except TypeError as error:
            if "use_cache" not in str(error):
                raise
            output = call(*args, **inputs)
    logits: torch.Tensor = output.logits if hasattr(output, "logits") else output
    return logits


def _bridge_forward(
    bridge: Any, sequences: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The bridge's uncached forward over left-padded ``sequences`` (:func:`uncached_forward`)."""
    return uncached_forward(bridge, sequences, attention_mask=mask, position_ids=positions)


def _hf_inputs(
    sequences: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, device: Any
) -> dict[str, Any]:
    return {
        "input_ids": sequences.to(device),
        "attention_mask": mask.to(device),
        "position_ids": positions.to(device),
    }


def run_batch(
    bridge: Any,
    reference: Any,
    prompts: Sequence[str],
    new_tokens: int = NEW_TOKENS,
    *,
    uncached_generate: bool = True,
    order_steps: int | None = 0,
    hf_generate: bool = True,
) -> BridgeRun:
    """Generate greedily from ``prompts`` (left-padded) with the cache, and replay.

    The logits of every cached step are compared with the bridge's own uncached forward
    (``max_rel_err``) and with ``reference`` (``reference_rel_err``), each run once over the
    generated sequence; errors are relative to the largest logit compared against. ``order``
    (:func:`safelens_tl.verify.oracle.order_error`) takes the uncached forwards over the
    prefixes ending at ``order_steps`` of the steps (spread, the last included; ``None``: every
    step; 0: not measured), whose mean time is the uncached time per token when
    ``uncached_generate`` is off.
    ``uncached_generate``: also generate without the cache (``uncached_tokens``, and its time);
    else the uncached forward's top token at each step stands for it. ``hf_generate``: also run
    :func:`hf_generate_against_uncached` on the same prompts.
    """
    common = checks.greedy_arguments(new_tokens)
    start = time.perf_counter()
    output = bridge.generate(list(prompts), use_past_kv_cache=True, output_logits=True, **common)
    middle = time.perf_counter()
    uncached = None
    if uncached_generate:
        uncached = bridge.generate(list(prompts), use_past_kv_cache=False, **common)
    end = time.perf_counter()
    sequences = output.sequences
    step_logits = _step_logits(output)
    mask, positions = mask_and_positions(bridge, sequences)
    device = next(reference.parameters()).device
    steps = slice(-new_tokens - 1, -1)
    own = _bridge_forward(bridge, sequences, mask, positions)[:, steps]
    full = uncached_forward(reference, **_hf_inputs(sequences, mask, positions, device))[:, steps]
    with torch.inference_mode():
        # The Hugging Face model inside the bridge (its attention modules are the bridge's), so
        # that the cache it fills over the prompt can be inspected on every release.
        prompt_output = bridge.original_model(
            input_ids=sequences[:, :-new_tokens],
            attention_mask=mask[:, :-new_tokens],
            position_ids=positions[:, :-new_tokens],
            use_cache=True,
        )
    cache = cache_of(prompt_output)
    keys = first_cache_layer(cache)
    recurrent = holds_recurrent_state(cache)
    prompt_ids, prompt_mask = sequences[:, :-new_tokens], mask[:, :-new_tokens]
    own_heads = hugging_face_cache_heads(reference, prompt_ids.to(device), prompt_mask.to(device))
    scale = float(own.float().abs().max())
    order, seconds_per_step = prefix_order(
        bridge, sequences, mask, positions, own, new_tokens, order_steps, scale
    )
    uncached_tokens: torch.Tensor
    seconds_uncached: float | None = end - middle
    stateful = getattr(bridge.cfg, "is_stateful", False)
    if isinstance(uncached, torch.Tensor) and not stateful:
        uncached_tokens = uncached[:, -new_tokens:]
    else:
        # TransformerLens hands a state-space model's use_past_kv_cache=False to Hugging Face's
        # generate, which caches anyway (and, stock, returns text). Greedy generation without a
        # cache picks the uncached forward's top token at each step, so over the cached sequence
        # those choices agree with the cached tokens exactly when an uncached generation would.
        uncached_tokens = own.argmax(dim=-1)
        seconds_uncached = None
        if not uncached_generate and not stateful and seconds_per_step is not None:
            seconds_uncached = seconds_per_step * new_tokens
    hf_error: str | None = None
    hf_rel_err: float | None = None
    if hf_generate:
        try:
            hf_rel_err = hf_generate_against_uncached(bridge, prompts, new_tokens)
        except Exception as error:  # reported in the check's row, as any failing check
            hf_error = f"{type(error).__name__}: {error}"
    return BridgeRun(
        architecture=str(reference.config.architectures[0]),
        batch=len(prompts),
        max_rel_err=oracle.relative_error(step_logits, own),
        reference_rel_err=oracle.relative_error(step_logits, full),
        cached_tokens=sequences[:, -new_tokens:].cpu(),
        uncached_tokens=uncached_tokens.cpu(),
        seconds_cached=middle - start,
        seconds_uncached=seconds_uncached,
        cache_dtype=None if keys is None else keys.dtype,
        cache_device=None if keys is None else keys.device,
        cache_heads=None if keys is None else int(keys.shape[1]),
        expected_cache_heads=heads_to_expect(reference.config, own_heads, keys),
        recurrent_state=recurrent,
        state_only=recurrent and keys is None,
        hf_generate_rel_err=hf_rel_err,
        hf_generate_error=hf_error,
        order_rel_err=order,
        # The last step fed the last token but one, after every position before it.
        cached_positions=int(sequences.shape[1]) - 2,
        top1_agreement=oracle.agreement(step_logits, own),
        replay=("causal", sequences, mask, positions, own, new_tokens),
    )


def prefix_order(
    bridge: Any,
    sequences: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    own: torch.Tensor,
    new_tokens: int,
    order_steps: int | None,
    scale: float,
) -> tuple[float | None, float | None]:
    """``order`` (:func:`safelens_tl.verify.oracle.order_error`) and the mean seconds of one
    prefix forward (what a step of uncached generation costs). ``order_steps`` 0: nothing
    measured, ``(None, None)``.

    Other orders of the same sums, each one uncached forward in the dtype: the forwards over the
    prefixes ending at the chosen steps, and (where the model takes a padded batch) the whole
    sequence behind :data:`~safelens_tl.verify.oracle.SHIFTS` more positions of left padding,
    which gives every matrix product and attention row other lengths and alignments at every
    step; and the whole sequence through :func:`~safelens_tl.verify.oracle.other_kernels` where
    they apply."""
    if order_steps == 0:
        return None, None
    chosen = oracle.order_steps(new_tokens, order_steps)
    prompt = sequences.shape[1] - new_tokens
    other, whole = [], []
    start = time.perf_counter()
    for step in chosen:
        end = prompt + step  # the prefix that predicts generated token ``step``
        logits = _bridge_forward(bridge, sequences[:, :end], mask[:, :end], positions[:, :end])
        other.append(logits[:, -1])
        whole.append(own[:, step])
    seconds = (time.perf_counter() - start) / max(len(chosen), 1)
    if generates_padded_batches(bridge):
        pad_id = getattr(bridge.tokenizer, "pad_token_id", None)
        for shift in oracle.SHIFTS:
            pad = torch.full(
                (sequences.shape[0], shift),
                0 if pad_id is None else int(pad_id),
                dtype=sequences.dtype,
                device=sequences.device,
            )
            blank = torch.zeros_like(pad, dtype=mask.dtype)
            logits = _bridge_forward(
                bridge,
                torch.cat([pad, sequences], dim=1),
                torch.cat([blank, mask], dim=1),
                torch.cat([blank.to(positions.dtype), positions], dim=1),
            )
            other.append(logits[:, -new_tokens - 1 : -1])
            whole.append(own)
    if oracle.other_kernels_apply(bridge):
        with oracle.other_kernels():
            logits = _bridge_forward(bridge, sequences, mask, positions)
        other.append(logits[:, -new_tokens - 1 : -1])
        whole.append(own)
    return oracle.order_error(other, whole, scale), seconds


def add_float32_rounding(bridge: Any, runs: Sequence[BridgeRun]) -> list[BridgeRun]:
    """``runs`` with ``rounding_rel_err``: the uncached forward over each run's sequence in its
    dtype against the same forward in float32, for which ``bridge`` is converted to float32 (the
    dtype's weights, float32 arithmetic). Call it last: the bridge stays in float32. Runs whose
    replay is unknown, or a conversion that fails (memory), keep ``None``."""
    if not runs or all(run.replay is None for run in runs):
        return list(runs)
    try:
        with contextlib.redirect_stdout(None):
            bridge.to(torch.float32)
    except (RuntimeError, MemoryError):
        return list(runs)
    measured = []
    for run in runs:
        rounding = None
        if run.replay is not None and run.replay[0] == "causal":
            _, sequences, mask, positions, own, new_tokens = run.replay
            logits = _bridge_forward(bridge, sequences, mask, positions)
            rounding = oracle.relative_error(own, logits[:, -new_tokens - 1 : -1])
        elif run.replay is not None and run.replay[0] == "seq2seq":
            _, encoded, decoder_ids, own = run.replay
            logits, _ = _seq2seq_decoder_forward(bridge.original_model, encoded, decoder_ids)
            rounding = oracle.relative_error(own, logits)
        measured.append(replace(run, rounding_rel_err=rounding))
    return measured


def allowance_of(runs: Sequence[BridgeRun], dtype: torch.dtype) -> oracle.Allowance:
    """The allowance of a model's runs in ``dtype``: the worst ``order`` and ``rounding`` they
    measured, and whether any keeps a recurrent state (:func:`safelens_tl.verify.oracle.allowance`).
    """
    orders = [run.order_rel_err for run in runs if run.order_rel_err is not None]
    roundings = [run.rounding_rel_err for run in runs if run.rounding_rel_err is not None]
    rounding = (
        0.0 if dtype == torch.float32 else (oracle.worst_error(roundings) if roundings else None)
    )
    return oracle.allowance(
        dtype,
        oracle.worst_error(orders) if orders else None,
        rounding,
        any(run.recurrent_state for run in runs),
    )


def greedy_hf_generate(
    bridge: Any, prompts: Sequence[str], new_tokens: int, cached: bool = True
) -> Any:
    """``bridge.hf_generate`` of ``prompts``: greedy, exactly ``new_tokens`` tokens, with or
    without the cache; Hugging Face's output with the logits of every step."""
    return bridge.hf_generate(
        list(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # an early end would leave fewer steps to compare
        do_sample=False,
        stop_at_eos=False,
        return_type="tokens",
        use_cache=cached,
        output_logits=True,
    )


def hf_generate_against_uncached(
    bridge: Any, prompts: Sequence[str], new_tokens: int
) -> float | None:
    """``bridge.hf_generate`` of ``prompts`` (greedy, with the cache): the logits of every step
    against the bridge's own uncached forward over what it generated (relative error). It hands
    generation to Hugging Face's loop, which passes the cache to the bridge's modules its own
    way; ``None`` where this TransformerLens has no ``hf_generate``."""
    if not callable(getattr(bridge, "hf_generate", None)):
        return None
    output = greedy_hf_generate(bridge, prompts, new_tokens)
    sequences = output.sequences
    mask, positions = mask_and_positions(bridge, sequences)
    own = _bridge_forward(bridge, sequences, mask, positions)
    return oracle.relative_error(
        torch.stack(list(output.logits), dim=1), own[:, -new_tokens - 1 : -1]
    )


def relative_error(logits: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference of ``logits`` from ``expected``, relative to the largest
    ``expected`` logit (in float32); see :func:`safelens_tl.verify.oracle.relative_error`."""
    return oracle.relative_error(logits, expected)


def worst_error(errors: Iterable[float]) -> float:
    """The largest of ``errors``, or NaN when any is NaN; see
    :func:`safelens_tl.verify.oracle.worst_error`."""
    return oracle.worst_error(errors)


def run_bridge(
    name: str, dtype: torch.dtype, device: str = "cpu", conversion: str = "boot"
) -> list[BridgeRun]:
    """Boot the built-in ``name`` (see :func:`boot`) and run every batch of :data:`BATCHES`."""
    return run_folder(model_folder(name), dtype, device, conversion)


def run_folder(
    folder: str | Path,
    dtype: torch.dtype,
    device: str = "cpu",
    conversion: str = "boot",
    new_tokens: int = NEW_TOKENS,
) -> list[BridgeRun]:
    """Boot the checkpoint in ``folder`` and run :func:`run_batches` on it."""
    bridge = boot_folder(folder, dtype, device, conversion)
    return run_batches(bridge, reference_from(folder, dtype, device), new_tokens)


def run_batches(
    bridge: Any,
    reference: Any,
    new_tokens: int = NEW_TOKENS,
    *,
    uncached_generate: bool = True,
    order_steps: int | None = 0,
    hf_generate_batches: Sequence[int] | None = None,
) -> list[BridgeRun]:
    """:func:`run_batch` for every batch of :data:`BATCHES` that ``bridge`` can generate (one
    prompt only where it refuses a padded batch: :func:`generates_padded_batches`); for an
    encoder-decoder checkpoint, :func:`run_seq2seq_batch`. ``hf_generate_batches``: the batch
    sizes ``hf_generate`` runs on too (``None``: every one; where the padded batch is refused,
    the single prompt)."""
    batched = generates_padded_batches(bridge)
    chosen = [prompts for prompts in BATCHES.values() if batched or len(prompts) == 1]
    if getattr(reference.config, "is_encoder_decoder", False):
        return [
            run_seq2seq_batch(bridge, reference, prompts, new_tokens, order_steps=order_steps)
            for prompts in chosen
        ]
    return [
        run_batch(
            bridge,
            reference,
            prompts,
            new_tokens,
            uncached_generate=uncached_generate,
            order_steps=order_steps,
            hf_generate=(
                hf_generate_batches is None
                or len(prompts) in hf_generate_batches
                or len(chosen) == 1
            ),
        )
        for prompts in chosen
    ]


def generates_padded_batches(bridge: Any) -> bool:
    """Whether TransformerBridge generates a left-padded batch on this model. Its adapter says no
    for models whose forward takes no attention mask (RWKV), and ``generate`` then refuses any
    batch, rightly: padding would enter the recurrent state."""
    return bool(getattr(bridge.adapter, "supports_batched_generation", True))


def cache_argument_diagnosis() -> str | None:
    """Why stock TransformerBridge's cache stays empty here, or ``None`` when it should not.

    Reads what the installed transformers passes (see :mod:`safelens_tl.fixes.bridge.cache`).
    """
    import transformers

    from safelens_tl.fixes.bridge import cache as bridge_cache

    if bridge_cache.attention_cache_argument() != bridge_cache.NEW_NAME:
        return None
    return (
        f"transformers {transformers.__version__} passes the KV cache to attention modules as "
        f"`cache`, and TransformerBridge's attention reads only `past_key_values`/`layer_past`, "
        f"so each cached step attends to itself alone; safelens-tl fixes this when active"
    )


# Encoder-decoder checkpoints ----------------------------------------------------------------------
# Cached generation of an encoder-decoder checkpoint (T5, BART, ...) through ``TransformerBridge``.
#
# ``TransformerBridge.generate`` recomputes an encoder-decoder model's decoder at every step,
# without a cache; only ``hf_generate`` (Hugging Face's own loop over the bridge's modules) uses
# one. So for these checkpoints the verifier's bridge check is ``hf_generate``: greedy, with the
# cache, its logits at every step replayed against two uncached forwards over the decoder tokens it
# generated, as :func:`safelens_tl.verify.bridge.run_batch` does for decoder-only models:
#
# - the bridge's own (its Hugging Face model, whose modules are the bridge's), in the same dtype;
# - an independent reference, the checkpoint loaded with ``AutoModelForSeq2SeqLM`` alone.
#
# The encoder reads the prompts as ``hf_generate`` tokenizes a list for an encoder-decoder model
# (the tokenizer's own padding side, padded to the longest).
#
# In half precision the reference comparison is reported but not held to a bound: these models'
# half-precision forwards are far from their own float32 ones (a tiny T5 in bfloat16: Hugging Face's
# by 0.22, the bridge's by 0.55, and the two 0.44 apart, uncached), so two implementations differ by
# more than any bound that would still mean something. The cache is held to the dtype's tolerance
# against the bridge's own uncached forward, as for decoder-only models, and the reference to its
# bound in float32.


def _seq2seq_decoder_forward(
    model: Any, encoded: Any, decoder_ids: torch.Tensor, use_cache: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over ``decoder_ids``: its logits, and with ``use_cache`` the keys of the first
    decoder self-attention layer it caches (``None`` where none holds keys, or without it)."""
    with torch.inference_mode():
        output = model(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            decoder_input_ids=decoder_ids,
            use_cache=use_cache,
        )
    if not use_cache:
        return output.logits, None
    cache = cache_of(output)
    # An EncoderDecoderCache holds the cross-attention's keys too, which never change.
    keys = first_cache_layer(getattr(cache, "self_attention_cache", cache))
    return output.logits, keys


def run_seq2seq_batch(
    bridge: Any,
    reference: Any,
    prompts: Sequence[str],
    new_tokens: int = NEW_TOKENS,
    *,
    order_steps: int | None = 0,
) -> BridgeRun:
    """``hf_generate`` of an encoder-decoder checkpoint's ``prompts`` with and without the
    cache; the cached one replayed (see the comment above :func:`_seq2seq_decoder_forward`)."""
    device = next(reference.parameters()).device
    encoded = bridge.tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
    start = time.perf_counter()
    cached = greedy_hf_generate(bridge, prompts, new_tokens, cached=True)
    middle = time.perf_counter()
    uncached = greedy_hf_generate(bridge, prompts, new_tokens, cached=False)
    end = time.perf_counter()
    # The decoder's start token, then one token per step: each step's logits predict the next.
    sequences = cached.sequences.to(device)
    step_logits = torch.stack(list(cached.logits), dim=1)
    decoder_ids = sequences[:, :-1]
    own, _ = _seq2seq_decoder_forward(bridge.original_model, encoded, decoder_ids)
    full, _ = _seq2seq_decoder_forward(reference, encoded, decoder_ids)
    _, keys = _seq2seq_decoder_forward(bridge.original_model, encoded, decoder_ids, True)
    _, own_keys = _seq2seq_decoder_forward(reference, encoded, decoder_ids, True)
    own_heads = None if own_keys is None else int(own_keys.shape[1])
    order = None
    if order_steps != 0:
        chosen = oracle.order_steps(decoder_ids.shape[1], order_steps)
        model = bridge.original_model
        other = [
            _seq2seq_decoder_forward(model, encoded, decoder_ids[:, : step + 1])[0][:, -1]
            for step in chosen
        ]
        whole = [own[:, step] for step in chosen]
        if oracle.other_kernels_apply(model):
            with oracle.other_kernels():
                other.append(_seq2seq_decoder_forward(model, encoded, decoder_ids)[0])
            whole.append(own)
        order = oracle.order_error(other, whole, float(own.float().abs().max()))
    return BridgeRun(
        architecture=str(reference.config.architectures[0]),
        batch=len(prompts),
        max_rel_err=oracle.relative_error(step_logits, own),
        reference_rel_err=oracle.relative_error(step_logits, full),
        cached_tokens=sequences[:, -new_tokens:].cpu(),
        uncached_tokens=uncached.sequences[:, -new_tokens:].cpu(),
        seconds_cached=middle - start,
        seconds_uncached=end - middle,
        cache_dtype=None if keys is None else keys.dtype,
        cache_device=None if keys is None else keys.device,
        cache_heads=None if keys is None else int(keys.shape[1]),
        expected_cache_heads=heads_to_expect(reference.config, own_heads, keys),
        reference_held=next(reference.parameters()).dtype == torch.float32,
        order_rel_err=order,
        cached_positions=int(decoder_ids.shape[1]) - 1,
        top1_agreement=oracle.agreement(step_logits, own),
        replay=("seq2seq", encoded, decoder_ids, own),
    )
