"""Flax NNX owners of fast levels: memory layers, attention, Titans hybrids, Hope, the
Continuum Memory System, and the language model that holds them."""
