"""Cached TransformerBridge generation (TransformerLens 3.x/4.x), made right by safelens-tl.

Runs offline: it saves a tiny Llama-like checkpoint with random weights and boots it (swap in
``TransformerBridge.boot_transformers("meta-llama/Llama-3.2-1B", dtype=torch.bfloat16)`` for a
real one). Without safelens-tl, with transformers 5.24 or later, the cached generation differs
from the uncached one (each step attends to itself alone), and under autocast the shorter,
left-padded prompt gets NaN logits.
"""

import torch
from transformer_lens.model_bridge import TransformerBridge

import safelens_tl.patch  # noqa: F401  (activates; not needed once auto-activation is installed)
from safelens_tl.verify.bridge import model_folder
from safelens_tl.verify.models import load_tokenizer

checkpoint = str(model_folder("llama-like-gqa"))
prompts = ["the cat runs", "a big old dog sleeps in the house"]
settings = {"max_new_tokens": 8, "do_sample": False, "stop_at_eos": False, "verbose": False}

model = TransformerBridge.boot_transformers(
    checkpoint, dtype=torch.bfloat16, tokenizer=load_tokenizer()
)
cached = model.generate(prompts, use_past_kv_cache=True, **settings)
uncached = model.generate(prompts, use_past_kv_cache=False, **settings)
print("bfloat16, cached:  ", cached)
print("bfloat16, uncached:", uncached)

# A float32 model computing in bfloat16: the cache holds what attention computed.
model = TransformerBridge.boot_transformers(
    checkpoint, dtype=torch.float32, tokenizer=load_tokenizer()
)
with torch.autocast("cpu", dtype=torch.bfloat16):
    output = model.generate(prompts, output_logits=True, **settings)
finite = all(bool(torch.isfinite(step).all()) for step in output.logits)
print("float32 under bfloat16 autocast:", output.sequences, "finite logits:", finite)
if not finite:
    raise SystemExit("NaN logits under autocast: is safelens-tl active?")
