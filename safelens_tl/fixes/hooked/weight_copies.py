"""HookedTransformer forwards that read the weights where they lie, instead of copying them.

TransformerLens 3.0-3.9 copy weight matrices at every forward, in every layer:

* ``GatedMLP.forward`` and ``Unembed.forward`` call ``F.linear(x, self.W.T.contiguous())``: a
  transposed copy of ``W_gate``, ``W_in``, ``W_out`` and ``W_U``;
* attention's output projection makes ``einops.rearrange(self.W_O, ...).contiguous()``;
* ``utilities.attention.simple_attn_linear`` (queries, keys and values) rearranges
  ``[head, d_model, d_head]`` into ``[(head d_head), d_model]``, which cannot be a view (also in
  TransformerLens 2.x).

On a 135M-parameter Llama most of a cached generation's time went into those copies. The fix
reads each weight in its own layout:

* ``F.linear(x, W.T)``: ``W.T`` is a transposed view, and the matrix product takes it as it is;
* ``W_O.reshape(head * d_head, d_model)`` is a view of ``[head, d_head, d_model]``;
* queries, keys and values are one matrix product per head (``torch.baddbmm`` with the heads as
  the batch, the bias fused as ``F.linear`` fuses it); the input is broadcast over the heads
  (no copy) and the ``[head, pos, d_head]`` result is laid out as ``[batch, pos, head, d_head]``
  (a copy of the activation, the same layout the release returns).

Nothing is cached: no transposed or repeated weight stays in memory, and gradients reach the
parameters as before. The hooks see the same names and shapes. Logits: bitwise equal where the
matrix product takes the same kernel for either layout (float32 with 16 or more rows per
product; bfloat16 on CPU for every row count measured; float16 on CPU with one row); with one or
two rows in float32 (a cached decoding step of batch 1), and with several rows in float16 on
CPU, the kernel differs and so do the last bits (docs/performance.md gives the measured
differences).

What is patched is found by behaviour or by source: ``simple_attn_linear`` only where a call on
tiny tensors copies its weight (:func:`copies_weight`); ``GatedMLP.forward`` and
``Unembed.forward`` only where their source is, to the byte, the body the replacements were
written from (:data:`_KNOWN_SOURCES`); the output projection only where
``AbstractAttention.forward`` calls ``.contiguous()`` on that very rearrangement: the attention
module's ``einops`` is then one whose ``rearrange`` returns that rearrangement as a view, whose
``.contiguous()`` returns the view (:class:`EinopsWithoutOutputCopy`), and the rest of the
release's forward runs as it is.

Not covered: with ``cfg.ungroup_grouped_query_attention`` (off by default), grouped-query
attention still projects keys and values with ``W_K``/``W_V``, properties that
``repeat_interleave`` the key/value weights at each call.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from safelens_tl import targets
from safelens_tl.patching import Patch
from safelens_tl.registry import Context, Fix, frozen

#: ATen operations that write a new tensor from another one's elements: a copy when that other
#: tensor is a weight. ``contiguous()``, ``reshape`` of a non-viewable layout and ``einops``'
#: rearrangements reach ATen as ``clone``; ``repeat_interleave`` as ``index_select``.
COPYING_OPERATIONS = frozenset(
    {
        "clone",
        "copy_",
        "_to_copy",
        "contiguous",
        "index_select",
        "repeat",
        "repeat_interleave",
        "cat",
        "stack",
        "expand_copy",
        "permute_copy",
        "transpose_copy",
        "t_copy",
        "view_copy",
        "_reshape_copy",
    }
)


#: Operations that return a view where the layout allows and a copy where it does not. Autograd
#: decomposes them before the dispatch mode sees them, but under ``torch.inference_mode`` (TL 2.x's
#: ``generate``) they arrive whole: a copy is told by a result in other storage.
VIEW_OR_COPY_OPERATIONS = frozenset({"reshape", "flatten", "unflatten", "contiguous", "view_as"})


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class WeightCopyCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record every copying ATen operation (:data:`COPYING_OPERATIONS`) that reads a tensor
    sharing storage with one of ``weights`` (a module's parameters, say), below autograd: what a
    forward really runs, whatever Python spelling produced it.

    ``copies`` lists ``(operation, shape of the weight-backed input)`` in the order they ran.
    """

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = _storages(weights)
        self.copies: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in VIEW_OR_COPY_OPERATIONS:
            result = func(*args, **kwargs)
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            pointer = None if source is None else source.untyped_storage().data_ptr()
            if (
                pointer in self.storages
                and isinstance(result, torch.Tensor)
                and result.untyped_storage().data_ptr() != pointer
            ):
                self.copies.append((name, tuple(source.shape)))  # type: ignore[union-attr]
            return result
        if name in COPYING_OPERATIONS:
            # copy_(destination, source): only the source is read.
            inputs = _tensors(args[1:2] if name == "copy_" else args) + _tensors(
                list(kwargs.values())
            )
            for tensor in inputs:
                if tensor.untyped_storage().data_ptr() in self.storages:
                    self.copies.append((name, tuple(tensor.shape)))
                    break
        return func(*args, **kwargs)


