"""Where each TransformerLens release keeps its KV-cache classes.

This is the only module that knows TransformerLens versions. Everything else asks :func:`locate`
for a :class:`Layout` and works with the classes it names.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from dataclasses import dataclass
from types import ModuleType

DISTRIBUTION = "transformer-lens"


@dataclass(frozen=True)
class KnownLayout:
    """One row of the table: the releases it covers and the dotted paths of the cache classes."""

    name: str
    first_major: int
    last_major: int
    entry_path: str
    cache_path: str
    config_path: str
    #: Dotted path of ``HookedTransformer`` (whose ``generate`` reserves the cache); ``None`` when
    #: the release has none.
    model_path: str | None = None

    @property
    def has_hooked_transformer(self) -> bool:
        """Whether the release still ships ``HookedTransformer`` (4.x does not)."""
        return self.model_path is not None


#: The table. ``first_major``/``last_major`` are inclusive major versions of ``transformer-lens``.
KNOWN_LAYOUTS: tuple[KnownLayout, ...] = (
    KnownLayout(
        name="past_key_value_caching (TransformerLens 1.x-2.x)",
        first_major=1,
        last_major=2,
        entry_path="transformer_lens.past_key_value_caching.HookedTransformerKeyValueCacheEntry",
        cache_path="transformer_lens.past_key_value_caching.HookedTransformerKeyValueCache",
        config_path="transformer_lens.HookedTransformerConfig",
        model_path="transformer_lens.HookedTransformer.HookedTransformer",
    ),
    KnownLayout(
        name="cache package (TransformerLens 3.x)",
        first_major=3,
        last_major=3,
        entry_path="transformer_lens.cache.key_value_cache_entry.TransformerLensKeyValueCacheEntry",
        cache_path="transformer_lens.cache.key_value_cache.TransformerLensKeyValueCache",
        config_path="transformer_lens.config.TransformerLensConfig",
        model_path="transformer_lens.HookedTransformer.HookedTransformer",
    ),
    KnownLayout(
        name="cache package (TransformerLens 4.x, no HookedTransformer)",
        first_major=4,
        last_major=4,
        entry_path="transformer_lens.cache.key_value_cache_entry.TransformerLensKeyValueCacheEntry",
        cache_path="transformer_lens.cache.key_value_cache.TransformerLensKeyValueCache",
        config_path="transformer_lens.config.TransformerLensConfig",
    ),
)

#: TransformerLens's own loader of Hugging Face checkpoints into ``HookedTransformer`` (config
#: conversion, weight conversion), TransformerLens 2.x and 3.x.
HOOKED_LOADING_MODULE = "transformer_lens.loading_from_pretrained"

#: The module ``HookedTransformer.generate`` calls ``utils.get_attention_mask`` through
#: (TransformerLens 2.x and 3.x; 3.0 defines it in ``utilities.tokenize_utils`` and re-exports it).
#: Its calls on a placeholder of zeros are answered once per ``generate`` where that placeholder
#: exists (:data:`HOOKED_GENERATE_MASKS_NO_PADDING`; :mod:`safelens_tl.fixes.hooked.zeros_mask`).
HOOKED_UTILS_MODULE = "transformer_lens.utils"

#: HookedTransformer's attention base (TransformerLens 2.x and 3.x): its ALiBi layers get their
#: bias sized to each forward (:mod:`safelens_tl.fixes.hooked.alibi`).
HOOKED_ATTENTION_CLASS = "transformer_lens.components.abstract_attention.AbstractAttention"
#: HookedTransformer's mixture-of-experts layer (Mixtral, OLMoE), built in the model's dtype
#: (:mod:`safelens_tl.fixes.hooked.moe_dtype`). Not every release has it.
HOOKED_MOE_CLASS = "transformer_lens.components.mlps.moe.MoE"
#: Where ``simple_attn_linear`` (queries, keys, values) is defined (TransformerLens 2.x and 3.x),
#: and the attention modules that import it by name and call it through their own globals
#: (:mod:`safelens_tl.fixes.hooked.weight_copies`).
HOOKED_ATTENTION_LINEAR_MODULE = "transformer_lens.utilities.attention"
HOOKED_ATTENTION_LINEAR_USERS: tuple[str, ...] = (
    "transformer_lens.components.abstract_attention",
    "transformer_lens.components.grouped_query_attention",
)
#: Layers whose forward copies a weight matrix at every call in TransformerLens 3.0-3.9
#: (:mod:`safelens_tl.fixes.hooked.weight_copies`); each is rewritten only where its source does.
HOOKED_GATED_MLP_CLASS = "transformer_lens.components.mlps.gated_mlp.GatedMLP"
HOOKED_UNEMBED_CLASS = "transformer_lens.components.unembed.Unembed"
HOOKED_GQA_CLASS = "transformer_lens.components.grouped_query_attention.GroupedQueryAttention"

#: Where ``TransformerBridge`` lives (TransformerLens 3.x and 4.x). TransformerLens imports it
#: lazily (about 2 s), so its patches wait for that import instead of forcing it.
BRIDGE_MODULE = "transformer_lens.model_bridge"
#: Where TransformerBridge lists the Hugging Face architectures it boots (3.x and 4.x).
BRIDGE_ARCHITECTURES = (
    "transformer_lens.factories.architecture_adapter_factory.SUPPORTED_ARCHITECTURES"
)
BRIDGE_CLASS = "transformer_lens.model_bridge.TransformerBridge"
#: The attention bridges' common base; its ``_update_kv_cache`` reads the KV cache argument.
ATTENTION_BRIDGE_CLASS = (
    "transformer_lens.model_bridge.generalized_components.attention.AttentionBridge"
)
#: The rotary attention bridge that rotates queries and keys with Llama's function whatever the
#: model (see :mod:`safelens_tl.fixes.bridge.rotary_dtype`).
ROTARY_ATTENTION_BRIDGE_CLASS = (
    "transformer_lens.model_bridge.generalized_components.position_embeddings_attention."
    "PositionEmbeddingsAttentionBridge"
)
#: CodeGen's attention bridge, which looks its rotary angles up in a table transformers 5.24 moved
#: (see :mod:`safelens_tl.fixes.bridge.codegen`).
CODEGEN_ATTENTION_BRIDGE_CLASS = (
    "transformer_lens.model_bridge.generalized_components.codegen_attention.CodeGenAttentionBridge"
)
#: The linear-attention bridge of Qwen3-Next and Qwen3.5, whose hooked (uncached) forward in
#: TransformerLens 3.9 reads two functions from Hugging Face's layer that transformers 5.15+ keeps
#: at module level (see :mod:`safelens_tl.fixes.bridge.gated_delta`).
GATED_DELTA_NET_BRIDGE_CLASS = (
    "transformer_lens.model_bridge.generalized_components.gated_delta_net.GatedDeltaNetBridge"
)
#: The block bridge of T5, mT5 and LongT5, whose own block forward takes the cache as
#: ``past_key_values`` (see :mod:`safelens_tl.fixes.bridge.t5_block`).
T5_BLOCK_BRIDGE_CLASS = (
    "transformer_lens.model_bridge.generalized_components.t5_block.T5BlockBridge"
)
#: Architecture adapters whose ``create_stateful_cache`` imports a cache class later transformers
#: removed (see :mod:`safelens_tl.fixes.bridge.hybrid_cache`). Not every release has each.
STATEFUL_CACHE_ADAPTERS: tuple[str, ...] = (
    "transformer_lens.model_bridge.supported_architectures.olmo_hybrid."
    "OlmoHybridArchitectureAdapter",
)
#: Hugging Face's CodeGen, whose attention the bridge reads ``scale_attn`` of (transformers 5.24
#: dropped it); imported only by a CodeGen model.
CODEGEN_MODULE = "transformers.models.codegen.modeling_codegen"
CODEGEN_ATTENTION_CLASS = f"{CODEGEN_MODULE}.CodeGenAttention"
#: How TransformerBridge calls the Hugging Face model (TransformerLens 4.x; absent in 3.x, which
#: calls the model itself).
TRANSFORMERS_DRIVER_CLASS = (
    "transformer_lens.model_bridge.sources.transformers_driver.TransformersDriver"
)
#: Attention bridges whose own ``forward`` reads the KV cache argument from its keyword arguments
#: rather than through ``AttentionBridge._update_kv_cache``. Not every release has each.
FORWARD_CACHE_READERS: tuple[str, ...] = (
    "transformer_lens.model_bridge.generalized_components.mla_attention.MLAAttentionBridge",
    "transformer_lens.model_bridge.generalized_components.glm_moe_dsa_attention."
    "GlmMoeDsaAttentionBridge",
)
#: Attention bridges that reconstruct attention themselves (``_reconstruct_attention``) and may
#: never write the KV cache there: TransformerLens 3.x's ALiBi bridges (Falcon with ALiBi, such as
#: Falcon-RW, and MPT); 4.x calls ``_update_kv_cache`` in both. Not every release has each.
RECONSTRUCTING_ATTENTION_BRIDGES: tuple[str, ...] = (
    "transformer_lens.model_bridge.generalized_components.alibi_joint_qkv_attention."
    "ALiBiJointQKVAttentionBridge",
    "transformer_lens.model_bridge.generalized_components.mpt_alibi_attention."
    "MPTALiBiAttentionBridge",
)
#: Bridges that choose their cached (generation) path by whether ``cache_params`` arrives, the
#: name transformers gave the linear-attention state cache before 5.24 (which passes ``cache``),
#: each with the method that path runs. Not every release has each.
STATE_CACHE_READERS: dict[str, str] = {GATED_DELTA_NET_BRIDGE_CLASS: "_native_forward"}
#: State-space mixer bridges whose Hugging Face mixer multiplies its input by the attention mask it
#: is given (Mamba, FalconMamba); see :mod:`safelens_tl.fixes.bridge.state_mask`. Mamba-2's bridge
#: is not listed: its Hugging Face model trims the mask before its mixers see it.
STATE_SPACE_MIXERS: tuple[str, ...] = (
    "transformer_lens.model_bridge.generalized_components.ssm_mixer.SSMMixerBridge",
)
#: State-space mixer bridges whose opt-in eager scan (``eager_scan=True``, a Python scan from an
#: empty state so that the state hooks fire) runs only when no ``cache_params`` arrives, the name
#: transformers gave their cache before 5.24 (which passes ``cache``). Not every release has each.
EAGER_SCAN_MIXERS: tuple[str, ...] = (
    "transformer_lens.model_bridge.generalized_components.ssm_mixer.SSMMixerBridge",
    "transformer_lens.model_bridge.generalized_components.ssm2_mixer.SSM2MixerBridge",
)
_REMOTE_CODE = (
    "trust_remote_code model: its own modeling code passes the cache under its own name, "
    "whatever transformers calls it"
)
_ENCODER_DECODER = (
    "encoder-decoder block: TransformerBridge.generate recomputes the decoder without a KV cache, "
    "so cached generation does not go through it; hf_generate hands the cache on through its "
    "**kwargs and is right in stock too (benchmarks/bridge_hf_generate.py, T5Gemma)"
)
#: Bridge classes that read a KV cache argument and are deliberately left alone, with the reason.
#: ``tests/test_bridge_cache.py`` finds every reader in the installed release and fails
#: on one that is neither patched nor listed here.
UNPATCHED_CACHE_READERS: dict[str, str] = {
    "transformer_lens.model_bridge.supported_architectures.baichuan._BaichuanAttentionBridge": (
        _REMOTE_CODE
    ),
    "transformer_lens.model_bridge.supported_architectures.internlm2._InternLM2AttentionBridge": (
        _REMOTE_CODE
    ),
    "transformer_lens.model_bridge.supported_architectures.llada._LLaDAAttentionBridge": (
        _REMOTE_CODE
    ),
    "transformer_lens.model_bridge.generalized_components.t5gemma_decoder_block."
    "T5GemmaDecoderBlockBridge": _ENCODER_DECODER,
    "transformer_lens.model_bridge.generalized_components.t5gemma2_decoder_block."
    "T5Gemma2DecoderBlockBridge": _ENCODER_DECODER,
}
#: A Hugging Face attention module whose ``forward`` shows which name the installed transformers
#: gives the KV cache: ``past_key_values`` up to 5.23, ``cache`` from 5.24.
REFERENCE_ATTENTION = "transformers.models.llama.modeling_llama.LlamaAttention"
#: A Hugging Face model whose ``forward`` shows whether ``past_key_values`` is still accepted.
REFERENCE_MODEL = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
#: The base of Hugging Face model outputs (``output.past_key_values`` is an alias there from 5.24).
MODEL_OUTPUT_CLASS = "transformers.utils.generic.ModelOutput"


@dataclass(frozen=True)
class BridgeLayout:
    """The ``TransformerBridge`` classes found in the installed TransformerLens."""

    bridge_class: type
    attention_class: type
    #: Present in TransformerLens 4.x only.
    driver_class: type | None
    forward_cache_readers: tuple[type, ...]
    #: Bridges of :data:`STATE_CACHE_READERS` in this release, with their cached path's method.
    state_cache_readers: tuple[tuple[type, str], ...] = ()
    #: Bridges of :data:`STATE_SPACE_MIXERS` in this release.
    state_space_mixers: tuple[type, ...] = ()
    #: Bridges of :data:`EAGER_SCAN_MIXERS` in this release.
    eager_scan_mixers: tuple[type, ...] = ()
    #: :data:`ROTARY_ATTENTION_BRIDGE_CLASS`, where this release has it.
    rotary_attention_class: type | None = None
    #: Bridges of :data:`RECONSTRUCTING_ATTENTION_BRIDGES` in this release.
    reconstructing_attention_classes: tuple[type, ...] = ()
    #: :data:`CODEGEN_ATTENTION_BRIDGE_CLASS`, where this release has it.
    codegen_attention_class: type | None = None
    #: Adapters of :data:`STATEFUL_CACHE_ADAPTERS` in this release.
    stateful_cache_adapters: tuple[type, ...] = ()
    #: :data:`GATED_DELTA_NET_BRIDGE_CLASS`, where this release has it.
    gated_delta_net_class: type | None = None
    #: :data:`T5_BLOCK_BRIDGE_CLASS`, where this release has it.
    t5_block_class: type | None = None


def has_bridge() -> bool:
    """Whether this TransformerLens has ``transformer_lens.model_bridge`` (without importing it)."""
    from importlib import util

    try:
        return util.find_spec(BRIDGE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def bridge_architectures() -> frozenset[str]:
    """The Hugging Face architectures this TransformerBridge boots (empty without a bridge)."""
    if not has_bridge():
        return frozenset()
    try:
        supported = _import_object(BRIDGE_ARCHITECTURES)
    except (ImportError, AttributeError):
        return frozenset()
    return (
        frozenset(str(name) for name in supported) if isinstance(supported, dict) else frozenset()
    )


def optional_class(dotted: str) -> type | None:
    """The class at ``dotted``, or ``None`` when this release does not have it."""
    try:
        found = _import_object(dotted)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def optional_module(name: str) -> ModuleType | None:
    """The module ``name``, or ``None`` when this release does not have it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def locate_bridge() -> BridgeLayout:
    """Find the ``TransformerBridge`` classes (imports ``transformer_lens.model_bridge``).

    Raises :class:`UnsupportedLayoutError` when the bridge or its attention base is missing.
    """
    bridge_class = optional_class(BRIDGE_CLASS)
    attention_class = optional_class(ATTENTION_BRIDGE_CLASS)
    if bridge_class is None or attention_class is None:
        raise UnsupportedLayoutError(
            f"expected {BRIDGE_CLASS} and {ATTENTION_BRIDGE_CLASS}; TransformerBridge was not "
            "patched"
        )
    readers = tuple(c for c in map(optional_class, FORWARD_CACHE_READERS) if c is not None)
    state_readers = tuple(
        (found, method)
        for dotted, method in STATE_CACHE_READERS.items()
        if (found := optional_class(dotted)) is not None
    )
    return BridgeLayout(
        bridge_class=bridge_class,
        attention_class=attention_class,
        driver_class=optional_class(TRANSFORMERS_DRIVER_CLASS),
        forward_cache_readers=readers,
        state_cache_readers=state_readers,
        state_space_mixers=tuple(
            c for c in map(optional_class, STATE_SPACE_MIXERS) if c is not None
        ),
        eager_scan_mixers=tuple(c for c in map(optional_class, EAGER_SCAN_MIXERS) if c is not None),
        rotary_attention_class=optional_class(ROTARY_ATTENTION_BRIDGE_CLASS),
        reconstructing_attention_classes=tuple(
            c for c in map(optional_class, RECONSTRUCTING_ATTENTION_BRIDGES) if c is not None
        ),
        codegen_attention_class=optional_class(CODEGEN_ATTENTION_BRIDGE_CLASS),
        stateful_cache_adapters=tuple(
            c for c in map(optional_class, STATEFUL_CACHE_ADAPTERS) if c is not None
        ),
        gated_delta_net_class=optional_class(GATED_DELTA_NET_BRIDGE_CLASS),
        t5_block_class=optional_class(T5_BLOCK_BRIDGE_CLASS),
    )


