"""Cached TransformerBridge generate across architectures: patched and stock, each against uncached.

For each architecture a tiny checkpoint with random weights is built from its transformers config
(two layers, nothing downloaded; vision-language and audio-text checkpoints get a one-layer
tower and are given text only; local attention spans :data:`WINDOW` positions, so generation goes
past it) and booted with ``TransformerBridge.boot_transformers`` and the tiny tokenizer. Greedy
generation of 8 tokens from one prompt and from two left-padded prompts, cached, is compared with
the bridge's own uncached forward over the generated sequence (largest logit difference relative
to the largest logit), first with safelens-tl active, then stock. A cache that is ignored, or
whose state is lost between steps, shows as a relative error near 1. Hugging Face's own cached
generate of the same prompts against its uncached forward is shown too ("HF's own"): where the
model's own cached path rounds differently (recurrent states, HRM's loops), twice that still counts
as right.

    HF_HUB_OFFLINE=1 python benchmarks/bridge_architectures.py [--architectures A,B] [--json PATH]
        [--dtype float32|float16|bfloat16] [--conversion boot|half|to] [--compatibility-mode]
        [--autocast float16|bfloat16]

An architecture the installed transformers or TransformerLens lacks, or whose tiny checkpoint
cannot be built or booted, gets a row saying why. CPU; float32 unless ``--dtype`` says otherwise,
where right means within the verifier's tolerance for that dtype and a cache stored in it.
``--compatibility-mode`` calls the bridge's ``enable_compatibility_mode()`` after booting (folded
layer norms, centred weights, ``HookedTransformer``'s hook names), as many users do;
``--autocast`` generates (and compares) under ``torch.autocast`` to that dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl.verify import bridge, checks, diagnostics, models

#: Settings every tiny checkpoint shares (an architecture's own settings override them).
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Larger than the default 0.02 so that logits are well apart and a cache error shows.
    "initializer_range": 0.3,
}
_MOE = {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2}
_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
_LATENT = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
_NO_GQA = {"num_key_value_heads": None, "head_dim": None}
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
#: Local attention spans 4 positions: the prompts (4 and 10 tokens) and the 8 generated tokens go
#: past it, so a cache that keeps, or masks, the wrong positions shows.
WINDOW = 4
_WINDOW = {"sliding_window": WINDOW}
_SLIDING = {**_WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
#: Gemma 3n and 4 add a small embedding per layer to every token's input: 8 wide, and one row per
#: token of the tokenizer (:func:`_language_config`). Their defaults (262,144 rows of 256 per
#: layer) made the tiny Gemma 4 checkpoint 0.5 GB, and with images 1.1 GB, which filled CI's disk.
_PER_LAYER_INPUT = {"hidden_size_per_layer_input": 8}
#: Key-value sharing (Gemma 3n, Gemma 4 E2B/E4B): the last two of four layers compute no keys or
#: values of their own and attend over those of the last earlier layer of their type, which the
#: cache does not hold for them.
_KV_SHARED = {
    **_WINDOW,
    **_PER_LAYER_INPUT,
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
#: Gemma 3n's language model: key-value sharing, AltUp, per-layer inputs, sparse activations.
_GEMMA_3N = {
    **_KV_SHARED,
    "laurel_rank": 4,
    "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
}
#: Llama 4's chunked attention: chunks of :data:`WINDOW` positions.
_CHUNKED = {
    **_EXPERTS,
    "attention_chunk_size": WINDOW,
    "layer_types": ["chunked_attention", "full_attention"],
}
#: Multi-head latent attention sizes its heads from the latent settings, not ``head_dim``.
_MLA_HEADS = {"num_key_value_heads": 4, "head_dim": None}
#: GPT-2-style names of the sizes.
_GPT2_SIZES = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}
#: Mamba-2-style state-space layers (also in hybrids): 8 heads of 16 = 2 x hidden_size.
_SSM2 = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "mamba_expand": 2,
}
#: architecture -> (transformers config class, its own settings; ``None`` removes a common one).
#: The first twenty are the ones every test run goes through; the rest are the other causal
#: language models TransformerLens 4.3 boots through TransformerBridge.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "GPT2LMHeadModel": ("GPT2Config", {**_GPT2_SIZES, **_NO_GQA, "n_positions": None}),
    "MistralForCausalLM": ("MistralConfig", _WINDOW),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"moe_intermediate_size": 32}),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", {**_HYBRID, "moe_intermediate_size": 32}),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", _HYBRID),
    "GemmaForCausalLM": ("GemmaConfig", {}),
    "Gemma2ForCausalLM": ("Gemma2Config", _WINDOW),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", _WINDOW),
    "Phi3ForCausalLM": ("Phi3Config", _WINDOW),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", {}),
    "MixtralForCausalLM": ("MixtralConfig", _WINDOW),
    "GptOssForCausalLM": ("GptOssConfig", _WINDOW),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", _NO_GQA),
    "FalconForCausalLM": ("FalconConfig", _NO_GQA),
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        {**_LATENT, **_MOE, **_MLA_HEADS, "q_lora_rank": 32, "first_k_dense_replace": 2},
    ),
    "GlmMoeDsaForCausalLM": (
        "GlmMoeDsaConfig",
        {
            **_LATENT,
            **_MOE,
            "q_lora_rank": 32,
            "first_k_dense_replace": 2,
            "num_key_value_heads": 4,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
    ),
    # State-space models, and hybrids of state-space and attention layers.
    "MambaForCausalLM": ("MambaConfig", {"state_size": 16, "time_step_rank": 8}),
    "Mamba2ForCausalLM": (
        "Mamba2Config",
        {"num_heads": 8, "state_size": 16, "n_groups": 1, "chunk_size": 16, "expand": 2},
    ),
    "FalconMambaForCausalLM": ("FalconMambaConfig", {"state_size": 16, "time_step_rank": 8}),
    # RWKV-4: a recurrent state under its own names, no attention heads, no attention mask
    # (TransformerBridge generates it one prompt at a time and recomputes without a cache).
    "RwkvForCausalLM": (
        "RwkvConfig",
        {
            **_NO_GQA,
            "num_attention_heads": None,
            "attention_hidden_size": 64,
            "context_length": 512,
            "max_position_embeddings": None,
        },
    ),
    "BambaForCausalLM": ("BambaConfig", {**_SSM2, "attn_layer_indices": [1]}),
    "FalconH1ForCausalLM": ("FalconH1Config", {**_SSM2, "mamba_d_ssm": 128}),
    "GraniteMoeHybridForCausalLM": (
        "GraniteMoeHybridConfig",
        {
            **_SSM2,
            **_EXPERTS,
            "layer_types": ["mamba", "attention"],
            "position_embedding_type": "rope",
        },
    ),
    "JambaForCausalLM": (
        "JambaConfig",
        {**_EXPERTS, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_dt_rank": 8},
    ),
    "NemotronHForCausalLM": (
        "NemotronHConfig",
        {
            **_MOE,
            "layers_block_type": ["linear_attention", "full_attention"],
            "ssm_state_size": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "chunk_size": 16,
        },
    ),
    "Zamba2ForCausalLM": (
        "Zamba2Config",
        {
            "layers_block_type": ["linear_attention", "hybrid"],
            "mamba_d_state": 16,
            "n_mamba_heads": 8,
            "mamba_headdim": 16,
            "attention_head_dim": 16,
            "adapter_rank": 8,
            "chunk_size": 16,
        },
    ),
    "Lfm2ForCausalLM": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
    "Lfm2MoeForCausalLM": (
        "Lfm2MoeConfig",
        {**_EXPERTS, "moe_intermediate_size": 32, "layer_types": ["conv", "full_attention"]},
    ),
    "RecurrentGemmaForCausalLM": (
        "RecurrentGemmaConfig",
        {"block_types": ["recurrent", "attention"], "attention_window_size": WINDOW},
    ),
    "OlmoHybridForCausalLM": ("OlmoHybridConfig", _HYBRID),
    "Qwen3_5MoeForCausalLM": (
        "Qwen3_5MoeTextConfig",
        {**_HYBRID, **_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    # Attention only, and their own names for sizes where they have them.
    "AfmoeForCausalLM": ("AfmoeConfig", {**_SLIDING, **_EXPERTS, "moe_intermediate_size": 32}),
    "ApertusForCausalLM": ("ApertusConfig", {}),
    "ArceeForCausalLM": ("ArceeConfig", {}),
    "BitNetForCausalLM": ("BitNetConfig", {}),
    "BloomForCausalLM": ("BloomConfig", {"n_layer": 2, "n_head": 4, **_NO_GQA}),
    "CodeGenForCausalLM": ("CodeGenConfig", {**_GPT2_SIZES, **_NO_GQA, "rotary_dim": 8}),
    "Cohere2ForCausalLM": ("Cohere2Config", _SLIDING),
    "CohereForCausalLM": ("CohereConfig", {}),
    "DeepseekV2ForCausalLM": (
        "DeepseekV2Config",
        {**_LATENT, **_MOE, **_MLA_HEADS, "q_lora_rank": 32, "first_k_dense_replace": 2},
    ),
    "DeepseekV4ForCausalLM": (
        "DeepseekV4Config",
        {
            **_MOE,
            **_WINDOW,
            "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        },
    ),
    "Ernie4_5ForCausalLM": ("Ernie4_5Config", {}),
    "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeConfig", {"moe_intermediate_size": 32}),
    "ExaoneForCausalLM": ("ExaoneConfig", {"num_layers": 2}),
    "Exaone4ForCausalLM": ("Exaone4Config", _SLIDING),
    "FlexOlmoForCausalLM": ("FlexOlmoConfig", _EXPERTS),
    "Gemma4ForCausalLM": ("Gemma4TextConfig", {**_SLIDING, **_PER_LAYER_INPUT}),
    "GlmForCausalLM": ("GlmConfig", {}),
    "Glm4ForCausalLM": ("Glm4Config", {}),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", _MOE),
    "Glm4MoeLiteForCausalLM": (
        "Glm4MoeLiteConfig",
        {
            **_LATENT,
            **_MOE,
            **_MLA_HEADS,
            "q_lora_rank": 32,
            "mlp_layer_types": ["dense", "sparse"],
        },
    ),
    "GPTBigCodeForCausalLM": ("GPTBigCodeConfig", {**_GPT2_SIZES, **_NO_GQA}),
    "GPTJForCausalLM": ("GPTJConfig", {**_GPT2_SIZES, **_NO_GQA, "rotary_dim": 8}),
    "GPTNeoForCausalLM": (
        "GPTNeoConfig",
        {
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "window_size": WINDOW,
            **_NO_GQA,
        },
    ),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", _EXPERTS),
    "HrmTextForCausalLM": ("HrmTextConfig", {}),
    "HunYuanDenseV1ForCausalLM": ("HunYuanDenseV1Config", {}),
    "Jais2ForCausalLM": ("Jais2Config", {}),
    "JetMoeForCausalLM": ("JetMoeConfig", {**_EXPERTS, "kv_channels": 16}),
    # Phi-3.5-MoE: as published, its config names the remote-code class (see PUBLISHED_AS).
    "PhiMoEForCausalLM": ("PhimoeConfig", _EXPERTS),
    "LagunaForCausalLM": (
        "LagunaConfig",
        {
            **_EXPERTS,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["full_attention", "full_attention"],
        },
    ),
    "Llama4ForCausalLM": ("Llama4TextConfig", _CHUNKED),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", _EXPERTS),
    "Ministral3ForCausalLM": ("Ministral3Config", {}),
    "ModernBertDecoderForCausalLM": (
        "ModernBertDecoderConfig",
        {**_WINDOW, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    "MptForCausalLM": ("MptConfig", {"d_model": 64, "n_layers": 2, "n_heads": 4, **_NO_GQA}),
    "NanoChatForCausalLM": ("NanoChatConfig", {}),
    "NemotronForCausalLM": ("NemotronConfig", {}),
    "OlmoForCausalLM": ("OlmoConfig", {}),
    "Olmo3ForCausalLM": ("Olmo3Config", _SLIDING),
    "OlmoeForCausalLM": ("OlmoeConfig", _EXPERTS),
    "OpenAIGPTLMHeadModel": ("OpenAIGPTConfig", {**_GPT2_SIZES, **_NO_GQA}),
    "OPTForCausalLM": ("OPTConfig", {"ffn_dim": 128, **_NO_GQA}),
    "PhiForCausalLM": ("PhiConfig", {}),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        {**_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "SeedOssForCausalLM": ("SeedOssConfig", {}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", _WINDOW),
    "VaultGemmaForCausalLM": ("VaultGemmaConfig", _SLIDING),
    "XGLMForCausalLM": ("XGLMConfig", {"d_model": 64, "num_layers": 2, "ffn_dim": 128, **_NO_GQA}),
    "YoutuForCausalLM": (
        "YoutuConfig",
        {**_LATENT, **_MLA_HEADS, "q_lora_rank": 32},
    ),
}
#: Multimodal rotary sections, in pairs of dimensions: three that sum to ``head_dim / 2``.
_MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
#: Vision-language checkpoints, generating text only (what Gemma 3 from 4B up, Mistral Small 3,
#: Llava and Qwen-VL are published as): architecture -> (config class, its language model's
#: config class, that model's own settings). The language model takes the sizes above; the
#: vision tower the smallest sizes of :data:`TINY_VISION` its config has (never run: no image).
VISION_LANGUAGE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3Config", "Gemma3TextConfig", _WINDOW),
    # As Gemma 4 E2B and E4B are published: with key-value sharing.
    "Gemma4ForConditionalGeneration": ("Gemma4Config", "Gemma4TextConfig", _KV_SHARED),
    # Its vision tower comes from timm, which needs torchvision.
    "Gemma3nForConditionalGeneration": ("Gemma3nConfig", "Gemma3nTextConfig", _GEMMA_3N),
    "Mistral3ForConditionalGeneration": ("Mistral3Config", "MistralConfig", _WINDOW),
    "Llama4ForConditionalGeneration": ("Llama4Config", "Llama4TextConfig", _CHUNKED),
    "LlavaForConditionalGeneration": ("LlavaConfig", "LlamaConfig", {}),
    "LlavaNextForConditionalGeneration": ("LlavaNextConfig", "LlamaConfig", {}),
    "LlavaOnevisionForConditionalGeneration": ("LlavaOnevisionConfig", "Qwen2Config", {}),
    "Idefics3ForConditionalGeneration": ("Idefics3Config", "LlamaConfig", {}),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", "Qwen2_5_VLTextConfig", _MROPE),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", "Qwen3VLTextConfig", {}),
    "Qwen3VLMoeForConditionalGeneration": (
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeTextConfig",
        {**_EXPERTS, "moe_intermediate_size": 32},
    ),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", "Qwen3_5TextConfig", _HYBRID),
    "Qwen3_5MoeForConditionalGeneration": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeTextConfig",
        {**_HYBRID, **_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "Glm4vForConditionalGeneration": ("Glm4vConfig", "Glm4vTextConfig", _MROPE),
    # Images become tokens of a VQ-VAE (its vq_config, in TOWERS), which text never runs.
    "Emu3ForConditionalGeneration": ("Emu3Config", "Emu3TextConfig", {}),
    "Gemma4UnifiedForConditionalGeneration": (
        "Gemma4UnifiedConfig",
        "Gemma4UnifiedTextConfig",
        _KV_SHARED,
    ),
    "MuseGlimmerForConditionalGeneration": ("MuseGlimmerConfig", "MuseGlimmerTextConfig", {}),
}
#: The smallest vision towers: each vision config takes the names it has.
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "depth": 1,
    "num_heads": 2,
    "embed_dim": 32,
    "out_hidden_size": 64,
    "image_size": 32,
    "patch_size": 8,
    # Llama 4's projector and Gemma 4 Unified's embedder (4096 and 3840 wide by default).
    "vision_output_dim": 32,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
    "mm_embed_dim": 32,
    "output_proj_dims": 32,
}
#: Towers :data:`TINY_VISION` cannot shrink: architecture -> sub-config -> its settings.
TOWERS: dict[str, dict[str, dict[str, Any]]] = {
    "Emu3ForConditionalGeneration": {
        "vq_config": {
            "codebook_size": 16,
            "embed_dim": 4,
            "latent_channels": 4,
            "base_channels": 32,  # its group norms take 32 groups
            "channel_multiplier": [1, 1],
            "num_res_blocks": 1,
            "attn_resolutions": [],
            "hidden_size": 32,
        }
    },
    # Its pixel shuffle turns 32 wide patches into 128 wide ones, which its adapter takes.
    "Llama4ForConditionalGeneration": {"vision_config": {"intermediate_size": 128}},
    # Its tower's attention has 12 key/value heads of 64 by default, for 2 query heads here.
    "Gemma4ForConditionalGeneration": {"vision_config": {"num_key_value_heads": 2, "head_dim": 16}},
    "Gemma3nForConditionalGeneration": {
        # timm's smallest MobileNet-V5 (80 million weights as built, 320 MB) at a fortieth of
        # its channels, its features as wide as the tower's hidden size (2,048 by default) on a
        # 2 x 2 grid (16 x 16): an image is 4 soft tokens.
        "vision_config": {
            "architecture": "mobilenetv5_base",
            "model_args": {
                "channel_multiplier": 0.025,
                "num_features": 32,
                "msfa_output_resolution": 2,
            },
        },
        "audio_config": {
            "hidden_size": 32,
            "input_feat_size": 16,
            "conf_num_hidden_layers": 1,
            "conf_num_attention_heads": 2,
            "sscp_conv_channel_size": [8, 8],
        },
    },
}
#: Audio towers for checkpoints named ``<architecture>+audio`` (:data:`WITH_AUDIO`): Gemma 4 has
#: no audio tower by default, and its other checkpoints stay without one.
AUDIO_TOWERS: dict[str, dict[str, Any]] = {
    "Gemma4ForConditionalGeneration": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        # Its input projection takes as many mel bins as the first convolution has channels.
        "subsampling_conv_channels": [16, 8],
        "output_proj_dims": 32,
        "attention_chunk_size": 4,
        "attention_context_left": 5,
    },
}
WITH_AUDIO = "+audio"
#: Settings of the composite config itself (text needs none of them, but the model reads them when
#: built).
COMPOSITE: dict[str, dict[str, Any]] = {
    # Its map from image-tokenizer codes to its vocabulary.
    "Emu3ForConditionalGeneration": {"vocabulary_map": {}},
    # Its adapter from the vision tower (4096 x 6144 by default): the tower's 32 wide x 2 x 2.
    "MuseGlimmerForConditionalGeneration": {"out_hidden_size": 128, "projector_hidden_size": 32},
    # Its projector pools the tower's 4 x 4 patches to a square of this many (16 x 16 by default).
    "Gemma3ForConditionalGeneration": {"mm_tokens_per_image": 4},
    # Its tower's 2 x 2 grid of features (TOWERS): soft tokens per image (256 by default).
    "Gemma3nForConditionalGeneration": {"vision_soft_tokens_per_image": 4},
}
#: Audio-text decoders (an audio encoder before a causal language model), generating text only,
#: as :data:`VISION_LANGUAGE`; their audio towers take the sizes of :data:`TINY_AUDIO` they have.
AUDIO_LANGUAGE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Qwen2AudioForConditionalGeneration": ("Qwen2AudioConfig", "Qwen2Config", {}),
    "AudioFlamingo3ForConditionalGeneration": ("AudioFlamingo3Config", "Qwen2Config", {}),
    "MusicFlamingoForConditionalGeneration": ("MusicFlamingoConfig", "Qwen2Config", {}),
    "GlmAsrForConditionalGeneration": ("GlmAsrConfig", "LlamaConfig", {}),
}
#: The smallest audio towers (Whisper-style encoders under two sets of names).
TINY_AUDIO: dict[str, Any] = {
    "d_model": 32,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_mel_bins": 16,
}
#: Every architecture the benchmark knows, in table order.
ALL_ARCHITECTURES: tuple[str, ...] = (*ARCHITECTURES, *VISION_LANGUAGE, *AUDIO_LANGUAGE)
#: The sizes of :data:`TINY_VISION` a SigLIP vision tower takes.
_SIGLIP = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
)
_BART_LIKE_WIDTH = 64
#: The smallest DaViT vision tower (Florence-2's): four stages of one block each.
_DAVIT = {
    "depths": [1, 1, 1, 1],
    "embed_dim": [16, 32, 32, 64],
    "num_heads": [1, 2, 2, 4],
    "num_groups": [1, 2, 2, 4],
    "window_size": 2,
    "projection_dim": _BART_LIKE_WIDTH,
    "drop_path_rate": 0.0,
}
_T5_LIKE = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}
_BART_LIKE = {
    "d_model": _BART_LIKE_WIDTH,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 64,
}
#: Encoder-decoder checkpoints (architecture -> config class, settings). Only ``hf_generate`` runs
#: them with a cache (``TransformerBridge.generate`` recomputes the decoder without one), so they
#: are swept by ``benchmarks/bridge_hf_generate.py``, not here. Weights at a larger scale than
#: the default (``initializer_factor``, ``init_std``), as :data:`COMMON` does for the others.
ENCODER_DECODER: dict[str, tuple[str, dict[str, Any]]] = {
    "T5ForConditionalGeneration": ("T5Config", {**_T5_LIKE, "initializer_factor": 3.0}),
    "MT5ForConditionalGeneration": ("MT5Config", {**_T5_LIKE, "initializer_factor": 3.0}),
    "LongT5ForConditionalGeneration": ("LongT5Config", {**_T5_LIKE, "initializer_factor": 3.0}),
    "BartForConditionalGeneration": ("BartConfig", {**_BART_LIKE, "init_std": 0.3}),
    "MBartForConditionalGeneration": ("MBartConfig", {**_BART_LIKE, "init_std": 0.3}),
    "PegasusForConditionalGeneration": ("PegasusConfig", {**_BART_LIKE, "init_std": 0.3}),
    "BlenderbotForConditionalGeneration": ("BlenderbotConfig", {**_BART_LIKE, "init_std": 0.3}),
    "M2M100ForConditionalGeneration": ("M2M100Config", {**_BART_LIKE, "init_std": 0.3}),
    "MarianMTModel": ("MarianConfig", {**_BART_LIKE, "init_std": 0.3}),
    # Longformer's encoder: local attention windows of WINDOW positions on each side.
    "LEDForConditionalGeneration": (
        "LEDConfig",
        {
            **_BART_LIKE,
            "init_std": 0.3,
            "attention_window": [WINDOW, WINDOW],
            "max_position_embeddings": None,
            "max_encoder_position_embeddings": 64,
            "max_decoder_position_embeddings": 64,
        },
    ),
    # T5 with mixture-of-experts feed-forward layers (every other layer sparse).
    "SwitchTransformersForConditionalGeneration": (
        "SwitchTransformersConfig",
        {
            **_T5_LIKE,
            "initializer_factor": 3.0,
            "num_decoder_layers": 2,
            "num_experts": 4,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 1,
        },
    ),
    # Its encoder and decoder are Gemma 2 stacks with their own configs (filled in by build).
    "T5GemmaForConditionalGeneration": (
        "T5GemmaConfig",
        {"encoder": {**COMMON, **_SLIDING}, "decoder": {**COMMON, **_SLIDING}},
    ),
    # Gemma 3 stacks; the decoder merges self- and cross-attention into one module, and the
    # encoder nests its language model next to a SigLIP vision tower (never run: no image).
    "T5Gemma2ForConditionalGeneration": (
        "T5Gemma2Config",
        {
            "encoder": {
                "text_config": {**COMMON, **_SLIDING},
                "vision_config": {
                    "model_type": "siglip_vision_model",
                    **{key: TINY_VISION[key] for key in _SIGLIP},
                },
                "mm_tokens_per_image": 4,
            },
            "decoder": {**COMMON, **_SLIDING},
        },
    ),
    # A BART encoder-decoder behind a DaViT vision tower (never run: no image). Its image token
    # keeps the default id, beyond the tiny vocabulary, so no prompt holds one.
    "Florence2ForConditionalGeneration": (
        "Florence2Config",
        {"text_config": {**_BART_LIKE, "init_std": 0.3}, "vision_config": _DAVIT},
    ),
}
#: Checkpoints whose published config names a class transformers lacks (the remote-code one they
#: were released with), which is the only name TransformerLens boots them by; transformers saves
#: its own class's name (``PhimoeForCausalLM``), so the folder's config is given the published one.
PUBLISHED_AS = frozenset({"PhiMoEForCausalLM"})
#: Saved as ``pytorch_model.bin``: TransformerLens's Switch Transformers adapter loads with
#: ``use_safetensors=False`` (the google/switch-base repositories ship that file only), so it
#: cannot boot a folder of safetensors, which is all transformers 5 saves.
PICKLED_WEIGHTS = frozenset({"SwitchTransformersForConditionalGeneration"})
#: Relative error above which a cached generation counts as wrong (the cache ignored or lost).
WRONG = 0.1
#: The sweep holds a model's cached path to twice Hugging Face's own cached path's error where that
#: is larger than the dtype's floor (some models round differently with a cache by themselves).
OWN_ROUNDING_FACTOR = 2.0


@dataclass
class Outcome:
    """One architecture, patched or stock: the worst relative error and whether tokens agree."""

    max_rel_err: float | None = None
    tokens_equal: bool | None = None
    error: str | None = None
    #: Hugging Face's own cached generate of the same prompts against its uncached forward: some
    #: models' cached path rounds differently by itself (recurrent states, HRM's loops).
    hugging_face_rel_err: float | None = None
    #: The model's dtype and what the first attention layer's cache holds after a cached forward
    #: over a prompt (``None`` where no layer holds keys: state-space models).
    dtype: str = "float32"
    cache_dtype: str | None = None
    #: Key/value heads of that layer's cache, and how many a correct cache holds
    #: (``BridgeRun.expected_cache_heads``: the config's count or Hugging Face's own).
    cache_heads: int | None = None
    expected_heads: int | None = None
    #: The dtype of ``torch.autocast`` around generation, if any: it computes in that precision,
    #: and keys are cached in whichever of it and the model's dtype they were computed in.
    autocast: str | None = None

    @property
    def precision(self) -> str:
        """The dtype the logits are rounded to: autocast's, else the model's."""
        return self.autocast or self.dtype

    def within_rounding(self) -> bool:
        """Logits within the verifier's tolerance for the dtype, or twice Hugging Face's own
        error."""
        if self.error is not None or self.max_rel_err is None:
            return False
        own = self.hugging_face_rel_err or 0.0
        tolerance = checks.TOLERANCES[getattr(torch, self.precision)]
        return self.max_rel_err <= max(tolerance, OWN_ROUNDING_FACTOR * own)

    def cache_right(self) -> bool:
        """The cache, if the model keeps keys at all, holds the model's dtype (or, under autocast,
        the dtype autocast computes in) and as many heads as a correct cache holds."""
        heads_right = self.cache_heads is None or self.cache_heads == self.expected_heads
        return self.cache_dtype in (None, self.dtype, self.autocast) and heads_right

    def cache_problem(self) -> str:
        """What :meth:`cache_right` found wrong, or ``""``."""
        problems = []
        if self.cache_dtype not in (None, self.dtype, self.autocast):
            problems.append(f"cache in {self.cache_dtype}")
        if self.cache_heads is not None and self.cache_heads != self.expected_heads:
            problems.append(f"{self.cache_heads} cached heads, {self.expected_heads} expected")
        return ", ".join(problems)

    def right(self) -> bool:
        """Logits within rounding (:meth:`within_rounding`), the cache in the model's dtype, and,
        in float32, the same tokens. In half precision a greedy choice between two logits closer
        than the dtype's rounding may go either way, as Hugging Face's own does (a tiny Mamba in
        bfloat16); the logits compared are over the same sequence, so that still shows."""
        if not self.within_rounding() or not self.cache_right():
            return False
        return bool(self.tokens_equal) or self.precision != "float32"

    def wrong(self) -> bool:
        """Far off: the cache ignored or lost (above :data:`WRONG`), NaN logits, or other tokens,
        for logits outside rounding. Within twice Hugging Face's own error is never wrong: HRM's
        loops in half precision move Hugging Face's own cached logits by more than 1 (bfloat16)."""
        assert self.max_rel_err is not None
        if self.within_rounding():
            return False
        # Written as "not <=" so that NaN is wrong too.
        return not self.max_rel_err <= WRONG or not self.tokens_equal

    def text(self) -> str:
        """The table cell."""
        if self.error is not None:
            return f"[red]{self.error}[/red]"
        assert self.max_rel_err is not None
        style = "green" if self.right() else "red" if self.wrong() else "yellow"
        tokens = "same tokens" if self.tokens_equal else "other tokens"
        stored = f", {self.cache_problem()}" if self.cache_problem() else ""
        return f"[{style}]{self.max_rel_err:.1e}, {tokens}{stored}[/{style}]"


