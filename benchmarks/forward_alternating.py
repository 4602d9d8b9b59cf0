"""One HookedTransformer forward, stock and safelens-tl alternating in one process.

For calls of 0.1 s and more, switching the patches between calls costs nothing measurable, and
both variants see the same machine load at the same moments: on a shared machine this is the
steadier ratio. Uses ``benchmarks/generate_vs_hf.py``'s converted SmolLM2 checkpoint (run that
first) or ``--checkpoint FOLDER``.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 SAFELENS_TL_AUTOPATCH=0 \\
        python benchmarks/forward_alternating.py --batch 1 --tokens 16 --pairs 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate_vs_hf


def main(argv: list[str] | None = None) -> int:
    """Time ``--pairs`` pairs of forwards and print the median stock / patched ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint folder (default: generate_vs_hf's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--dtype", choices=generate_vs_hf.DTYPES, default="float32")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    import safelens_tl

    folder = Path(args.checkpoint) if args.checkpoint else generate_vs_hf.default_checkpoint_dir()
    auto: Any = AutoTokenizer
    tokenizer = auto.from_pretrained(str(folder))
    model = generate_vs_hf.load_tl("hooked", folder, getattr(torch, args.dtype))
    tokens = generate_vs_hf.prompt_tokens(tokenizer, args.tokens).repeat(args.batch, 1)
    seconds: dict[str, list[float]] = {"stock": [], "patched": []}
    with torch.no_grad():
        model(tokens)  # warm-up
        for pair in range(args.pairs):
            order = ("stock", "patched") if pair % 2 == 0 else ("patched", "stock")
            for variant in order:
                safelens_tl.deactivate()
                if variant == "patched":
                    safelens_tl.activate()
                start = time.perf_counter()
                model(tokens)
                seconds[variant].append(time.perf_counter() - start)
    safelens_tl.deactivate()
    ratios = [s / p for s, p in zip(seconds["stock"], seconds["patched"], strict=True)]
    stock_ms = statistics.median(seconds["stock"]) * 1e3
    print(
        f"{args.batch}x{args.tokens} {args.dtype}: stock {stock_ms:.0f} ms, "
        f"patched {statistics.median(seconds['patched']) * 1e3:.0f} ms, stock / patched per pair "
        f"{[round(r, 2) for r in ratios]}, median {statistics.median(ratios):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
