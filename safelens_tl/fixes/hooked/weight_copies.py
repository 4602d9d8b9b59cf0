"""HookedTransformer forwards that read the weights where they lie, instead of copying them.

TransformerLens 3.0-3.9 copy weight matrices at every forward, in every layer:

* ``GatedMLP.forward`` and ``Unembed.forward`` call ``F.linear(x, self.W.T.contiguous())``: a
  transposed copy of ``W_gate``, ``W_in``, ``W_out`` and ``W_U``;
* attention's output projection makes ``einops.rearrange(self.W_O, ...).contiguous()``;
* ``utilities.attention.simple_attn_linear`` (queries, keys and values) rearranges
  ``[head, d_model, d_head]`` into ``[(head d_head), d_model]``, which cannot be a view (also in
  TransformerLens 2.x).

On a 135M-parameter Llama most of a cached generation's time went into those copies. Where it
costs less, the fix reads each weight in its own layout:

* ``F.linear(x, W.T)``: ``W.T`` is a transposed view, and the matrix product takes it as it is;
* ``W_O.reshape(head * d_head, d_model)`` is a view of ``[head, d_head, d_model]``;
* queries, keys and values are one matrix product per head (``torch.baddbmm`` with the heads as
  the batch, the bias fused as ``F.linear`` fuses it); the input is broadcast over the heads
  (no copy) and the ``[head, pos, d_head]`` result is laid out as ``[batch, pos, head, d_head]``
  (a copy of the activation, the same layout the release returns).

**Where the release's own code runs instead.** Each replacement decides at every call, from
what the call sees (:func:`reads_in_place`), and otherwise calls the release's function:

* half precision on the CPU (both in-place forms are slower there than a copy and a product),
  any device but the CPU (CUDA's crossover is not measured yet), mixed dtypes or devices (the
  release's error or move);
* more than :data:`PROJECTION_MAX_ROWS` rows in the query, key and value projections (where one
  product per head costs more than the copy);
* anything autograd records: gradients and backward memory are stock's, bitwise;
* tensors that are not plain (fake, functional, ``DTensor``, quantized or a user's
  ``__torch_function__`` subclass), and tracing: ``torch.compile``, ``torch.export``,
  ``torch.jit.trace``, ``make_fx`` and fake-tensor modes see the release's code, so their graphs
  are stock's.

Nothing is cached: no transposed or repeated weight stays in memory. The hooks see the same names
and shapes. Logits are bitwise stock's wherever the release's code runs, and on the in-place path
from 4 rows per product on; with 1 to 3 rows (a decoding step of a batch of 1 to 3) the matrix
product takes another kernel and the last bits differ (docs/performance.md gives the measured
error against float64 for both).

What is patched is found by behaviour or by source: ``simple_attn_linear`` only where a call on
tiny tensors copies its weight (:func:`copies_weight`); ``GatedMLP.forward`` and
``Unembed.forward`` only where their source is, to the byte, the body the replacements were
written from (:data:`_KNOWN_SOURCES`); the output projection only where
``AbstractAttention.forward`` calls ``.contiguous()`` on that very rearrangement: the attention
module's ``einops`` is then a copy of einops whose ``rearrange`` returns that rearrangement as a
view, whose ``.contiguous()`` returns the view (:func:`einops_without_output_copy`), and the rest
of the release's forward runs as it is.

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


#: The most rows (batch x positions) a query, key or value projection reads its weight in place
#: for, and never more than ``d_model`` rows. One product per head costs more than stock's single
#: product plus the weight copy from 512-1,024 rows of float32 on a 2-core AVX2 CPU; 256 keeps a
#: factor of two or more below that and covers every decoding step of a batch of up to 256 prompts
#: (``benchmarks/forward_in_place.py``). Up to ``d_model`` rows the projection also holds no more
#: memory than stock: its result twice (``rows x heads x d_head`` elements each) against stock's
#: result and its copy of the weight (``d_model x heads x d_head``).
PROJECTION_MAX_ROWS = 256

#: The dtypes whose products read in place are faster than stock's copy and product, by device
#: type. On the CPU only float32: in float16 and bfloat16, a matrix product whose weight is a
#: transposed view, and one product per head, are 1.5-10x slower than stock's copy plus its
#: product (``--section crossover``). Any other device runs the release's code until its
#: crossover is measured there (``benchmarks/forward_in_place.py --section crossover --device
#: cuda``, which ``benchmarks/gpu_checks.sh`` runs).
IN_PLACE_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "cpu": frozenset({torch.float32}),
}

#: Tensor types read in place; any other (a subclass: fake, functional, ``DTensor``, quantized,
#: a user's ``__torch_function__`` tensor) runs the release's code, which it was written for.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _compiling_check() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (``torch._dynamo.is_compiling`` before torch 2.3)."""
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    if check is None:
        check = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return check if callable(check) else (lambda: False)


