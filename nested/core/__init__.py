"""The core: levels, systems and the scheduler that compiles them into scans.

``level`` (the declaration of one level and its fast state), ``system`` (levels and owners,
validated), ``kernels`` (which op of :mod:`nested.ops` implements which declaration),
``inner`` (a fast level's inner loop: a matching kernel or the generic path), ``outer_loss``
(levels learning from the outer loss, run span by span: CMS), ``batch`` (the batch a program
takes and its checks), ``scheduler`` (``compile(system) -> Program``), ``guards`` (finite
checks), ``probes`` (measurements taken inside the inner loops while a model runs).
"""
