"""The scheduler: compiles a :class:`NestedSystem` into pure, jit-able functions.

``compile(system)`` returns a :class:`Program` with

* ``init(rng, batch_size=None) -> State``: the outermost level's model and optimizer state
  (and, with a batch size, the carried fast state of every memory);
* ``apply(params, inputs, fast=None) -> (logits, fast)``: a forward pass over a sequence that
  runs every fast level's inner loop (``lax.scan`` over its chunks, see :mod:`nested.core.inner`)
  and returns the final fast states, so a stream can be processed in pieces;
* ``train_step(state, batch) -> (state, metrics)``: one update of the outermost level, its
  objective differentiated with ``jax.value_and_grad`` through every inner loop, so the outer
  level meta-learns the fast levels' initial states, projections and gates;
* ``eval_step(state, batch) -> metrics``.

The model is a Flax NNX module built by the outermost level's factory; the scheduler only sees
pytrees (``nnx.split`` once, ``nnx.merge`` inside each pure function).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from nested.core import guards, outer_loss
from nested.core.level import LevelState
from nested.core.system import NestedSystem


@struct.dataclass
class State:
    """Everything a run needs to continue: a pytree, saved and restored whole.

    ``params``: the outermost level's parameters (an ``nnx.State``); ``opt_state``: its optax
    state; ``fast``: the carried fast state of every memory (leading batch dim), or None when
    every level restarts at each sequence; ``step``; ``rng``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    fast: Any
    rng: jax.Array


def level_states(fast) -> list[LevelState]:
    """The :class:`LevelState` leaves of a model's fast state."""
    return [
        x
        for x in jax.tree.leaves(fast, is_leaf=lambda x: isinstance(x, LevelState))
        if isinstance(x, LevelState)
    ]


def _is_state(x) -> bool:
    return isinstance(x, LevelState)


class Program:
    """The compiled system; see the module docstring."""

    def __init__(self, system: NestedSystem, *, skip_nonfinite: bool = False):
        self.system = system
        self.skip_nonfinite = skip_nonfinite
        outer = system.outer
        model = nnx.eval_shape(lambda: outer.memory(nnx.Rngs(0)))
        for attr in ("initial_fast",):
            if not hasattr(model, attr):
                raise ValueError(
                    f"level {outer.name!r}: the model {type(model).__name__} has no {attr}(); "
                    f"models must implement initial_fast(batch_size) and "
                    f"__call__(inputs, fast) -> (outputs, fast)"
                )
        self.graphdef, abstract_params = nnx.split(model)
        fast = jax.eval_shape(
            lambda p: nnx.merge(self.graphdef, p).initial_fast(1), abstract_params
        )
        used = {state.level for state in level_states(fast)}
        declared = {level.name for level in system.fast_levels}
        if used - declared:
            raise ValueError(
                f"the model of level {outer.name!r} runs level(s) {sorted(used - declared)} "
                f"that are not declared in the system {sorted(declared)}"
            )
        if declared - used:
            raise ValueError(
                f"level(s) {sorted(declared - used)} are declared but no layer of the model "
                f"of {outer.name!r} runs them"
            )
        self.outer = outer
        self.tx = outer.update
        self.outer_loss_levels = {
            level.name: level for level in system.fast_levels if level.learns_outer_loss
        }

    # -- building blocks ------------------------------------------------------------------

    def model(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    def start_fast(self, params, batch_size: int, carried=None):
        """The fast state a sequence starts from: learned initial states, except that levels
        with ``persist="stream"`` continue from ``carried`` when it is given."""
        fresh = self.model(params).initial_fast(batch_size)
        if carried is None:
            return fresh

        def pick(new, old):
            # Memories follow their level's persistence; other per-stream state (attention
            # caches) continues whenever a carried state is given.
            if isinstance(new, LevelState) and self.system[new.level].persist != "stream":
                return new
            return old

        return jax.tree.map(pick, fresh, carried, is_leaf=_is_state)

    # -- the compiled functions ----------------------------------------------------------

    def init(self, rng: jax.Array, *, batch_size: int | None = None) -> State:
        """Build the model from ``rng``; with ``batch_size``, also the carried fast state."""
        init_rng, rng = jax.random.split(rng)
        model = self.outer.memory(nnx.Rngs(init_rng))
        _, params = nnx.split(model)
        fast = None if batch_size is None else model.initial_fast(batch_size)
        return State(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            fast=fast,
            rng=rng,
        )

    def apply(self, params, inputs: jax.Array, fast=None, *, targets=None, mask=None):
        """Forward over ``inputs (B, T)``; ``fast`` continues a stream (None: start fresh).

        Model-level levels (CMS blocks, :mod:`nested.core.outer_loss`) learn only when ``targets``
        (and optionally ``mask``) are given; without them they read their current state.
        """
        if fast is None:
            fast = self.start_fast(params, inputs.shape[0])
        model = self.model(params)
        if self.outer_loss_levels and targets is not None:
            batch = {"targets": targets} if mask is None else {"targets": targets, "mask": mask}
            return outer_loss.run(self.outer_loss_levels, model, inputs, fast, batch)
        return model(inputs, fast)

    def loss(self, params, batch, fast=None):
        """Outer objective of one batch: ``(loss, (metrics, final fast state))``."""
        logits, fast = self.apply(
            params, batch["inputs"], fast, targets=batch["targets"], mask=batch.get("mask")
        )
        loss, metrics = self.outer.objective(logits, batch)
        return loss, (metrics, fast)

    def train_step(self, state: State, batch) -> tuple[State, dict]:
        """One step of the outermost level through every inner loop.

        Metrics include ``finite/loss``, ``finite/grads`` and ``finite/<level>`` flags
        (:mod:`nested.core.guards`); with ``skip_nonfinite`` a step with any non-finite quantity
        leaves the state unchanged (but for the step counter) and reports ``skipped = 1``.
        """
        fast = None
        if state.fast is not None:
            fast = self.start_fast(state.params, batch["inputs"].shape[0], state.fast)
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        (loss, (metrics, fast)), grads = grad_fn(state.params, batch, fast)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        flags = guards.health(loss, grads, fast)
        metrics = {**metrics, **flags, "grad_norm": optax.tree.norm(grads)}
        carried = None if state.fast is None else jax.lax.stop_gradient(fast)
        new = (params, opt_state, carried)
        if self.skip_nonfinite:
            ok = guards.healthy(flags)
            old = (state.params, state.opt_state, state.fast)
            new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            metrics["skipped"] = 1 - ok.astype(jnp.int32)
        params, opt_state, carried = new
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, fast=carried
        )
        return new_state, metrics

    def eval_step(self, state: State, batch) -> dict:
        """Metrics of the outer objective on ``batch`` (fast levels still learn in context)."""
        fast = None
        if state.fast is not None:
            fast = self.start_fast(state.params, batch["inputs"].shape[0], state.fast)
        _, (metrics, _) = self.loss(state.params, batch, fast)
        return metrics


def compile(system: NestedSystem, *, skip_nonfinite: bool = False) -> Program:  # noqa: A001
    """Compile ``system`` into a :class:`Program` (validates the model against the levels).

    ``skip_nonfinite``: a step whose loss, gradients or fast states are not finite keeps the
    previous state instead of applying the update (see :mod:`nested.core.guards`).
    """
    if not isinstance(system, NestedSystem):
        raise ValueError(f"compile() takes a nested.NestedSystem, got {type(system).__name__}")
    return Program(system, skip_nonfinite=skip_nonfinite)
