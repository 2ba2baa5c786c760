"""Memory rules as level recipes: a rule is data (memory + objective + update rule).

Each recipe returns a :class:`nested.Level`; ``RULES`` maps rule names to recipes so configs can
choose a rule by name. A recipe may attach a ``fast`` form (closed form, chunkwise parallel);
the generic path (``nested.inner.run_generic``) is the definition it must agree with.
"""

from __future__ import annotations

from nested import memories, objectives, rules
from nested.level import Level


def delta(name: str = "memory", *, d_k: int, d_v: int, every: int = 1, **level_kwargs) -> Level:
    """DeltaNet: one SGD step of lr ``beta_t`` on ``1/2 |W k_t - v_t|^2`` per token,
    ``W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T`` (``every=C``: mini-batch TTT-Linear)."""
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.l2,
        update=rules.sgd(lr="beta"),
        every=every,
        **level_kwargs,
    )


RULES = {"delta": delta}