def copies_weight(attn_linear: Callable[..., torch.Tensor]) -> bool:
    """Whether ``simple_attn_linear(input, w, b)`` copies ``w`` or ``b`` (tried on tiny tensors)."""
    weight, bias = torch.zeros(2, 3, 4), torch.zeros(2, 4)
    with torch.no_grad(), WeightCopyCounter([weight, bias]) as counter:
        attn_linear(torch.zeros(1, 1, 3), weight, bias)
    return bool(counter.copies)


def simple_attn_linear(input: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, d_model] x [head, d_model, d_head] + [head, d_head]`` ->
    ``[batch, pos, head, d_head]``, the weight read in its own layout (one product per head)."""
    if input.device != w.device:
        w = w.to(input.device)
    if input.device != b.device:
        b = b.to(input.device)
    heads, d_model, d_head = w.shape
    rows = input.reshape(-1, d_model)
    # The heads are the batch: each head's [d_model, d_head] block is a contiguous matrix, and
    # the input is broadcast (stride 0), not repeated. The bias is added inside the product, as
    # F.linear adds it.
    projected = torch.baddbmm(b.unsqueeze(1), rows.expand(heads, *rows.shape), w)
    # [head, rows, d_head] -> [rows, head, d_head], contiguous as the release's result is.
    laid_out = projected.transpose(0, 1).contiguous()
    return laid_out.view(input.shape[0], input.shape[1], heads, d_head)


def gated_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``GatedMLP.forward`` of TransformerLens 3.0-3.9 with ``W.T`` for ``W.T.contiguous()``."""
    if self.W_gate.device != x.device:
        x = x.to(self.W_gate.device)
    pre_act = self.hook_pre(F.linear(x, self.W_gate.T))  # [batch, pos, d_mlp]
    if self.cfg.is_layer_norm_activation() and self.hook_mid is not None and self.ln is not None:
        mid_act = self.hook_mid(self.act_fn(pre_act))  # [batch, pos, d_mlp]
        post_act = self.hook_post(self.ln(mid_act))
    else:
        pre_linear = self.hook_pre_linear(F.linear(x, self.W_in.T))  # [batch, pos, d_mlp]
        post_act = self.hook_post((self.act_fn(pre_act) * pre_linear) + self.b_in)
    return F.linear(post_act, self.W_out.T, self.b_out)


def unembed_forward(self: Any, residual: torch.Tensor) -> torch.Tensor:
    """``Unembed.forward`` of TransformerLens 3.0-3.9 with ``W_U.T`` for ``W_U.T.contiguous()``."""
    residual = self.hook_in(residual)
    logits: torch.Tensor = self.hook_out(F.linear(residual, self.W_U.T, self.b_U))
    return logits


#: sha256 of the dedented source of each forward the replacements above were written from
#: (TransformerLens 3.0.0 and 3.9.0 have the same two): another body is left as it is.
_KNOWN_SOURCES: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    targets.HOOKED_GATED_MLP_CLASS: (
        "0c31a3055a4d523061fe8fb8f01ac319885381aa98092c5b661c733f9d28614c",
        gated_mlp_forward,
    ),
    targets.HOOKED_UNEMBED_CLASS: (
        "0387667288742277042146229c03512a628d51ae8f915951def7cd1abb971ae2",
        unembed_forward,
    ),
}