#: The parameters the replacements expect; a release whose methods differ is not patched.
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "init_cache_entry": ("cfg", "device", "batch_size"),
    "append": ("self", "new_keys", "new_values"),
}


class UnsupportedLayoutError(RuntimeError):
    """The installed TransformerLens keeps its cache somewhere this release does not know."""


@dataclass(frozen=True)
class Layout:
    """The cache classes found in the installed TransformerLens."""

    release: str
    known: KnownLayout
    entry_class: type
    cache_class: type
    #: Set when the layout was recognised by its classes because the version said nothing (a git
    #: checkout's ``0.0.0``, no metadata): what to tell the user.
    note: str | None = None

    def config_class(self) -> type:
        """The release's base model-config class (for building configs in checks and tests)."""
        config = _import_object(self.known.config_path)
        assert isinstance(config, type)
        return config

    def model_class(self) -> type | None:
        """The release's ``HookedTransformer`` class, or ``None`` when it has none."""
        if self.known.model_path is None:
            return None
        model = _import_object(self.known.model_path)
        return model if isinstance(model, type) else None

    @property
    def entry_class_path(self) -> str:
        """Dotted path of the entry class, as written in reports."""
        return self.known.entry_path

    @property
    def cache_class_path(self) -> str:
        """Dotted path of the cache class, as written in reports."""
        return self.known.cache_path


