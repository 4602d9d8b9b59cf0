"""Cached TransformerBridge generation (TransformerLens 3.x/4.x), made right by safelens-tl.

Runs offline: it saves a tiny Llama-like checkpoint with random weights and a word-level tokenizer
to a temporary folder and boots it (swap in
``TransformerBridge.boot_transformers("meta-llama/Llama-3.2-1B", dtype=torch.bfloat16)`` for a
real one). Without safelens-tl, with transformers 5.24 or later, the cached generation differs
from the uncached one (each step attends to itself alone), and under autocast the shorter,
left-padded prompt gets NaN logits. On TransformerLens 2.x, which has no TransformerBridge, it
says so and exits.
"""

import sys
import tempfile

import torch

import safelens_tl.patch  # noqa: F401  (activates; not needed once auto-activation is installed)

try:
    from transformer_lens.model_bridge import TransformerBridge
except ImportError:
    print("examples/transformer_bridge.py is for TransformerLens 3.x/4.x (TransformerBridge).")
    sys.exit(0)

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = [*SPECIAL, "the", "a", "cat", "dog", "runs", "sleeps", "in", "big", "old", "house"]


def save_tiny_llama(folder: str) -> None:
    """A 2-layer Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,  # logits well apart, so a wrong cache shows in the tokens
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


prompts = ["the cat runs", "a big old dog sleeps in the house"]
settings = {"max_new_tokens": 8, "do_sample": False, "stop_at_eos": False, "verbose": False}

with tempfile.TemporaryDirectory() as checkpoint:
    save_tiny_llama(checkpoint)

    model = TransformerBridge.boot_transformers(checkpoint, dtype=torch.bfloat16)
    cached = model.generate(prompts, use_past_kv_cache=True, **settings)
    uncached = model.generate(prompts, use_past_kv_cache=False, **settings)
    print("bfloat16, cached:  ", cached)
    print("bfloat16, uncached:", uncached)
    if cached != uncached:
        raise SystemExit("cached and uncached generation differ: is safelens-tl active?")

    # A float32 model computing in bfloat16: the cache holds what attention computed.
    model = TransformerBridge.boot_transformers(checkpoint, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model.generate(prompts, output_logits=True, **settings)
    finite = all(bool(torch.isfinite(step).all()) for step in output.logits)
    print("float32 under bfloat16 autocast:", output.sequences, "finite logits:", finite)
    if not finite:
        raise SystemExit("NaN logits under autocast: is safelens-tl active?")
