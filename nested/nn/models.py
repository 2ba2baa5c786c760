"""Sequence models whose token mixers are fast levels (Flax NNX).

Models are pure in their fast state, like the layers they are built from:
``model(tokens, fast, documents=None) -> (logits, fast)`` (``documents``: the document ids of
packed rows, where every fast level restarts) and ``model.initial_fast(B)`` gives the fast state a
sequence starts from (a pytree of :class:`nested.core.level.LevelState`, one per memory layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner
from nested.core.level import Level
from nested.nn.attention import SlidingWindowAttention
from nested.nn.cms import ContinuumMemory
from nested.nn.frequencies import MultiFrequencyMemory
from nested.nn.hope import SelfModifyingLayer
from nested.nn.hybrid import AdaTransformerMixer, MemoryAsContext, MemoryAsGate, MemoryAsLayer
from nested.nn.layers import MemoryLayer, dense


class MLPBlock(nnx.Module):
    """Position-wise SwiGLU feed-forward block, ``W_d (silu(W_g x) * W_u x)``."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate = dense(dim, hidden, use_bias=False, rngs=rngs)
        self.up = dense(dim, hidden, use_bias=False, rngs=rngs)
        self.down = dense(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


# Rematerialisation of each block in the backward pass (``jax.checkpoint`` policies): "none"
# keeps every activation, "full" recomputes the block from its input, "save_dots" keeps the
# matmul outputs, "save_dots_no_batch" those without batch dims (the weights' products).
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def padded_vocab(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple``: the rows of the embedding and the
    columns of the output head (Megatron's ``make-vocab-size-divisible-by``)."""
    return -(-vocab // multiple) * multiple


MIXERS = ("memory", "context", "gate", "layer", "self_modifying", "adatransformer", "attention")


def make_mixer(
    kind: str,
    level: Level | None,
    *,
    dim: int,
    heads: int,
    window: int | None,
    rngs: nnx.Rngs,
    **memory_kwargs,
) -> nnx.Module:
    """A token mixer by name: ``"attention"`` (causal RoPE softmax attention, no fast level:
    the Transformer++ baseline; ``window=None`` for full attention), ``"memory"`` (the fast
    level alone), ``"context"`` (Titans MAC:
    segments of ``window`` tokens attend over persistent tokens and their retrieval from the
    memory; ``persistent=`` their count), ``"gate"`` (Titans MAG: memory gating
    sliding-window attention), ``"layer"`` (Titans MAL: memory, then attention),
    ``"self_modifying"`` (Hope: the memory's projections are fast memories too; pass
    ``projections=`` the projection level), ``"memory"`` with ``head_levels=`` (some heads run
    other levels: :class:`~nested.nn.frequencies.MultiFrequencyMemory`), ``"adatransformer"``
    (attention whose MLP is the memory, from the Nested Learning paper; ``window=None`` for
    full causal attention)."""
    if kind not in MIXERS:
        raise ValueError(f"mixer={kind!r} is unknown; use one of {MIXERS}")
    head_levels = memory_kwargs.pop("head_levels", ())
    if (head_levels or "consolidate" in memory_kwargs) and kind != "memory":
        raise ValueError(
            f"head_levels and consolidate split the heads of mixer='memory' among levels; "
            f"mixer={kind!r} takes one level"
        )
    if (kind == "attention") != (level is None):
        raise ValueError(
            f"mixer={kind!r}: mixer='attention' takes no fast level (level=None) and every "
            "other mixer runs one (level=...)"
        )
    if kind == "attention":
        if memory_kwargs:
            raise ValueError(
                f"mixer='attention' has no memory layer; {sorted(memory_kwargs)} set one"
            )
        return SlidingWindowAttention(dim=dim, heads=heads, window=window, rngs=rngs)
    if kind != "context" and "persistent" in memory_kwargs:
        raise ValueError(
            f"persistent={memory_kwargs['persistent']!r} sets the persistent tokens of "
            f"mixer='context' (Titans MAC); mixer={kind!r} has none"
        )
    if head_levels or "consolidate" in memory_kwargs:
        return MultiFrequencyMemory(
            level, head_levels=head_levels, dim=dim, heads=heads, rngs=rngs, **memory_kwargs
        )
    if kind == "memory":
        return MemoryLayer(level, dim=dim, heads=heads, rngs=rngs, **memory_kwargs)
    if kind == "context":
        return MemoryAsContext(
            level, dim=dim, heads=heads, window=window, rngs=rngs, **memory_kwargs
        )
    if kind == "gate":
        return MemoryAsGate(level, dim=dim, heads=heads, window=window, rngs=rngs, **memory_kwargs)
    if kind == "layer":
        return MemoryAsLayer(level, dim=dim, heads=heads, window=window, rngs=rngs, **memory_kwargs)
    if kind == "adatransformer":
        return AdaTransformerMixer(
            level, dim=dim, heads=heads, window=window, rngs=rngs, **memory_kwargs
        )
    return SelfModifyingLayer(level, dim=dim, heads=heads, rngs=rngs, **memory_kwargs)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then the position-wise part: an MLP
    (``x + mlp(norm(x))``, of hidden width ``mlp_hidden``), a Continuum Memory System when
    ``cms`` levels are given, or nothing when ``mlp_hidden=0``. Fast state:
    ``{"mixer": ..., "cms": (...)}``."""

    def __init__(
        self, mixer: nnx.Module, *, dim: int, mlp_hidden: int, cms: Sequence[Level], rngs: nnx.Rngs
    ):
        self.mixer_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.mixer = mixer
        self.cms = ContinuumMemory(cms, dim=dim, rngs=rngs) if cms else None
        use_mlp = mlp_hidden > 0 and not cms
        self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs) if use_mlp else None
        self.mlp = MLPBlock(dim, mlp_hidden, rngs=rngs) if use_mlp else None

    def initial_state(self, batch_size: int) -> dict:
        state = {"mixer": self.mixer.initial_state(batch_size)}
        if self.cms is not None:
            state["cms"] = self.cms.initial_state(batch_size)
        return state

    def __call__(self, x, state, starts=None):
        """``x (B, T, dim)``; document ``starts (B, T)`` go to the mixer and the CMS."""
        y, mixer_state = self.mixer(self.mixer_norm(x), state["mixer"], starts)
        x = x + y
        state = {**state, "mixer": mixer_state}
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        if self.cms is not None:
            x, state["cms"] = self.cms(x, state["cms"], starts)
        return x, state


class MemoryLM(nnx.Module):
    """A causal language model of ``layers`` blocks whose mixers run the fast level ``level``
    (None for ``mixer="attention"``, the Transformer++ baseline).

    ``tokens (B, T) int -> logits (B, T, V)``, ``V = padded_vocab(vocab, vocab_multiple)``:
    the embedding and the head are padded to a multiple of ``vocab_multiple`` (1: none, 128 as
    Megatron and MaxText), so that a tensor axis divides them. The padded logits (columns
    ``vocab..V-1``) hold the dtype's lowest finite value: every softmax gives them exactly zero
    probability, ``argmax`` never picks them, and being finite they give no NaN in ``0 * log p``;
    their head columns get zero gradients. Masked rather than sliced to ``vocab``, so the
    logits keep a shape the tensor axis divides. ``self.vocab`` is the ids the model reads and
    predicts (:attr:`nested.core.scheduler.Program.vocab`).

    ``mixer`` picks the block's token mixer (:func:`make_mixer`; ``window`` is the attention
    window of the hybrid mixers and of ``"attention"``); the MLP blocks are ``mlp_hidden`` wide
    (None: ``mlp_ratio * dim``; Llama's SwiGLU is ``8/3 dim`` rounded), ``mlp_ratio=0`` drops
    them; ``cms`` (levels, fastest first) replaces each MLP by a Continuum Memory System;
    ``projections`` is the projection level of the self-modifying (Hope) mixer. Other keyword
    arguments go to the memory layers (:class:`nested.nn.layers.MemoryLayer`: ``conv``,
    ``key_shift``, ``turn``, ``experts``...). ``remat`` picks what each block keeps for the
    backward pass (:data:`REMAT`); it changes memory and time, never the values.
    """

    def __init__(
        self,
        level: Level | None = None,
        *,
        vocab: int,
        vocab_multiple: int = 1,
        dim: int,
        heads: int,
        layers: int = 2,
        mlp_ratio: int = 2,
        mlp_hidden: int | None = None,
        mixer: str = "memory",
        window: int | None = 64,
        cms: Sequence[Level] = (),
        projections: Level | None = None,
        remat: str = "none",
        rngs: nnx.Rngs,
        **memory_kwargs,
    ):
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is unknown; use one of {list(REMAT)}")
        self.remat = remat
        if not isinstance(vocab_multiple, int) or vocab_multiple < 1:
            raise ValueError(
                f"vocab_multiple={vocab_multiple!r} must be an int >= 1 (1: no padding; e.g. "
                f"128 pads the vocabulary {vocab} to {padded_vocab(vocab, 128)})"
            )
        self.vocab = vocab
        if (mixer == "self_modifying") != (projections is not None):
            raise ValueError(
                "MemoryLM: mixer='self_modifying' needs the projection level (projections=...) "
                "and other mixers take none"
            )
        if projections is not None:
            memory_kwargs["projections"] = projections
        padded = padded_vocab(vocab, vocab_multiple)
        self.embed = nnx.Embed(padded, dim, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(
                    make_mixer(
                        mixer,
                        level,
                        dim=dim,
                        heads=heads,
                        window=window,
                        rngs=rngs,
                        **memory_kwargs,
                    ),
                    dim=dim,
                    mlp_hidden=mlp_ratio * dim if mlp_hidden is None else mlp_hidden,
                    cms=cms,
                    rngs=rngs,
                )
                for _ in range(layers)
            ]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = dense(dim, padded, use_bias=False, rngs=rngs)

    def initial_fast(self, batch_size: int):
        return tuple(block.initial_state(batch_size) for block in self.blocks)

    def __call__(self, tokens: jax.Array, fast, documents=None):
        """``tokens (B, T) -> (logits (B, T, V), fast)`` (``V`` padded: the class docstring);
        ``documents (B, T)`` int, the document of each position of a packed row: every fast
        level and cache restarts where a new one starts inside the row
        (:func:`nested.core.inner.document_starts`)."""
        starts = None if documents is None else inner.document_starts(documents)
        # In the table's dtype: nnx.Embed returns float32 even from a bfloat16 table, and the
        # table's dtype is the model's compute dtype (nested.compile's compute_dtype).
        with jax.named_scope("embedding"):
            x = self.embed(tokens).astype(self.embed.embedding[...].dtype)
        states = []
        for block, state in zip(self.blocks, fast, strict=True):
            if self.remat == "none":
                x, state = block(x, state, starts)
            else:  # a pure function of the block's variables: nothing is written back
                graph, variables = nnx.split(block)
                run = lambda v, x, s, starts, graph=graph: nnx.merge(graph, v)(x, s, starts)
                run = jax.checkpoint(run, policy=REMAT[self.remat])
                x, state = run(variables, x, state, starts)
            states.append(state)
        with jax.named_scope("head"):
            logits = self.head(self.norm(x))
            if logits.shape[-1] > self.vocab:
                column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
                logits = jnp.where(column < self.vocab, logits, jnp.finfo(logits.dtype).min)
            return logits, tuple(states)
