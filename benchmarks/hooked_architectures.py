"""Cached HookedTransformer generation across architectures, in float32, float16 and bfloat16.

For each architecture TransformerLens 2.x/3.x converts to a ``HookedTransformer``, a tiny
checkpoint with random weights is built from its transformers config (that of
``bridge_architectures.py``: two layers, nothing downloaded) and loaded by TransformerLens's own
loader, as ``HookedTransformer.from_pretrained(..., dtype=...)`` does (its config conversion, its
weight converter, no folding or centering). Gemma's configs are hard-coded per official name in
TransformerLens, so Gemma 1-3 take the official config of their smallest model, shrunk to the
checkpoint's sizes. Each model then goes through the verifier's checks
(``safelens_tl.verify.runner.check_hooked``: cached logits against uncached over a teacher-forced
sequence, the cache's dtype and heads, greedy generation cached against uncached), first with
safelens-tl active, then stock.

    HF_HUB_OFFLINE=1 python benchmarks/hooked_architectures.py [--architectures A,B]
        [--dtypes float32,float16,bfloat16] [--json PATH]

CPU. A row that cannot be built or loaded says why. TransformerLens 4.x has no HookedTransformer:
there the script says so and exits (``bridge_architectures.py`` covers TransformerBridge).
"""

from __future__ import annotations

import argparse
import contextlib
import io
from dataclasses import asdict, dataclass
from typing import Any

import bridge_architectures
import torch
from kv_cache import patched
from rich.console import Console
from rich.table import Table

from safelens_tl import targets
from safelens_tl.verify import bridge, diagnostics, local_model, models, runner

#: Settings a HookedTransformer conversion needs beyond ``bridge_architectures``'s tiny config:
#: TransformerLens sizes GPT-Neo's MLP at four times the width, whatever the config says (as
#: published GPT-Neo checkpoints are).
SETTINGS: dict[str, dict[str, Any]] = {
    "GPTNeoForCausalLM": {"intermediate_size": None},
}
#: Architectures whose TransformerLens config is hard-coded per official name: that name's.
NAMED_CONFIGS: dict[str, str] = {
    "GemmaForCausalLM": "google/gemma-2b",
    "Gemma2ForCausalLM": "google/gemma-2-2b",
    "Gemma3ForCausalLM": "google/gemma-3-1b-pt",
}
#: Everything TransformerLens 2.18-3.9 converts from a causal language model's config.
ARCHITECTURES: tuple[str, ...] = (
    "GPT2LMHeadModel",
    "GPTNeoForCausalLM",
    "OPTForCausalLM",
    "GPTJForCausalLM",
    "GPTNeoXForCausalLM",
    "BloomForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "PhiForCausalLM",
    "Phi3ForCausalLM",
    "ApertusForCausalLM",
    "OlmoForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "OlmoeForCausalLM",
    *NAMED_CONFIGS,
)
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Outcome:
    """One variant's checks (``runner.check_hooked``), or why it could not run."""

    passed: bool = False
    max_rel_err: float | None = None
    cache_dtype: str | None = None
    greedy_agreement: float | None = None
    problem: str | None = None
    #: The model could not be built or loaded at all.
    load_error: str | None = None

    def text(self) -> str:
        """The table cell."""
        if self.load_error is not None:
            return f"[red]cannot load: {self.load_error}[/red]"
        if self.passed:
            return f"[green]{self.max_rel_err:.1e}, cache {self.cache_dtype}[/green]"
        return f"[red]{self.problem}[/red]"


def build(architecture: str) -> str:
    """Save the tiny checkpoint of ``architecture``; return its folder."""
    if architecture not in SETTINGS:
        return bridge_architectures.build(architecture)
    tokenizer = models.load_tokenizer()
    config_name, settings = bridge_architectures.ARCHITECTURES[architecture]
    config = bridge_architectures._language_config(
        config_name, {**settings, **SETTINGS[architecture]}, tokenizer
    )
    config.architectures = [architecture]
    return str(bridge.save_checkpoint(config, f"{architecture}-hooked", tokenizer))


