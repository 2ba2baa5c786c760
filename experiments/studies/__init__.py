"""Research studies built on the library and kept apart from it (as big_vision keeps ``proj/``):
their protocols, baselines and reports. Entry points in ``experiments/`` run them."""