def installed_release() -> str | None:
    """Return the installed ``transformer-lens`` version, or ``None`` when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def says_nothing(release: str | None) -> bool:
    """Whether a version names no release: no metadata, ``0.0.0`` (what a git checkout of
    TransformerLens reports, also with a ``.devN`` or ``+local`` tail), or not numeric."""
    if release is None or major_version(release) is None:
        return True
    return release.split("+", 1)[0].split(".dev", 1)[0] == "0.0.0"


def major_version(release: str) -> int | None:
    """Return the leading integer of a version string such as ``"3.0.0"`` or ``"2.18.0.dev1"``."""
    head = release.split(".", 1)[0]
    return int(head) if head.isdigit() else None


#: ``[first, end)`` of the releases whose ``HookedTransformer.generate`` builds its attention mask
#: from a tensor of zeros rather than from the prompts' tokens, so no padding is masked at any step
#: (upstream issue #1005; 3.1.0 builds it from the tokens and pads a list on the left). Read from
#: the wheels of 2.11.0 (no such mask), 2.13.0-2.18.0 and 3.0.0 (it), 3.1.0-3.9.0 (the fix).
HOOKED_GENERATE_MASKS_NO_PADDING = ((2, 13, 0), (3, 1, 0))


#: TransformerLens releases whose ``HookedTransformer.generate`` passes its step mask, built from
#: the prompts and extended with ones, to ``get_residual`` and ``forward``, and whose attention
#: computes the same numbers without an all-ones mask. Read from the wheels of 3.1.0, 3.5.0, 3.8.0
#: and 3.9.0; 4.x has no ``HookedTransformer``.
HOOKED_GENERATE_PASSES_ITS_MASK = ((3, 1, 0), (4, 0, 0))


def release_numbers(release: str) -> tuple[int, ...] | None:
    """``(major, minor, patch)`` of a version such as ``"3.0.0"`` or ``"2.18.0.dev1"``; ``None``
    when it does not start with three numbers."""
    parts = release.split("+", 1)[0].split(".")[:3]
    digits = ["".join(itertools.takewhile(str.isdigit, part)) for part in parts]
    if len(digits) < 3 or not all(digits):
        return None
    return tuple(int(digit) for digit in digits)


#: ``(first, end)``: releases from ``first`` up to, not including, ``end``.
ReleaseRange = tuple[tuple[int, int, int], tuple[int, int, int]]


def _within(releases: ReleaseRange, release: str | None) -> bool:
    """Whether ``release`` lies in ``[first, end)``; ``False`` for an unknown version."""
    numbers = None if release is None else release_numbers(release)
    first, end = releases
    return numbers is not None and first <= numbers < end


def hooked_generate_masks_no_padding(release: str | None) -> bool:
    """Whether this release's ``HookedTransformer.generate`` attends to the padding of a batch
    (:data:`HOOKED_GENERATE_MASKS_NO_PADDING`); ``False`` for an unknown version."""
    return _within(HOOKED_GENERATE_MASKS_NO_PADDING, release)


def hooked_generate_passes_its_mask(release: str | None) -> bool:
    """Whether this release's ``HookedTransformer.generate`` passes an all-ones mask that can be
    left out of ``forward`` (:data:`HOOKED_GENERATE_PASSES_ITS_MASK`); ``False`` for an unknown
    version."""
    return _within(HOOKED_GENERATE_PASSES_ITS_MASK, release)


def known_layout_for(release: str) -> KnownLayout | None:
    """Return the table row that covers ``release``, or ``None`` for an unknown release."""
    major = major_version(release)
    if major is None:
        return None
    for layout in KNOWN_LAYOUTS:
        if layout.first_major <= major <= layout.last_major:
            return layout
    return None


def _import_object(dotted: str) -> object:
    module_name, _, attribute = dotted.rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, attribute)


def _parameter_names(function: object) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)  # type: ignore[arg-type]


def check_signatures(entry_class: type) -> None:
    """Raise :class:`UnsupportedLayoutError` when the entry's methods are not shaped as expected."""
    for method_name, expected in EXPECTED_PARAMETERS.items():
        method = getattr(entry_class, method_name, None)
        if method is None:
            raise UnsupportedLayoutError(
                f"{entry_class.__qualname__} has no {method_name!r}; expected one taking {expected}"
            )
        received = _parameter_names(method)
        if received[: len(expected)] != expected:
            raise UnsupportedLayoutError(
                f"{entry_class.__qualname__}.{method_name} takes {received}; expected {expected}"
            )


