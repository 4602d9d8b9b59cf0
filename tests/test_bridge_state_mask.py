"""State-space models through TransformerBridge: a batch of prompts generates right with the cache.

TransformerBridge's generate hands its state-space mixers the attention mask of every position at
each one-position cached step; Hugging Face's Mamba and FalconMamba mixers multiply their input by
it, which then broadcasts to every position (:mod:`safelens_tl.fixes.bridge.state_mask`). Real
bridges on tiny random checkpoints, cached against the bridge's own uncached forward. (Mamba-2,
whose own forward trims the mask, is in ``benchmarks/bridge_architectures.py`` and its test.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import safelens_tl
from safelens_tl import targets
from safelens_tl.fixes.bridge import _positions as bridge_positions
from safelens_tl.fixes.bridge import state_mask as bridge_state_mask
from safelens_tl.verify import bridge, checks
from tests.conftest import architecture_folder, requires_bridge

pytestmark = requires_bridge

#: The state-space architectures whose mixers take the mask as given, and their mixer bridge.
STATE_SPACE_MODELS = {
    "MambaForCausalLM": "ssm_mixer.SSMMixerBridge",
    "FalconMambaForCausalLM": "ssm_mixer.SSMMixerBridge",
}


def _mixer(architecture: str) -> type:
    found = targets.optional_class(
        "transformer_lens.model_bridge.generalized_components." + STATE_SPACE_MODELS[architecture]
    )
    assert found is not None
    return found


@pytest.mark.parametrize("architecture", sorted(STATE_SPACE_MODELS))
def test_a_batch_of_prompts_generates_right_through_a_state_space_model(
    architecture: str,
) -> None:
    """Patched: cached generation of one prompt and of two left-padded prompts agrees with the
    uncached forward, tokens and logits. Stock gets the batch of two wrong on every release that
    has these bridges (with transformers 5.24 the single prompt too, through the renamed cache
    argument), which is what this test would catch if the patch were lost."""
    folder = architecture_folder(architecture)
    reference = bridge.reference_from(folder, torch.float32)
    safelens_tl.deactivate()
    stock = bridge.boot_folder(folder, torch.float32)
    try:
        stock_batch = bridge.run_batch(stock, reference, bridge.BATCHES[2])
    except ImportError as missing:
        # TransformerLens 3.0's Mamba adapter imports MambaCache, which transformers 5.24
        # removed: it cannot generate at all, stock or patched.
        safelens_tl.activate()
        model = bridge.boot_folder(folder, torch.float32)
        with pytest.raises(ImportError, match="MambaCache"):
            bridge.run_batch(model, reference, bridge.BATCHES[1])
        assert "MambaCache" in str(missing)
        return
    assert stock_batch.max_rel_err > 0.1  # the bug, where the patch is not there

    safelens_tl.activate()
    model = bridge.boot_folder(folder, torch.float32)
    assert any(isinstance(module, _mixer(architecture)) for module in model.modules())
    for prompts in bridge.BATCHES.values():
        run = bridge.run_batch(model, reference, prompts)
        assert run.max_rel_err <= checks.TOLERANCES[torch.float32], (architecture, run.batch)
        assert torch.equal(run.cached_tokens, run.uncached_tokens), (architecture, run.batch)
        assert run.state_only and run.cache_dtype is None
        assert run.seconds_uncached is None  # TransformerLens has no uncached generate here


def test_a_single_prompt_generates_right_through_bamba() -> None:
    """Bamba's forward counts positions from 0 at every call unless it is given ``position_ids``;
    TransformerBridge's generate for models with a state gives a single prompt only
    ``cache_position``, which transformers 5 no longer reads
    (:mod:`safelens_tl.fixes.bridge._positions`). Stock puts every generated token at position 0."""
    folder = architecture_folder("BambaForCausalLM")
    reference = bridge.reference_from(folder, torch.float32)
    safelens_tl.deactivate()
    stock = bridge.run_batch(
        bridge.boot_folder(folder, torch.float32), reference, bridge.BATCHES[1]
    )
    assert stock.max_rel_err > 0.1
    safelens_tl.activate()
    model = bridge.boot_folder(folder, torch.float32)
    for prompts in bridge.BATCHES.values():
        run = bridge.run_batch(model, reference, prompts)
        assert run.max_rel_err <= checks.TOLERANCES[torch.float32], run.batch
        assert torch.equal(run.cached_tokens, run.uncached_tokens), run.batch
        assert run.recurrent_state and not run.state_only


class _ReadsPositions:
    def forward(self, input_ids: Any = None, position_ids: Any = None, **kwargs: Any) -> None:
        """A transformers 5 model: positions only."""


class _ReadsCachePosition:
    def forward(
        self, input_ids: Any = None, position_ids: Any = None, cache_position: Any = None
    ) -> None:
        """A transformers 4 model: derives positions from ``cache_position`` itself."""


def test_positions_are_given_from_cache_position_only_where_the_model_reads_positions() -> None:
    tokens = torch.zeros(3, 1, dtype=torch.long)
    arguments: dict[str, Any] = {"cache_position": torch.tensor([7])}
    bridge_positions.add_positions_from_cache_position((tokens,), arguments, _ReadsPositions)
    assert torch.equal(arguments["position_ids"], torch.tensor([[7], [7], [7]]))
    for model_class, given in [
        (_ReadsCachePosition, {"cache_position": torch.tensor([7])}),
        (_ReadsPositions, {"cache_position": torch.tensor([7]), "position_ids": torch.ones(3, 1)}),
        (_ReadsPositions, {}),
    ]:
        before = dict(given)
        bridge_positions.add_positions_from_cache_position((tokens,), given, model_class)
        assert given.keys() == before.keys()
        assert all(given[key] is before[key] for key in before)


def _recording_forward(seen: list[Any]) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> str:
        seen.append(kwargs.get("attention_mask"))
        return "done"

    return forward


def test_a_mask_longer_than_the_input_keeps_its_last_columns() -> None:
    seen: list[Any] = []
    forward = bridge_state_mask.trimming_mask_forward(_recording_forward(seen))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    arguments = {"attention_mask": mask}
    assert forward(None, torch.zeros(2, 1, 8), **arguments) == "done"
    assert torch.equal(seen[-1], mask[:, -1:])
    assert arguments["attention_mask"] is mask  # the caller's dict is left as it was
    forward(None, hidden_states=torch.zeros(2, 2, 8), attention_mask=mask)
    assert torch.equal(seen[-1], mask[:, -2:])


@pytest.mark.parametrize(
    ("hidden_states", "mask"),
    [
        (torch.zeros(2, 5, 8), torch.ones(2, 5, dtype=torch.long)),  # the prompt: as long
        (torch.zeros(2, 1, 8), None),  # no mask (a single prompt)
        (torch.zeros(2, 1, 8), torch.ones(2, 5, 1)),  # not a [batch, positions] mask
    ],
    ids=["as-long", "none", "other-shape"],
)
def test_any_other_mask_passes_unchanged(hidden_states: torch.Tensor, mask: Any) -> None:
    seen: list[Any] = []
    forward = bridge_state_mask.trimming_mask_forward(_recording_forward(seen))
    forward(None, hidden_states, attention_mask=mask)
    assert seen[-1] is mask


@pytest.mark.parametrize("architecture", ["MambaForCausalLM", "Mamba2ForCausalLM"])
def test_the_eager_scan_keeps_to_calls_without_a_cache(architecture: str) -> None:
    """``eager_scan=True`` (TransformerLens scans in Python from an empty state so that
    ``hook_ssm_state`` fires): a forward without a cache still scans, and cached generation stays
    right. Stock with transformers 5.24 scans every cached step from an empty state too, since
    it recognises a cache only as ``cache_params``."""
    folder = architecture_folder(architecture)
    reference = bridge.reference_from(folder, torch.float32)
    safelens_tl.activate()
    model = bridge.boot_folder(folder, torch.float32)
    mixers = [m for m in model.modules() if hasattr(m, "_eager_scan_forward")]
    if not mixers:
        pytest.skip("this TransformerBridge has no eager scan")
    fired: list[int] = []
    for mixer in mixers:
        mixer.eager_scan = True
        mixer.hook_ssm_state.add_hook(lambda tensor, hook: fired.append(1))
    try:
        model(torch.tensor([[5, 6, 7, 8]]), return_type="logits", use_cache=False)
        assert fired, "the eager scan no longer runs without a cache"
        try:
            runs = [bridge.run_batch(model, reference, p) for p in bridge.BATCHES.values()]
        except ImportError as missing:  # TransformerLens 3.0: see the test above
            assert "MambaCache" in str(missing)
            return
        for run in runs:
            assert run.max_rel_err <= checks.TOLERANCES[torch.float32], (architecture, run.batch)
        assert all(mixer.eager_scan for mixer in mixers)
    finally:
        model.reset_hooks()


def test_every_state_space_mixer_of_this_release_is_patched() -> None:
    layout = targets.locate_bridge()
    status = safelens_tl.activate()
    for mixer in layout.state_space_mixers:
        assert f"{mixer.__module__}.{mixer.__qualname__}.forward" in status.patched
