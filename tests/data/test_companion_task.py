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


MIXED = data.CompanionTask(families=("k2", "k4", "pairs"), events=4, rare_facts=1)


def test_families_draw_one_per_agent_and_pad_inputs_to_the_widest():
    families = [MIXED.agent(r, a).family for r in range(8) for a in range(4)]
    assert set(families) == {"k2", "k4", "pairs"}  # 32 draws of 3 families: all appear
    assert MIXED.width == 4 and MIXED.event_length == 5 and MIXED.seq_len == 20
    batch = MIXED.batch(0, 8)
    for row in range(8):
        agent = MIXED.agent(row, 0)
        k = data.companion.FAMILIES[agent.family][0]
        events = batch.inputs[row].reshape(4, 5)
        assert (events[:, : 4 - k] == 0).all() and (events[:, 4 - k : 4] > 0).all()  # padded
        inputs, answers = events[:, 4 - k : 4] - 1, events[:, 4] - 1 - MIXED.num_features
        np.testing.assert_array_equal(inputs[0], agent.facts[0])
        np.testing.assert_array_equal(answers[1:], MIXED.answers(agent.rule, inputs[1:]))
        scored = batch.mask[row] > 0  # each answer predicted at the slot before it
        np.testing.assert_array_equal(np.flatnonzero(scored), [3, 8, 13, 18])
        np.testing.assert_array_equal(batch.targets[row][scored], events[:, 4])


def test_a_family_left_out_never_appears_in_training_batches():
    """Agents of the training batches (rows x agent indices) are of the listed families
    only; a one-family task of another kind is what the study holds out."""
    seen = {MIXED.agent(r, a).family for r in range(16) for a in range(16)}
    assert seen == {"k2", "k4", "pairs"}
    for index in range(0, 3 * MIXED.agent_batches, MIXED.agent_batches):
        batch = MIXED.batch(index, 16)
        for row in range(16):
            agent = MIXED.agent(row, index // MIXED.agent_batches)
            assert agent.family != "one_feature" and agent.rule.ndim == (
                3 if agent.family == "pairs" else 2
            )
            assert (batch.inputs[row][batch.inputs[row] > 0] <= 1 + 32 + 8).all()


def test_one_family_tasks_keep_the_default_agents():
    """Families change nothing of the default task; a family's agent is the one-family
    task's agent of the same row and index (the family draw has its own stream)."""
    default = data.CompanionTask()
    assert default.width == 3 and default.seq_len == 64 and default.agent(0, 0).family is None
    k4 = data.CompanionTask(features_per_input=4, input_width=4)
    for r in range(8):
        agent = MIXED.agent(r, 0)
        if agent.family == "k4":
            np.testing.assert_array_equal(agent.rule, k4.agent(r, 0).rule)


def test_bad_families_name_the_field():
    with pytest.raises(ValueError, match="families"):
        data.CompanionTask(families=("k5",))
    with pytest.raises(ValueError, match="input_width"):
        data.CompanionTask(families=("k4",), input_width=3)
    with pytest.raises(ValueError, match="rule_kind"):
        data.CompanionTask(rule_kind="xor")


def test_queries_wider_than_the_task_stay_whole_and_narrower_ones_are_padded():
    wide = data.CompanionTask().query_tokens(np.array([[0, 1, 2, 3]]))  # a k4 variant's query
    np.testing.assert_array_equal(wide, [[1, 2, 3, 4]])
    narrow = MIXED.query_tokens(np.array([[0, 1]]))
    np.testing.assert_array_equal(narrow, [[0, 0, 1, 2]])