def _named_config(architecture: str, reference: Any, dtype: torch.dtype) -> Any:
    """TransformerLens's hard-coded config of the official model, at the checkpoint's sizes."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens import loading_from_pretrained as loading

    official = NAMED_CONFIGS[architecture]
    fields = dict(loading.convert_hf_model_config(official))
    config = reference.config
    fields.update(
        d_model=config.hidden_size,
        d_head=config.head_dim,
        rotary_dim=config.head_dim,
        n_heads=config.num_attention_heads,
        n_key_value_heads=config.num_key_value_heads,
        d_mlp=config.intermediate_size,
        n_layers=config.num_hidden_layers,
        d_vocab=config.vocab_size,
        n_ctx=config.max_position_embeddings,
        dtype=dtype,
        device="cpu",
        init_weights=False,
        model_name=official.split("/")[-1],
    )
    if fields.get("window_size"):
        fields["window_size"] = config.sliding_window
    if fields.get("attn_types"):
        fields["attn_types"] = list(fields["attn_types"])[: config.num_hidden_layers]
    return HookedTransformerConfig(**fields)


def load(folder: str, dtype: torch.dtype, architecture: str) -> Any:
    """The checkpoint as a ``HookedTransformer`` in ``dtype``, by TransformerLens's own loader.

    That is ``safelens-tl verify --model FOLDER``'s loader (``local_model.load_hooked``: the steps
    of ``from_pretrained(..., dtype=...)``, no folding or centering), except for Gemma, whose
    configurations TransformerLens has per official name only: the smallest official one, shrunk
    to the checkpoint.
    """
    if architecture not in NAMED_CONFIGS:
        return local_model.load_hooked(folder, dtype, "cpu")
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as loading
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    name = NAMED_CONFIGS[architecture]
    config = _named_config(architecture, reference, dtype)
    state = loading.get_pretrained_state_dict(name, config, reference, dtype=dtype)
    model = HookedTransformer(config, models.load_tokenizer(), move_to_device=False)
    model.load_and_process_state_dict(
        state,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        refactor_factored_attn_matrices=False,
    )
    return model


def run(folder: str, architecture: str, active: bool, dtype: torch.dtype) -> Outcome:
    """Load and check the model with safelens-tl active or not (stock)."""
    # TransformerLens and transformers print and warn while loading; the table says it all.
    with patched(active), bridge_architectures.quietly(), contextlib.redirect_stdout(io.StringIO()):
        try:
            model = load(folder, dtype, architecture)
        except Exception as error:  # a row saying why
            return Outcome(load_error=bridge_architectures.last_line(error))
        result = runner.check_hooked(model, architecture)
    return Outcome(
        passed=bool(result.passed),
        max_rel_err=result.max_rel_err,
        cache_dtype=result.cache_dtype,
        greedy_agreement=result.greedy_agreement,
        problem=None if result.error is None else result.error[:140],
    )


def verdict(patched: Outcome, stock: Outcome) -> str:
    """What safelens-tl changes for this architecture and dtype."""
    if patched.load_error is not None:
        return "cannot load"
    if patched.passed:
        return "right in both" if stock.passed else "[green]fixed by safelens-tl[/green]"
    return "[red]fails in both[/red]" if not stock.passed else "[red]broken by safelens-tl[/red]"


def main(argv: list[str] | None = None) -> int:
    """Run every architecture and dtype asked for and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--architectures",
        default=",".join(ARCHITECTURES),
        help="comma-separated, from: " + ", ".join(ARCHITECTURES),
    )
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="comma-separated, from: " + ", ".join(DTYPES)
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    arguments = parser.parse_args(argv)
    chosen = [name.strip() for name in arguments.architectures.split(",") if name.strip()]
    dtypes = [name.strip() for name in arguments.dtypes.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in ARCHITECTURES]
    unknown += [name for name in dtypes if name not in DTYPES]
    if unknown:
        parser.error(f"unknown {unknown}; see --help for the choices")
    console = Console(width=None if Console().is_terminal else 160)
    layout = targets.locate()
    if not layout.known.has_hooked_transformer:
        console.print(f"TransformerLens {layout.release} has no HookedTransformer: nothing to run")
        return 0
    table = Table(title=f"cached HookedTransformer generation, TransformerLens {layout.release}")
    for column in ("architecture", "dtype", "patched", "stock", "verdict"):
        table.add_column(column)
    results: dict[str, Any] = {}
    for architecture in chosen:
        console.print(f"[dim]{architecture}...[/dim]")
        try:
            folder = build(architecture)
        except Exception as error:  # the row says why
            why = bridge_architectures.last_line(error)
            table.add_row(architecture, "", f"[red]cannot build: {why}[/red]")
            results[architecture] = {"build_error": why}
            bridge_architectures.write_json(arguments.json, results)
            continue
        for name in dtypes:
            dtype = getattr(torch, name)
            patched = run(folder, architecture, True, dtype)
            stock = run(folder, architecture, False, dtype)
            table.add_row(
                architecture,
                diagnostics.dtype_name(dtype),
                patched.text(),
                stock.text(),
                verdict(patched, stock),
            )
            results.setdefault(architecture, {})[name] = {
                "patched": asdict(patched),
                "stock": asdict(stock),
            }
        bridge_architectures.write_json(arguments.json, results)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
