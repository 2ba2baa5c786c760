"""Memory rules as level recipes: a rule is data (memory + objective + update rule).

Each recipe returns a :class:`nested.Level` named ``name`` with the rule's memory, objective and
update rule; extra keyword arguments (``every``, ``persist``, ``read``, ``chunk``, ``truncate``)
go to the level. ``RULES`` maps rule names to recipes so configs can choose a rule by name.
Recipes are declarations only (as optax's ``alias.py``): the kernel that runs a level is found
from what it declares (:mod:`nested.core.kernels`), the same for a level built by hand.

Equations (value-by-key ``W (d_v, d_k)``, DESIGN.md section 3):

* ``hebbian`` (linear attention): ``W_t = W_{t-1} + v_t k_t^T``; lr 1 on ``-<W k, v>``.
* ``delta`` (DeltaNet): ``W_t = W_{t-1} + b_t (v_t - W_{t-1} k_t) k_t^T``; lr ``b_t`` on
  ``1/2 |W k - v|^2``. With ``every=C`` it is mini-batch TTT-Linear.
* ``gated_delta`` (Gated DeltaNet): ``W_t = a_t W_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``:
  retain ``a_t``, then the delta step at the retained state.
* ``falcon`` (Falcon-1): ``W_t = (1 - e_t l_t) W_{t-1} + e_t (v_t - W_{t-1} x_t) x_t^T``,
  ``e_t = b_t / (|x_t|^2 + l_t + eps)``: lr ``b_t`` on the normalised ridge loss. The layer
  provides the alignment ``x_t = k_{t-1}`` (``MemoryLayer(key_shift=True)``).
* ``gdn2`` (MemT Stable GDN-2): ``W_t = W_{t-1} D_t (I - u_t u_t^T) + (w_t * v_t) u_t^T``,
  ``u_t = sqrt(b_t) * k_t``, ``D_t = diag(exp(l_t))``: retain ``D_t``, then lr 1 on
  ``1/2 |W u - w * v|^2``.

Neural memories (``f_theta`` an MLP; all losses ``1/2 |f(k) - v|^2``):

* ``ttt_linear`` / ``ttt_mlp`` (TTT, Sun et al. 2024): ``f(k) = k + LN(f_W(k))`` with a linear
  or two-layer (hidden 4x) ``f_W``, mini-batch SGD of lr ``lr_t`` every ``every`` tokens
  (default 16), the dual-form read.
* ``titans`` (Behrouz et al. 2025): ``S_t = m_t S_{t-1} - h_t grad L_t``,
  ``theta_t = (1 - a_t) theta_{t-1} + S_t`` on an MLP of ``depth`` layers (1 = linear).
* ``atlas`` (Behrouz et al. 2025): the Omega rule over the last ``window`` items with gates,
  polynomial key features of ``degree``, and Muon: ``S_t = m_t S_{t-1} - grad L_t``,
  ``theta_t = (1 - a_t) theta_{t-1} + h_t NS(S_t)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nested.core.level import Level
from nested.learn import memories, objectives, rules
from nested.learn.rules import Gate


def hebbian(name: str = "memory", *, d_k: int, d_v: int, **level_kwargs) -> Level:
    """Linear attention: one step of lr 1 on ``-<W k, v>`` per token."""
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.dot,
        update=rules.sgd(lr=1.0),
        **level_kwargs,
    )


def delta(
    name: str = "memory", *, d_k: int, d_v: int, lr: float | None = None, **level_kwargs
) -> Level:
    """DeltaNet: one SGD step of lr ``beta_t`` on ``1/2 |W k_t - v_t|^2`` per token; ``lr``:
    a fixed step size instead of the gate ``beta_t`` the model emits (None: the gate)."""
    if lr is not None and not (isinstance(lr, int | float) and 0 < lr <= 2):
        raise ValueError(f"lr={lr!r}: a fixed step size is a number in (0, 2]; None for the gate")
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.l2,
        update=rules.sgd(lr="beta" if lr is None else float(lr)),
        **level_kwargs,
    )


def gated_delta(name: str = "memory", *, d_k: int, d_v: int, **level_kwargs) -> Level:
    """Gated DeltaNet: retain ``alpha_t = exp(log_alpha_t)``, then the delta step of lr
    ``beta_t``. The retention is emitted in log space (``-softplus``), exact in float32 for
    strong forgetting."""
    gates = {"retain": Gate("log_decay", init=math.log(0.95))}
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.l2,
        update=rules.gradient_descent("beta", retain="log_alpha", gate_kinds=gates),
        **level_kwargs,
    )


def falcon(name: str = "memory", *, d_k: int, d_v: int, eps: float = 1e-6, **level_kwargs) -> Level:
    """Falcon-1: lr ``beta_t`` on the input-normalised ridge loss (gate ``lam`` >= 0)."""
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.NormalizedRidge(eps=eps),
        update=rules.sgd(lr="beta"),
        **level_kwargs,
    )


def gdn2(name: str = "memory", *, d_k: int, d_v: int, **level_kwargs) -> Level:
    """MemT Stable GDN-2: diagonal decay ``exp(l_t)`` over keys, erase and write vectors."""
    decay = {"retain": Gate("log_decay", init=-0.05, size="d_k")}
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.ErasedL2(),
        update=rules.gradient_descent(1.0, retain="log_decay", gate_kinds=decay),
        **level_kwargs,
    )


def bounded_lr(scale: float, init: float | None = None) -> dict[str, Gate]:
    """Gate kinds whose learning rate lies in (0, scale), starting at ``init`` (default the
    middle, scale / 2): neural memories and chunked updates diverge with steps ~1."""
    lr = Gate("unit", init=scale / 2 if init is None else init, scale=scale)
    return {**rules.DEFAULT_GATES, "lr": lr}


def _ttt(name: str, memory, lr_scale: float, every: int, level_kwargs) -> Level:
    return Level(
        name,
        memory=memory,
        objective=objectives.l2,
        update=rules.gradient_descent("lr", gate_kinds=bounded_lr(lr_scale)),
        every=every,
        **level_kwargs,
    )


def ttt_linear(
    name: str = "memory", *, d_k: int, d_v: int, every: int = 16, **level_kwargs
) -> Level:
    """TTT-Linear: ``f(k) = k + LN(W k)``, mini-batch SGD of lr ``lr_t`` in (0, 1) (needs
    d_k == d_v)."""
    memory = memories.MLP(d_k, d_v, hidden=d_v, depth=1, residual=True)
    return _ttt(name, memory, 1.0, every, level_kwargs)


def ttt_mlp(
    name: str = "memory",
    *,
    d_k: int,
    d_v: int,
    every: int = 16,
    hidden: int | None = None,
    **level_kwargs,
) -> Level:
    """TTT-MLP: ``f(k) = k + LN(MLP(k))``, two layers of hidden ``4 d_k``, mini-batch SGD of
    lr in (0, 0.1)."""
    memory = memories.MLP(d_k, d_v, hidden=hidden or 4 * d_k, depth=2, residual=True)
    return _ttt(name, memory, 0.1, every, level_kwargs)


def titans(
    name: str = "memory",
    *,
    d_k: int,
    d_v: int,
    depth: int = 2,
    hidden: int | None = None,
    every: int = 1,
    lr_scale: float | None = None,
    clip: float | None = None,
    **level_kwargs,
) -> Level:
    """Titans' neural memory: momentum ``m_t``, step ``h_t`` in ``(0, lr_scale)`` and forgetting
    ``a_t`` gates. In chunks of ``every = C`` tokens the C steps of a chunk add up at the
    chunk-start state (and momentum amplifies them), so the default range shrinks with the
    chunk, ``lr_scale = 0.1 / C`` (0.1 per token): on text, C = 16 with 0.1 diverges at the
    first step. On a long run of one repeated token every gradient of a chunk is the same, the
    momentum carries the chunk's step into the next ones (a step up to ``h C / (1 - m)`` a
    chunk) and the memory diverges for ``m`` near 1; ``clip`` (the largest norm of one token's
    gradient, ``rules.GradientDescent``) bounds every step (None: no clip, the paper's rule)."""
    if lr_scale is None:
        lr_scale = 0.1 / every
    memory = (
        memories.Linear(d_k, d_v)
        if depth == 1
        else memories.MLP(d_k, d_v, hidden=hidden or 4 * d_k, depth=depth)
    )
    return Level(
        name,
        memory=memory,
        objective=objectives.l2,
        update=rules.gradient_descent(
            "lr", momentum="momentum", decay="decay", clip=clip, gate_kinds=bounded_lr(lr_scale)
        ),
        every=every,
        **level_kwargs,
    )


def atlas(
    name: str = "memory",
    *,
    d_k: int,
    d_v: int,
    window: int = 4,
    degree: int = 2,
    depth: int = 2,
    hidden: int | None = None,
    ns_steps: int = 5,
    **level_kwargs,
) -> Level:
    """ATLAS: Omega rule over ``window`` items, polynomial features, Muon inner optimizer."""
    features = degree * d_k
    inner_memory = (
        memories.Linear(features, d_v)
        if depth == 1
        else memories.MLP(features, d_v, hidden=hidden or 4 * d_k, depth=depth)
    )
    return Level(
        name,
        memory=memories.Featurized(inner_memory, degree) if degree > 1 else inner_memory,
        objective=objectives.Omega(window=window),
        update=rules.muon(
            "lr",
            momentum="momentum",
            decay="decay",
            ns_steps=ns_steps,
            gate_kinds=bounded_lr(0.1),
        ),
        **level_kwargs,
    )


def cms(
    name: str = "cms",
    *,
    d_k: int,
    d_v: int,
    every: int,
    hidden: int | None = None,
    lr: float = 0.01,
    momentum: float = 0.0,
    **level_kwargs,
) -> Level:
    """A Continuum Memory System block (:mod:`nested.nn.cms`): an MLP ``d_k -> d_v`` (hidden
    ``4 d_k`` by default) that learns from the outer loss over its window every ``every``
    tokens, by SGD of constant step ``lr`` (and ``momentum``; 0 for none)."""
    return Level(
        name,
        memory=memories.MLP(d_k, d_v, hidden=hidden or 4 * d_k),
        objective=objectives.outer_loss,
        update=rules.gradient_descent(lr, momentum=momentum or None),
        every=every,
        **level_kwargs,
    )


def projections(
    name: str = "projections",
    *,
    d_k: int,
    d_v: int,
    every: int = 16,
    lr_scale: float | None = None,
    **level_kwargs,
) -> Level:
    """Hope's projection memories (:class:`nested.nn.hope.SelfModifyingLayer`): linear
    ``dim -> dim`` (``d_k == d_v == dim``), one SGD step on ``1/2 |P x - P v|^2`` per chunk of
    ``every`` tokens with a learned step size ``beta`` in ``(0, lr_scale)``: the mini-batch
    delta rule on self-generated targets.

    Default ``lr_scale = 1 / (dim * every)``: a chunk's summed gradient has curvature up to
    ``every * |x|^2 = every * dim`` for RMS-normalised inputs, so any step in the range is
    stable (a range of (0, 1) diverges at the first step of a width-128 model on text).
    """
    if d_k != d_v:
        raise ValueError(f"projections map dim -> dim: d_k={d_k} and d_v={d_v} must be equal")
    scale = 1.0 / (d_k * every) if lr_scale is None else lr_scale
    return Level(
        name,
        memory=memories.Linear(d_k, d_v),
        objective=objectives.l2,
        update=rules.sgd("beta", gate_kinds=bounded_lr(scale, 0.01 * scale)),
        every=every,
        **level_kwargs,
    )


# What a rule needs from the layer that owns it: Falcon writes the key aligned one step back,
# x_t = k_{t-1} (keyword arguments of nested.nn.layers.MemoryLayer).
LAYER_OPTIONS: dict[str, dict] = {"falcon": {"key_shift": True}}

RULES: dict[str, Callable[..., Level]] = {
    "hebbian": hebbian,
    "delta": delta,
    "gated_delta": gated_delta,
    "falcon": falcon,
    "gdn2": gdn2,
    "ttt_linear": ttt_linear,
    "ttt_mlp": ttt_mlp,
    "titans": titans,
    "atlas": atlas,
}
# Levels a model can hold besides the token-mixing memory rules, by name: CMS blocks and
# Hope's projections.
LEVELS: dict[str, Callable[..., Level]] = {"cms": cms, "projections": projections}


def named() -> dict[str, Callable[..., Level]]:
    """Every level recipe a config can name (read at call time: later registrations count)."""
    return {**RULES, **LEVELS}
