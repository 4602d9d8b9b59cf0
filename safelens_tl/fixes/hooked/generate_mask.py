"""The attention mask that ``HookedTransformer.generate`` of TransformerLens 2.13 to 3.0.0 should
build at every step, and builds from zeros instead.

Those releases (:func:`safelens_tl.targets.hooked_generate_masks_no_padding`) compute each step's
mask from a tensor of zeros that stands in for the tokens, pass it to ``get_residual`` only, and
call ``forward`` without a mask. Two things go wrong, cached and uncached alike:

- **Padding.** In a batch of prompts of different lengths every shorter prompt attends to its
  padding, left or right, and generates other tokens than it does alone (upstream issue #1005).
- **Learned positions** (``positional_embedding_type`` ``"standard"`` or ``"shortformer"``, as
  GPT-2's): ``get_residual`` takes them from that mask. When the tokenizer's pad token id is 0,
  every zero reads as padding, each position gets position 0's embedding zeroed as padding, and
  the model generates without positions, a single prompt as well as a batch. (TransformerLens makes
  the end-of-text token the pad token of a tokenizer that has none; GPT-NeoX's vocabulary numbers
  it 0.)

TransformerLens 3.1 builds the mask from the prompts' tokens, left-pads a list of text prompts,
and passes the mask, extended with ones for the generated tokens, to both calls. A patched
``generate`` does the same inside the release's own loop. :func:`masking_generate` works out the
prompts' mask as 3.1 does and marks the model in a :class:`~contextvars.ContextVar`:

- a list of two or more texts is tokenized once, padded on the left, and handed to the original
  as tokens (texts still come back as texts); its mask counts each prompt's own tokens
  (:func:`safelens_tl.fixes._prompt_batches.mask_from_lengths`), so a BOS that is also the pad token
  (GPT-2's tokenizer) is never taken for padding;
- a tensor of two or more token rows padded on the left gets the mask of each row's leading
  padding, whichever side the tokenizer pads (HookedTransformer's default is the right). The side
  is read from the tensor where it shows it (:func:`padded_side`: the rows' leading pad runs
  differ in length and their trailing ones do not), and from the tokenizer's ``padding_side``
  only where it cannot tell: the pad token is also EOS and some prompts end with it, a row is
  nothing but pads, or every row is padded alike. A BOS that is the pad token (GPT-2's) is kept
  where ``prepend_bos`` says one was prepended and every row starts with the pad token, which the
  tensor cannot tell from padding; a row that starts with another token shows that none was, and
  every leading pad is then masked (:func:`left_padding_mask`). Rows padded on the right go on
  after their padding, which 3.1's mask does not make right either, so they run as stock runs
  them. (3.1 to 3.9 mask a tensor by the tokenizer's side and ``prepend_bos`` alone: there a
  tensor padded against the tokenizer's side, or GPT-2-style rows without BOS, still attend to a
  pad; this fix does not apply to them.)

:func:`masked_step_residual` and :func:`masked_step_forward` then give ``generate``'s own
``get_residual`` and ``forward`` calls that mask. Where nothing is padded, only a model that
would lose its positions is marked, and its step mask is filled with ones (what the release
computes for any other pad id). Every other call, and every model, release and input that needs
nothing, runs the original as it is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from safelens_tl import targets
from safelens_tl.fixes._prompt_batches import RETURNS_TEXT, mask_from_lengths
from safelens_tl.fixes.hooked._generate_steps import (
    StepMethods,
    is_generates_residual_call,
    step_wraps,
)
from safelens_tl.registry import Context, Fix, frozen

#: The ``positional_embedding_type`` values ``get_residual`` takes from the mask.
LEARNED_POSITIONS = ("standard", "shortformer")


@dataclass
class StepMask:
    """What a marked ``generate`` masks: the prompts' padding, or nothing (all ones)."""

    model: object
    #: ``[batch, prompt]``, 1 for a token and 0 for padding; ``None`` when nothing is padded.
    prompt_mask: torch.Tensor | None = None
    #: How many tokens ``generate`` may add (sizes :attr:`full` once).
    max_new_tokens: int = 0
    #: ``prompt_mask`` followed by ones for every token ``generate`` may add, on the step's device.
    full: torch.Tensor | None = field(default=None, repr=False)
    #: The length of the current step's mask (prompt plus tokens generated so far).
    length: int = 0

    def step(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The mask for a step whose placeholder mask is ``placeholder`` (``[batch, length]``):
        the prompts' mask and ones after it, a view of one tensor allocated at the first step."""
        assert self.prompt_mask is not None
        length = int(placeholder.shape[1])
        full = self.full
        if full is None or full.shape[1] < length or full.device != placeholder.device:
            batch, prompt = self.prompt_mask.shape
            full = torch.ones(
                (batch, max(length, prompt + self.max_new_tokens)),
                dtype=self.prompt_mask.dtype,
                device=placeholder.device,
            )
            full[:, :prompt] = self.prompt_mask.to(placeholder.device)
            self.full = full
        self.length = length
        return full[:, :length]

    def current(self) -> torch.Tensor | None:
        """The mask of the step whose residual was just computed, for ``forward``."""
        if self.full is None or self.length == 0:
            return None
        return self.full[:, : self.length]


#: The mask of the patched ``generate`` running in this context; ``None`` outside one, or when
#: that ``generate`` needs nothing.
_generating: ContextVar[StepMask | None] = ContextVar("safelens_tl_hooked_step_mask", default=None)


def loses_positions(model: Any) -> bool:
    """Whether this release's ``generate`` would drop ``model``'s positions: learned positions
    and a tokenizer whose pad token id is 0."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "positional_embedding_type", None) not in LEARNED_POSITIONS:
        return False
    # A tokenizer's pad_token_id is a property that looks the token up (tens of thousands of
    # instructions): read once per generate, not at every step.
    return getattr(getattr(model, "tokenizer", None), "pad_token_id", None) == 0


def padded_side(tokens: torch.Tensor, pad: int) -> str | None:
    """The side the rows of ``tokens`` (``[batch, n]``) are padded on, as the tensor itself
    shows it: ``"left"`` where the rows' leading runs of ``pad`` differ in length and their
    trailing runs do not, ``"right"`` the other way round, ``None`` where it cannot tell.

    A padding side is the same for every row, so only the side whose runs differ can hold the
    padding. The tensor cannot tell where both differ (the pad token is also EOS and a prompt
    ends with it, or a row is nothing but pads) or neither does (nothing padded, or every row
    padded alike, BOS = pad at position 0 included).
    """
    is_pad = tokens.eq(pad)
    # Each row's leading run, then each row's trailing run: the length of the first run of ones.
    runs = torch.cat((is_pad, is_pad.flip(-1))).to(torch.uint8).cumprod(-1).sum(-1)
    low, high = runs.view(2, -1).aminmax(dim=-1)
    leading_differ, trailing_differ = (high > low).tolist()
    if leading_differ == trailing_differ:
        return None
    return "left" if leading_differ else "right"


def left_padding_mask(tokens: torch.Tensor, tokenizer: Any, prepend_bos: bool) -> torch.Tensor:
    """The mask of ``tokens`` padded on the left: 0 for each row's leading pad tokens, 1 after;
    where BOS is the pad token and was prepended, the last leading one is that BOS (1).

    What ``transformer_lens.utils.get_attention_mask`` computes for a tokenizer that pads on the
    left, without setting the shared tokenizer's ``padding_side`` for a list (3.1 sets and
    restores it, which another thread using the tokenizer would see), except where the tensor
    shows that no BOS was prepended: a row that starts with another token than the pad token
    would start with BOS = pad if one had been, so then every leading pad token is padding (the
    rows of ``to_tokens(..., prepend_bos=False)`` with GPT-2's tokenizer, ``prepend_bos`` left to
    the model's default). Where every row starts with the pad token, the tensor cannot tell a
    BOS from padding and ``prepend_bos`` decides, as in 3.1.
    """
    pad = tokenizer.pad_token_id
    leading = torch.cumsum(tokens.ne(pad), dim=-1) == 0
    mask = torch.ones_like(tokens)
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == pad:
        counts = leading.sum(-1)
        if bool(counts.min() > 0):
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            mask[rows, counts - 1] = 1
    return mask


def rows_padding_mask(
    tokens: torch.Tensor, tokenizer: Any, prepend_bos: bool
) -> torch.Tensor | None:
    """The padding mask of a tensor of token rows, or ``None`` to run it as stock runs it.

    The side the rows are padded on is read from the tensor (:func:`padded_side`), and from the
    tokenizer's ``padding_side`` only where the tensor cannot tell. Rows padded on the left get
    :func:`left_padding_mask`. Rows padded on the right go on after their padding, masked (3.1)
    or not (stock): wrong either way, so they are left as stock runs them.
    """
    side = padded_side(tokens, tokenizer.pad_token_id)
    if side is None:
        side = tokenizer.padding_side
    if side != "left":
        return None
    return left_padding_mask(tokens, tokenizer, prepend_bos)


def _prepend_bos(model: Any, given: Any) -> bool:
    """``generate``'s ``prepend_bos`` argument as 3.1 resolves it for the mask: ``None`` is
    TransformerLens's ``USE_DEFAULT_VALUE`` (``generate``'s default), so it means
    ``cfg.default_prepend_bos``, not False. Read as False, the BOS of a tokenizer whose BOS is its
    pad token (GPT-2's) would be masked as padding in every row."""
    if isinstance(given, bool):
        return given
    return bool(model.cfg.default_prepend_bos)


def prompts_mask(
    model: Any, prompts: list[str], tokens: torch.Tensor, prepend_bos: Any
) -> torch.Tensor:
    """The padding mask of ``tokens``, the left-padded tokens of ``prompts``, from each prompt's
    own token count (:func:`safelens_tl.fixes._prompt_batches.mask_from_lengths`)."""
    lengths = [int(model.to_tokens(p, prepend_bos=prepend_bos).shape[-1]) for p in prompts]
    return mask_from_lengths(lengths, int(tokens.shape[-1]), tokens)


def _prompts_mask(
    model: Any, bound: inspect.BoundArguments
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens ``generate`` is to run and their padding mask, for a call on a batch that may
    be padded (two or more texts, or two or more token rows); ``None`` for any other call."""
    given = bound.arguments["input"]
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or tokenizer.pad_token_id is None:
        return None
    prepend_bos = bound.arguments["prepend_bos"]
    # _may_be_padded has seen two or more prompts or rows.
    if isinstance(given, list):
        if not all(isinstance(prompt, str) for prompt in given):
            return None
        tokens = model.to_tokens(given, prepend_bos=prepend_bos, padding_side="left")
        return tokens, prompts_mask(model, given, tokens, prepend_bos)
    if isinstance(given, torch.Tensor):
        mask = rows_padding_mask(given, tokenizer, _prepend_bos(model, prepend_bos))
        return None if mask is None else (given, mask)
    return None


def _may_be_padded(given: Any) -> bool:
    """Whether ``generate``'s ``input`` is a batch that padding could be in: two or more prompts
    in a list, or a tensor of two or more token rows."""
    if isinstance(given, list):
        return len(given) >= 2
    return isinstance(given, torch.Tensor) and given.ndim == 2 and given.shape[0] >= 2


def _batch_call(
    signature: inspect.Signature, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[inspect.BoundArguments, StepMask | None] | None:
    """The call rewritten to run on tokens, with the mask of their padding, when its prompts are
    a batch that is padded; ``None`` otherwise (arguments the signature refuses included: the
    original then raises its own error)."""
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return None
    # generate's own defaults (prepend_bos's is the model's, not True), passed on as given.
    bound.apply_defaults()
    prompts = _prompts_mask(model, bound)
    if prompts is None:
        return None
    tokens, mask = prompts
    if isinstance(bound.arguments["input"], list):
        # As 3.1 does: a list is tokenized once, on the left, and its texts come back as texts.
        bound.arguments["input"] = tokens
        if bound.arguments["return_type"] in RETURNS_TEXT:
            bound.arguments["return_type"] = "str"
    if bool(mask.all()):
        return bound, StepMask(model) if loses_positions(model) else None
    return bound, StepMask(model, mask, max_new_tokens=int(bound.arguments["max_new_tokens"]))


def masking_generate(
    generate_with: Callable[..., Any],
    original: Callable[..., Any] | None,
    steps: StepMethods,
) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.generate`` of a release that builds its step mask from zeros (see
    the module docstring): a padded batch is masked as 3.1 masks it, and learned positions are
    kept where the pad token id is 0.

    ``generate_with`` generates (``generate`` or a wrapper of it); the result presents itself as
    ``original`` (``None``: ``generate_with``), so that a patch always wraps the original itself.
    ``steps`` puts :func:`masked_step_residual` and :func:`masked_step_forward` on the model for a
    call that masks anything.
    """
    presented = generate_with if original is None else original
    signature = inspect.signature(presented)

    @functools.wraps(presented)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Nearly every call is one prompt or one row: answered by a look at the first argument,
        # before binding (which costs about ten microseconds, visible in a short generation).
        given = kwargs["input"] if "input" in kwargs else (args[0] if args else None)
        batch = _batch_call(signature, self, args, kwargs) if _may_be_padded(given) else None
        if batch is not None:
            bound, state = batch
            args, kwargs = bound.args[1:], bound.kwargs
        else:
            state = StepMask(self) if loses_positions(self) else None
        if state is None:
            return generate_with(self, *args, **kwargs)
        token = _generating.set(state)
        try:
            with steps.installed(self):
                return generate_with(self, *args, **kwargs)
        finally:
            _generating.reset(token)

    return generate


def masked_step_residual(get_residual: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.get_residual``: the call a marked ``generate`` makes with its
    placeholder mask (``embeds, pos_offset`` positionally, ``attention_mask`` by keyword, no
    ``tokens``) gets the step's mask; every other call is the original's."""

    @functools.wraps(get_residual)
    def residual(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _generating.get()
        if state is not None and state.model is self and is_generates_residual_call(args, kwargs):
            placeholder = kwargs.get("attention_mask")
            if placeholder is not None:
                if state.prompt_mask is None:
                    # In place: generate builds this mask afresh at each step and reads it
                    # nowhere else, and fill_ costs a third of a new tensor (0.8 against 2.2 us).
                    placeholder.fill_(1)
                else:
                    kwargs["attention_mask"] = state.step(placeholder)
        return get_residual(self, *args, **kwargs)

    return residual


def masked_step_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``HookedTransformer.forward``: the call a marked ``generate`` on a padded batch makes
    from the residual (``start_at_layer=0``, no ``attention_mask``, the step's batch and either
    one position or all of them) gets the step's mask, as 3.1's ``generate`` passes it; every
    other call is the original's."""

    @functools.wraps(forward)
    def masked(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _generating.get()
        if (
            state is not None
            and state.model is self
            and state.prompt_mask is not None
            and kwargs.get("start_at_layer") == 0
            and kwargs.get("attention_mask") is None
            and args
        ):
            mask = state.current()
            residual = args[0]
            if (
                mask is not None
                and isinstance(residual, torch.Tensor)
                and residual.shape[0] == mask.shape[0]
                and residual.shape[1] in (1, mask.shape[1])
            ):
                kwargs["attention_mask"] = mask
        return forward(self, *args, **kwargs)

    return masked


def _applies(context: Context) -> tuple[bool, str]:
    if not targets.hooked_generate_masks_no_padding(context.release):
        return False, f"TransformerLens {context.release} masks generate's padding itself"
    return True, f"TransformerLens {context.release} builds generate's step mask from zeros"


_patches = step_wraps(
    masking_generate, masked_step_residual, masked_step_forward, "hooked_generate_mask"
)


FIX = Fix(
    id="hooked_generate_mask",
    symptom="HookedTransformer.generate on prompts of different lengths (or learned positions "
    "with pad token id 0) silently generates other text",
    affects=frozen({"transformer-lens": ">=2.13,<3.1"}),
    remedy="generate builds each step's mask from the prompts, padded on the left, as 3.1 does",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_generate_mask.py",
    changes=("generate", "forward"),
    detector="release",
    upstream="https://github.com/TransformerLensOrg/TransformerLens/issues/1005",
    fixed_in="3.1.0",
)
