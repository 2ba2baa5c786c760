"""The companion's training loss is test-then-train over an agent's answers: each answer is
predicted before its event is observed, and the loss is the mean of those predictions'
cross-entropies (the regret's smooth form), on a mixture of agent families."""

import jax
import numpy as np
import pytest
from helpers import tiny_configs

from nested.run import config as nc
from nested.run import pieces


@pytest.mark.slow  # a tiny model compiled three times: about 10-30 s on 2 shared cores
def test_the_loss_is_the_mean_cross_entropy_of_answers_predicted_before_they_are_seen():
    config = tiny_configs.config(
        "companion", **{"task.families": ("k2", "pairs"), "task.input_width": 3}
    )
    experiment = nc.build(config)
    program, task = experiment.program, experiment.task
    params = pieces.init_state(experiment).params
    batch = task.batch(0, 2)
    arrays = {"inputs": batch.inputs, "targets": batch.targets, "mask": batch.mask}
    loss, _ = program.loss(params, arrays)
    logits, _ = program.apply(params, batch.inputs, program.start_fast(params, 2))
    logits = np.asarray(logits, np.float64)
    at = np.argwhere(batch.mask > 0)  # (events * rows, 2): row, position of each answer
    assert len(at) == 2 * task.events and (at[:, 1] % task.event_length == 2).all()
    by_hand = []
    for row, t in at:
        z = logits[row, t]
        answer = batch.inputs[row, t + 1]  # the token the prediction at t is scored against
        by_hand.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[answer])
    np.testing.assert_allclose(float(loss), np.mean(by_hand), rtol=1e-5)

    # Test, then train: event 1's answer does not reach its own prediction, but the next's.
    changed = batch.inputs.copy()
    answer_at = at[1, 1] + 1  # row 0, event 1's answer token
    labels = task.label_token(np.arange(task.num_labels))
    changed[0, answer_at] = labels[(list(labels).index(changed[0, answer_at]) + 1) % len(labels)]
    other, _ = program.apply(params, jax.numpy.asarray(changed), program.start_fast(params, 2))
    other = np.asarray(other, np.float64)
    np.testing.assert_allclose(other[0, at[1, 1]], logits[0, at[1, 1]], rtol=1e-6)
    assert np.abs(other[0, at[2, 1]] - logits[0, at[2, 1]]).max() > 1e-6
