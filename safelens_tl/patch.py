"""``import safelens_tl.patch`` activates safelens-tl (the explicit spelling of auto-activation)."""

from safelens_tl import activate as _activate

STATUS = _activate()
