"""The companion study's baselines and variants (``experiments/studies/companion``): the online
learners and raw retrieval on hand-made streams, the learning rate tuned on training agents
only, the byte accounting, and the variants' rules."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import tiny_configs

from nested.data import CompanionTask
from nested.run import config as nc
from nested.run import pieces
from nested.run.loading import Trained

sys.path.insert(0, str(tiny_configs.ROOT / "experiments"))
from studies.companion import baselines, study  # noqa: E402

TASK = CompanionTask(num_features=5, features_per_input=2, num_labels=4, events=2, sessions=2,
                     session_length=1, rare_facts=0)  # fmt: skip


def feed(learner, events):
    for x, y in events:
        learner.observe(np.array([x]), np.array([y]))


def ask(learner, *inputs):
    return learner.predict(np.array([inputs]))[0].tolist()


def test_online_logistic_takes_one_sgd_step_per_event():
    task = CompanionTask(num_features=4, features_per_input=2, num_labels=2, rare_facts=0)
    learner = baselines.OnlineLogistic(task, 1, lr=1.0)
    assert ask(learner, (0, 1)) == [0]  # W = 0: the first label
    feed(learner, [((0, 1), 1)])  # p = (1/2, 1/2), z = (1, 1, 0, 0, 1)
    assert np.allclose(learner.w[0], [[-0.5, -0.5, 0, 0, -0.5], [0.5, 0.5, 0, 0, 0.5]])
    assert ask(learner, (0, 2), (2, 3)) == [1, 1]  # logits (-1, 1) and the bias (-0.5, 0.5)
    feed(learner, [((2, 3), 0)])  # p = softmax(-0.5, 0.5) = (s, 1 - s), s = 1 / (1 + e)
    s = 1 / (1 + np.e)
    step = 1 - s
    w0 = [-0.5, -0.5, step, step, -0.5 + step]
    assert np.allclose(learner.w[0], [w0, [-v for v in w0]], atol=1e-6)
    assert ask(learner, (2, 3), (0, 2), (0, 1)) == [0, 0, 1]
    assert learner.nbytes == 2 * 5 * 4  # (L, F + 1) float32


def test_vote_counter_sums_the_counts_of_the_input_features():
    votes = baselines.VoteCounter(TASK, 1)
    assert ask(votes, (0, 3)) == [0]
    feed(votes, [((0, 1), 1), ((0, 2), 1), ((1, 3), 0)])
    # counts: label 1 has f0: 2, f1: 1, f2: 1; label 0 has f1: 1, f3: 1
    assert ask(votes, (0, 3), (1, 3), (1, 2), (2, 3)) == [1, 0, 1, 0]  # (2, 3): a tie, label 0
    assert votes.counts.dtype == np.uint8 and votes.nbytes == 4 * 5  # a life of 4 events


def test_raw_retrieval_answers_with_the_most_overlap_then_the_most_recent():
    raw = baselines.RawRetrieval(TASK, 1, capacity=3)
    assert ask(raw, (0, 1)) == [0]  # nothing stored
    feed(raw, [((0, 1), 0), ((1, 2), 1), ((3, 4), 2)])
    assert ask(raw, (0, 1), (1, 4), (0, 2)) == [0, 2, 1]
    feed(raw, [((0, 3), 3)])  # evicts (0, 1); the ring's slots now hold 4th, 2nd, 3rd
    assert ask(raw, (0, 1), (2, 4), (0, 4)) == [3, 2, 3]
    assert raw.nbytes == 3 * (2 + 1) + 4  # a byte per id and answer, a write counter


def test_the_learners_answer_many_agents_and_queries_at_once():
    rng = np.random.default_rng(0)
    inputs, answers = TASK.draw_inputs(rng, 6).reshape(3, 2, 2), rng.integers(0, 4, (3, 2))
    queries = TASK.draw_inputs(rng, 12).reshape(3, 4, 2)
    for make in (
        lambda n: baselines.OnlineLogistic(TASK, n, 0.5),
        lambda n: baselines.VoteCounter(TASK, n),
        lambda n: baselines.RawRetrieval(TASK, n, 2),
    ):
        together = make(3)
        baselines.test_then_train(together, inputs, answers)
        for r in range(3):
            alone = make(1)
            baselines.test_then_train(alone, inputs[r : r + 1], answers[r : r + 1])
            assert (alone.predict(queries[r : r + 1]) == together.predict(queries)[r]).all()


def test_the_batched_oracle_fits_each_agent_as_alone():
    rng = np.random.default_rng(1)
    inputs, answers = TASK.draw_inputs(rng, 12).reshape(2, 6, 2), rng.integers(0, 4, (2, 6))
    both = baselines.fit_oracle(TASK, inputs, answers, steps=20)
    for r in range(2):
        assert np.allclose(both[r], baselines.fit_oracle(TASK, inputs[r], answers[r], steps=20))


def test_equal_bytes_within_one_entry_and_every_event_kept_raw():
    budget, dim = 10496, 64  # the companion's fast state in configs/companion.py
    for k in (2, 3, 4):
        task = CompanionTask(features_per_input=k)
        size = baselines.method_bytes(task, budget, dim)
        entry = {"knn": 4 * dim + 4, "knn_recency": 4 * dim + 4, "raw_overlap": k + 1}
        for method in baselines.EQUAL_BYTES:
            assert size[method] <= budget, method
        for method, bytes_each in entry.items():  # the stores fill the budget
            assert size[method] > budget - bytes_each, method
        assert size["logistic"] == 4 * 8 * 33 and size["votes"] == 2 * 8 * 32  # whole classes
        lifetime = task.sessions * task.session_length * task.events
        assert baselines.raw_capacity(task, budget) >= lifetime
        store = baselines.RawRetrieval(task, 1, baselines.raw_capacity(task, budget))
        assert store.nbytes == size["raw_overlap"]


def test_tuning_picks_the_fewest_errors_of_the_grid():
    task = CompanionTask(num_features=8, num_labels=4, events=8, sessions=2, session_length=1)
    agents = study.training_agents(task, 4)
    lr, errors = baselines.tune_learning_rate(task, agents, (0.0, 1.0), np.random.default_rng(0))
    assert lr == 1.0 and errors["1.0"] < errors["0.0"]


def test_survival_is_the_ratio_of_mean_advantages():
    same = study._survival(np.array([1.0, 1.0]), np.array([2.0, 2.0]))
    assert same == {"mean": 0.5, "low": 0.5, "high": 0.5, "undefined": 0.0}
    mixed = study._survival(np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, -1.0]))
    assert mixed["mean"] == 3.0 and 0 < mixed["undefined"] < 1
    assert study._survival(np.array([1.0]), np.array([0.0])) is None  # no advantage before


def test_one_feature_rule_lets_the_highest_ranked_feature_decide():
    settings = study.Settings(agents=3)
    base, _ = study.held_out(CompanionTask(), settings)
    task, agents = study.held_out(CompanionTask(), settings, "one_feature")
    inputs = task.draw_inputs(np.random.default_rng(0), 50)
    for agent in agents:
        votes, rank = agent.rule.argmax(0), agent.rule.max(0)
        decider = inputs[np.arange(50), np.argmax(rank[inputs], axis=1)]
        assert (task.answers(agent.rule, inputs) == votes[decider]).all()
        assert (task.answers(agent.rule, agent.facts) != agent.fact_answers).all()
    same = base.agent(0, 0)  # the votes are the standard agent's
    assert (agents[0].rule.argmax(0) == same.rule.argmax(0)).all()


def test_pair_rule_sums_the_votes_of_the_input_pairs():
    task, agents = study.held_out(CompanionTask(), study.Settings(agents=2), "pairs")
    agent = agents[0]
    x = np.array([3, 7, 20])
    weights = np.zeros(task.num_labels)
    for f, g in ((3, 7), (3, 20), (7, 20)):
        label = agent.rule[:, f, g].argmax()
        weights[label] += agent.rule[label, f, g]
    assert task.answers(agent.rule, x) == weights.argmax()
    assert (task.answers(agent.rule, agent.facts) != agent.fact_answers).all()
    assert np.count_nonzero(agent.rule) == 32 * 31 // 2


def test_variants_change_only_their_fields():
    settings = study.Settings(agents=2)
    for name, fields in study.VARIANTS.items():
        task, _ = study.held_out(CompanionTask(seed=5), settings, name)
        assert task.seed == 5 + settings.agent_seed
        assert task.features_per_input == fields.get("features_per_input", 3)
        assert task.rule_kind == fields.get("rule_kind", "linear")
        assert task.width == task.features_per_input  # unpadded: the default task's layout
    mixed = CompanionTask(families=("k2", "pairs"), input_width=4)
    for name in study.VARIANTS:
        task, agents = study.held_out(mixed, settings, name)
        assert task.families == () and task.width == 4 and agents[0].family is None


@pytest.mark.slow
def test_held_out_agents_never_reach_the_tuner(tmp_path, monkeypatch):
    """The whole study on the tiny companion model (initial weights: what is learnt does not
    matter here), the tuner and the evaluation spied on: the tuner sees the training task and
    its agents only; every evaluated agent is another one."""
    experiment = nc.build(tiny_configs.config("companion"))
    run, workdir = Trained(experiment, pieces.init_state(experiment), 0), tmp_path
    tuned, evaluated = [], []
    tune, evaluate = baselines.tune_learning_rate, study._evaluate

    def spy_tune(task, agents, grid, rng):
        tuned.append((task, list(agents)))
        return tune(task, agents, grid, rng)

    def spy_evaluate(model, task, agents, *args):
        evaluated.append((task, list(agents)))
        return evaluate(model, task, agents, *args)

    monkeypatch.setattr(study, "tune_learning_rate", spy_tune)
    monkeypatch.setattr(study, "_evaluate", spy_evaluate)
    settings = study.Settings(
        agents=3, queries=3, latency_agents=2, latency_runs=1, tune_agents=3, variants=("k2",)
    )
    result = study.run(run, settings)
    base = run.experiment.task
    [(task, agents)] = tuned
    assert task == base
    training = study.training_agents(base, 3)
    assert all(np.array_equal(a.rule, b.rule) for a, b in zip(agents, training, strict=True))
    assert len(evaluated) == 2
    for held_task, held_agents in evaluated:
        assert held_task.seed == base.seed + settings.agent_seed != base.seed
        for a in held_agents:
            assert not any(np.array_equal(a.rule, b.rule) for b in agents)
    assert set(result["sessions"]) == set(study.METHODS)
    assert set(result["variants"]) == {"standard", "k2"}
    assert (
        "survives" in result["variants"]["k2"] and "survives" not in result["variants"]["standard"]
    )
    assert result["tuning"]["lr"] in settings.lr_grid
    summary = study.format_summary(result)
    assert "k2 (k=2, linear)" in summary and "logistic lr" in summary
    # The results page renders the study (benchmarks/sections/companion.py, in its own process).
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, 'benchmarks');"
        "from sections import companion, rows; d = Path(sys.argv[1]);"
        "record = {'command': 'train', 'after': {'command': 'study'}, 'error': None};"
        "print(companion.render(rows.Runs({'companion/x': (record, [])}, d, d)))"
    )
    (workdir / "companion").mkdir(exist_ok=True)
    (workdir / "companion" / "x").mkdir(exist_ok=True)
    (workdir / "companion" / "x" / "companion_study.json").write_text(json.dumps(result))
    page = subprocess.run(
        [sys.executable, "-c", code, str(workdir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tiny_configs.ROOT,
    ).stdout
    assert "| raw_overlap |" in page and "| k2 | 2 | linear |" in page
    assert "`logistic`'s learning rate" in page