def _importable(module: str) -> bool:
    from importlib import util

    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _recognise(release: str | None) -> Layout:
    """The layout whose classes the importable TransformerLens has, when its version says nothing.

    Rows are tried oldest first; a row naming ``HookedTransformer`` matches only where it imports,
    so a 4.x checkout (no ``HookedTransformer``) is not taken for 3.x.
    """
    shown = "no version metadata" if release is None else f"version {release!r}"
    for known in KNOWN_LAYOUTS:
        try:
            entry_class = _import_object(known.entry_path)
            cache_class = _import_object(known.cache_path)
            if known.model_path is not None:
                _import_object(known.model_path)
        except (ImportError, AttributeError):
            continue
        if not isinstance(entry_class, type) or not isinstance(cache_class, type):
            continue
        try:
            check_signatures(entry_class)
        except UnsupportedLayoutError:
            continue
        note = (
            f"transformer-lens has {shown} (installed from git or a source tree?); its classes "
            f"match the known layout {known.name!r}, which is patched"
        )
        return Layout(release or "unknown", known, entry_class, cache_class, note)
    raise UnsupportedLayoutError(
        f"transformer-lens is importable but has {shown}, and its classes match no layout "
        f"safelens-tl knows; nothing was patched. Install a released transformer-lens."
    )


