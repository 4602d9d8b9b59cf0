"""TransformerBridge reads the KV cache under whichever name the installed transformers passes.

Real TransformerBridge, real Hugging Face models (tiny, random weights, saved to a temporary
folder and booted offline) and an independent reference: the same checkpoint loaded with plain
``AutoModelForCausalLM`` and run once, uncached, over what the bridge generated.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import cache as bridge_cache
from safelens_tl.fixes.bridge import t5_block as bridge_t5_block
from safelens_tl.fixes.bridge import t5_legacy_block as bridge_t5_legacy_block
from safelens_tl.verify import bridge, checks
from tests.conftest import requires_bridge, subclasses

pytestmark = requires_bridge

#: Whether the installed transformers passes the cache as ``cache`` (5.24 on).
RENAMED = bridge_cache.attention_cache_argument() == bridge_cache.NEW_NAME
renamed_only = pytest.mark.skipif(
    not RENAMED, reason="this transformers still passes the cache as past_key_values"
)
MODELS = tuple(bridge.BRIDGE_MODELS)
HALF_DTYPES = (torch.float16, torch.bfloat16)
CACHE_ARGUMENT_NAMES = {"past_key_values", "past_key_value", "layer_past", "cache", "cache_params"}


@pytest.mark.parametrize(
    "active",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.skipif(RENAMED, reason="stock is wrong with this transformers"),
        ),
    ],
    ids=["patched", "stock"],
)
@pytest.mark.parametrize("name", MODELS)
def test_cached_generate_equals_the_greedy_uncached_loop_in_float32(
    name: str, active: bool
) -> None:
    """Patched everywhere; stock too where transformers passes ``past_key_values`` (<= 5.23)."""
    if active:
        safelens_tl.activate()
    for run in bridge.run_bridge(name, torch.float32):
        assert torch.equal(run.cached_tokens, run.uncached_tokens), (name, run.batch)
        assert run.max_rel_err <= checks.TOLERANCES[torch.float32], (name, run.batch)
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[torch.float32]


@pytest.mark.parametrize("conversion", bridge.CONVERSIONS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_cached_generate_replays_against_hugging_face_in_half_precision(
    patched: safelens_tl.activation.Status, name: str, dtype: torch.dtype, conversion: str
) -> None:
    """Booted in the dtype, or booted in float32 and converted with .half()/.bfloat16()/.to()."""
    model = bridge.boot(name, dtype, conversion=conversion)
    assert model.cfg.dtype == dtype
    reference = bridge.reference_model(name, dtype)
    for batch, prompts in bridge.BATCHES.items():
        run = bridge.run_batch(model, reference, prompts, hf_generate=False)  # not read here
        assert run.max_rel_err <= checks.TOLERANCES[dtype], (batch, run.max_rel_err)
        assert run.reference_rel_err <= bridge.REFERENCE_TOLERANCES[dtype], batch
        assert run.cache_dtype == dtype and run.cache_device == torch.device("cpu")
        assert run.cache_heads == run.expected_cache_heads


@renamed_only
@pytest.mark.parametrize("name", MODELS)
def test_stock_bridge_ignores_its_cache_when_the_argument_is_renamed(name: str) -> None:
    """What the fix is for: without it, each cached step attends to itself alone."""
    assert not safelens_tl.is_active()
    runs = bridge.run_bridge(name, torch.float32)
    assert all(run.max_rel_err > 0.1 for run in runs)
    assert all(run.cache_dtype is None for run in runs), "stock stored nothing in the cache"
    assert bridge.cache_argument_diagnosis() is not None


#: Tiny checkpoints of the architectures whose bridges read the cache in their own ``forward``
#: (``targets.FORWARD_CACHE_READERS``, ``targets.STATE_CACHE_READERS``), not through
#: ``_update_kv_cache``: multi-head latent attention with a compressed query (DeepSeek-V3) and
#: without (DeepSeek-V2), GLM's MoE with its sparse-attention indexer, and Qwen3-Next's
#: GatedDeltaNet linear attention. Each: transformers config class, the reader class it must
#: go through, and the architecture's own settings (every layer dense: the MoE is not what is
#: tested).
_LATENT = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
_DENSE = {"first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2}
FORWARD_READER_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek-v3-mla": (
        "DeepseekV3Config",
        targets.FORWARD_CACHE_READERS[0],
        {**_LATENT, **_DENSE, "q_lora_rank": 32, "n_group": 1, "topk_group": 1},
    ),
    "deepseek-v2-mla": (
        "DeepseekV2Config",
        targets.FORWARD_CACHE_READERS[0],
        {**_LATENT, **_DENSE, "q_lora_rank": None},
    ),
    # GatedDeltaNet linear attention beside full attention: its state cache arrives as `cache`.
    "qwen3-next-gated-delta": (
        "Qwen3NextConfig",
        next(iter(targets.STATE_CACHE_READERS)),
        {"layer_types": ["linear_attention", "full_attention"], "num_key_value_heads": 2},
    ),
    "glm-moe-dsa": (
        "GlmMoeDsaConfig",
        targets.FORWARD_CACHE_READERS[1],
        {
            **_LATENT,
            **_DENSE,
            "q_lora_rank": 32,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
            "head_dim": 16,
        },
    ),
}
_forward_reader_folders: dict[str, Path] = {}


def forward_reader_folder(name: str) -> Path:
    """Save the tiny checkpoint ``name`` of :data:`FORWARD_READER_MODELS` once per pytest session.

    Skips when the installed transformers or TransformerLens lacks the architecture.
    """
    config_name, reader, settings = FORWARD_READER_MODELS[name]
    transformers = importlib.import_module("transformers")
    config_class = getattr(transformers, config_name, None)
    if config_class is None or targets.optional_class(reader) is None:
        pytest.skip(f"this transformers or TransformerLens has no {config_name} / {reader}")
    architecture = config_name.replace("Config", "ForCausalLM")
    factory = importlib.import_module("transformer_lens.factories.architecture_adapter_factory")
    if architecture not in getattr(factory, "SUPPORTED_ARCHITECTURES", {}):
        pytest.skip(f"this TransformerBridge does not support {architecture}")
    if name not in _forward_reader_folders:
        from safelens_tl.verify import models

        tokenizer = models.load_tokenizer()
        common: dict[str, Any] = {
            "vocab_size": models.vocab_size(),
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 512,
            "initializer_range": 0.3,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        config = config_class(**{**common, **settings})
        _forward_reader_folders[name] = bridge.save_checkpoint(config, name, tokenizer)
    return _forward_reader_folders[name]


@pytest.mark.parametrize(
    "active", [True, pytest.param(False, marks=renamed_only)], ids=["patched", "stock"]
)
@pytest.mark.parametrize("name", sorted(FORWARD_READER_MODELS))
def test_attention_that_reads_the_cache_in_its_own_forward_generates_right(
    name: str, active: bool
) -> None:
    """Cached generate through MLA, GLM-MoE-DSA and GatedDeltaNet bridges: right when patched;
    wrong in stock where transformers passes the cache as ``cache`` (5.24 on).

    These bridges pop the cache from their keyword arguments themselves, so only the patch of
    their ``forward`` (not of ``_update_kv_cache``) gives them the renamed argument."""
    folder = forward_reader_folder(name)
    if active:
        safelens_tl.activate()
    model = bridge.boot_folder(folder, torch.float32)
    reader = targets.optional_class(FORWARD_READER_MODELS[name][1])
    assert reader is not None and any(isinstance(m, reader) for m in model.modules())
    reference = bridge.reference_from(folder, torch.float32)
    try:
        runs = bridge.run_batches(model, reference)
    except AttributeError as error:
        # Stock TransformerLens 3.x's GatedDeltaNet bridge, outside its cached path, reads a
        # Hugging Face attribute that transformers 5.24 removed: stock fails outright there.
        assert not active, error
        return
    # Cached against the bridge's own uncached forward only: TransformerLens 3.0's DeepSeek-V3
    # adapter disagrees with Hugging Face even uncached (relative error about 1.3), cache or not.
    for run in runs:
        if active:
            assert torch.equal(run.cached_tokens, run.uncached_tokens), (name, run.batch)
            assert run.max_rel_err <= checks.TOLERANCES[torch.float32], (name, run.batch)
        else:  # what the patch is for: each cached step attends to itself alone
            assert run.max_rel_err > 0.1, (name, run.batch)


@pytest.mark.skipif(RENAMED, reason="needs a transformers that passes past_key_values (<= 5.23)")
def test_where_nothing_is_renamed_the_cache_argument_is_left_alone() -> None:
    """transformers <= 5.23: stock is right; no cache-argument patch is added (but where the
    release's ``_update_kv_cache`` ignores ``layer_past``, TransformerLens 3.0: that one, which
    any transformers needs for Falcon, BLOOM and GPTBigCode); results are equal."""
    attention = targets.optional_class(targets.ATTENTION_BRIDGE_CLASS)
    assert attention is not None
    reads_layer_past = bridge_cache.reads_layer_past(attention.__dict__["_update_kv_cache"])
    stock = bridge.run_bridge("llama-like-gqa", torch.float16)
    status = safelens_tl.activate()
    patched = bridge.run_bridge("llama-like-gqa", torch.float16)
    update_patches = [target for target in status.patched if "_update_kv_cache" in target]
    assert len(update_patches) == (0 if reads_layer_past else 1), update_patches
    assert bridge.cache_argument_diagnosis() is None
    for before, after in zip(stock, patched, strict=True):
        assert before.max_rel_err == after.max_rel_err <= checks.TOLERANCES[torch.float16]
        assert torch.equal(before.cached_tokens, after.cached_tokens)


def _reads_cache_argument(function: ast.FunctionDef) -> bool:
    """Whether a method takes a cache parameter or reads one from ``kwargs`` by name."""
    parameters = {a.arg for a in function.args.args + function.args.kwonlyargs}
    if parameters & (CACHE_ARGUMENT_NAMES - {"cache"}):
        return True
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"get", "pop"}
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "kwargs"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in CACHE_ARGUMENT_NAMES
        ):
            return True
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "kwargs"
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in CACHE_ARGUMENT_NAMES
        ):
            return True
    return False


def cache_readers() -> set[str]:
    """Every component class of the installed ``model_bridge`` that reads a KV cache argument.

    Found in the source, so that a reader added by a new TransformerLens release shows up here.
    The bridge itself (``TransformerBridge.forward``, which hands the cache to the model) is not a
    component and is covered separately.
    """
    package = importlib.import_module(targets.BRIDGE_MODULE)
    root = Path(package.__file__).parent  # type: ignore[arg-type]
    found = set()
    for path in sorted(root.rglob("*.py")):
        module = ".".join((targets.BRIDGE_MODULE, *path.relative_to(root).with_suffix("").parts))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name != "TransformerBridge":
                methods = [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef)]
                if any(_reads_cache_argument(method) for method in methods):
                    found.add(f"{module.removesuffix('.__init__')}.{node.name}")
    return found


def test_every_cache_reader_of_the_release_is_patched_or_listed_with_a_reason() -> None:
    readers = cache_readers()
    assert targets.ATTENTION_BRIDGE_CLASS in readers, "the scan no longer finds the base reader"
    covered = {
        targets.ATTENTION_BRIDGE_CLASS,
        *targets.FORWARD_CACHE_READERS,
        *targets.STATE_CACHE_READERS,
        *targets.EAGER_SCAN_MIXERS,
        *targets.UNPATCHED_CACHE_READERS,
        targets.T5_BLOCK_BRIDGE_CLASS,
    }
    missing = sorted(readers - covered)
    assert not missing, (
        f"these TransformerBridge components read a KV cache argument and are neither patched "
        f"(targets.FORWARD_CACHE_READERS) nor listed in targets.UNPATCHED_CACHE_READERS: {missing}"
    )
    # A subclass overriding _update_kv_cache would escape the base-class patch.
    attention = targets.locate_bridge().attention_class
    overriding = [c.__qualname__ for c in subclasses(attention) if "_update_kv_cache" in c.__dict__]
    assert not overriding, overriding


@renamed_only
def test_every_patched_reader_of_the_release_is_patched_after_activation(
    patched: safelens_tl.activation.Status,
) -> None:
    layout = targets.locate_bridge()
    report = safelens_tl.status()
    expected = [(layout.attention_class, "_update_kv_cache")]
    expected += [(reader, "forward") for reader in layout.forward_cache_readers]
    expected += [(reader, "forward") for reader, _ in layout.state_cache_readers]
    expected += [(mixer, "forward") for mixer in layout.eager_scan_mixers]
    t5_block = layout.t5_block_class
    if t5_block is not None and (
        bridge_t5_block.hands_sublayers_the_cache(t5_block)
        or bridge_t5_legacy_block.builds_a_legacy_forward(t5_block)
    ):
        expected.append((t5_block, "forward"))
    for owner, name in expected:
        assert f"{owner.__module__}.{owner.__qualname__}.{name}" in report.patched
    assert not report.failures, report.failures


def test_deactivate_restores_every_bridge_attribute_exactly() -> None:
    layout = targets.locate_bridge()
    owners = [layout.bridge_class, layout.attention_class, *layout.forward_cache_readers]
    owners += [layout.t5_block_class] if layout.t5_block_class is not None else []
    owners += [reader for reader, _ in layout.state_cache_readers]
    owners += [*layout.state_space_mixers, *layout.eager_scan_mixers]
    if layout.driver_class is not None:
        owners.append(layout.driver_class)
    before = [dict(owner.__dict__) for owner in owners]
    status = safelens_tl.activate()
    assert any("TransformerBridge" in target for target in status.patched)
    safelens_tl.deactivate()
    after = [dict(owner.__dict__) for owner in owners]
    for owner, old, new in zip(owners, before, after, strict=True):
        assert old.keys() == new.keys(), owner
        assert all(old[k] is new[k] for k in old), owner


@renamed_only
@pytest.mark.skipif(
    not hasattr(targets, "TRANSFORMERS_DRIVER_CLASS")
    or targets.optional_class(targets.TRANSFORMERS_DRIVER_CLASS) is None,
    reason="the cache is handed to the model by name only where TransformersDriver exists (4.x)",
)
def test_patched_generate_raises_no_deprecation_warning_about_the_old_name(
    patched: safelens_tl.activation.Status,
) -> None:
    model = bridge.boot("llama-like-gqa", torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate("the cat runs", use_past_kv_cache=True, **checks.greedy_arguments(4))
    messages = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not messages, messages


def _without_old_name_shims(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> int:
    """Replace every ``deprecate_kwarg("past_key_values", ...)`` method by what it wraps."""
    removed = 0
    for owner in vars(module).values():
        if not isinstance(owner, type) or owner.__module__ != module.__name__:
            continue
        for name, function in list(vars(owner).items()):
            inner: Any = function
            while bridge_cache.SHIM_OLD_NAME in bridge_cache._shim_old_names(inner):
                inner = inner.__wrapped__
            if inner is not function:
                monkeypatch.setattr(owner, name, inner)
                removed += 1
    return removed


@renamed_only
def test_cached_generate_stays_right_once_transformers_drops_the_old_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers says the ``past_key_values`` shims go in 5.40: simulated here by removing
    them (and ``ModelOutput.past_key_values``) from the real installed modules."""
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama
    from transformers.utils import generic

    assert _without_old_name_shims(monkeypatch, modeling_llama) > 0
    assert _without_old_name_shims(monkeypatch, modeling_gpt2) > 0
    monkeypatch.delattr(generic.ModelOutput, bridge_cache.SHIM_OLD_NAME)
    assert not bridge_cache.accepts_past_key_values(modeling_llama.LlamaForCausalLM)
    try:
        status = safelens_tl.activate()
        assert not status.failures, status.failures
        for name in MODELS:
            for run in bridge.run_bridge(name, torch.float32):
                assert torch.equal(run.cached_tokens, run.uncached_tokens), (name, run.batch)
                assert run.max_rel_err <= checks.TOLERANCES[torch.float32], (name, run.batch)
    finally:
        safelens_tl.deactivate()  # before monkeypatch puts the shims back


