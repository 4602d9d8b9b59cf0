"""The built-in TransformerBridge fix (TransformerLens 3.x/4.x), registered like any plugin.

``transformer_lens.model_bridge`` is imported lazily by TransformerLens (about 2 s), so the
patches are :class:`~safelens_tl.patching.DeferredPatches`: built and installed when that module
is first imported, not at ``import transformer_lens``. Every patch is chosen by what the installed
code has (feature detection), never by version numbers: see :mod:`safelens_tl.bridge_cache`,
:mod:`safelens_tl.bridge_conversion`, :mod:`safelens_tl.bridge_rotary_dtype`,
:mod:`safelens_tl.bridge_codegen`, :mod:`safelens_tl.bridge_hybrid_cache`,
:mod:`safelens_tl.bridge_gated_delta`, :mod:`safelens_tl.bridge_hf_generate_mask`,
:mod:`safelens_tl.bridge_t5_block`, :mod:`safelens_tl.bridge_t5_legacy_block`,
:mod:`safelens_tl.bridge_attention_mask`, :mod:`safelens_tl.bridge_mask_dtype`,
:mod:`safelens_tl.bridge_state_mask`, :mod:`safelens_tl.bridge_uncached_media`,
:mod:`safelens_tl.bridge_stateful_generate`, :mod:`safelens_tl.bridge_generate_batch` and
:mod:`safelens_tl.bridge_cohere_rotary`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from safelens_tl import (
    bridge_attention_mask,
    bridge_cache,
    bridge_cache_writes,
    bridge_codegen,
    bridge_cohere_rotary,
    bridge_conversion,
    bridge_gated_delta,
    bridge_generate_batch,
    bridge_hf_generate_mask,
    bridge_hybrid_cache,
    bridge_mask_dtype,
    bridge_model_call,
    bridge_rotary_dtype,
    bridge_state_mask,
    bridge_stateful_generate,
    bridge_t5_block,
    bridge_t5_legacy_block,
    bridge_uncached_media,
    targets,
)
from safelens_tl.hookspecs import hookimpl
from safelens_tl.patching import DeferredPatches, Patch
from safelens_tl.plugins import Failure
from safelens_tl.targets import Layout

SOURCE = "safelens_tl.bridge_plugin"
#: What each reader patch applies to the method it replaces.
_Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@hookimpl
def safelens_tl_patches(layout: Layout) -> list[DeferredPatches]:
    """TransformerBridge's cache argument, ``cfg`` sync, rotary dtype, state-space masks, masks
    and caches of single architectures, when it exists; Hugging Face's CodeGen once imported."""
    if not targets.has_bridge():
        return []
    return [
        DeferredPatches(targets.BRIDGE_MODULE, bridge_patches),
        # Its own module: importing Hugging Face's CodeGen costs about 0.3 s, paid only by
        # those who load a CodeGen model.
        DeferredPatches(targets.CODEGEN_MODULE, codegen_patches),
    ]


def codegen_patches() -> Iterator[Patch | Failure]:
    """Hugging Face's ``CodeGenAttention`` answers ``scale_attn`` where transformers 5.24+ no
    longer sets it (:class:`~safelens_tl.bridge_codegen.HeadSizeScale`)."""
    attention = targets.optional_class(targets.CODEGEN_ATTENTION_CLASS)
    if attention is None:
        yield Failure(
            SOURCE,
            "CodeGen",
            f"expected {targets.CODEGEN_ATTENTION_CLASS}; CodeGen models may fail through "
            "TransformerBridge",
        )
    elif "scale_attn" not in attention.__dict__:
        yield Patch(attention, "scale_attn", bridge_codegen.HeadSizeScale())