#: ``torch.compile`` and ``torch.export`` tracing a forward: checked first, so that the tracer
#: takes the release's code without reading (and guarding on) anything else of the call.
_is_compiling = _compiling_check()
#: ``torch.jit.trace`` tracing a forward.
_jit_tracing: Callable[[], bool] = torch._C._is_tracing
_dispatch_stack_depth: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _infrastructure_mode_active() -> bool:
    """Whether a fake-tensor, proxy (``make_fx``) or functionalization mode is active: tracing
    and shape propagation, where real tensors may still reach a forward."""
    if not _dispatch_stack_depth():
        return False
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if keys is None:
        return True  # an older torch with some mode active: take the release's path
    return any(torch._C._get_dispatch_mode(key) is not None for key in keys.__members__.values())


def reads_in_place(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], max_rows: int | None = None
) -> bool:
    """Whether a product of ``x`` with ``weights`` takes the in-place path (else the release's).

    Every condition is one where reading in place was measured to cost no more than stock's
    copy, or where the release's code is the one its callers expect: plain tensors (no
    subclass, fake or functional tensor), all of one dtype in :data:`IN_PLACE_DTYPES` and on one
    device, at most ``max_rows`` rows where given and never more rows than ``x`` has columns
    then, nothing that autograd records (backward
    memory and gradients stay stock's), and no tracing (``torch.compile``, ``torch.export``,
    ``torch.jit.trace``, ``make_fx``, fake-tensor modes).
    """
    # Types first: reading an attribute of a subclass runs its __torch_function__.
    if _is_compiling() or type(x) not in _PLAIN:
        return False
    for weight in weights:
        if type(weight) not in _PLAIN:
            return False
    dtype, device = x.dtype, x.device
    if dtype not in IN_PLACE_DTYPES.get(device.type, ()):
        return False
    if max_rows is not None:
        width = x.shape[-1]
        if x.numel() > min(max_rows, width) * width:
            return False
    recording = torch.is_grad_enabled()
    if recording and x.requires_grad:
        return False
    for weight in weights:
        if weight.dtype != dtype or weight.device != device:
            return False
        if recording and weight.requires_grad:
            return False
    return not _jit_tracing() and not _infrastructure_mode_active()


def in_place_projection(input: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, d_model] x [head, d_model, d_head] + [head, d_head]`` ->
    ``[batch, pos, head, d_head]``, the weight read in its own layout (one product per head)."""
    heads, d_model, d_head = w.shape
    rows = input.reshape(-1, d_model)
    # The heads are the batch: each head's [d_model, d_head] block is a contiguous matrix, and
    # the input is broadcast (stride 0), not repeated. The bias is added inside the product, as
    # F.linear adds it.
    projected = torch.baddbmm(b.unsqueeze(1), rows.expand(heads, *rows.shape), w)
    # [head, rows, d_head] -> [rows, head, d_head], contiguous as the release's result is.
    laid_out = projected.transpose(0, 1).contiguous()
    return laid_out.view(input.shape[0], input.shape[1], heads, d_head)


def projection_reading_in_place(
    original: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """``simple_attn_linear`` that reads its weight in place where :func:`reads_in_place` says
    so (at most :data:`PROJECTION_MAX_ROWS` rows and ``d_model`` rows), and is ``original``
    everywhere else."""

    @functools.wraps(original)
    def simple_attn_linear(input: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if reads_in_place(input, (w, b), PROJECTION_MAX_ROWS):
            return in_place_projection(input, w, b)
        return original(input, w, b)

    return simple_attn_linear


def gated_mlp_in_place(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``GatedMLP.forward`` of TransformerLens 3.0-3.9 with ``W.T`` for ``W.T.contiguous()``."""
    pre_act = self.hook_pre(F.linear(x, self.W_gate.T))  # [batch, pos, d_mlp]
    if self.cfg.is_layer_norm_activation() and self.hook_mid is not None and self.ln is not None:
        mid_act = self.hook_mid(self.act_fn(pre_act))  # [batch, pos, d_mlp]
        post_act = self.hook_post(self.ln(mid_act))
    else:
        pre_linear = self.hook_pre_linear(F.linear(x, self.W_in.T))  # [batch, pos, d_mlp]
        post_act = self.hook_post((self.act_fn(pre_act) * pre_linear) + self.b_in)
    return F.linear(post_act, self.W_out.T, self.b_out)


