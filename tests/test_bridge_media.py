"""Cached generation from an image or a sound through a multimodal TransformerBridge.

The sweeps and the verifier generate text only. Here a prompt holds an image (or audio): its
pixels (or features) go through the vision (or audio) tower once, at the prompt's forward, and
every later step reads them only from the cache; the multimodal rotary positions (M-RoPE) of
Qwen's and GLM-4V's generated tokens also depend on the image's grid. Hugging Face's own cached
``generate`` of the same checkpoint is the reference. The tiny checkpoints of
``benchmarks/bridge_architectures.py`` are copied with their image or audio tokens moved into the
tiny vocabulary (their default ids lie beyond it). Of the vision-language ones the Qwens and GLM-4V
need torchvision (TransformerLens's adapters import it): they run in tox's ``py312-tl430-vision``
(PyPI's build of torch, whose torchvision loads; the CPU build of torch 2.13 has none that does),
and the fix they need is also tested on Hugging Face's Qwen2.5-VL alone, stepped as the bridge
steps it, everywhere. The audio-text ones need nothing
more; Gemma 4, built with an image tower only, gets a tiny audio tower for its sound tests
(``Gemma4ForConditionalGeneration+audio``). Gemma's copies also get word embeddings a tenth as
large: as built, the tiny Gemmas pick the same token whatever their prompt, image or none.
Emu3's image tokenizer turns an image into codes that are words of its own vocabulary: its copy
maps them into the tiny one. Gemma 3n is left out: TransformerLens 4.3 boots it as text only
(``pixel_values can only be passed to multimodal or vision models``, stock as patched).

TransformerLens's own uncached ``generate`` (``use_past_kv_cache=False``) hands the pixels to the
first step only and runs every later step over the whole sequence without them: its tokens drift
from the second one on (TransformerLens 3.9 and 4.3). With safelens-tl every uncached step gets
them (:mod:`safelens_tl.fixes.bridge.uncached_media`), and picks Hugging Face's tokens too.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import safelens_tl
from safelens_tl.fixes.bridge import _mrope_positions as bridge_mrope_positions
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.verify import bridge, models
from tests.conftest import architecture_folder, requires_bridge

pytestmark = [requires_bridge, pytest.mark.media]

NEW_TOKENS = 8
#: The text around the image or sound.
PROMPT = "the cat runs"
IMAGE_MODELS = [
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "Llama4ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Glm4vForConditionalGeneration",
    "MuseGlimmerForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Emu3ForConditionalGeneration",
]
#: TransformerLens's adapters for these import torchvision.
NEEDS_TORCHVISION = {name for name in IMAGE_MODELS if name.startswith(("Qwen", "Glm"))}
AUDIO_MODELS = [
    "Qwen2AudioForConditionalGeneration",
    "AudioFlamingo3ForConditionalGeneration",
    "MusicFlamingoForConditionalGeneration",
    "GlmAsrForConditionalGeneration",
    # Gemma 4 with an audio tower added (it has an image tower too; the test gives it a sound).
    "Gemma4ForConditionalGeneration+audio",
]
#: Qwen's placeholders and the tokens around an image (Llava reads only the placeholder); the
#: audio placeholder takes the image's id; the video placeholder, only in the video tests.
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = -1, -2, -3, -4
#: Those that take a video (``pixel_values_videos``).
VIDEO_MODELS = [
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "MuseGlimmerForConditionalGeneration",
    "Glm4vForConditionalGeneration",
]


def _with_media_tokens_in_the_vocabulary(
    architecture: str, destination: Path, video: bool = False
) -> Path:
    """A copy of the tiny checkpoint whose image (or audio) tokens are the vocabulary's last
    ids; with ``video``, its video placeholder too (left out of the others, so that no token they
    generate is taken for a video's)."""
    folder = destination / architecture
    shutil.copytree(architecture_folder(architecture), folder)
    vocabulary = models.vocab_size()
    ids = {
        "image_token_id": vocabulary + IMAGE_TOKEN,
        "image_token_index": vocabulary + IMAGE_TOKEN,
        "audio_token_id": vocabulary + IMAGE_TOKEN,
        "audio_token_index": vocabulary + IMAGE_TOKEN,
        "vision_start_token_id": vocabulary + VISION_START,
        "vision_end_token_id": vocabulary + VISION_END,
    }
    if video:
        ids["video_token_id"] = vocabulary + VIDEO_TOKEN
    if architecture in AUDIO_MODELS:  # a model of both: its sound's placeholder is not an image's
        ids["image_token_id"] = vocabulary + VISION_START
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update({key: value for key, value in ids.items() if key in config})
    if "vocabulary_map" in config:  # Emu3: its image tokenizer's codes are words of its own
        config["vocabulary_map"] = _emu3_vocabulary(config["vq_config"]["codebook_size"])
    if "image_grid_pinpoints" in config:
        # LLaVA-NeXT, LLaVA-OneVision: tile images of the tiny tower's size, not 336-pixel ones.
        size = config["vision_config"]["image_size"]
        config["image_grid_pinpoints"] = [[size, 2 * size]]
    path.write_text(json.dumps(config), encoding="utf-8")
    if config["model_type"].startswith("gemma"):
        _quieter_word_embeddings(folder / "model.safetensors")
    return folder


def _emu3_vocabulary(codes: int) -> dict[str, int]:
    """Emu3's map from its image tokenizer's codes (and its image placeholder and end-of-row
    token) to ids of the tiny vocabulary: the codes take ids from 20 on, clear of the special
    tokens and of the media ids at the vocabulary's end."""
    vocabulary = models.vocab_size()
    words = {f"<|visual token {code:06d}|>": 20 + code for code in range(codes)}
    return {**words, "<image>": vocabulary + IMAGE_TOKEN, "<|extra_200|>": vocabulary + VISION_END}


def _quieter_word_embeddings(checkpoint: Path) -> None:
    """Gemma's word embeddings a tenth as large. Gemma multiplies them by the square root of its
    width; with random weights its residual stream then holds the last token's embedding almost
    alone, and with the same matrix as its output layer the tiny model picks that token again
    whatever came before, image or none. Smaller, attention (and with it the image) counts."""
    weights = safetensors.torch.load_file(checkpoint)
    for name, tensor in weights.items():
        if name.endswith("embed_tokens.weight"):
            tensor.mul_(0.1)
    safetensors.torch.save_file(weights, checkpoint, metadata={"format": "pt"})


def _video_prompt(reference: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:data:`PROMPT` with a random video (seed 0) of two frames (one step of the tower's
    temporal patches, each frame a grid of 2 x 2 merged patches) after its first word, and the
    inputs that carry it. Qwen2.5-VL's processor puts the whole video between one pair of vision
    tokens, the later Qwens and GLM-4V each frame (after its timestamp, left out here); MuseGlimmer
    has no such tokens. GLM-4V's frames are image placeholders that ``mm_token_type_ids`` marks
    as a video's."""
    vocabulary = models.vocab_size()
    vision = reference.config.vision_config
    merge = getattr(vision, "spatial_merge_size", None) or vision.merge_size
    side, frames = 2 * merge, 2
    temporal = getattr(vision, "temporal_patch_size", None) or vision.patch_temporal
    patch = 3 * temporal * vision.patch_size**2
    inputs = {
        "pixel_values_videos": torch.randn(frames * side * side, patch, generator=_seeded()),
        "video_grid_thw": torch.tensor([[frames, side, side]]),
    }
    glm = reference.config.model_type.startswith("glm")
    placeholder = vocabulary + (IMAGE_TOKEN if glm else VIDEO_TOKEN)
    frame = [placeholder] * (side * side // merge**2)
    start, end = vocabulary + VISION_START, vocabulary + VISION_END
    if not hasattr(vision, "spatial_merge_size"):  # MuseGlimmer
        video = frame * frames
    elif reference.config.model_type == "qwen2_5_vl":
        video = [start, *frame * frames, end]
    else:
        video = [start, *frame, end] * frames
    words = models.load_tokenizer()(PROMPT, return_tensors="pt")["input_ids"][0]
    prompt = torch.cat([words[:1], torch.tensor(video), words[1:]]).unsqueeze(0)
    if "mm_token_type_ids" in inspect.signature(reference.forward).parameters:
        inputs["mm_token_type_ids"] = 2 * (prompt == placeholder).long()  # 2 = video
    return prompt, inputs


def _media_prompt(
    reference: Any, sound: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:data:`PROMPT` with one random image, or one random sound (a model without an image
    tower, or ``sound``), after its first word, and the inputs that carry it."""
    words = models.load_tokenizer()(PROMPT, return_tensors="pt")["input_ids"][0]
    config = reference.config
    if sound or getattr(config, "vision_config", getattr(config, "vq_config", None)) is None:
        return _audio_prompt(reference, words)
    return _image_prompt(reference, words)


def _audio_prompt(
    reference: Any, words: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random log-mel features (seed 0) as long as the Whisper-style tower takes (Gemma 4's
    conformer: 64 frames), all of them valid, and one placeholder per frame the tower puts
    out."""
    audio = reference.config.audio_config
    if hasattr(audio, "subsampling_conv_channels"):  # Gemma 4: frames first, a boolean mask
        bins = audio.subsampling_conv_channels[0]
        features = torch.randn(1, 64, bins, generator=torch.Generator().manual_seed(0))
        mask = torch.ones(1, features.shape[1], dtype=torch.bool)
    else:
        positions = getattr(audio, "max_source_positions", None) or audio.max_position_embeddings
        features = torch.randn(
            1, audio.num_mel_bins, 2 * positions, generator=torch.Generator().manual_seed(0)
        )
        mask = torch.ones(1, features.shape[-1], dtype=torch.long)
    mask_name = "feature_attention_mask"
    if mask_name not in inspect.signature(reference.forward).parameters:
        mask_name = "input_features_mask"  # Audio Flamingo 3, Music Flamingo, GLM-ASR
    # Whisper-style towers say how many frames come out; GLM-ASR's only by running.
    tower = next(
        (m for m in reference.modules() if hasattr(m, "_get_feat_extract_output_lengths")), None
    )
    if tower is not None:
        placeholders = int(tower._get_feat_extract_output_lengths(mask.sum(-1))[-1].item())
    else:
        with torch.no_grad():
            output = _own_method(reference, "get_audio_features")(features, mask)
        frames = getattr(output, "pooler_output", output)
        placeholders = frames.reshape(-1, frames.shape[-1]).shape[0]
    audio_tokens = torch.full((placeholders,), models.vocab_size() + IMAGE_TOKEN)
    prompt = torch.cat([words[:1], audio_tokens, words[1:]]).unsqueeze(0)
    return prompt, {"input_features": features, mask_name: mask}


def _own_method(reference: Any, name: str) -> Any:
    """The model's method ``name``: on the whole model, or on its inner one (Gemma 4's audio,
    Emu3's images)."""
    return getattr(reference, name, None) or getattr(reference.model, name)


def _seeded() -> torch.Generator:
    """The random numbers of every image, the same in every test."""
    return torch.Generator().manual_seed(0)


def _pixels(reference: Any) -> dict[str, torch.Tensor]:
    """The inputs that carry one random image to a tower that takes whole images (or, Gemma 4,
    patches with their positions) and says itself how many features it puts out."""
    vision = getattr(reference.config, "vision_config", None)
    if vision is None:  # Emu3: an image of 8 x 8 pixels, 4 x 4 codes and an end-of-row each row
        return {
            "pixel_values": torch.randn(1, 3, 8, 8, generator=_seeded()),
            "image_sizes": torch.tensor([[8, 8]]),
        }
    if hasattr(vision, "pooling_kernel_size"):  # Gemma 4: patches and their (x, y)
        side = 2 * vision.pooling_kernel_size
        patch = getattr(vision, "model_patch_size", None) or vision.patch_size
        x, y = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy")
        return {
            "pixel_values": torch.rand(1, side * side, 3 * patch**2, generator=_seeded()),
            "image_position_ids": torch.stack([x.flatten(), y.flatten()], -1).unsqueeze(0),
        }
    size = vision.image_size
    inputs = {"pixel_values": torch.randn(1, 3, size, size, generator=_seeded())}
    if "pixel_attention_mask" in inspect.signature(reference.forward).parameters:
        # Idefics3: images by prompt, each with the mask of its real (unpadded) pixels.
        inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(0)
        inputs["pixel_attention_mask"] = torch.ones(1, 1, size, size, dtype=torch.bool)
    if vision.model_type == "pixtral":  # Mistral 3's tower asks each image's size
        inputs["image_sizes"] = torch.tensor([[size, size]])
    if getattr(reference.config, "image_grid_pinpoints", None):
        # Any resolution (LLaVA-NeXT, LLaVA-OneVision): one image twice as wide as high,
        # as the whole image scaled down and its two tiles.
        inputs["pixel_values"] = torch.randn(1, 3, 3, size, size, generator=_seeded())
        inputs["image_sizes"] = torch.tensor([[size, 2 * size]])
    return inputs


def _image_prompt(
    reference: Any, words: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A prompt with one random image (seed 0) between the first word of ``words`` and the rest,
    and the inputs that carry the image: ``pixel_values`` and, where the model asks, the image's
    patch grid, patch positions, size or pixel mask."""
    vocabulary = models.vocab_size()
    vision = getattr(reference.config, "vision_config", None)  # Emu3 has none
    merge = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None)
    if merge:  # Qwen, GLM-4V, MuseGlimmer: flattened patches on a grid
        side = 2 * merge
        frames = getattr(vision, "temporal_patch_size", None) or vision.patch_temporal
        inputs = {
            "pixel_values": torch.randn(
                side * side, 3 * frames * vision.patch_size**2, generator=_seeded()
            ),
            "image_grid_thw": torch.tensor([[1, side, side]]),
        }
        image = [vocabulary + IMAGE_TOKEN] * (side * side // merge**2)
        if hasattr(vision, "spatial_merge_size"):  # tokens around it (Qwen, GLM-4V)
            image = [vocabulary + VISION_START, *image, vocabulary + VISION_END]
    else:  # one placeholder per feature the tower and projector put out
        inputs = _pixels(reference)
        with torch.no_grad():
            features = _own_method(reference, "get_image_features")(**inputs)
        if getattr(features, "pooler_output", None) is not None:
            features = features.pooler_output
        elif hasattr(features, "last_hidden_state"):  # Llama 4 with transformers 5.23
            features = features.last_hidden_state
        if isinstance(features, (list, tuple)):  # one tensor per image
            features = torch.cat([image.reshape(-1, image.shape[-1]) for image in features])
        image = [vocabulary + IMAGE_TOKEN] * features.reshape(-1, features.shape[-1]).shape[0]
    prompt = torch.cat([words[:1], torch.tensor(image), words[1:]]).unsqueeze(0)
    if "mm_token_type_ids" in inspect.signature(reference.forward).parameters:
        # Qwen3-VL asks which tokens are image placeholders, as its processor says (1 = image).
        inputs["mm_token_type_ids"] = (prompt == vocabulary + IMAGE_TOKEN).long()
    return prompt, inputs


#: TransformerBridge's ``generate`` as the tests run it: greedy, never stopped at the
#: end-of-sequence token, the tokens back.
BRIDGE_GREEDY = {
    "max_new_tokens": NEW_TOKENS,
    "do_sample": False,
    "return_type": "tokens",
    "verbose": False,
    "stop_at_eos": False,
}


def _hugging_face_s_generate(
    reference: Any, prompt: torch.Tensor, use_cache: bool = True, **inputs: Any
) -> torch.Tensor:
    """What Hugging Face's own greedy ``generate`` returns for :data:`NEW_TOKENS` tokens, by
    default cached, never stopped at the end-of-sequence token (as the bridge is told)."""
    config = copy.deepcopy(reference.generation_config)
    config.eos_token_id = []  # None would fall back to the model config's
    with torch.no_grad():
        generated: torch.Tensor = reference.generate(
            prompt,
            generation_config=config,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=use_cache,
            **inputs,
        )
    return generated


def _hugging_face_s_own(
    reference: Any, prompt: torch.Tensor, use_cache: bool = True, **inputs: Any
) -> torch.Tensor:
    """The tokens Hugging Face's own ``generate`` picks, by default cached. (Uncached, a tiny
    model may generate its own image (or audio) token, which every later step takes for one more
    placeholder than the image has features: ``ValueError``.)"""
    generated = _hugging_face_s_generate(reference, prompt, use_cache, **inputs)
    assert generated.shape[1] == prompt.shape[1] + NEW_TOKENS
    tokens: torch.Tensor = generated[:, -NEW_TOKENS:]
    return tokens


def _boot_unless_stock_cannot(folder: Path) -> Any:
    """The bridge of ``folder``, or a skip where stock TransformerLens cannot boot it either
    (3.0's Llava: ``'CLIPVisionModel' object has no attribute 'vision_model'``)."""
    try:
        return bridge.boot_folder(folder, torch.float32, tokenizer=models.load_tokenizer())
    except Exception as error:
        safelens_tl.deactivate()
        try:
            bridge.boot_folder(folder, torch.float32, tokenizer=models.load_tokenizer())
        except Exception:
            pytest.skip(f"stock TransformerBridge cannot boot it either: {error!r}")
        finally:
            safelens_tl.activate()
        raise


MediaSetup = tuple[Any, torch.Tensor, dict[str, torch.Tensor], torch.Tensor, Any]
PrepareMedia = Callable[..., MediaSetup]


@pytest.fixture(scope="module")
def media_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrepareMedia]:
    """:func:`_prepare_media_prompt` once per architecture and medium for this module's tests, or
    the skip it raised: the tests of one architecture share its bridge, as the property tests do
    (generating changes no weight; a user also generates many times from one model), and the
    copy, the boot and Hugging Face's two reference generations happen once instead of four
    times. Released when the module is done."""
    base = tmp_path_factory.mktemp("media")
    prepared: dict[tuple[str, bool], MediaSetup | pytest.skip.Exception] = {}

    def prepare(architecture: str, video: bool = False) -> MediaSetup:
        key = (architecture, video)
        if key not in prepared:
            try:
                prepared[key] = _prepare_media_prompt(architecture, base / str(video), video)
            except pytest.skip.Exception as skip:
                prepared[key] = skip
        found = prepared[key]
        if isinstance(found, pytest.skip.Exception):
            raise found
        return found

    yield prepare
    prepared.clear()


def _prepare_media_prompt(architecture: str, destination: Path, video: bool) -> MediaSetup:
    """The bridge of the tiny ``architecture`` with its media tokens in the vocabulary, a prompt
    with an image or a sound (with ``video``, a video), the inputs that carry it, the tokens
    Hugging Face's own ``generate`` picks for it (which the media changes), and Hugging Face's
    model."""
    destination.mkdir(exist_ok=True)
    if architecture in NEEDS_TORCHVISION:
        pytest.importorskip("torchvision")
    folder = _with_media_tokens_in_the_vocabulary(architecture, destination, video)
    reference = bridge.reference_from(folder, torch.float32)
    if video:
        prompt, inputs = _video_prompt(reference)
    else:
        prompt, inputs = _media_prompt(reference, sound=architecture in AUDIO_MODELS)
    expected = _hugging_face_s_own(reference, prompt, **inputs)
    # Every media token (the vocabulary's last four ids) replaced by a word.
    without_media = prompt.where(prompt < models.vocab_size() + VIDEO_TOKEN, prompt[0, -1])
    assert not torch.equal(_hugging_face_s_own(reference, without_media), expected)
    model = _boot_unless_stock_cannot(folder)
    parameters = inspect.signature(model.generate).parameters.values()
    if not any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        pytest.skip("this TransformerBridge.generate takes no image or sound")
    return model, prompt, inputs, expected, reference


@pytest.mark.parametrize("architecture", IMAGE_MODELS + AUDIO_MODELS)
def test_a_bridge_generates_from_an_image_or_a_sound_with_the_cache_as_hugging_face_does(
    architecture: str, media_setup: PrepareMedia, patched: safelens_tl.activation.Status
) -> None:
    """``generate`` and ``hf_generate`` with ``pixel_values`` (or ``input_features``), cached,
    pick Hugging Face's own tokens, which the image (or sound) changes. (Stock Llava and the
    audio-text models fail this with transformers 5.25: the cache is ignored, and every step
    after the prompt's forward sees neither the image nor the text.)"""
    model, prompt, inputs, expected, reference = media_setup(architecture)
    generated = model.generate(prompt, use_past_kv_cache=True, **BRIDGE_GREEDY, **inputs)
    assert generated[:, -NEW_TOKENS:].tolist() == expected.tolist()
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_type": "tokens"}
    through_hugging_face = model.hf_generate(
        prompt, use_past_kv_cache=True, use_cache=True, stop_at_eos=False, **greedy, **inputs
    )
    # TransformerLens 3.9's hf_generate stops at the end-of-sequence token whatever stop_at_eos
    # says (it leaves Hugging Face's default in force): up to there, the same tokens.
    picked = through_hugging_face[0, prompt.shape[1] :].tolist()
    assert picked == expected[0, : len(picked)].tolist()
    assert len(picked) == NEW_TOKENS or picked[-1] == reference.generation_config.eos_token_id


@pytest.mark.parametrize("architecture", IMAGE_MODELS + AUDIO_MODELS)
def test_an_uncached_generate_sees_the_image_or_sound_at_every_step(
    architecture: str, media_setup: PrepareMedia, patched: safelens_tl.activation.Status
) -> None:
    """``generate(use_past_kv_cache=False)`` with an image (or a sound) picks Hugging Face's own
    tokens: every step, which runs the whole sequence again, gets the image and its per-token
    inputs, extended (stock TransformerLens 3.9 and 4.3 give them to the first step only). Where
    the tiny model picks its own image token, Hugging Face's uncached ``generate`` raises, and so
    does the bridge's."""
    model, prompt, inputs, _, reference = media_setup(architecture)
    _assert_generates_as_hugging_face(model, reference, prompt, inputs, use_cache=False)


def _assert_generates_as_hugging_face(
    model: Any,
    reference: Any,
    prompt: torch.Tensor,
    inputs: dict[str, Any],
    use_cache: bool,
    **options: Any,
) -> None:
    """``model.generate`` of ``prompt`` with ``inputs`` and ``options`` picks the tokens of
    Hugging Face's own ``generate``, both cached or both not; where Hugging Face's raises (a
    tiny model that picks its own image token, uncached), the bridge's raises too."""
    bridge_s = {"use_past_kv_cache": use_cache, **BRIDGE_GREEDY}
    try:
        expected = _hugging_face_s_own(reference, prompt, use_cache, **options, **inputs)
    except ValueError as error:
        assert "do not match" in str(error)  # more placeholders than features
        with pytest.raises(ValueError, match="do not match"):
            model.generate(prompt, **bridge_s, **options, **inputs)
        return
    generated = model.generate(prompt, **bridge_s, **options, **inputs)
    assert generated[:, -NEW_TOKENS:].tolist() == expected.tolist()


def _left_padded_batch(
    prompt: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Two prompts: ``prompt`` with its image (or sound), left-padded, and one two words longer
    with the same placeholders and the negative of the image (or silence); their attention mask,
    and the inputs that carry both."""
    words = models.load_tokenizer()(PROMPT + " the cat", return_tensors="pt")["input_ids"][0]
    media = prompt[0, 1:-2]  # PROMPT's first word, the placeholders, its last two words
    longer = torch.cat([words[:1], media, words[1:]])
    shorter = torch.cat([torch.zeros(len(longer) - prompt.shape[1], dtype=torch.long), prompt[0]])
    batch = torch.stack([shorter, longer])
    mask = torch.ones_like(batch)
    mask[0, : len(longer) - prompt.shape[1]] = 0
    both: dict[str, torch.Tensor] = {}
    for name, value in inputs.items():
        if name == "mm_token_type_ids":
            both[name] = (batch == models.vocab_size() + IMAGE_TOKEN).long()
        elif name == "pixel_values":
            # Not a black image: Idefics3 drops an image of zeros as padding.
            both[name] = torch.cat([value, -value])
        elif name == "input_features":
            both[name] = torch.cat([value, torch.zeros_like(value)])
        else:  # the image's grid, the sound's mask: the same for both
            both[name] = torch.cat([value, value])
    return batch, mask, both


@pytest.mark.parametrize("use_past_kv_cache", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("architecture", IMAGE_MODELS + AUDIO_MODELS)
def test_a_left_padded_batch_with_images_or_sounds_generates_as_hugging_face_does(
    architecture: str,
    use_past_kv_cache: bool,
    media_setup: PrepareMedia,
    patched: safelens_tl.activation.Status,
) -> None:
    """Two prompts of different lengths, each with its own image (or sound), left-padded, with
    their ``attention_mask``: ``generate`` picks Hugging Face's tokens for both, cached and
    uncached (Hugging Face's generate cached, and uncached)."""
    model, prompt, inputs, _, reference = media_setup(architecture)
    if "attention_mask" not in inspect.signature(model.generate).parameters:
        pytest.skip("this TransformerBridge.generate takes no attention_mask")
    batch, mask, both = _left_padded_batch(prompt, inputs)
    _assert_generates_as_hugging_face(
        model, reference, batch, both, use_past_kv_cache, attention_mask=mask
    )


@pytest.mark.parametrize("use_past_kv_cache", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("architecture", VIDEO_MODELS)
def test_a_bridge_generates_from_a_video_as_hugging_face_does(
    architecture: str,
    use_past_kv_cache: bool,
    media_setup: PrepareMedia,
    patched: safelens_tl.activation.Status,
) -> None:
    """``generate`` with ``pixel_values_videos`` and ``video_grid_thw`` picks Hugging Face's
    own tokens, which the video changes, cached and uncached. (Stock: the cached Qwen2.5-VL and
    Qwen3-VL raise at the second step, as with an image; the rest pick other tokens.)"""
    model, prompt, inputs, _, reference = media_setup(architecture, video=True)
    _assert_generates_as_hugging_face(model, reference, prompt, inputs, use_past_kv_cache)


def test_an_encoder_decoder_bridge_generates_from_an_image_as_hugging_face_does(
    tmp_path: Path, patched: safelens_tl.activation.Status
) -> None:
    """Florence-2 (a BART encoder-decoder reading a DaViT tower's image features through
    placeholders in its encoder's input): TransformerBridge's ``generate`` runs encoder-decoders
    without a cache and hands the image to no step, so stock picks the same tokens whatever the
    image (TransformerLens 3.9 and 4.3). With safelens-tl every step gets the image: Hugging
    Face's own tokens, for each of two images that change them."""
    folder = _with_media_tokens_in_the_vocabulary("Florence2ForConditionalGeneration", tmp_path)
    reference = bridge.reference_from(folder, torch.float32)
    generator = torch.Generator().manual_seed(0)
    images = [torch.randn(1, 3, 64, 64, generator=generator), torch.zeros(1, 3, 64, 64)]
    with torch.no_grad():
        features = reference.get_image_features(images[0])
    placeholders = getattr(features, "pooler_output", features).shape[1]
    words = models.load_tokenizer()(PROMPT, return_tensors="pt")["input_ids"][0]
    image = torch.full((placeholders,), models.vocab_size() + IMAGE_TOKEN)
    prompt = torch.cat([image, words]).unsqueeze(0)
    model = _boot_unless_stock_cannot(folder)
    picked = []
    for pixels in images:
        expected = _hugging_face_s_generate(reference, prompt, pixel_values=pixels)
        generated = model.generate(prompt, pixel_values=pixels, **BRIDGE_GREEDY)
        # TransformerLens 3.9 does not force the end token at the length limit, as Hugging Face
        # does where the config names one (Florence-2's does): up to there, the same tokens.
        assert generated[:, :-1].tolist() == expected[:, :-1].tolist()
        picked.append(expected.tolist())
    assert picked[0] != picked[1], "the image changes Hugging Face's tokens"


def _decoded_step_by_step(model: Any, prompt: torch.Tensor, inputs: dict[str, Any]) -> list[int]:
    """Greedy tokens of ``model`` driven as TransformerBridge's ``generate`` drives it: the prompt
    with its image, then one token per call with the whole attention mask and no positions."""
    cache_name = bridge_cache.attention_cache_argument() or "past_key_values"
    with torch.no_grad():
        output = model(input_ids=prompt, use_cache=True, **inputs)
        cache, tokens = output.past_key_values, prompt
        for _ in range(NEW_TOKENS):
            chosen = output.logits[:, -1:].argmax(dim=-1)
            tokens = torch.cat([tokens, chosen], dim=1)
            step = {"attention_mask": torch.ones_like(tokens), cache_name: cache}
            output = model(input_ids=chosen, use_cache=True, **step)
    generated: list[int] = tokens[0, prompt.shape[1] :].tolist()
    return generated


@pytest.mark.parametrize("media", ["image", "video"])
def test_a_multimodal_rotary_model_stepped_without_positions_decodes_as_hugging_face_s_generate(
    media: str, tmp_path: Path, patched: safelens_tl.activation.Status
) -> None:
    """Hugging Face's Qwen2.5-VL itself (no TransformerLens, so no torchvision), stepped as the
    bridge steps it from an image or a video, once fitted
    (:mod:`safelens_tl.fixes.bridge._mrope_positions`, what the bridge does at its first call) picks
    the tokens of its own ``generate``; unfitted, a step of one token gets a position for every
    column of the mask, and the next step fails."""
    folder = _with_media_tokens_in_the_vocabulary(
        "Qwen2_5_VLForConditionalGeneration", tmp_path, video=True
    )
    reference = bridge.reference_from(folder, torch.float32)
    prompt, inputs = _media_prompt(reference) if media == "image" else _video_prompt(reference)
    if "mm_token_type_ids" not in inputs:
        pytest.skip("this transformers computes Qwen2.5-VL's positions without mm_token_type_ids")
    expected = _hugging_face_s_own(reference, prompt, **inputs)
    bridge_mrope_positions.fit_step_positions(reference)
    assert _decoded_step_by_step(reference, prompt, inputs) == expected[0].tolist()
    safelens_tl.deactivate()
    try:
        with pytest.raises(RuntimeError):  # a size mismatch, wherever the shapes first meet
            _decoded_step_by_step(reference, prompt, inputs)
    finally:
        safelens_tl.activate()
