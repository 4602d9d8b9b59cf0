"""The built-in plugins, registered through the ``safelens_tl`` entry-point group like any
third-party plugin: :mod:`~safelens_tl.builtin_plugins.hooked` (entry point ``kv_cache``) and
:mod:`~safelens_tl.builtin_plugins.bridge` (``transformer_bridge``). Each asks the list of fixes
(:mod:`safelens_tl.fixes`) for the patches of one API.
"""
