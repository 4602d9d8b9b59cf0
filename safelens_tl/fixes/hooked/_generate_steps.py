"""What the two fixes of ``HookedTransformer.generate``'s step mask share (``hooked_generate_mask``
on TransformerLens 2.13 to 3.0.0, ``hooked_generate_ones_mask`` on 3.1 to 3.9): ``generate`` marks
the model for the call, and ``get_residual`` and ``forward`` change the mask of the calls that
``generate`` makes itself.

Only ``generate`` is patched on the class. The ``get_residual`` and ``forward`` wrappers are put on
the model itself, as instance attributes, for the length of a ``generate`` call that needs them
(:class:`StepMethods`), and taken off when the last such call on that model returns: every other
forward pass, compiled, exported or traced ones included, runs the class's own methods, with no
frame of safelens-tl in its tracebacks.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from safelens_tl.patching import passing_errors_through
from safelens_tl.registry import Context, PatchBuilder, Wrap, Wrapper

#: ``marking(generate_with, original, steps)``: a ``generate`` that runs ``generate_with`` and
#: enters ``steps.installed(model)`` around the calls that need the step wrappers.
Marking = Callable[[Callable[..., Any], Callable[..., Any], "StepMethods"], Callable[..., Any]]

#: The methods ``generate`` calls at each step, wrapped on the model while it runs.
STEP_METHODS = ("get_residual", "forward")


@dataclass
class _Installed:
    """The step wrappers on one model: how many ``generate`` calls use them, and what the model's
    own ``__dict__`` held under each name before (absent: nothing)."""

    users: int = 0
    before: dict[str, Any] = field(default_factory=dict)
    ours: dict[str, Any] = field(default_factory=dict)


class StepMethods:
    """``get_residual`` and ``forward`` wrappers, put on a model for the length of a call.

    Several ``generate`` calls on one model (threads, a ``generate`` from a hook) share one
    installation; the last to return takes it off. A wrapper finds the method it wraps where
    ``generate`` would: an instance attribute of the model's own, else the class's method.
    """

    def __init__(self, residual: Wrapper, forward: Wrapper, fix: str) -> None:
        self.wrappers = {"get_residual": residual, "forward": forward}
        #: The fix the wrappers belong to, named in a note on an error raised through them.
        self.fixes = (fix,)
        self._lock = threading.Lock()
        self._models: dict[int, _Installed] = {}

    @contextlib.contextmanager
    def installed(self, model: Any) -> Iterator[None]:
        """The wrappers on ``model`` while the block runs."""
        self._install(model)
        try:
            yield
        finally:
            self._uninstall(model)

    def _install(self, model: Any) -> None:
        with self._lock:
            entry = self._models.setdefault(id(model), _Installed())
            entry.users += 1
            if entry.users > 1:
                return
            own = model.__dict__
            for name, wrapper in self.wrappers.items():
                entry.before[name] = own.get(name, _ABSENT)
                current = getattr(model, name)  # bound: the instance's own or the class's

                def call_current(
                    _self: Any, *args: Any, _current: Any = current, **kwargs: Any
                ) -> Any:
                    return _current(*args, **kwargs)

                call_current.__name__ = name
                call_current.__qualname__ = f"{type(model).__qualname__}.{name}"
                wrapped = passing_errors_through(wrapper(call_current), self.fixes)
                bound = types.MethodType(wrapped, model)
                entry.ours[name] = bound
                own[name] = bound

    def _uninstall(self, model: Any) -> None:
        with self._lock:
            entry = self._models[id(model)]
            entry.users -= 1
            if entry.users > 0:
                return
            del self._models[id(model)]
            own = model.__dict__
            for name, bound in entry.ours.items():
                if own.get(name) is not bound:
                    continue  # replaced meanwhile by someone else: theirs stays
                before = entry.before[name]
                if before is _ABSENT:
                    del own[name]
                else:
                    own[name] = before

    def on(self, model: Any) -> bool:
        """Whether the wrappers are on ``model`` now (for tests and ``status``)."""
        with self._lock:
            return id(model) in self._models


_ABSENT = object()


def step_wraps(marking: Marking, residual: Wrapper, forward: Wrapper, fix: str) -> PatchBuilder:
    """A record's ``patches`` (the record ``fix``): ``generate`` wrapped by ``marking(inner,
    original, steps)`` (presented as the original ``generate``), where ``steps`` puts
    ``residual`` and ``forward`` on the model for the calls that need them."""
    steps = StepMethods(residual, forward, fix)

    def patches(context: Context) -> list[Wrap]:
        model = context.layout.model_class()
        original = None if model is None else model.__dict__.get("generate")
        if model is None or not callable(original):
            return []
        # Outermost: the reservation then sees the tokens a list was turned into.
        return [Wrap(model, "generate", lambda inner: marking(inner, original, steps))]

    return patches


def is_generates_residual_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``get_residual`` call has the shape of ``generate``'s own: ``embeds,
    pos_offset`` positionally, ``attention_mask`` by keyword, no ``tokens``."""
    return len(args) <= 2 and "tokens" not in kwargs
