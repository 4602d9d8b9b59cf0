"""Deprecated name of :mod:`safelens_tl.kv.storage` (``kv_storage.reserve(total)`` for a decoding
loop of your own is now ``safelens_tl.kv.storage.reserve(total)``); it goes in a later release.

Importing it warns once and gives the module itself, so that settings made through the old name
(``small_cache_limit``, ``reserve``) are the ones the cache reads.
"""

import sys
import warnings

from safelens_tl.kv import storage

warnings.warn(
    "safelens_tl.kv_storage is now safelens_tl.kv.storage; the old name goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = storage
