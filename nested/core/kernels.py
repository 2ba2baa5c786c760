"""Kernels: the ops of :mod:`nested.ops` matched to the level declarations they implement.

A kernel computes a fast level's inner loop over a sequence, ``run(level, state, ctx) -> (o,
state)``, the same function as the generic path (:func:`nested.core.inner.run_generic`: the
level's objective differentiated and its rule stepped token by token), in closed or
chunkwise-parallel form. A kernel is never attached to a level. :func:`find` matches what the
level declares (memory, objective, update rule with its constants and gates, read, period,
truncation) against each registered kernel's ``mismatch``, which names the first field the
kernel does not implement (or returns None), so a level whose rule is replaced
(``dataclasses.replace(level, update=...)``) gets the kernel of its new declaration or none.

Every kernel carries ``examples``: levels it implements. ``tests/core/test_kernels.py`` runs each
registered kernel on each of its examples against the generic path (values and gradients,
float64, lengths that are not a multiple of the chunk), so registering a kernel registers its
proof. Kernels are tried in registration order; the first that matches runs.

The built-in kernels, :mod:`nested.core.builtin_kernels` (state layout: every memory is a
tuple of layers ``({"w": W}, ...)``, the rule state a :class:`nested.rules.MomentumState`):

* ``linear_attention``: ``W += h_t v_t k_t^T`` (Dot objective, any period);
* ``delta_rule``: ``W += h_t (v_t - W k_t) k_t^T`` online, ``ttt_linear`` in mini-batches;
* ``gated_delta_rule``: the delta step after a log-space retention ``exp(a_t)``;
* ``falcon``: the delta step on the normalised ridge loss;
* ``gdn2``: MemT's decayed, erased write with a key-channel decay;
* ``neural_gradient_descent``: any MLP memory (``Linear`` as depth 1, polynomial features
  too) on the L2 loss under :class:`~nested.rules.GradientDescent` with optional momentum and
  decay (TTT-Linear, TTT-MLP, Titans), either read, any period;
* ``atlas``: the Omega rule (or L2) under :class:`~nested.rules.Muon`.

Document starts (packed language-model rows, flash-linear-attention's ``cu_seqlens``): a
context may carry ``starts`` (B, T), True where a new document starts, and ``initial``, the
state every such document starts from. A kernel with ``documents=True`` runs each document as
if alone (the first from the given state, every later one from ``initial``, update periods
counted from each document's start; outputs concatenated, the final state the last
document's), values and gradients, by splitting its chunks at the starts
(:mod:`nested.ops.documents`); ``tests/core/test_kernel_documents.py`` proves it on every example.
Every kernel here does (``atlas`` too: its Omega window holds none of an earlier document's
samples); for a context with starts the generic path runs in place of a kernel registered
without ``documents``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from nested.core.level import Level, LevelState
from nested.learn import memories, objectives

Run = Callable[[Level, LevelState, Any], tuple[jax.Array, LevelState]]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel: ``mismatch(level)`` is None when ``run`` implements the level exactly, else
    the reason it does not (one line, naming the field); ``examples()`` builds levels it
    implements, the cases of its equivalence test. ``documents``: ``run`` honours the
    context's document starts (``ctx.starts``, ``ctx.initial``) exactly, each document as if
    run alone; without, the generic path runs a context with starts."""

    name: str
    mismatch: Callable[[Level], str | None]
    run: Run
    examples: Callable[[], Sequence[Level]]
    documents: bool = False


