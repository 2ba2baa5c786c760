"""Deprecated path: the recipes are :mod:`nested.levels.recipes` (``nl.recipes``). Importing
this module warns and gives that one."""

import importlib
import sys
import warnings

warnings.warn(
    "nested.learn.recipes moved to nested.levels.recipes (nl.recipes is unchanged)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("nested.levels.recipes")
