"""The core: levels, systems and the scheduler that compiles them into scans.

``level`` (the declaration of one level and its fast state), ``system`` (levels and owners,
validated), ``inner`` (a fast level's inner loop: a matching kernel or the generic path),
``windows`` (levels learning from the outer loss window by window), ``scheduler``
(``compile(system) -> Program``), ``guards`` (finite checks).
"""