def locate(release: str | None = None) -> Layout:
    """Find the cache classes of the installed TransformerLens.

    Raises :class:`UnsupportedLayoutError` with a message that names the release when it is not
    installed, not in the table, or its classes are missing or shaped differently. A version that
    says nothing (see :func:`says_nothing`) is no reason to refuse: the classes are recognised by
    what imports, and the layout's ``note`` says so.
    """
    release = installed_release() if release is None else release
    if says_nothing(release):
        if not _importable("transformer_lens"):
            raise UnsupportedLayoutError("transformer-lens is not installed; nothing to patch")
        return _recognise(release)
    assert release is not None
    known = known_layout_for(release)
    if known is None:
        supported = ", ".join(f"{k.first_major}.x-{k.last_major}.x" for k in KNOWN_LAYOUTS)
        raise UnsupportedLayoutError(
            f"transformer-lens {release} is not a release safelens-tl knows (supported: "
            f"{supported}); nothing was patched. Upgrade safelens-tl or pin transformer-lens."
        )
    try:
        entry_class = _import_object(known.entry_path)
        cache_class = _import_object(known.cache_path)
    except (ImportError, AttributeError) as error:
        raise UnsupportedLayoutError(
            f"transformer-lens {release}: expected {known.entry_path} and {known.cache_path} "
            f"({known.name}) but could not import them ({error}); nothing was patched"
        ) from error
    if not isinstance(entry_class, type) or not isinstance(cache_class, type):
        raise UnsupportedLayoutError(
            f"transformer-lens {release}: {known.entry_path} is not a class; nothing was patched"
        )
    try:
        check_signatures(entry_class)
    except UnsupportedLayoutError as error:
        raise UnsupportedLayoutError(
            f"transformer-lens {release}: {error}; nothing was patched"
        ) from error
    return Layout(release=release, known=known, entry_class=entry_class, cache_class=cache_class)