def test_bridge_patches_wait_for_the_bridge_import_and_then_apply(tmp_path: Path) -> None:
    """A fresh interpreter: activation must not import the bridge (about 2 s) where
    ``import transformer_lens`` does not (4.x); where it does (3.x), the patches apply at once.
    Hugging Face's CodeGen likewise: patched when a CodeGen model imports it."""
    code = textwrap.dedent(
        """
        import json, sys
        import transformer_lens
        import safelens_tl
        before = safelens_tl.status()
        loaded_early = "transformer_lens.model_bridge" in sys.modules
        import transformer_lens.model_bridge
        after = safelens_tl.status()
        codegen_loaded = "transformers.models.codegen.modeling_codegen" in sys.modules
        import transformers.models.codegen.modeling_codegen
        last = safelens_tl.status()
        print(json.dumps({
            "loaded_early": loaded_early,
            "pending_before": list(before.pending),
            "pending_after": list(after.pending),
            "bridge_patched": [t for t in after.patched if "model_bridge" in t],
            "codegen_loaded": codegen_loaded,
            "pending_last": list(last.pending),
            "codegen_patched": [t for t in last.patched if t.startswith("transformers.")],
            "failures": [str(f) for f in last.failures],
        }))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_child_env(), "HF_HUB_OFFLINE": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    import json

    out = json.loads(completed.stdout.strip().splitlines()[-1])
    bridge_pending = [] if out["loaded_early"] else [targets.BRIDGE_MODULE]
    assert out["pending_before"] == [*bridge_pending, targets.CODEGEN_MODULE]
    if targets.locate_bridge().driver_class is not None:
        assert not out["loaded_early"], "TransformerLens 4.x imports its bridge lazily"
    # Hugging Face's CodeGen (about 0.3 s) is imported by a CodeGen model, not by the bridge.
    assert not out["codegen_loaded"]
    assert out["pending_after"] == [targets.CODEGEN_MODULE]
    assert out["pending_last"] == []
    assert out["codegen_patched"] == [f"{targets.CODEGEN_ATTENTION_CLASS}.scale_attn"]
    assert any(t.endswith("TransformerBridge.to") for t in out["bridge_patched"])
    if RENAMED:
        assert any(t.endswith("AttentionBridge._update_kv_cache") for t in out["bridge_patched"])
    assert out["failures"] == []


def _child_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "SAFELENS_TL_AUTOPATCH"}


def test_the_cache_argument_reads_the_same_from_source_as_from_the_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without importing ``modeling_llama`` (its source is read) the answer is the same."""
    module_name = targets.REFERENCE_ATTENTION.rpartition(".")[0]
    importlib.import_module(module_name)
    names = {bridge_cache.NEW_NAME, bridge_cache.SHIM_OLD_NAME}
    from_module = bridge_cache._forward_parameters(targets.REFERENCE_ATTENTION) & names
    monkeypatch.delitem(sys.modules, module_name)
    from_source = bridge_cache._forward_parameters(targets.REFERENCE_ATTENTION) & names
    assert from_source == from_module != set()


def test_a_module_s_source_is_parsed_again_only_when_its_file_changes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``activate()`` asks for the reference attention's parameters each time; the answer read
    from its source is kept while the file is unchanged."""
    import os

    parses: list[int] = []
    parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parses.append(1) or parse(*a, **k))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "sl_reference_attention.py"

    def write(parameter: str, stamp: int) -> None:
        module.write_text(f"class Attention:\n    def forward(self, x, {parameter}=None): ...\n")
        os.utime(module, ns=(stamp, stamp))

    write("past_key_values", 10**18)
    for _ in range(3):
        names = bridge_cache._forward_parameters("sl_reference_attention.Attention")
        assert names == {"self", "x", "past_key_values"}
    assert len(parses) == 1
    write("cache", 10**18 + 10**9)
    assert bridge_cache._forward_parameters("sl_reference_attention.Attention") == {
        "self",
        "x",
        "cache",
    }
    assert len(parses) == 2