def _config_class(name: str) -> Any:
    import transformers

    found = getattr(transformers, name, None)
    if found is None:
        raise LookupError(f"transformers {transformers.__version__} has no {name}")
    return found


def _language_config(config_name: str, settings: dict[str, Any], tokenizer: Any) -> Any:
    merged = {**COMMON, **settings}
    merged.update(
        vocab_size=models.vocab_size(),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if "hidden_size_per_layer_input" in merged:
        merged["vocab_size_per_layer_input"] = merged["vocab_size"]
    return _config_class(config_name)(
        **{key: value for key, value in merged.items() if value is not None}
    )


def _multimodal_config(architecture: str, tokenizer: Any) -> Any:
    if architecture in AUDIO_LANGUAGE:
        config_name, text_name, settings = AUDIO_LANGUAGE[architecture]
        tower, tiny = "audio_config", TINY_AUDIO
    else:
        config_name, text_name, settings = VISION_LANGUAGE[architecture]
        tower, tiny = "vision_config", TINY_VISION
    config_class = _config_class(config_name)
    text = _language_config(text_name, settings, tokenizer)
    # The default tower names its own type (CLIP, SigLIP, Pixtral, Whisper-like, ...); keep the
    # type, shrink what it has.
    towers = dict(TOWERS.get(architecture, {}))
    shrunk: dict[str, Any] = {}
    if tower in config_class.sub_configs:  # Emu3 has none: its image tokenizer is in TOWERS
        default_tower = getattr(config_class(), tower)
        if default_tower is None:  # Gemma 4 has no tower by default: its own class's defaults
            default_tower = config_class.sub_configs[tower]()
        known = default_tower.to_dict()
        shrunk = {key: value for key, value in tiny.items() if key in known}
        shrunk["model_type"] = default_tower.model_type
        shrunk.update(towers.pop(tower, {}))
    others = {name: config_class.sub_configs[name](**value) for name, value in towers.items()}
    config = config_class(
        text_config=text.to_dict(),
        **({tower: shrunk} if shrunk else {}),
        **others,
        **COMPOSITE.get(architecture, {}),
    )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    # The composite's own setting initializes the language model's weights in some releases.
    config.initializer_range = COMMON["initializer_range"]
    return config


def _nested_text(stack: dict[str, Any], tokens: dict[str, Any]) -> dict[str, Any]:
    text = stack.get("text_config")
    return {"text_config": {**text, **tokens}} if isinstance(text, dict) else {}


def _save_encoder_decoder(architecture: str, tokenizer: Any) -> str:
    config_name, settings = ENCODER_DECODER[architecture]
    tokens = {
        "vocab_size": models.vocab_size(),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    # Each stack gets the tokenizer's ids; so does a language model nested in one (T5Gemma 2).
    stacks = {
        name: {**value, **tokens, **_nested_text(value, tokens)}
        for name, value in settings.items()
        if isinstance(value, dict)
    }
    config = _config_class(config_name)(
        **tokens, decoder_start_token_id=tokenizer.bos_token_id, **{**settings, **stacks}
    )
    config.architectures = [architecture]
    torch.manual_seed(0)
    folder = models.scratch_folder(f"hf-{architecture}")
    # Florence-2 is an image-text-to-text model, not in the sequence-to-sequence mapping.
    model = bridge.build_model(config)
    with bridge.no_progress_bars():
        model.save_pretrained(folder)
    if architecture in PICKLED_WEIGHTS:
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    tokenizer.save_pretrained(folder)
    return str(folder)


def build(architecture: str) -> str:
    """Save the tiny checkpoint of ``architecture`` (any of :data:`ALL_ARCHITECTURES` and
    :data:`ENCODER_DECODER`); return its folder."""
    tokenizer = models.load_tokenizer()
    if architecture in ENCODER_DECODER:
        return _save_encoder_decoder(architecture, tokenizer)
    if architecture.endswith(WITH_AUDIO):
        return str(_save_with_audio(architecture.removesuffix(WITH_AUDIO), tokenizer))
    if architecture in VISION_LANGUAGE or architecture in AUDIO_LANGUAGE:
        config = _multimodal_config(architecture, tokenizer)
    else:
        config_name, settings = ARCHITECTURES[architecture]
        config = _language_config(config_name, settings, tokenizer)
    config.architectures = [architecture]
    folder = bridge.save_checkpoint(config, architecture, tokenizer)
    if architecture in PUBLISHED_AS:
        saved = folder / "config.json"
        published = json.loads(saved.read_text(encoding="utf-8"))
        published["architectures"] = [architecture]
        saved.write_text(json.dumps(published, indent=2), encoding="utf-8")
    return str(folder)


def _save_with_audio(architecture: str, tokenizer: Any) -> Path:
    """Save the tiny checkpoint of ``architecture`` with the audio tower of
    :data:`AUDIO_TOWERS`."""
    if architecture not in AUDIO_TOWERS:
        raise LookupError(f"no audio tower is defined for {architecture}")
    config = _multimodal_config(architecture, tokenizer)
    config.audio_config = config.sub_configs["audio_config"](**AUDIO_TOWERS[architecture])
    config.architectures = [architecture]
    folder: Path = bridge.save_checkpoint(config, architecture + "-audio", tokenizer)
    return folder


def last_line(error: BaseException) -> str:
    """The error's last line (type and message), cut to fit a table cell."""
    return traceback.format_exception_only(error)[-1].strip()[:120]


def boot(
    folder: str,
    dtype: torch.dtype = torch.float32,
    conversion: str = "boot",
    compatibility_mode: bool = False,
) -> Any:
    """Boot the tiny checkpoint in ``folder`` in ``dtype``, with the tiny tokenizer itself.

    transformers 5 loads some model types' tokenizers as their own class whatever the folder
    says (Qwen2, Qwen3.5-MoE), which reads every prompt of the word-level tokenizer as one token.
    ``conversion``: how the dtype is reached (:data:`safelens_tl.verify.bridge.CONVERSIONS`);
    ``compatibility_mode``: then call ``enable_compatibility_mode()`` (processed weights).
    """
    model = bridge.boot_folder(
        folder, dtype, conversion=conversion, tokenizer=models.load_tokenizer()
    )
    if compatibility_mode:
        model.enable_compatibility_mode(disable_warnings=True)
    return model


def quietly() -> contextlib.AbstractContextManager[Any]:
    """Boot-time chatter (TransformerLens prints, transformers warns) would bury the table."""
    return contextlib.redirect_stderr(io.StringIO())


def run(
    folder: str,
    active: bool,
    dtype: torch.dtype = torch.float32,
    conversion: str = "boot",
    compatibility_mode: bool = False,
    autocast: torch.dtype | None = None,
) -> Outcome:
    """Generate cached and uncached on every batch; stock when ``active`` is false; under
    ``torch.autocast`` to ``autocast`` when given."""
    name = diagnostics.dtype_name(dtype)
    computing = (
        contextlib.nullcontext()
        if autocast is None
        else torch.autocast(device_type="cpu", dtype=autocast)
    )
    try:
        with patched(active), quietly():
            model = boot(folder, dtype, conversion, compatibility_mode)
            with computing:
                reference = bridge.reference_from(folder, dtype)
                # Hugging Face's loop through the bridge (hf_generate) is not in an Outcome: its
                # own benchmark (bridge_hf_generate.py) reports it. Leaving it out here saves a
                # sixth of each architecture's time.
                runs = bridge.run_batches(model, reference, hf_generate_batches=())
                own_rounding = max(hugging_face_cached_error(reference, run) for run in runs)
    except Exception as error:  # a row saying why, not a crash
        return Outcome(error=last_line(error), dtype=name)
    stored = {diagnostics.dtype_name(r.cache_dtype) for r in runs if r.cache_dtype is not None}
    heads = [r.cache_heads for r in runs if r.cache_heads is not None]
    return Outcome(
        max_rel_err=bridge.worst_error(r.max_rel_err for r in runs),
        tokens_equal=all(torch.equal(r.cached_tokens, r.uncached_tokens) for r in runs),
        hugging_face_rel_err=own_rounding,
        dtype=name,
        cache_dtype=",".join(sorted(stored)) or None,
        cache_heads=heads[0] if heads else None,
        expected_heads=runs[0].expected_cache_heads,
        autocast=None if autocast is None else diagnostics.dtype_name(autocast),
    )


def hugging_face_cached_error(reference: Any, run: bridge.BridgeRun) -> float:
    """Hugging Face's own greedy cached ``generate`` from the prompts ``run`` generated from,
    against its own uncached forward over what it generated, no TransformerLens involved: how far
    the model's cached path rounds from its uncached one by itself (a recurrent state, HRM's
    loops). The sweep's own yardstick; the verifier takes none from a cached path
    (:mod:`safelens_tl.verify.oracle`)."""
    with torch.inference_mode():
        if run.replay[0] == "seq2seq":
            _, encoded, decoder_ids, _ = run.replay
            new_tokens = decoder_ids.shape[1]
            inputs = {
                "input_ids": encoded["input_ids"],
                "attention_mask": encoded["attention_mask"],
            }
        else:
            _, sequences, mask, _, _, new_tokens = run.replay
            device = next(reference.parameters()).device
            inputs = {
                "input_ids": sequences[:, :-new_tokens].to(device),
                "attention_mask": mask[:, :-new_tokens].to(device),
            }
        output = reference.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # raw logits are compared: an early end changes nothing
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logits = torch.stack(list(output.logits), dim=1)
        if run.replay[0] == "seq2seq":
            full = bridge.uncached_forward(
                reference, **inputs, decoder_input_ids=output.sequences[:, :-1]
            )
            return bridge.relative_error(logits, full)
        generated = torch.ones(
            inputs["attention_mask"].shape[0],
            new_tokens,
            dtype=inputs["attention_mask"].dtype,
            device=inputs["attention_mask"].device,
        )
        full_mask = torch.cat([inputs["attention_mask"], generated], dim=1)
        positions = (full_mask.cumsum(dim=1) - 1).clamp_min(0)
        full = bridge.uncached_forward(
            reference, input_ids=output.sequences, attention_mask=full_mask, position_ids=positions
        )
    return bridge.relative_error(logits, full[:, -new_tokens - 1 : -1])


def verdict(patched: Outcome, stock: Outcome) -> str:
    """What safelens-tl changes for this architecture."""
    if patched.error is not None:
        return "cannot say (patched fails)"
    both = " in both" if stock == patched else ""
    if patched.wrong():
        return "[red]wrong in both[/red]" if both else "[red]wrong with safelens-tl[/red]"
    if not patched.cache_right():
        return f"[red]{patched.cache_problem()}{both}[/red]"
    if not patched.right():
        return "off by more than rounding" + both
    if not stock.right():
        return "[green]fixed by safelens-tl[/green]"
    return "right in both"


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """Write what is known so far: a sweep takes minutes per architecture in half precision on a
    CPU (depthwise convolutions), and a run stopped early keeps its rows."""
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


def main(argv: list[str] | None = None) -> int:
    """Run every architecture asked for and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--architectures",
        default=",".join(ALL_ARCHITECTURES),
        help="comma-separated, from: " + ", ".join(ALL_ARCHITECTURES),
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="the bridge's and the reference's dtype (default float32)",
    )
    parser.add_argument(
        "--conversion",
        default="boot",
        choices=bridge.CONVERSIONS,
        help="boot in the dtype, or boot in float32 and call .half()/.bfloat16() or .to(dtype)",
    )
    parser.add_argument(
        "--compatibility-mode",
        action="store_true",
        help="call enable_compatibility_mode() after booting (processed weights, legacy hooks)",
    )
    parser.add_argument(
        "--autocast",
        choices=("float16", "bfloat16"),
        help="generate under torch.autocast to this dtype (the model stays in --dtype)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    arguments = parser.parse_args(argv)
    dtype = getattr(torch, arguments.dtype)
    autocast = None if arguments.autocast is None else getattr(torch, arguments.autocast)
    chosen = [name.strip() for name in arguments.architectures.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in ALL_ARCHITECTURES]
    if unknown:
        parser.error(
            f"--architectures: unknown {unknown}; expected some of {list(ALL_ARCHITECTURES)}"
        )
    how = "" if arguments.conversion == "boot" else f" by {arguments.conversion}"
    if arguments.compatibility_mode:
        how += ", compatibility mode"
    if autocast is not None:
        how += f", under autocast to {arguments.autocast}"
    tolerance = checks.TOLERANCES[autocast or dtype]
    table = Table(
        title=f"cached TransformerBridge generate, {arguments.dtype}{how}, "
        f"right within {tolerance:.0e}, wrong above {WRONG}"
    )
    columns = ("architecture", "patched: cached vs uncached", "stock", "HF's own", "verdict")
    for column in columns:
        table.add_column(column)
    results: dict[str, Any] = {}
    # Piped or logged, rich's default 80 columns would fold every cell.
    console = Console(width=None if Console().is_terminal else 160)
    for architecture in chosen:
        console.print(f"[dim]{architecture}...[/dim]")
        try:
            folder = build(architecture)
        except Exception as error:  # the row says why
            missing = Outcome(error=last_line(error))
            table.add_row(architecture, missing.text(), "", "", "cannot build")
            results[architecture] = {"build_error": missing.error}
            write_json(arguments.json, results)
            continue
        mode = arguments.compatibility_mode
        patched = run(folder, True, dtype, arguments.conversion, mode, autocast)
        stock = run(folder, False, dtype, arguments.conversion, mode, autocast)
        own = patched.hugging_face_rel_err
        own_text = "" if own is None else f"{own:.1e}"
        table.add_row(architecture, patched.text(), stock.text(), own_text, verdict(patched, stock))
        results[architecture] = {"patched": asdict(patched), "stock": asdict(stock)}
        write_json(arguments.json, results)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
