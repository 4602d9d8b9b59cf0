"""What an uncached step of TransformerBridge's ``generate`` gets of the prompt's media inputs
(:mod:`safelens_tl.fixes.bridge.uncached_media`), call by call. Whole generations through real
bridges are in ``tests/test_bridge_media.py``; here a plain function stands in for ``generate`` and
reports what each call into the model would receive, so that every rule can be seen alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from safelens_tl.fixes.bridge import uncached_media as bridge_uncached_media

PROMPT_LENGTH = 4


def _generate(
    self: Any,
    input: Any = "",
    max_new_tokens: int = 10,
    pixel_values: Any = None,
    attention_mask: Any = None,
    **multimodal_kwargs: Any,
) -> list[dict[str, Any]]:
    """Stands in for ``TransformerBridge.generate``: three calls into the model as its uncached
    loop makes them (media at the first only), then one cached call; what each call would pass
    on."""
    first = {"pixel_values": pixel_values, **multimodal_kwargs}
    first = {name: value for name, value in first.items() if value is not None}
    calls: list[tuple[torch.Tensor, dict[str, Any]]] = [
        (torch.zeros(1, PROMPT_LENGTH), first),
        (torch.zeros(1, PROMPT_LENGTH + 1), {}),
        (torch.zeros(1, PROMPT_LENGTH + 2), {"attention_mask": torch.ones(1, PROMPT_LENGTH + 2)}),
        (torch.zeros(1, 1), {"past_key_values": object()}),
    ]
    seen = []
    for tokens, kwargs in calls:
        bridge_uncached_media.restore_media((tokens,), kwargs)
        seen.append(kwargs)
    return seen


generate = bridge_uncached_media.passing_media_at_every_step(_generate)


def test_every_uncached_step_gets_the_prompt_s_pixels_and_a_cached_one_does_not() -> None:
    pixels = torch.randn(1, 3, 8, 8)
    grid = torch.tensor([[1, 2, 2]])
    first, second, third, cached = generate(None, "x", pixel_values=pixels, image_grid_thw=grid)
    for step in (first, second, third):
        assert step["pixel_values"] is pixels
        assert step["image_grid_thw"] is grid
    assert torch.equal(third["attention_mask"], torch.ones(1, PROMPT_LENGTH + 2))
    assert set(cached) == {"past_key_values"}


@pytest.mark.parametrize(
    ("name", "prompt_s", "after_two_tokens"),
    [
        # Hugging Face's generate: new tokens are text (0) in mm_token_type_ids...
        ("mm_token_type_ids", [0, 1, 1, 1], [0, 1, 1, 1, 0, 0]),
        # ... and repeat the last column in token_type_ids.
        ("token_type_ids", [0, 1, 1, 0], [0, 1, 1, 0, 0, 0]),
        ("token_type_ids", [0, 0, 1, 1], [0, 0, 1, 1, 1, 1]),
    ],
)
def test_per_token_inputs_grow_with_the_sequence_as_hugging_face_grows_them(
    name: str, prompt_s: list[int], after_two_tokens: list[int]
) -> None:
    value = torch.tensor([prompt_s])
    first, second, third, _ = generate(None, "x", **{name: value})
    assert first[name] is value
    assert second[name].tolist() == [after_two_tokens[:-1]]
    assert third[name].tolist() == [after_two_tokens]
    assert value.tolist() == [prompt_s], "the caller's tensor is left as it was"


def test_media_names_are_pixel_values_and_what_generate_has_no_parameter_for() -> None:
    given = {
        "max_new_tokens": 3,
        "pixel_values": torch.ones(1),
        "image_grid_thw": torch.ones(1),
        "attention_mask": torch.ones(1),  # the loop grows it at every step itself
        "image_sizes": None,
    }
    names = bridge_uncached_media.media_names(bridge_uncached_media.not_media(_generate), given)
    assert names == {"pixel_values", "image_grid_thw"}


def test_a_text_generate_and_calls_outside_generate_are_left_alone() -> None:
    text_only = generate(None, "x")
    assert text_only[1] == {} and text_only[2].keys() == {"attention_mask"}
    outside: dict[str, Any] = {}
    bridge_uncached_media.restore_media((torch.zeros(1, 9),), outside)
    assert outside == {}


def test_nothing_is_left_behind_by_a_generate_that_raises() -> None:
    def failing(self: Any, input: Any = "", **multimodal_kwargs: Any) -> None:
        bridge_uncached_media.restore_media((torch.zeros(1, 2),), dict(multimodal_kwargs))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        bridge_uncached_media.passing_media_at_every_step(failing)(None, pixel_values=1)
    later: dict[str, Any] = {}
    bridge_uncached_media.restore_media((torch.zeros(1, 3),), later)
    assert later == {}
