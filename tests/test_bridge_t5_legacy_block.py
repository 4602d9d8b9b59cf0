"""TransformerLens 3.x's T5 block, written for transformers 4, generates right with transformers 5
(:mod:`safelens_tl.fixes.bridge.t5_legacy_block`): the logits through the bridge are Hugging
Face's own. Whether cached ``hf_generate`` equals uncached, with either T5 block, and how the
sublayers are patched: ``tests/test_bridge_t5_block.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import t5_legacy_block as bridge_t5_legacy_block
from tests.conftest import architecture_folder, benchmark_module, requires_bridge


@requires_bridge
def test_a_t5_through_transformer_lens_3_bridge_matches_hugging_face_s_own(
    patched: safelens_tl.activation.Status,
) -> None:
    """With TransformerLens 3.x's T5 block, the decoder's logits through the bridge (uncached and
    cached ``hf_generate``) are those of Hugging Face's own T5 on the same tokens: the layout the
    block returns is read right by the stack, not merely consistent with itself. One prompt at a
    time: TransformerLens 3.0's ``hf_generate`` drops the attention mask of a padded batch (its
    own, with or without a cache)."""
    block = targets.optional_class(targets.T5_BLOCK_BRIDGE_CLASS)
    if block is None or not bridge_t5_legacy_block.builds_a_legacy_forward(block):
        pytest.skip("this TransformerLens's T5 block is not 3.x's")
    from transformers import AutoModelForSeq2SeqLM

    folder = str(architecture_folder("T5ForConditionalGeneration"))
    model = benchmark_module("bridge_architectures").boot(folder)
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = benchmark_module("bridge_hf_generate").PROMPTS
    sweep = benchmark_module("bridge_hf_generate")
    with torch.inference_mode():
        for prompt, cached in itertools.product(prompts, (False, True)):
            out = sweep.generate(
                model, cached, [prompt], min_new_tokens=sweep.NEW_TOKENS, output_logits=True
            )
            logits = torch.stack(list(out.logits), dim=1)
            encoded = model.tokenizer([prompt], return_tensors="pt")
            expected = reference(
                input_ids=encoded.input_ids, decoder_input_ids=out.sequences[:, :-1]
            ).logits
            error = float((logits - expected).abs().max() / expected.abs().max())
            assert error <= 1e-4, (prompt, cached, error)
