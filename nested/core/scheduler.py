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

A batch is a mapping of ``inputs`` and ``targets``, ``(B, T)`` integer token ids, and optionally
``mask (B, T)``, ``reset (B, T)`` (set at the first position of rows that start a new stream:
their carried fast state restarts from the learned initial state) and ``documents (B, T)``
integer document ids of packed rows (every fast level restarts where a new document starts
inside a row, :mod:`nested.core.inner`), or a
:class:`nested.data.Batch`. Where a batch enters (``loss``, ``train_step``,
``eval_step``; ``apply``'s ``inputs``) its shapes and dtypes are checked when the function is
traced, so under ``jax.jit`` too; token ids are checked to lie in ``[0, vocab)`` where their
values are known: in eager calls and in :meth:`Program.check_batch`, the checked entry to call
on the host before a jitted step (the training loop checks every batch). Inside ``jax.jit``
values are tracers, and an id outside the vocabulary would make the loss NaN.

The model is a Flax NNX module built by the outermost level's factory; the scheduler only sees
pytrees (``nnx.split`` once, ``nnx.merge`` inside each pure function).

Mixed precision: with ``compile(system, compute_dtype=jnp.bfloat16)`` the model computes in
that dtype: the float32 slow parameters are cast to it where the model is merged (their
gradients come back in float32 through the cast), except the fast levels' learned initial
states (:class:`nested.core.level.InitialState`), so every fast state starts, is updated and
is carried in float32 (the kernels compute in the wider of their inputs' dtypes); the outer
objective sees float32 logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from nested.core import guards, inner, outer_loss, probes
from nested.core.batch import (
    Batch,
    as_arrays,
    check_arrays,
    check_document_grid,
    check_documents,
    check_tokens,
)
from nested.core.level import InitialState, Level, LevelState
from nested.core.system import NestedSystem
from nested.ops import documents as nested_documents


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


def _model_levels(model: nnx.Module) -> list[Level]:
    """The levels the modules of ``model`` hold (as attributes, or tuples or lists of them)."""
    found = []
    for _, module in nnx.iter_modules(model):
        for value in vars(module).values():
            values = value if isinstance(value, tuple | list) else (value,)
            found += [level for level in values if isinstance(level, Level)]
    return found


def _difference(system: Level, model: Level) -> str:
    fields = [f.name for f in dataclasses.fields(Level)]
    differ = [f for f in fields if getattr(system, f) != getattr(model, f)]
    ours = ", ".join(f"{f}={getattr(system, f)!r}" for f in differ)
    theirs = ", ".join(f"{f}={getattr(model, f)!r}" for f in differ)
    return f"the system's has {ours}, the model's {theirs}"


# Token ids outside the model's vocabulary: where the bound comes from, and the fix.
_VOCAB = "the model's vocabulary: Program.vocab"
_FIX = "fix the data or build a model of that vocabulary"


class Program:
    """The compiled system; see the module docstring."""

    def __init__(
        self,
        system: NestedSystem,
        *,
        skip_nonfinite: bool = False,
        compute_dtype=None,
        microbatches: int = 1,
        document_grid: int = 1,
    ):
        for name, value in (("microbatches", microbatches), ("document_grid", document_grid)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.document_grid = document_grid
        self.system = system
        self.skip_nonfinite = skip_nonfinite
        self.microbatches = microbatches
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        if self.compute_dtype is not None and not jnp.issubdtype(self.compute_dtype, jnp.floating):
            raise ValueError(f"compute_dtype={compute_dtype!r} must be a floating dtype")
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
        for level in _model_levels(model):
            if level.name in declared and level != system[level.name]:
                raise ValueError(
                    f"level {level.name!r} is declared twice, differently: "
                    f"{_difference(system[level.name], level)}; build the model and the "
                    f"system from the same Level (equal names must be equal levels)"
                )
        self._abstract_params = abstract_params
        self._model_vocab = getattr(model, "vocab", None)
        self.outer = outer
        self.tx = outer.update
        self.outer_loss_levels = {
            level.name: level for level in system.fast_levels if level.learns_outer_loss
        }

    # -- building blocks ------------------------------------------------------------------

    def model(self, params) -> nnx.Module:
        """The model of ``params``, its parameters in the compute dtype (module docstring)."""
        if self.compute_dtype is None:
            return nnx.merge(self.graphdef, params)
        initial, rest = nnx.split_state(params, InitialState, ...)
        cast = lambda x: (
            x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        )
        return nnx.merge(self.graphdef, initial, jax.tree.map(cast, rest))

    @functools.cached_property
    def vocab(self) -> int:
        """V: token ids lie in ``[0, V)``. The model's ``vocab`` attribute where it has one (its
        logits may be wider: padded columns of zero probability, as
        :class:`nested.nn.models.MemoryLM`'s ``vocab_multiple``), else the last dim of its
        logits ``(B, T, V)``."""
        if self._model_vocab is not None:
            return self._model_vocab
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        with probes.probing(None):  # a shape inference, not a call for a probe to measure
            logits = jax.eval_shape(
                lambda p, x: self._forward(p, x)[0], self._abstract_params, tokens
            )
        return logits.shape[-1]

    def check_batch(self, batch: Mapping[str, Any] | Batch) -> dict[str, Any]:
        """``batch`` as the dict of arrays the steps take, checked: ``inputs`` and ``targets``
        (and ``mask``, if given) of one shape ``(B, T)``, token ids integers in ``[0, vocab)``.

        Raises ``ValueError`` naming the array and the fix. Token ids are checked where their
        values are known, not inside ``jax.jit`` (tracers); call this on the host before a
        jitted step. The steps call it themselves, so shapes and dtypes are checked under jit.
        """
        arrays = as_arrays(batch)
        check_arrays(arrays, self.vocab, "batch", source=_VOCAB, fix=_FIX, grid=self.document_grid)
        return arrays

    def check_tokens(self, x, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` unless ``x`` is (B, T) integers (checked at
        trace time) whose ids, where its values are known (not a tracer), lie in
        ``[0, vocab)``."""
        check_tokens(x, self.vocab, name, source=_VOCAB, fix=_FIX)

    def start_fast(self, params, batch_size: int, carried=None, reset=None):
        """The fast state a sequence starts from: learned initial states, except that levels
        with ``persist="stream"`` continue from ``carried`` when it is given. ``reset``
        ``(B,)`` bool: rows that start a new stream (a new agent, say) take the initial state
        there too, carried or not."""
        fresh = self.model(params).initial_fast(batch_size)
        if carried is None:
            return fresh

        def pick(new, old):
            # Memories follow their level's persistence; other per-stream state (attention
            # caches) continues whenever a carried state is given.
            if isinstance(new, LevelState) and self.system[new.level].persist != "stream":
                return new
            if reset is None:
                return old
            return inner.select_rows(reset, new, old)

        return jax.tree.map(pick, fresh, carried, is_leaf=_is_state)

    def stream_start(self, params, batch: Mapping[str, Any], carried):
        """:meth:`start_fast` for a batch of a stream: ``carried`` continued (None: fresh),
        except in the rows where the batch's optional ``reset`` ``(B, T)`` is set at its first
        position (the task marks a new stream there)."""
        if carried is None:
            return None
        reset = batch.get("reset")
        reset = None if reset is None else reset[:, 0] > 0
        return self.start_fast(params, batch["inputs"].shape[0], carried, reset)

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

    def apply(
        self,
        params,
        inputs: jax.Array,
        fast=None,
        *,
        targets=None,
        mask=None,
        documents=None,
        document_grid=None,
    ):
        """Forward over ``inputs (B, T)``; ``fast`` continues a stream (None: start fresh).

        Model-level levels (CMS blocks, :mod:`nested.core.outer_loss`) learn only when ``targets``
        (and optionally ``mask``) are given; without them they read their current state.
        ``documents (B, T)`` int: the document of each position of packed rows; every fast level
        restarts from its learned initial state where a new one starts inside a row; they start
        at multiples of ``document_grid`` positions (None: the program's ``document_grid``; 1:
        anywhere), checked where the ids are known. ``inputs`` is checked as a batch's (module
        docstring).
        """
        self.check_tokens(inputs, "inputs")
        grid = self.document_grid if document_grid is None else document_grid
        if documents is not None:
            check_documents(documents, inputs.shape, "apply")
            check_document_grid(documents, grid, "apply")
        return self._forward(
            params, inputs, fast, targets=targets, mask=mask, documents=documents, grid=grid
        )

    def _forward(
        self, params, inputs, fast=None, *, targets=None, mask=None, documents=None, grid=None
    ):
        if fast is None:
            fast = self.start_fast(params, inputs.shape[0])
        model = self.model(params)
        ids = {} if documents is None else {"documents": documents}
        grid = self.document_grid if grid is None else grid
        with nested_documents.on_grid(grid):  # checked by check_batch and apply
            if self.outer_loss_levels and targets is not None:
                given = {"targets": targets, "mask": mask, **ids}
                batch = {k: v for k, v in given.items() if v is not None}
                return outer_loss.run(self.outer_loss_levels, model, inputs, fast, batch)
            return model(inputs, fast, **ids)

    def loss(self, params, batch, fast=None):
        """Outer objective of one batch: ``(loss, (metrics, final fast state))``.

        ``fast`` is the state the batch starts from, taken as given (a constant to a gradient
        of ``params``); None: the learned initial states of ``params``. To continue a stream,
        use :meth:`stream_loss`, which builds the start from ``params``."""
        return self._loss(params, self.check_batch(batch), fast)

    def stream_loss(self, params, batch, carried):
        """:meth:`loss` of a batch of a stream continued from ``carried`` (None: fresh): the
        start is :meth:`stream_start` of ``params``, built inside this function, so rows that
        start anew (``reset``, and levels with ``persist="sequence"``) begin at learned
        initial states that a gradient with respect to ``params`` reaches; carried rows begin
        at ``carried``, held constant (``stop_gradient``)."""
        return self._stream_loss(params, self.check_batch(batch), carried)

    def _stream_loss(self, params, batch: dict, carried):
        carried = None if carried is None else jax.lax.stop_gradient(carried)
        return self._loss(params, batch, self.stream_start(params, batch, carried))

    def _loss(self, params, batch: dict, fast=None):
        logits, fast = self._forward(
            params,
            batch["inputs"],
            fast,
            targets=batch["targets"],
            mask=batch.get("mask"),
            documents=batch.get("documents"),
        )
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # bf16 -> f32
        with jax.named_scope("loss"):
            loss, metrics = self.outer.objective(logits, batch)
        return loss, (metrics, fast)

    def train_step(self, state: State, batch) -> tuple[State, dict]:
        """One step of the outermost level through every inner loop.

        Metrics include ``finite/loss``, ``finite/grads`` and ``finite/<level>`` flags
        (:mod:`nested.core.guards`); with ``skip_nonfinite`` a step with any non-finite quantity
        leaves the state unchanged (but for the step counter) and reports ``skipped = 1``.
        """
        batch = self.check_batch(batch)
        (loss, (metrics, fast)), grads = self._gradients(state.params, batch, state.fast)
        with jax.named_scope("optimizer"):
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

    def _gradients(self, params, batch: dict, carried):
        """``((loss, (metrics, fast)), grads)`` of :meth:`stream_loss` on ``batch``.

        With ``microbatches = k`` the rows (and the carried fast state's) are split into ``k``
        equal parts run one after another in a ``lax.scan`` (one part's activations live at a
        time), and the losses, metrics and gradients are their averages weighted by each part's
        share of the batch's ``mask`` (equal shares without one): exactly the full batch's for
        an objective that averages over the (masked) positions, as ``next_token`` does.
        """
        # The start is built inside the differentiated function: rows that restart take
        # initial states of the parameters being differentiated (:meth:`stream_loss`).
        grad_fn = jax.value_and_grad(self._stream_loss, has_aux=True)
        k = self.microbatches
        if k == 1:
            return grad_fn(params, batch, carried)
        rows = batch["inputs"].shape[0]
        if rows % k:
            raise ValueError(f"microbatches={k} does not divide the batch's {rows} rows")
        split = lambda x: x.reshape(k, rows // k, *x.shape[1:])
        mask = batch.get("mask")
        if mask is None:
            weights = jnp.full((k,), 1.0 / k)
        else:
            per_part = jnp.sum(split(mask).astype(jnp.float32), axis=(1, 2))
            weights = per_part / jnp.maximum(jnp.sum(per_part), 1.0)

        def part(total, inputs):
            piece, start, weight = inputs
            (loss, (metrics, fast)), grads = grad_fn(params, piece, start)
            total = jax.tree.map(lambda t, g: t + weight * g.astype(t.dtype), total, grads)
            return total, (loss, metrics, fast)

        zeros = jax.tree.map(jnp.zeros_like, params)
        parts = (jax.tree.map(split, batch), jax.tree.map(split, carried), weights)
        grads, (losses, metrics, fast) = jax.lax.scan(part, zeros, parts)
        average = lambda x: jnp.tensordot(weights, x.astype(jnp.float32), axes=1).astype(x.dtype)
        merge = lambda x: x.reshape(rows, *x.shape[2:])
        return (average(losses), (jax.tree.map(average, metrics), jax.tree.map(merge, fast))), grads

    def eval_step(self, state: State, batch) -> dict:
        """Metrics of the outer objective on ``batch`` (fast levels still learn in context)."""
        _, (metrics, _) = self.stream_loss(state.params, batch, state.fast)
        return metrics


def compile(  # noqa: A001
    system: NestedSystem,
    *,
    skip_nonfinite: bool = False,
    compute_dtype=None,
    microbatches=1,
    document_grid=1,
) -> Program:
    """Compile ``system`` into a :class:`Program` (validates the model against the levels).

    ``skip_nonfinite``: a step whose loss, gradients or fast states are not finite keeps the
    previous state instead of applying the update (see :mod:`nested.core.guards`).
    ``compute_dtype``: the model computes in this dtype (e.g. ``jnp.bfloat16``), parameters
    and fast states stay float32 (module docstring); None: in the parameters' dtype.
    ``microbatches``: gradient accumulation, each batch's rows in this many parts inside the
    step (:meth:`Program.train_step`).
    ``document_grid``: the documents of packed rows start at multiples of this many positions
    (as the task ``tokens`` lays them out, its ``align``); checked on the host where ids are
    known (:meth:`Program.check_batch`), it lets the ops restart at chunk starts and run
    without segments where their chunks divide it (:mod:`nested.ops.documents`). 1: anywhere.
    """
    if not isinstance(system, NestedSystem):
        raise ValueError(f"compile() takes a nested.NestedSystem, got {type(system).__name__}")
    return Program(
        system,
        skip_nonfinite=skip_nonfinite,
        compute_dtype=compute_dtype,
        microbatches=microbatches,
        document_grid=document_grid,
    )
