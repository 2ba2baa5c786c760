"""RULER's single-needle tasks (nested.run.needle, ``eval_lm.py --needle``): prompts of the exact
token length with the needle at the requested depth in both haystacks, the string-match score
and the Wilson interval against hand values, greedy answers against one ``Program.apply``, the
whole evaluation on a trained workdir, and one-line errors for bad input."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lm import fake_run, lm_config

from nested.data import corpus
from nested.run import config as nc
from nested.run import lm_eval, needle, pieces, rundir, train
from nested.run.config import ConfigError
from nested.run.loading import Trained

EOS = 256
SENTENCES = ("Alpha reads the map.", "Beta writes a letter!", "Is gamma here?", "Delta sleeps")
SAMPLE = needle.Sample("odd-wagon", "1234567", 0.5)


def texts(count: int = 60) -> list[str]:
    """Documents of a few sentences, some ending in a newline."""
    rng = np.random.default_rng(0)
    return [
        " ".join(rng.choice(SENTENCES, size=rng.integers(2, 6))) + "\n" * int(rng.integers(2))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The documents prepared with bytes and with a BPE of 300."""
    root = tmp_path_factory.mktemp("needle")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()))
    out = {}
    for kind, vocab in (("bytes", 0), ("bpe", 300)):
        out[kind] = root / kind
        docs = [str(root / "docs.jsonl")]
        corpus.prepare(docs, out[kind], tokenizer=kind, vocab_size=vocab, val_fraction=0.3)
    return out


def prepared(folder) -> tuple[corpus.Tokenizer, np.ndarray]:
    """The folder's tokenizer and its val split's tokens."""
    index = json.loads((folder / corpus.INDEX).read_text())
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    shards = index["splits"]["val"]["shards"]
    val = np.concatenate([np.fromfile(folder / s["file"], dtype) for s in shards])
    return corpus.prepared_tokenizer(folder, index), val.astype(np.int32)


def encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text)]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_noise_prompt_is_exact_with_the_needle_line_nearest_the_depth(depth):
    """Bytes: every character a token, so the prompt is checked as text."""
    tokenizer, length, new = corpus.bytes_tokenizer(), 700, 9
    sample = SAMPLE._replace(depth=depth)
    prompt = needle.build_prompt(
        tokenizer, "niah_single_1", sample, length, new_tokens=new, prefix=(EOS,)
    )
    assert prompt.tokens.dtype == np.int32 and len(prompt.tokens) == length - new
    line = needle.NEEDLE.format(key="odd-wagon", value="1234567") + "\n"
    question = needle.QUESTION.format(key="odd-wagon")
    size = length - new - 1 - len(needle.HEAD) - len(line) - len(question)  # H
    unit = len(needle.NOISE) + 1
    noise = ((needle.NOISE + "\n") * (size // unit + 1))[-size:]  # its first line cut
    boundaries = [0, *range(size % unit, size + 1, unit)]  # line starts, and the end
    at = min(boundaries, key=lambda b: abs(b - depth * size))
    expected = needle.HEAD + noise[:at] + line + noise[at:] + question
    assert prompt.tokens[0] == EOS and bytes(prompt.tokens[1:].tolist()).decode() == expected
    assert prompt.needle == 1 + len(needle.HEAD) + at and prompt.depth == at / size
    assert abs(prompt.depth - depth) <= unit / 2 / size and (depth % 1 or prompt.depth == depth)


def test_corpus_prompt_puts_the_needle_after_the_nearest_sentence_end(folders):
    """A BPE: the prompt is the head, the text's first H tokens with the needle's tokens after
    the sentence end nearest to depth x H, and the question, in token ids."""
    tokenizer, val = prepared(folders["bpe"])
    text = needle.haystack_stream(val, tokenizer.eos_id)
    assert tokenizer.eos_id not in text and len(text) == (val != tokenizer.eos_id).sum()
    ends = needle.sentence_ends(tokenizer)
    assert ends[encode(tokenizer, ".")[0]] and not ends[encode(tokenizer, "A")[0]]
    head = encode(tokenizer, needle.HEAD)
    question = encode(tokenizer, needle.QUESTION.format(key=SAMPLE.key))
    line = encode(tokenizer, " " + needle.NEEDLE.format(key=SAMPLE.key, value=SAMPLE.value))
    for depth in (0.0, 0.37, 1.0):
        sample = SAMPLE._replace(depth=depth)
        prompt = needle.build_prompt(
            tokenizer, "niah_single_2", sample, 400, new_tokens=5, text=text, ends=ends
        )
        size = 400 - 5 - len(head) - len(line) - len(question)
        assert len(prompt.tokens) == 395 and tokenizer.eos_id not in prompt.tokens
        at = prompt.needle - len(head)
        expected = [*head, *text[:at], *line, *text[at:size], *question]
        np.testing.assert_array_equal(prompt.tokens, expected)
        boundaries = [0] + [p for p in range(1, size + 1) if ends[text[p - 1]]]
        assert at in boundaries and len(boundaries) > 10
        assert abs(at - depth * size) == min(abs(b - depth * size) for b in boundaries)
        before = tokenizer.decode(prompt.tokens[len(head) : prompt.needle])
        assert before == "" or before.rstrip(" ").endswith(needle.SENTENCE_ENDS)


@pytest.mark.parametrize("documents", [False, True])
def test_requests_sweep_the_depth_and_start_as_a_document(folders, documents):
    tokenizer, val = prepared(folders["bytes"])
    text = needle.haystack_stream(val, EOS)
    requests = needle.make_requests(
        tokenizer,
        needle.TASKS,
        (500, 657),
        5,
        documents=documents,
        val_tokens=val,
        where="here",
        new_tokens=7,
        seed=3,
    )
    assert [(r.task, r.length) for r in requests] == [
        (t, n) for t in needle.TASKS for n in (500, 657)
    ]
    chosen = needle.samples(5, seed=3)
    assert [s.depth for s in chosen] == [0, 0.25, 0.5, 0.75, 1]
    assert len({s.key for s in chosen}) == 5 and all(len(s.value) == 7 for s in chosen)
    prefix = () if documents else (EOS,)
    for request in requests:
        assert request.samples == chosen and request.prompts.shape == (5, request.length - 7)
        for i, (sample, tokens) in enumerate(zip(chosen, request.prompts, strict=True)):
            # niah_single_2: the text from a place of (seed, i); every length asks the same.
            size = needle.haystack_size(
                tokenizer, request.task, sample, request.length, 7, 1 - documents
            )
            start = np.random.default_rng((3, i, 1)).integers(len(text) - size + 1)
            again = needle.build_prompt(
                tokenizer,
                request.task,
                sample,
                request.length,
                new_tokens=7,
                prefix=prefix,
                text=text[start:],
                ends=needle.sentence_ends(tokenizer),
            )
            np.testing.assert_array_equal(tokens, again.tokens)
            assert request.depths[i] == again.depth
            assert (tokens[0] == EOS) != documents and EOS not in tokens[1:]


def test_string_match_and_the_wilson_interval():
    assert needle.string_match("it is 1234567.", ["1234567"]) == 1.0
    assert needle.string_match("it is 123456", ["1234567"]) == 0.0
    assert needle.string_match("Odd-Wagon x", ["odd-wagon", "y"]) == 0.5  # case ignored
    z2 = 1.959964**2
    low, high = needle.wilson(0, 50)
    assert low == 0 and high == pytest.approx(z2 / (50 + z2))  # 0.0713
    low, high = needle.wilson(50, 50)
    assert high == pytest.approx(1) and low == pytest.approx(50 / (50 + z2))
    assert needle.wilson(25, 50) == pytest.approx((0.3664, 0.6336), abs=1e-4)
    assert needle.wilson(3, 10) == pytest.approx((0.1078, 0.6032), abs=1e-4)


@pytest.fixture(scope="module")
def tiny(folders):
    """An untrained tiny DeltaNet on the bytes corpus."""
    exp = nc.build(lm_config(folders["bytes"]))
    return Trained(exp, pieces.init_state(exp), 0)


def test_answers_are_the_greedy_continuation_of_one_apply(tiny, folders):
    """Real prompts through the sampler, two rows a call (the last call padded): each answer is
    the argmax at every position of one apply over the prompt and the answer."""
    tokenizer, val = prepared(folders["bytes"])
    (request,) = needle.make_requests(
        tokenizer,
        ["niah_single_2"],
        [500],
        3,
        documents=False,
        val_tokens=val,
        where="here",
        new_tokens=6,
    )
    answers = needle.continuations(tiny, request.prompts, 6, 2, EOS)
    assert [len(a) for a in answers] == [6, 6, 6]  # no EOS drawn by this model
    whole = jnp.concatenate([request.prompts, jnp.asarray(answers, jnp.int32)], axis=1)
    logits, _ = jax.jit(tiny.program.apply)(tiny.state.params, whole)
    greedy = jnp.argmax(logits[:, 493:-1, : tiny.program.vocab], axis=-1)
    np.testing.assert_array_equal(greedy, answers)


def test_metrics_count_the_answers_that_contain_the_value(tiny, monkeypatch):
    tokenizer = corpus.bytes_tokenizer()
    chosen = needle.samples(4)
    prompts = np.zeros((4, 5), np.int32)
    request = needle.Request("niah_single_1", 64, prompts, chosen, [0.0, 0.3, 0.6, 1.0])
    said = [f" {s.value}." if i % 2 else " 42" for i, s in enumerate(chosen)]

    def answers(trained, rows, new_tokens, batch_size, eos):
        assert rows is prompts and (new_tokens, batch_size, eos) == (3, 2, EOS)
        return [encode(tokenizer, text) for text in said]

    monkeypatch.setattr(needle, "continuations", answers)
    got = needle.needle_metrics(tiny, tokenizer, [request], 2, new_tokens=3)
    result = got["niah_single_1"]["lengths"]["64"]
    assert got["niah_single_1"]["new_tokens"] == 3
    assert (result["samples"], result["correct"], result["accuracy"]) == (4, 2, 0.5)
    assert (result["low"], result["high"]) == needle.wilson(2, 4)
    assert result["hits"] == [0, 1, 0, 1] and result["predictions"] == said
    assert result["depths"] == [0.0, 0.3, 0.6, 1.0] and result["prompt_tokens"] == 5


@pytest.mark.slow
def test_eval_lm_scores_the_needle_tasks_of_a_trained_workdir(
    folders, tmp_path_factory, compilation_cache
):
    workdir = tmp_path_factory.mktemp("needle_run") / "run"
    train.train_and_evaluate(lm_config(folders["bytes"]), workdir)
    result = lm_eval.evaluate_lm(
        workdir,
        max_len=32,
        needle_tasks=needle.TASKS,
        needle_lengths=(500, 600),
        needle_samples=3,
        needle_new_tokens=8,
    )
    assert json.loads((workdir / lm_eval.RESULTS_FILE).read_text()) == result
    for task in needle.TASKS:
        by_length = result["needle"][task]["lengths"]
        assert list(by_length) == ["500", "600"]
        for length, r in by_length.items():
            assert r["samples"] == 3 and r["prompt_tokens"] == int(length) - 8
            assert r["accuracy"] == r["correct"] / 3 == np.mean(r["hits"])
            assert r["low"] <= r["accuracy"] <= r["high"] and len(r["predictions"]) == 3
    records = [
        json.loads(line) for line in (workdir / lm_eval.METRICS_DIR / "metrics.jsonl").open()
    ]
    sections = {r["split"]: r for r in records}
    assert set(sections) == {"val", "position", *needle.TASKS}
    assert set(sections["niah_single_2"]) >= {"acc_500", "acc_600"}
    assert "niah_single_1 (accuracy" in lm_eval.format_results(result)


def test_bad_needle_inputs_are_one_line_before_compiling(folders, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("restored a checkpoint: the check came too late")

    monkeypatch.setattr(rundir, "restore_latest", never)
    workdir = fake_run(folders["bytes"], tmp_path)
    base = dict(needle_tasks=("niah_single_2",), needle_lengths=(500,))
    val = int(json.loads((folders["bytes"] / corpus.INDEX).read_text())["splits"]["val"]["tokens"])
    cases = [
        (dict(needle_tasks=("niah_multikey_1",)), r"--needle: no task \['niah_multikey_1'\]"),
        (dict(needle_lengths=(200,)), r"--needle_lengths=200: the template, .* use longer"),
        (
            dict(needle_lengths=(4 * val,)),
            r"niah_single_2 needs a haystack of \d+ tokens, the val split of .* has \d+ \(EOS",
        ),
        (dict(needle_samples=0), r"--needle_samples=0: use a positive int"),
        (dict(needle_lengths=(0,)), r"--needle_lengths=0: use a positive int"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            lm_eval.evaluate_lm(workdir, max_len=32, **{**base, **change})
        assert "\n" not in str(error.value), error.value
    # A BPE corpus whose tokenizer.json is gone: the needle prompts cannot be written.
    bare = tmp_path / "bare"
    shutil.copytree(folders["bpe"], bare)
    (bare / corpus.TOKENIZER_FILE).unlink()
    config = lm_config(bare, vocab=300)
    (workdir / "config.json").write_text(nc.build(config).config.to_json_best_effort())
    with pytest.raises(ConfigError, match=r"tokenizer") as error:
        lm_eval.evaluate_lm(workdir, max_len=32, **base)
    assert "\n" not in str(error.value)
    for spec, parsed in ((["1024", "2K", "8k"], (1024, 2048, 8192)), (["64"], (64,))):
        assert needle.parse_lengths(spec) == parsed
    for spec in (["K"], ["-3"], ["1.5K"], ["x"], ["0"]):
        with pytest.raises(ConfigError, match=r"--needle_lengths: .* e\.g\."):
            needle.parse_lengths(spec)