def gated_mlp_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``GatedMLP.forward``: :func:`gated_mlp_in_place` where :func:`reads_in_place` says so,
    ``original`` everywhere else."""

    @functools.wraps(original)
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        # Compiling first, before any parameter is read: the traced graph is the release's own,
        # its inputs in the release's order.
        if not _is_compiling() and reads_in_place(
            x, (self.W_gate, self.W_in, self.W_out, self.b_in, self.b_out)
        ):
            return gated_mlp_in_place(self, x)
        return original(self, x)

    return forward


def unembed_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``Unembed.forward`` of TransformerLens 3.0-3.9 with ``W_U.T`` for ``W_U.T.contiguous()``
    where :func:`reads_in_place` says so, ``original`` everywhere else."""

    @functools.wraps(original)
    def forward(self: Any, residual: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or not reads_in_place(residual, (self.W_U, self.b_U)):
            return original(self, residual)
        residual = self.hook_in(residual)
        logits: torch.Tensor = self.hook_out(F.linear(residual, self.W_U.T, self.b_U))
        return logits

    return forward


#: sha256 of the dedented source of each forward the replacements above were written from
#: (TransformerLens 3.0.0 and 3.9.0 have the same two): another body is left as it is.
_KNOWN_SOURCES: dict[str, tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
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
    copy. Torch functions see a plain tensor (no subclass propagates). Made only from a plain
    tensor outside any tracing (:func:`reads_in_place`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


def output_projection_rearrange(rearrange: Callable[..., Any]) -> Callable[..., Any]:
    """einops' ``rearrange`` as ``AbstractAttention.forward`` sees it: the output projection's
    pattern on a contiguous ``W_O`` that :func:`reads_in_place` admits gives a view,
    ``W_O.reshape(head * d_head, d_model).T``, whose ``.contiguous()`` copies nothing; every
    other call is einops' own.

    The attention's input is not in sight here, so the rows are not counted: the view's product
    is as fast as the copy's at every row count measured in float32 (``--section layout``), and
    bitwise the same from 4 rows on.
    """

    @functools.wraps(rearrange)
    def output_rearrange(tensor: Any, pattern: str, **axes: Any) -> Any:
        if (
            pattern == OUTPUT_PATTERN
            and not axes
            and reads_in_place(tensor, ())
            and tensor.dim() == 3
            and tensor.is_contiguous()
        ):
            view = tensor.reshape(-1, tensor.shape[-1]).T
            return view.as_subclass(_TransposedView)
        return rearrange(tensor, pattern, **axes)

    return output_rearrange


def einops_without_output_copy(einops_module: ModuleType) -> ModuleType:
    """A module that is ``einops_module`` with :func:`output_projection_rearrange` for its
    ``rearrange``: what ``AbstractAttention.forward`` finds as its global ``einops``.

    A module, not an object with ``__getattr__``: ``torch.compile`` reads a module's attributes
    as constants and traces the functions it finds there.
    """
    module = ModuleType(einops_module.__name__, einops_module.__doc__)
    module.__dict__.update(
        {name: value for name, value in vars(einops_module).items() if not name.startswith("__")}
    )
    module.__dict__["rearrange"] = output_projection_rearrange(einops_module.rearrange)
    module.__dict__["__wrapped__"] = einops_module
    return module


def patches() -> list[Patch]:
    """The patches for the installed release: none where nothing copies."""
    found: list[Patch] = []
    attention = targets.optional_module(targets.HOOKED_ATTENTION_LINEAR_MODULE)
    original = None if attention is None else attention.__dict__.get("simple_attn_linear")
    if callable(original) and copies_weight(original):
        projection = projection_reading_in_place(original)
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
                found.append(Patch(module, "simple_attn_linear", projection))
    for dotted, (digest, replacement) in _KNOWN_SOURCES.items():
        owner = targets.optional_class(dotted)
        forward = None if owner is None else owner.__dict__.get("forward")
        if owner is not None and forward is not None and source_digest(forward) == digest:
            found.append(Patch(owner, "forward", replacement(forward)))
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
            found.append(Patch(module, "einops", einops_without_output_copy(einops_module)))
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
    remedy="float32 forwards without gradients read the weights in place where that costs "
    "less (no copy, no cache); everything else runs the release's code",
    applies=_applies,
    patches=_patches,
    test_module="tests/test_hooked_weight_copies.py",
    changes=("forward",),
)
