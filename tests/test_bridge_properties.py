"""Property-based tests: TransformerBridge's ``generate`` against Hugging Face's own model.

Hypothesis draws a batch of prompts (one to three rows of one to ten random tokens each,
left-padded to the longest, with their ``attention_mask``), how many tokens to generate (one to
six) and whether to use the cache. Every token the bridge picks must be a greedy choice of the
same checkpoint loaded as a plain Hugging Face model (no TransformerLens), run once over the whole
generated sequence with the batch's mask and the positions it implies: the logit of the token
picked must be within a small tolerance of the largest, so that near-ties between two orders of
floating-point summation do not fail the test while a wrong cache, position or mask does (those
move the logits by far more; ``docs/reliability.md``).

The architectures are a spread of what the bridge's caches and masks must handle: rotary,
learned, ALiBi and no positions; grouped-query, multi-head-latent and sliding-window attention;
key/value sharing across layers (Gemma 4); mixtures of experts; and state-space and linear
attention layers, alone or beside attention (Mamba, Bamba, Jamba, Zamba 2, Qwen3-Next, ...).
The number of examples is the profile's divided by 40 (at least 10): 25 per architecture in a
plain run, about 40 s for all of them on two cores; the examples are derived from the test, not
sampled anew, so that every CI run checks the same ones (a random run found the tolerance for
Zamba2's own rounding, below). Fewer would miss bugs: with 10, the second row's past values
shifted by one position (``tests/mutants.py``, ``second-row-shifted``) fail 1 architecture of 43;
with 25, 23 of them.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import safelens_tl
from safelens_tl import targets
from safelens_tl.verify import bridge, models
from tests.conftest import architecture_folder, requires_bridge

pytestmark = requires_bridge

ARCHITECTURES = [
    "LlamaForCausalLM",
    "GPT2LMHeadModel",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma4ForCausalLM",
    "Qwen3NextForCausalLM",
    "BloomForCausalLM",
    "OPTForCausalLM",
    "FalconForCausalLM",
    "GPTNeoXForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "FalconH1ForCausalLM",
    "MambaForCausalLM",
    "Mamba2ForCausalLM",
    "JambaForCausalLM",
    "Lfm2ForCausalLM",
    "GPTJForCausalLM",
    "MptForCausalLM",
    "CohereForCausalLM",
    "Cohere2ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "RecurrentGemmaForCausalLM",
    "Zamba2ForCausalLM",
    "NemotronHForCausalLM",
    "OlmoHybridForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "BambaForCausalLM",
    "XGLMForCausalLM",
    "GPTBigCodeForCausalLM",
    "OpenAIGPTLMHeadModel",
    "PhiForCausalLM",
    "StableLmForCausalLM",
    "CodeGenForCausalLM",
    "GPTNeoForCausalLM",
    "ModernBertDecoderForCausalLM",
    "Llama4ForCausalLM",
    "MixtralForCausalLM",
    "Exaone4ForCausalLM",
    "SmolLM3ForCausalLM",
    "DeepseekV4ForCausalLM",
]
#: How far below the largest logit the one picked may be (relative to the largest magnitude):
#: float32 summed in another order differs by about 1e-6 here; a wrong cache by 1e-1 and more.
TOLERANCE = 1e-4
#: Where Hugging Face's own cached path rounds differently from its uncached forward by itself
#: (docs/reliability.md: Zamba2 3.9e-3, NemotronH 8e-4), a near-tie may fall either way.
OWN_ROUNDING_TOLERANCE = {"Zamba2ForCausalLM": 2e-2, "NemotronHForCausalLM": 2e-2}
EXAMPLES = max(10, settings().max_examples // 40)

_booted: dict[str, tuple[Any, Any]] = {}


def _bridge_and_reference(architecture: str) -> tuple[Any, Any]:
    """The bridge of the tiny checkpoint and the same checkpoint as a plain Hugging Face model,
    booted once per pytest session (examples only read them)."""
    if architecture not in _booted:
        folder: Path = architecture_folder(architecture)
        model = bridge.boot_folder(folder, torch.float32, tokenizer=models.load_tokenizer())
        _booted[architecture] = (model, bridge.reference_from(folder, torch.float32))
    return _booted[architecture]


@st.composite
def left_padded_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """One to three prompts of one to ten ordinary tokens, left-padded with the padding id to the
    longest, and their attention mask."""
    tokenizer = models.load_tokenizer()
    special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    ordinary = [token for token in range(models.vocab_size()) if token not in special]
    rows = draw(
        st.lists(
            st.lists(st.sampled_from(ordinary), min_size=1, max_size=10), min_size=1, max_size=3
        )
    )
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return tokens, mask


def _greedy_shortfall(
    reference: Any, generated: torch.Tensor, mask: torch.Tensor, prompt_length: int
) -> float:
    """How far, relative to the largest logit's magnitude, the worst token the bridge picked
    lies below the largest logit of the reference's uncached forward at its position."""
    full_mask = torch.cat(
        [mask, torch.ones(mask.shape[0], generated.shape[1] - prompt_length, dtype=mask.dtype)], 1
    )
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = reference(
            input_ids=generated, attention_mask=full_mask, position_ids=positions
        ).logits.float()
    worst = 0.0
    for step in range(prompt_length, generated.shape[1]):
        scores = logits[:, step - 1]
        best = scores.max(-1).values
        picked = scores.gather(-1, generated[:, step : step + 1]).squeeze(-1)
        scale = scores.abs().max(-1).values.clamp(min=1e-6)
        worst = max(worst, float(((best - picked) / scale).max()))
    return worst


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_token_generate_picks_is_a_greedy_choice_of_hugging_face_s_model(
    architecture: str, patched: safelens_tl.activation.Status
) -> None:
    """Cached or not, any left-padded batch: each generated token is the reference's argmax."""
    generate = targets.locate_bridge().bridge_class.generate
    if "attention_mask" not in inspect.signature(generate).parameters:
        pytest.skip("this TransformerBridge.generate takes no attention_mask")
    model, reference = _bridge_and_reference(architecture)

    @settings(max_examples=EXAMPLES, derandomize=True)  # the same examples in every CI run
    @given(
        batch=left_padded_batches(),
        new_tokens=st.integers(1, 6),
        use_past_kv_cache=st.booleans(),
    )
    def check(batch: tuple[torch.Tensor, torch.Tensor], new_tokens: int, use_past_kv_cache: bool):
        tokens, mask = batch
        generated = model.generate(
            tokens,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            use_past_kv_cache=use_past_kv_cache,
            do_sample=False,
            stop_at_eos=False,
            return_type="tokens",
            verbose=False,
        )
        assert generated.shape == (tokens.shape[0], tokens.shape[1] + new_tokens)
        assert torch.equal(generated[:, : tokens.shape[1]], tokens)
        shortfall = _greedy_shortfall(reference, generated, mask, tokens.shape[1])
        tolerance = OWN_ROUNDING_TOLERANCE.get(architecture, TOLERANCE)
        assert shortfall <= tolerance, f"a token {shortfall:.2e} below the best logit"

    check()
