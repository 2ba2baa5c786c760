"""Streams that restart: a batch's ``reset`` rows start from the learned initial state, and the
continual task's agents mark where they start."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nested as nl
from nested import data
from nested.nn.models import MemoryLM


def program():
    memory = nl.recipes.delta("memory", d_k=8, d_v=8, persist="stream")
    model = nl.Level(
        "model",
        memory=lambda rngs: MemoryLM(memory, vocab=16, dim=16, heads=2, layers=1, rngs=rngs),
        objective=nl.objectives.next_token,
        update=optax.sgd(0.1),
        every="step",
    )
    return nl.compile(nl.NestedSystem([model, memory], owners={"memory": "model"}))


def batch(seed, reset=None):
    tokens = jax.random.randint(jax.random.key(seed), (2, 9), 0, 16)
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 8))}
    if reset is not None:
        out["reset"] = jnp.zeros((2, 8)).at[:, 0].set(jnp.array(reset, jnp.float32))
    return out


def test_a_reset_row_starts_fresh_and_the_others_continue():
    prog = program()
    state = prog.init(jax.random.key(0), batch_size=2)
    state, _ = jax.jit(prog.train_step)(state, batch(1))
    carried = state.fast
    fresh = jax.jit(prog.start_fast, static_argnums=1)(state.params, 2)
    start = jax.jit(prog.stream_start)(state.params, batch(2, reset=[1, 0]), carried)
    pick = lambda tree, row: jax.tree.map(lambda x: x[row], tree)
    jax.tree.map(np.testing.assert_array_equal, pick(start, 0), pick(fresh, 0))
    jax.tree.map(np.testing.assert_array_equal, pick(start, 1), pick(carried, 1))
    assert not np.array_equal(pick(carried, 0)[0]["mixer"].params[0]["w"], 0)  # it did carry
    # The training step takes it from the batch: row 0's loss is that of a fresh start.
    losses = []
    apply = jax.jit(prog.apply)
    for fast in (fresh, carried):
        logits, _ = apply(state.params, batch(2)["inputs"], fast)
        losses.append(nl.objectives.token_cross_entropy(logits, batch(2)).sum(1))
    metrics = jax.jit(prog.eval_step)(state, batch(2, reset=[1, 0]))
    expected = (losses[0][0] + losses[1][1]) / 16
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)


def test_agents_of_the_continual_task():
    task = data.ContinualTask(vocab_size=64, num_keys=8, num_pairs=3, num_queries=3, num_tasks=2)
    agents = data.ContinualTask(
        vocab_size=64, num_keys=8, num_pairs=3, num_queries=3, num_tasks=2, agent_every=4
    )
    np.testing.assert_array_equal(task.mapping(1, row=2), agents.mapping(1, row=2, agent=0))
    assert not np.array_equal(agents.mapping(1, row=2, agent=0), agents.mapping(1, row=2, agent=1))
    assert "reset" not in task.batch(0, 2).extras  # one agent per row: no stream restarts
    starts = [agents.batch(i, 2).extras["reset"][:, 0].tolist() for i in range(6)]
    assert starts == [[1, 1], [0, 0], [0, 0], [0, 0], [1, 1], [0, 0]]
    assert agents.batch(5, 2).extras["reset"][:, 1:].sum() == 0
    # Batch 5 is row r's agent 1 under task_at(5): its answers follow that agent's map.
    b = agents.batch(5, 2)
    keys, answers = b.inputs[0, 6::2] - 1, b.targets[0, 6::2]
    np.testing.assert_array_equal(answers, agents.mapping(agents.task_at(5), 0, agent=1)[keys])
    held_out = agents.batch(0, 2, split="task1")  # a held-out agent's first sequence
    assert held_out.extras["reset"][:, 0].tolist() == [1, 1]
    keys, answers = held_out.inputs[1, 6::2] - 1, held_out.targets[1, 6::2]
    np.testing.assert_array_equal(answers, agents.mapping(1, 1, agent=-1)[keys])
