"""Deprecated path: the optimizers as levels are :mod:`nested.levels.optim`. Importing this
module warns and gives that one."""

import importlib
import sys
import warnings

warnings.warn("nested.learn.optim moved to nested.levels.optim", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("nested.levels.optim")
