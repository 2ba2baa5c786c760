"""The companion task: agents' rules, drift, rare facts and the token layout of events."""

import numpy as np
import pytest

from nested import data

TASK = data.CompanionTask(
    num_features=10, features_per_input=3, num_labels=4, events=5, session_length=2, sessions=3
)


def decode(batch, row):
    """``(inputs (E, k) feature ids, answers (E,) labels, scored answers)`` of one row."""
    k = TASK.features_per_input
    events = batch.inputs[row].reshape(TASK.events, k + 1)
    scored = batch.targets[row][batch.mask[row] > 0]
    return events[:, :k] - 1, events[:, k] - 1 - TASK.num_features, scored - 1 - TASK.num_features


def test_events_follow_the_agents_rule_and_are_scored_before_their_answer():
    for index in (1, 3):  # session 0 and session 1 of agent 0 (the drift is at session 3)
        batch = TASK.batch(index, 4)
        for row in range(4):
            inputs, answers, scored = decode(batch, row)
            agent = TASK.agent(row, 0)
            np.testing.assert_array_equal(answers, TASK.answers(agent.rule, inputs))
            np.testing.assert_array_equal(scored, answers)  # each answer is a target
            assert all(len(set(x)) == 3 for x in inputs)
    assert TASK.vocab_size == 15 and TASK.seq_len == 20 and TASK.agent_batches == 6


def test_agents_restart_and_the_first_sequence_opens_with_the_rare_facts():
    resets = [TASK.batch(i, 2).extras["reset"][:, 0].tolist() for i in range(8)]
    assert resets == [[1, 1], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0], [1, 1], [0, 0]]
    inputs, answers, _ = decode(TASK.batch(0, 2), 1)
    agent = TASK.agent(1, 0)
    np.testing.assert_array_equal(inputs[:2], agent.facts)
    np.testing.assert_array_equal(answers[:2], agent.fact_answers)
    assert np.all(agent.fact_answers != TASK.answers(agent.rule, agent.facts))  # rule-breaking
    assert not np.array_equal(TASK.agent(1, 0).rule, TASK.agent(1, 1).rule)  # a new agent
    held_out = TASK.batch(0, 2, split="new_agent")
    assert held_out.extras["reset"][:, 0].tolist() == [1, 1]
    inputs, answers, _ = decode(held_out, 0)
    np.testing.assert_array_equal(answers[2:], TASK.answers(TASK.agent(0, -1).rule, inputs[2:]))


def test_agents_without_rare_facts_follow_their_rule_from_the_first_event():
    task = data.CompanionTask(rare_facts=0)
    agent = task.agent(0, 0)
    assert agent.facts.shape == (0, task.features_per_input) and agent.fact_answers.shape == (0,)
    batch = task.batch(0, 1)
    k = task.features_per_input
    events = batch.inputs[0].reshape(task.events, k + 1)
    answers = events[:, k] - 1 - task.num_features
    np.testing.assert_array_equal(answers, task.answers(agent.rule, events[:, :k] - 1))


def test_the_drift_redraws_some_features_columns_only():
    task = data.CompanionTask(drift_fraction=0.25, drift_session=1)
    agent = task.agent(0, 0)
    moved = np.any(agent.rule != agent.drifted, axis=0)
    assert moved.sum() == 8  # 25% of 32 features
    rng = np.random.default_rng(0)
    inputs = task.draw_inputs(rng, 500)
    untouched = ~moved[inputs].any(axis=1)
    before, after = task.answers(agent.rule, inputs), task.answers(agent.drifted, inputs)
    np.testing.assert_array_equal(before[untouched], after[untouched])
    assert np.mean(before[~untouched] != after[~untouched]) > 0.3
    np.testing.assert_array_equal(task.rule_at(agent, 0), agent.rule)
    np.testing.assert_array_equal(task.rule_at(agent, 1), agent.drifted)


def test_bad_fields_name_the_field():
    with pytest.raises(ValueError, match="features_per_input"):
        data.CompanionTask(num_features=2, features_per_input=3)
    with pytest.raises(ValueError, match="drift_fraction"):
        data.CompanionTask(drift_fraction=1.5)
    with pytest.raises(ValueError, match="rare_facts"):
        data.CompanionTask(events=1, rare_facts=2)