KERNELS: list[Kernel] = []


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (tried after the ones before it)."""
    if any(k.name == kernel.name for k in KERNELS):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    if not kernel.examples():
        raise ValueError(f"kernel {kernel.name!r}: give at least one example level it implements")
    KERNELS.append(kernel)
    return kernel


def find(level: Level) -> tuple[Kernel | None, dict[str, str]]:
    """The first registered kernel implementing ``level``, and why each one before it does
    not (``{kernel name: reason}``; every kernel's reason when none matches)."""
    reasons = {}
    for kernel in KERNELS:
        reason = kernel.mismatch(level)
        if reason is None:
            return kernel, reasons
        reasons[kernel.name] = reason
    return None, reasons


# -- checks on a declaration (public: a kernel of your own states its conditions with them) --

Check = Callable[[Level], str | None]
"""A condition on a declaration: None if it holds, else the reason (one line)."""


def requires(*checks: Check) -> Check:
    """A kernel's ``mismatch``: the reason of the first check that fails, else None (a check
    may assume that the ones before it hold)."""

    def mismatch(level: Level) -> str | None:
        for check in checks:
            reason = check(level)
            if reason is not None:
                return reason
        return None

    return mismatch


def memory_is(*kinds: type) -> Check:
    """The memory is exactly one of ``kinds`` (``Featurized`` among them: with an inner
    memory of the others)."""

    def check(level: Level) -> str | None:
        memory, allowed = level.memory, kinds
        if isinstance(memory, memories.Featurized) and memories.Featurized in kinds:
            memory, allowed = memory.memory, tuple(k for k in kinds if k is not memories.Featurized)
        if type(memory) not in allowed:
            names = " or ".join(k.__name__ for k in allowed)
            return f"memory is {type(memory).__name__}, not {names}"
        return None

    return check


def objective_is(*kinds: type) -> Check:
    """The objective is exactly one of ``kinds`` (an Omega rule: over the L2 loss)."""

    def check(level: Level) -> str | None:
        objective = level.objective
        if type(objective) not in kinds:
            names = " or ".join(k.__name__ for k in kinds)
            return f"objective is {type(objective).__name__}, not {names}"
        if isinstance(objective, objectives.Omega) and type(objective.base) is not objectives.L2:
            return f"the Omega objective's base is {type(objective.base).__name__}, not L2"
        return None

    return check


def rule_is(kind: type, *, without: Sequence[str] = (), clips: bool = False) -> Check:
    """The rule is exactly ``kind``, has none of the parts ``without``, no gradient clip
    unless ``clips`` (the kernel clips), and every coefficient it has is one number per token
    and head (a constant or a scalar gate)."""

    def check(level: Level) -> str | None:
        rule = level.rule
        if type(rule) is not kind:
            return f"rule is {type(rule).__name__}, not {kind.__name__}"
        for part in without:
            if getattr(rule, part) is not None:
                return f"rule has {part}={getattr(rule, part)!r}; this kernel has no {part}"
        if getattr(rule, "clip", None) is not None and not clips:
            return f"rule clips its gradients (clip={rule.clip!r}); this kernel does not"
        for role in ("lr", "momentum", "decay"):
            spec = getattr(rule, role)
            if isinstance(spec, str) and level.gates[spec].size is not None:
                size = level.gates[spec].size
                return f"rule's {role} gate {spec!r} has size {size!r}, not scalar"
        return None

    return check


def lr_is(value: float) -> Check:
    def check(level: Level) -> str | None:
        lr = level.rule.lr
        return None if lr == value else f"rule has lr={lr!r}; this kernel steps with lr={value}"

    return check


def retains(size: str | None) -> Check:
    """The rule retains by a ``log_decay`` gate of ``size`` (None: scalar)."""

    def check(level: Level) -> str | None:
        name = level.rule.retain
        if name is None:
            return "rule has no retain gate"
        gate = level.gates[name]
        if (gate.kind, gate.size) != ("log_decay", size):
            return (
                f"retain gate {name!r} is ({gate.kind!r}, size {gate.size!r}); this kernel "
                f"takes ('log_decay', size {size!r})"
            )
        return None

    return check


def online(level: Level) -> str | None:
    return None if level.every == 1 else f"every={level.every}; this kernel updates every token"


def after_write(level: Level) -> str | None:
    return None if level.read == "after_write" else f"read={level.read!r}, not 'after_write'"


def clips_in_chunks(level: Level) -> str | None:
    """A gradient clip only with mini-batches: the online path (``every=1``) does not clip."""
    if getattr(level.rule, "clip", None) is not None and level.every == 1:
        return f"rule clips (clip={level.rule.clip!r}) at every=1; the online path does not clip"
    return None


def untruncated(level: Level) -> str | None:
    return None if level.truncate is None else f"truncate={level.truncate}; kernels do not cut"


# The library's own kernels register themselves on import (after the names above exist).
from nested.core import builtin_kernels  # noqa: E402, F401