def bridge_patches() -> Iterator[Patch | Failure]:
    """Build the patches once ``transformer_lens.model_bridge`` is imported.

    Yields a :class:`~safelens_tl.plugins.Failure` (reported, not raised) for what cannot be
    fixed here.
    """
    bridge = targets.locate_bridge()
    for name in ("to", "_apply"):
        method = getattr(bridge.bridge_class, name)
        yield Patch(bridge.bridge_class, name, bridge_conversion.converting(method))
    hf_generate = bridge.bridge_class.__dict__.get("hf_generate")
    if callable(hf_generate):
        wrappers = hf_generate_wrappers(hf_generate)
        yield Patch(bridge.bridge_class, "hf_generate", _composed(hf_generate, *wrappers))
    yield _own_method_patch(
        bridge.bridge_class,
        "generate",
        _generate_wrapper,
        "generate options",
        "an uncached generate from an image or a sound sees it at its first step only, and an "
        "uncached generate of a state-space model may drop stop_at_eos, return_type and "
        "repetition_penalty",
    )
    if bridge.rotary_attention_class is not None:
        yield _own_method_patch(
            bridge.rotary_attention_class,
            "forward",
            _rotary_forward_wrapper,
            "rotary attention",
            "float16 and bfloat16 OLMo models may fail with a dtype mismatch in attention, and "
            "Cohere's rotary positions may be applied as Llama's",
        )
    if bridge.codegen_attention_class is not None:
        yield _own_method_patch(
            bridge.codegen_attention_class,
            "_reconstruct_attention",
            bridge_codegen.rotating_with_model_embeddings,
            "CodeGen",
            "CodeGen models fail with transformers 5.24+, and in float16 and bfloat16",
        )
    yield _own_method_patch(
        bridge.attention_class,
        "_apply_reconstruct_attention_mask",
        _attention_mask_wrapper,
        "attention masks",
        "a forward with an attention_mask may attend to later positions in models whose mask "
        "marks only padding (OpenAI GPT), and padded rows may come out as NaN under autocast",
    )
    gated_delta = bridge.gated_delta_net_class
    if gated_delta is not None and bridge_gated_delta.reads_functions_from_the_layer(
        gated_delta.__dict__.get("_hooked_forward")
    ):
        yield Patch(
            gated_delta,
            "_hooked_forward",
            bridge_gated_delta.supplying_layer_functions(gated_delta.__dict__["_hooked_forward"]),
        )
    for adapter in bridge.stateful_cache_adapters:
        yield _own_method_patch(
            adapter,
            "create_stateful_cache",
            bridge_hybrid_cache.falling_back_to_the_model_s_cache,
            "transformers compatibility",
            "its cached generation may fail on a cache class this transformers lacks",
        )
    yield from _cache_writing_patches(bridge)
    renamed = bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME
    yield from _state_space_mixer_patches(bridge, renamed)
    yield from _model_call_patch(bridge)
    update = bridge.attention_class.__dict__.get("_update_kv_cache")
    if renamed or not bridge_cache.reads_layer_past(update):
        yield _own_method_patch(
            bridge.attention_class,
            "_update_kv_cache",
            bridge_cache.reading_update_kv_cache,
            "transformers compatibility",
            "it cannot be taught the `cache` argument of this transformers, nor `layer_past`, so "
            "its cached generation may ignore the cache",
        )
    t5_block = bridge.t5_block_class
    if t5_block is not None and bridge_t5_legacy_block.builds_a_legacy_forward(t5_block):
        # Whatever transformers 5 calls the cache, this block forward never hands it on.
        yield _own_method_patch(
            t5_block,
            "forward",
            bridge_t5_legacy_block.handing_sublayers_the_cache,
            "transformers compatibility",
            "its T5-family decoders may ignore the cache, or fail, with transformers 5",
        )
    if not renamed:
        return  # transformers passes past_key_values, which TransformerLens reads: nothing to fix
    readers: list[tuple[type, str, _Wrapper]] = [
        (c, "forward", bridge_cache.reading_forward) for c in bridge.forward_cache_readers
    ]
    if t5_block is not None and bridge_t5_block.hands_sublayers_the_cache(t5_block):
        readers.append((t5_block, "forward", bridge_t5_block.reading_block_forward))
    for owner, cached_path in bridge.state_cache_readers:
        if callable(getattr(owner, cached_path, None)):
            reader = functools.partial(bridge_cache.reading_state_forward, cached_path=cached_path)
            readers.append((owner, "forward", reader))
        else:
            yield Failure(
                SOURCE,
                "transformers compatibility",
                f"{owner.__module__}.{owner.__qualname__} has no {cached_path}; it cannot be "
                f"taught the `cache` argument of this transformers, so its cached generation "
                f"may start every step from an empty state",
            )
    for owner, name, wrap in readers:
        yield _own_method_patch(
            owner,
            name,
            wrap,
            "transformers compatibility",
            "it cannot be taught the `cache` argument of this transformers, so its cached "
            "generation may ignore the cache",
        )
    yield from _model_output_alias()


def hf_generate_wrappers(hf_generate: Callable[..., Any]) -> list[_Wrapper]:
    """What wraps this release's ``TransformerBridge.hf_generate``, outermost first: a
    state-space model's ``generate`` options always, the attention mask of a batch of prompts
    where the release drops it (TransformerLens 3.0-3.8)."""
    wrappers: list[_Wrapper] = [bridge_stateful_generate.honouring_generate_options]
    if bridge_hf_generate_mask.drops_the_attention_mask(hf_generate):
        wrappers.append(bridge_hf_generate_mask.passing_the_attention_mask)
    return wrappers


def _composed(original: Callable[..., Any], *wrappers: _Wrapper) -> Callable[..., Any]:
    """``original`` wrapped by each of ``wrappers``, the first outermost. Its ``__wrapped__`` is
    ``original`` itself, as a single wrapper's is: what the patch replaced, one step away."""
    composed = original
    for wrap in reversed(wrappers):
        composed = wrap(composed)
    if composed is not original:
        composed.__wrapped__ = original  # type: ignore[attr-defined]
    return composed