def source_digest(function: Callable[..., Any]) -> str | None:
    """sha256 of ``function``'s dedented source; ``None`` where it has none."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


#: The output projection's copy in ``AbstractAttention.forward`` (TransformerLens 3.0-3.9).
OUTPUT_PATTERN = "head_index d_head d_model -> d_model (head_index d_head)"
_OUTPUT_COPY = (
    r"einops\.rearrange\(\s*self\.W_O,\s*\"" + re.escape(OUTPUT_PATTERN) + r"\"\s*,?\s*\)"
    r"\.contiguous\(\)"
)


class _TransposedView(torch.Tensor):
    """``W_O`` rearranged for the output projection, as a view, between ``rearrange`` and the
    ``.contiguous()`` the release calls on it: that call returns the plain view instead of a
    copy. Torch functions see a plain tensor (no subclass propagates)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


class EinopsWithoutOutputCopy:
    """``einops`` as ``AbstractAttention.forward`` sees it: every function is einops' own, except
    that the output projection's rearrangement of a contiguous ``W_O`` is a view,
    ``W_O.reshape(head * d_head, d_model).T``, whose ``.contiguous()`` copies nothing."""

    def __init__(self, einops_module: ModuleType) -> None:
        self._einops = einops_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._einops, name)

    def rearrange(self, tensor: Any, pattern: str, **axes: Any) -> Any:
        """einops' ``rearrange``; the output projection's pattern on ``W_O`` gives a view."""
        if (
            pattern == OUTPUT_PATTERN
            and not axes
            and isinstance(tensor, torch.Tensor)
            and tensor.dim() == 3
            and tensor.is_contiguous()
        ):
            view = tensor.reshape(-1, tensor.shape[-1]).T
            return view.as_subclass(_TransposedView)
        return self._einops.rearrange(tensor, pattern, **axes)


def patches() -> list[Patch]:
    """The patches for the installed release: none where nothing copies."""
    found: list[Patch] = []
    attention = targets.optional_module(targets.HOOKED_ATTENTION_LINEAR_MODULE)
    original = None if attention is None else attention.__dict__.get("simple_attn_linear")
    if callable(original) and copies_weight(original):
        # The attention modules imported the function by name: each binding is replaced.
        for module_name in (
            targets.HOOKED_ATTENTION_LINEAR_MODULE,
            *targets.HOOKED_ATTENTION_LINEAR_USERS,
        ):
            module = targets.optional_module(module_name)
            if (
                isinstance(module, ModuleType)
                and module.__dict__.get("simple_attn_linear") is original
            ):
                found.append(Patch(module, "simple_attn_linear", simple_attn_linear))
    for dotted, (digest, replacement) in _KNOWN_SOURCES.items():
        owner = targets.optional_class(dotted)
        forward = None if owner is None else owner.__dict__.get("forward")
        if owner is not None and forward is not None and source_digest(forward) == digest:
            found.append(Patch(owner, "forward", replacement))
    attention_class = targets.optional_class(targets.HOOKED_ATTENTION_CLASS)
    forward = None if attention_class is None else attention_class.__dict__.get("forward")
    module = None if attention_class is None else sys.modules.get(attention_class.__module__)
    einops_module = None if module is None else module.__dict__.get("einops")
    if module is not None and isinstance(einops_module, ModuleType) and forward is not None:
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            source = ""
        # Only where the forward calls .contiguous() on that very rearrangement.
        if re.search(_OUTPUT_COPY, source):
            found.append(Patch(module, "einops", EinopsWithoutOutputCopy(einops_module)))
    return found


@functools.cache
def _found() -> tuple[Patch, ...]:
    """:func:`patches`, worked out once per process: its probe and source hashes are the same
    for the detector and for the patches, and for every later activation."""
    return tuple(patches())


def _applies(context: Context) -> tuple[bool, str]:
    if context.layout.model_class() is None:
        return False, "this release has no HookedTransformer"
    found = _found()
    if not found:
        return False, "no forward of this release copies a weight matrix"
    names = sorted({patch.target.rsplit(".", 2)[-2] for patch in found})
    return True, f"these copy their weights at every forward: {', '.join(names)}"


def _patches(context: Context) -> list[Patch]:
    return list(_found())


FIX = Fix(
    id="hooked_weight_copies",
    symptom="HookedTransformer forwards copy every weight matrix at every call (3-4x slower "
    "generate than Hugging Face)",
    affects=frozen({"transformer-lens": ">=2.0,<4"}),
    remedy="gated MLP, unembed and attention read their weights in place (no copy, no cache)",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_weight_copies.py",
    changes=("forward",),
)
