"""The companion speaks text: the text companion task, and text in and out of the engine and
of the real server process, answering as token ids do."""

import dataclasses
import signal
import sys

import numpy as np
import pytest
from helpers import tiny_configs
from helpers.companion import events, text_run
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from nested import data
from nested.companion.client import ServerProcess
from nested.companion.engine import MAX_QUERY_TOKENS, Companion, CompanionError
from nested.companion.store import SQLiteStore
from nested.run import config as nc
from nested.run import loading

sys.path.insert(0, str(tiny_configs.ROOT / "experiments"))
from studies.companion import baselines, study  # noqa: E402

TASK = data.CompanionTask(num_features=8, num_labels=4, events=4, sessions=2, text=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return text_run(tmp_path_factory)


def test_the_text_task_is_the_id_task_in_sentences():
    ids = dataclasses.replace(TASK, text=False)
    a, b = TASK.batch(3, 2), TASK.batch(3, 2)
    np.testing.assert_array_equal(a.inputs, b.inputs)  # deterministic
    assert TASK.seq_len == 4 * 8 and TASK.vocab_size == 2 + 4 + 8 + 4
    words = TASK.text_tokenizer().decode(a.inputs[0]).split(" . ")[0]
    assert words.startswith("the ") and words.split()[-2:][0] == "is"
    # The same agents, inputs and answers as the id task; scored at "is", the colour next.
    k, at = TASK.features_per_input, TASK.answer_at
    events_ = a.inputs.reshape(2, TASK.events, TASK.event_length)
    plain = ids.batch(3, 2).inputs.reshape(2, ids.events, k + 1)
    np.testing.assert_array_equal(events_[..., 1 : 1 + k] - 6, plain[..., :k] - 1)
    np.testing.assert_array_equal(events_[..., at] - 14, plain[..., k] - 9)
    assert np.array_equal(np.flatnonzero(a.mask[0]), at - 1 + 8 * np.arange(4))
    np.testing.assert_array_equal(a.targets[0][a.mask[0] > 0], events_[0, :, at])
    np.testing.assert_array_equal(TASK.label_token([0, 3]), [14, 17])
    query = TASK.text_tokenizer().decode(TASK.query_tokens(np.array([0, 1, 7])))
    assert query == "the heavy light paper box is"


def test_a_tokenizer_json_giving_each_word_one_token_makes_the_same_sentences(tmp_path):
    texts = [events(TASK, seed)[0] for seed in range(20)]
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<|endoftext|>", "[UNK]"])
    words.train_from_iterator(texts, trainer=trainer)
    words.save(str(tmp_path / "words.json"))
    task = dataclasses.replace(TASK, tokenizer=str(tmp_path / "words.json"))
    decode = task.text_tokenizer().decode
    assert decode(task.batch(0, 1).inputs[0]) == TASK.text_tokenizer().decode(
        TASK.batch(0, 1).inputs[0]
    )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small = trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"])
    bpe.train_from_iterator(texts, trainer=small)
    bpe.save(str(tmp_path / "bpe.json"))
    with pytest.raises(ValueError, match="tokenizer=.*as 2 tokens|tokenizer=.*word by word"):
        dataclasses.replace(TASK, tokenizer=str(tmp_path / "bpe.json"))
    with pytest.raises(ValueError, match="tokenizer='x.json' is invalid: set text=True"):
        data.CompanionTask(tokenizer="x.json")
    with pytest.raises(ValueError, match="tokenizer='nowhere.json' is invalid: no such file"):
        dataclasses.replace(TASK, tokenizer="nowhere.json")
    with pytest.raises(ValueError, match="num_features=64 is invalid: use <= 48 with text"):
        data.CompanionTask(num_features=64, text=True)


def test_the_rule_is_learnable_from_the_bag_of_tokens():
    task = dataclasses.replace(TASK, rare_facts=0)
    agents = [task.agent(r, 0) for r in range(8)]
    rng = np.random.default_rng(0)
    learner = baselines.OnlineLogistic(task, len(agents), lr=0.3)
    for _ in range(32):
        drawn = [task.sequence(a, 0, rng) for a in agents]
        inputs, answers = np.stack([d[0] for d in drawn]), np.stack([d[1] for d in drawn])
        baselines.test_then_train(learner, inputs, answers)
    queries = np.stack([task.draw_inputs(rng, 32)] * len(agents))
    truth = np.stack([task.answers(a.rule, q) for a, q in zip(agents, queries, strict=True)])
    assert learner.w.shape == (8, 4, task.vocab_size + 1)
    assert np.mean(learner.predict(queries) == truth) > 0.85  # chance: 0.25


def test_text_and_ids_give_the_same_answers_and_bad_text_is_refused(workdir, tmp_path):
    trained = loading.load_trained(workdir)
    task = trained.experiment.task
    companion = Companion(trained, SQLiteStore(tmp_path / "agents.sqlite"))
    text, ids = events(task, 1)
    assert companion.tokenizer.encode(text).tolist() == ids
    assert companion.observe({"t": text, "i": ids}) == {"t": {"tokens": 32}, "i": {"tokens": 32}}
    queries = [task.query_tokens(np.array(x)) for x in ([0, 1, 2], [3, 5, 7])]
    words = [companion.tokenizer.decode(q) for q in queries]
    got = companion.recall({"t": words, "i": [q.tolist() for q in queries]})
    for key in ("tokens", "probs", "readout"):
        np.testing.assert_allclose(got["t"][key], got["i"][key], rtol=1e-6)
    decoded = [[companion.tokenizer.decode([t]) for t in row] for row in got["t"]["tokens"]]
    assert got["t"]["text"] == got["i"]["text"] == decoded
    long = "the " * (MAX_QUERY_TOKENS + 1)
    with pytest.raises(CompanionError, match="query 0: 513 tokens .the text's encoding., more"):
        companion.recall({"t": [long]})
    with pytest.raises(CompanionError, match="query 0: the text encodes to no tokens"):
        companion.recall({"t": ["   "]})
    with pytest.raises(CompanionError, match=r"query 1: .*does not know \['purple', 'x'\]"):
        companion.recall({"t": [words[0], "the x purple box is"]})
    plain = trained._replace(
        experiment=trained.experiment._replace(task=dataclasses.replace(task, text=False))
    )
    without = Companion(plain, companion.store)
    assert without.tokenizer is None and "text" not in without.recall({"i": [ids[:4]]})["i"]
    with pytest.raises(CompanionError, match="agent 't': tokens: text was given, but .*--tok"):
        without.observe({"t": text})
    with pytest.raises(CompanionError, match="--tokenizer=nowhere.json: no such file"):
        Companion(plain, companion.store, tokenizer="nowhere.json")


@pytest.mark.slow
def test_text_round_trip_through_the_server_process(workdir, tmp_path):
    served = ServerProcess(workdir, tmp_path / "agents.sqlite")
    try:
        client = served.client
        task = nc.build(tiny_configs.config("companion", task__text=True)).task
        text, ids = events(task, 2)
        assert client.health()["tokenizer"] == "words"
        assert client.observe("t", text) == 32 and client.observe("i", ids) == 32
        query = "the heavy light round box is"
        by_text = client.recall("t", [query])
        by_ids = client.recall("i", [task.text_tokenizer().encode(query).tolist()])
        assert by_text["tokens"] == by_ids["tokens"] and by_text["text"] == by_ids["text"]
        assert all(isinstance(w, str) and w for w in by_text["text"][0])
        bad = [
            ("observe", {"tokens": ids, "text": text}, "not both"),
            ("observe", {}, "tokens: Field required; give either 'tokens' (token ids) or 'text'"),
            ("recall", {"queries": [[2]], "text": [query]}, "'queries' (token ids) or 'text'"),
            ("observe", {"text": "the " * 9000}, "text: 9000 tokens (the text's encoding), more"),
            ("recall", {"text": [3]}, "text.0: Input should be a valid string"),
        ]
        for action, body, message in bad:
            status, answer = client.request("POST", f"/agents/t/{action}", body)
            assert status == 422 and message in answer["error"], (body, answer)
        assert client.tokens("t") == 32  # nothing written by the refused requests
    finally:
        served.stop(signal.SIGTERM)


@pytest.mark.slow
def test_the_study_runs_on_text(workdir):
    trained = loading.load_trained(workdir)
    task = trained.experiment.task
    settings = study.Settings(
        agents=4, queries=4, latency_agents=4, latency_runs=1, tune_agents=4, variants=()
    )
    result = study.run(trained, settings)
    assert result["task"]["text"] and set(result["sessions"]) == set(study.METHODS)
    assert result["bytes"]["methods"]["logistic"] == 4 * 4 * (task.vocab_size + 1)  # bag of tokens
    summary = study.format_summary(result)
    assert "text task: companion - knn (retrieval by the frozen model's embeddings" in summary
    assert "- logistic (bag of tokens)" in summary