def _generate_wrapper(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``TransformerBridge.generate`` with its fixes: media at every uncached step, a
    state-space model's options kept for its fallback to ``hf_generate``, and, where the release
    uses no attention mask (TransformerLens 3.0-3.7), text prompts of different lengths
    generated as one left-padded, masked batch."""
    wrappers: list[_Wrapper] = [
        bridge_stateful_generate.recording_generate_options,
        bridge_uncached_media.passing_media_at_every_step,
    ]
    if bridge_hf_generate_mask.drops_the_attention_mask(generate):
        wrappers.insert(0, bridge_generate_batch.generating_padded_batch)
    return _composed(generate, *wrappers)


def _attention_mask_wrapper(apply_mask: Callable[..., Any]) -> Callable[..., Any]:
    """``AttentionBridge._apply_reconstruct_attention_mask`` with both of its fixes: a float32
    mask saturating on half-precision scores (autocast), and a padding-row mask keeping the
    causal mask."""
    return _composed(
        apply_mask,
        bridge_mask_dtype.saturating_the_mask,
        bridge_attention_mask.keeping_the_causal_mask,
    )


def _rotary_forward_wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A rotary attention bridge's ``forward`` rotating in the model's dtype and, where it does
    not know Cohere's rotation, rotating Cohere's queries and keys as Hugging Face does."""
    wrappers: list[_Wrapper] = [bridge_rotary_dtype.rotating_in_model_dtype]
    if bridge_cohere_rotary.lacks_interleaved_rotary(forward):
        wrappers.insert(0, bridge_cohere_rotary.rotating_cohere_in_pairs)
    return _composed(forward, *wrappers)


def _own_method_patch(
    owner: type, name: str, wrap: _Wrapper, area: str, consequence: str
) -> Patch | Failure:
    """``owner.<name>`` (defined by ``owner`` itself) replaced by ``wrap`` of it, or a reported
    :class:`~safelens_tl.plugins.Failure` saying ``consequence`` when ``owner`` defines none."""
    method = owner.__dict__.get(name)
    if callable(method):
        return Patch(owner, name, wrap(method))
    return Failure(
        SOURCE, area, f"{owner.__module__}.{owner.__qualname__} defines no {name}; {consequence}"
    )


def _cache_writing_patches(bridge: targets.BridgeLayout) -> Iterator[Patch | Failure]:
    """Attention bridges whose own reconstruction never writes the KV cache (TransformerLens
    3.x's ALiBi bridges): it is written at their head split, as 4.x does."""
    skipping = [
        owner
        for owner in bridge.reconstructing_attention_classes
        if bridge_cache_writes.skips_the_cache(owner.__dict__.get("_reconstruct_attention"))
    ]
    if not skipping:
        return
    consequence = "its cached generation attends to the current position alone"
    for owner in skipping:
        yield _own_method_patch(
            owner,
            "_reconstruct_attention",
            bridge_cache_writes.writing_the_cache,
            "KV cache",
            consequence,
        )
    yield _own_method_patch(
        bridge.attention_class,
        "_reshape_qkv_to_heads",
        bridge_cache_writes.splitting_into_the_cache,
        "KV cache",
        f"{', '.join(owner.__qualname__ for owner in skipping)}: {consequence}",
    )


def _state_space_mixer_patches(
    bridge: targets.BridgeLayout, renamed: bool
) -> Iterator[Patch | Failure]:
    """State-space mixers: the mask of the positions they run (any transformers), and their eager
    scan kept to calls without a cache where transformers passes it as ``cache``."""
    eager = bridge.eager_scan_mixers if renamed else ()
    for mixer in dict.fromkeys((*bridge.state_space_mixers, *eager)):
        # One wrapper of the original for whichever adaptations apply: one patch per method.
        wrap = functools.partial(
            bridge_state_mask.adapting_mixer_forward,
            trims_mask=mixer in bridge.state_space_mixers,
            keeps_eager_scan_uncached=mixer in eager,
        )
        yield _own_method_patch(
            mixer,
            "forward",
            wrap,
            "state-space mixers",
            "its cached generation may be wrong (for a batch of prompts, or with eager_scan=True)",
        )


def _model_call_patch(bridge: targets.BridgeLayout) -> Iterator[Patch | Failure]:
    """The call into the Hugging Face model: the cache under the model's name for it, positions
    where only ``cache_position`` says them (with any transformers)."""
    if bridge.driver_class is not None:
        owner, model_attribute, keep_old_name = bridge.driver_class, "underlying_model", False
    else:  # TransformerLens 3.x hands the model its arguments from TransformerBridge.forward
        owner, model_attribute, keep_old_name = bridge.bridge_class, "original_model", True
    wrap = functools.partial(
        bridge_model_call.adapting_model_call,
        model_attribute=model_attribute,
        keep_accepted_old_name=keep_old_name,
    )
    yield _own_method_patch(
        owner,
        "forward",
        wrap,
        "transformers compatibility",
        "the model may not get its cache under the name it takes, nor the positions of "
        "stateful cached steps",
    )


def _model_output_alias() -> Iterator[Patch]:
    """``output.past_key_values``, which the bridge's generate loop reads, where transformers
    no longer has it."""
    output = targets.optional_class(targets.MODEL_OUTPUT_CLASS)
    if output is not None and not hasattr(output, bridge_cache.SHIM_OLD_NAME):
        yield Patch(output, bridge_cache.SHIM_OLD_NAME, bridge_cache.output_alias())
