"""Ready-made levels, declared with :class:`nested.Level` above the scheduler's core: the named
memory rules as recipes (:mod:`nested.levels.recipes`, ``nl.recipes``) and the optimizers as
levels (:mod:`nested.levels.optim`)."""
