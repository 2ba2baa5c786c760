"""Functional plasticity: do a level's online updates help what comes next, or interfere?

Seed 000, sections 1.3 and 5: a model's *plasticity capacity* is what it can change online;
its *functional plasticity* is whether those changes are useful, transferable capability or
only fit recent context and interfere with what follows. Measured per level, on a compiled
program and a deployment of it:

* :mod:`~nested.plasticity.alignment`: alignment of each update with the future objective;
* :mod:`~nested.plasticity.transfer`: the continual-learning matrix and its metrics;
* :mod:`~nested.plasticity.regret`: the regret utility of what was learned on one task for
  another, in the fast state and in the slow weights;
* :mod:`~nested.plasticity.capacity`: how much and in how many directions states change, and
  whether a long stream wears plasticity down;
* :mod:`~nested.plasticity.deployment`: the deployed setting they run in;
* :mod:`~nested.plasticity.budget`: what a model spends (slow parameters, carried bytes), for
  comparisons at equal budgets;
* :mod:`~nested.plasticity.report`: all of it on a trained run (``experiments/plasticity.py``).
"""

from nested.plasticity import alignment, budget, capacity, deployment, regret, report, transfer
from nested.plasticity.deployment import Deployment

__all__ = [
    "Deployment",
    "alignment",
    "budget",
    "capacity",
    "deployment",
    "regret",
    "report",
    "transfer",
]
