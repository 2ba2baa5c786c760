"""Language-model evaluation (nested.run.lm_eval, experiments/eval_lm.py): perplexity and bits
per byte against a hand computation from ``Program.apply`` logits (windows restarting, and a
``persist="stream"`` memory carried along rows), nll by position against the plain loss of
shorter windows, multiple choice against the harness's semantics, the entry point end to end
on a trained workdir, and one-line errors for bad input."""

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs
from helpers.lm import T, document_texts, fake_run, lm_config, prepare

from nested.data import corpus
from nested.data import tokens as tokens_mod
from nested.learn import objectives
from nested.run import checkpoint, choice, lm_eval, perplexity, pieces, rundir
from nested.run import config as nc
from nested.run.config import ConfigError
from nested.run.loading import Trained

EOS = 256
EVAL_LM = str(tiny_configs.ROOT / "experiments" / "eval_lm.py")
TRAIN = str(tiny_configs.ROOT / "experiments" / "train.py")


def held_out_texts() -> list[str]:
    """The documents the validation split holds (``val_fraction=0.3``)."""
    texts = document_texts()
    return [t for i, t in enumerate(texts) if corpus.val_fraction_of("docs.jsonl", i) < 0.3]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Prepared corpora of the same documents: ``bytes``, BPEs of vocab 257 (no merges) and 300."""
    root = tmp_path_factory.mktemp("lm_eval")
    kinds = {"bytes": ("bytes", 0), "bpe257": ("bpe", 257), "bpe": ("bpe", 300)}
    return prepare(root, kinds)


@pytest.fixture(scope="module")
def models(folders):
    """Untrained models of both persistences, ``{persist: (Trained, task)}``."""
    out = {}
    for persist in ("sequence", "stream"):
        exp = nc.build(lm_config(folders["bytes"], persist))
        out[persist] = Trained(exp, pieces.init_state(exp), 0), lm_eval.eval_task(exp.task, None)
    return out


@functools.cache
def jitted_apply(program):
    return jax.jit(program.apply)


def hand_nll(program, params, inputs, targets, fast=None):
    """(T,) nll of one window from the logits of ``Program.apply``, and its final fast state."""
    logits, fast = jitted_apply(program)(params, inputs[None], fast, targets=targets[None])
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float64), axis=-1)
    return -np.asarray(logp[np.arange(len(targets)), targets]), fast


def val_tokens(task) -> np.ndarray:
    """The val split's tokens, read from its shard files."""
    dtype = np.dtype(task.index["dtype"]).newbyteorder("<")
    shards = task.index["splits"]["val"]["shards"]
    return np.concatenate([np.fromfile(Path(task.path) / s["file"], dtype) for s in shards])


@pytest.mark.parametrize("persist", ["sequence", "stream"])
def test_perplexity_is_the_hand_computed_mean_nll(models, persist):
    trained, task = models[persist]
    program, params = trained.program, trained.state.params
    rows = 3
    got = perplexity.perplexity(trained, task, rows)
    stream = val_tokens(task)
    n = len(stream)
    x = np.concatenate([[EOS], stream, np.full(T, EOS)]).astype(np.int32)
    count = -(-n // T)
    per_row = -(-count // rows)
    carry = persist == "stream"
    total, restarted = 0.0, 0.0
    for b in range(rows):  # row b reads windows b K .. b K + K - 1, carrying a stream memory
        fast = program.start_fast(params, 1)
        for w in range(b * per_row, min((b + 1) * per_row, count)):
            scored = min(T, n - w * T)
            inputs, targets = x[w * T : w * T + T], x[w * T + 1 : w * T + T + 1]
            start = program.start_fast(params, 1, fast) if carry else None
            nll, fast = hand_nll(program, params, inputs, targets, start)
            total += nll[:scored].sum()
            restarted += hand_nll(program, params, inputs, targets)[0][:scored].sum()
    assert got["tokens"] == n == task.index["splits"]["val"]["tokens"]
    assert got["windows"] == count and got["carried"] == (persist == "stream")
    np.testing.assert_allclose(got["nll"], total / n, rtol=1e-5)
    np.testing.assert_allclose(got["perplexity"], math.exp(total / n), rtol=1e-5)
    if carry:  # the carried memory changes the numbers
        assert abs(total - restarted) > 1e-3 * n
    # Bytes: every scored token but EOS is one UTF-8 byte, and they are the documents' text.
    val_texts = held_out_texts()
    size = sum(len(t.encode()) for t in val_texts)
    assert got["bytes"] == size == int((stream != EOS).sum())
    np.testing.assert_allclose(got["bits_per_byte"], total / math.log(2) / size, rtol=1e-5)
    if persist == "sequence":  # each window's mean is the training loss of the window
        inputs, targets = x[:T][None], x[1 : T + 1][None]
        loss, _ = program.loss(params, {"inputs": inputs, "targets": targets})
        first = hand_nll(program, params, inputs[0], targets[0])[0]
        np.testing.assert_allclose(float(loss), first.mean(), rtol=1e-5)


class PaddingDiverges:
    """A program whose logits are NaN wherever the mask is 0, as a memory diverging on the
    eval's EOS padding gives them (issue 25: Hope's memory on the last window's run of EOS)."""

    def __init__(self, program):
        self.program = program

    def __getattr__(self, name):
        return getattr(self.program, name)

    def apply(self, params, inputs, fast=None, *, mask=None, **given):
        logits, fast = self.program.apply(params, inputs, fast, mask=mask, **given)
        return jnp.where(mask[..., None] > 0, logits, jnp.nan), fast


@pytest.mark.parametrize("persist", ["sequence", "stream"])
def test_non_finite_logits_on_padding_score_nothing(models, persist):
    trained, task = models[persist]
    rows = 3
    stream = val_tokens(task)
    assert len(stream) % T and -(-len(stream) // T) % rows  # a padded window, and copies
    poisoned = perplexity.make_score_fn(PaddingDiverges(trained.program))
    got = perplexity.perplexity(trained, task, rows, poisoned)
    want = perplexity.perplexity(trained, task, rows)
    for key in ("nll", "perplexity", "bits_per_byte"):
        assert math.isfinite(got[key])
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


def test_token_cross_entropy_is_zero_where_masked_whatever_the_logits():
    logits = jnp.zeros((1, 4, 3)).at[0, 2].set(jnp.nan).at[0, 3, 0].set(jnp.inf)
    batch = {"targets": jnp.zeros((1, 4), jnp.int32), "mask": jnp.array([[1.0, 0.5, 0.0, 0.0]])}
    nll = np.asarray(objectives.token_cross_entropy(logits, batch))
    np.testing.assert_allclose(nll, [[math.log(3), 0.5 * math.log(3), 0.0, 0.0]], rtol=1e-6)
    loss, _ = objectives.next_token(logits, batch)
    np.testing.assert_allclose(float(loss), 1.5 * math.log(3) / 1.5, rtol=1e-6)


def test_bits_per_byte_divides_by_the_text_bytes_of_a_bpe_corpus(folders):
    exp = nc.build(lm_config(folders["bpe"], vocab=300))
    trained = Trained(exp, pieces.init_state(exp), 0)
    task = lm_eval.eval_task(exp.task, None)
    got = perplexity.perplexity(trained, task, 4)
    tokenizer = corpus.prepared_tokenizer(task.path, task.index)
    stream = val_tokens(task)
    decoded = tokenizer.hf.decode([int(t) for t in stream if t != tokenizer.eos_id])
    val_texts = held_out_texts()
    assert got["bytes"] == len("".join(val_texts).encode()) == len(decoded.encode())
    assert got["tokens"] == len(stream) < got["bytes"]  # merges: fewer tokens than bytes
    np.testing.assert_allclose(
        got["bits_per_byte"], got["nll"] * got["tokens"] / math.log(2) / got["bytes"]
    )


def test_nll_by_position_within_the_trained_length_is_the_plain_loss(models):
    trained, task = models["sequence"]
    program, params = trained.program, trained.state.params
    got = perplexity.by_position(trained, task, 4 * T, 3)
    stream = val_tokens(task)
    count = len(stream) // (4 * T)
    assert got["windows"] == count >= 2 and len(got["nll"]) == 4 * T
    x = np.concatenate([[EOS], stream]).astype(np.int32)
    short = [
        hand_nll(program, params, x[w * 4 * T : w * 4 * T + T], x[w * 4 * T + 1 :][:T])[0]
        for w in range(count)
    ]
    np.testing.assert_allclose(got["nll"][:T], np.mean(short, axis=0), rtol=1e-5)
    full = [
        hand_nll(program, params, x[w * 4 * T :][: 4 * T], x[w * 4 * T + 1 :][: 4 * T])[0]
        for w in range(count)
    ]
    np.testing.assert_allclose(got["nll"], np.mean(full, axis=0), rtol=1e-5)
    assert [(b["start"], b["end"]) for b in got["buckets"]] == [(s, s + 4) for s in range(0, 64, 4)]
    np.testing.assert_allclose(got["buckets"][5]["nll"], np.mean(got["nll"][20:24]))
    np.testing.assert_allclose(got["nll_within"], np.mean(got["nll"][:T]))
    np.testing.assert_allclose(got["nll_beyond"], np.mean(got["nll"][T:]))


@pytest.mark.parametrize("whole", [True, False])
def test_aligned_windows_score_every_token_once_with_documents_on_the_grid(whole):
    """A run trained on aligned documents is scored on the val stream laid out alike: every
    document after EOS pads to a multiple of A, the pads masked, each token a target once (the
    complete windows only, ``whole=False``, for the by-position means)."""
    stream = np.array([5, 6, EOS, 7, EOS, 1, 2, 3, 4, 8, EOS, 9, EOS], np.int32)
    inputs, targets, mask = perplexity.windows(stream, 4, EOS, whole=whole, align=4)
    x = np.array([EOS, 0, 0, 0, 5, 6, EOS, 0, 7, EOS, 0, 0, 1, 2, 3, 4, 8, EOS, 0, 0, 9, EOS])
    real = x != 0
    count = 6 if whole else 5
    x = np.where(real, x, EOS)[: count * 4 + 1]
    padded = np.concatenate([x, np.full(count * 4 + 1 - len(x), EOS)])
    np.testing.assert_array_equal(inputs, padded[:-1].reshape(count, 4))
    np.testing.assert_array_equal(targets, padded[1:].reshape(count, 4))
    expected = np.concatenate([real[1 : count * 4 + 1], np.zeros(count * 4 + 1 - len(x))])
    np.testing.assert_array_equal(mask.ravel(), expected)
    if whole:
        assert mask.sum() == len(stream)
        np.testing.assert_array_equal(targets[mask > 0], stream)
    starts = np.flatnonzero((inputs.ravel()[:-1] == EOS) & (inputs.ravel()[1:] != EOS)) + 1
    assert (starts % 4 == 0).all() and len(starts) == (4 if whole else 3)


def test_scores_declare_the_grid_only_where_the_documents_lie_on_it(folders):
    """A program compiled with the task's grid (align 4, chunks of 4): windows whose documents
    start on it run the ops without segments, EOS-padded rows (a start after position 0 or
    after the pads) run them with segments; both score what the program declared on no grid
    (``document_grid=1``) scores."""
    config = lm_config(folders["bytes"])
    config.task.align, config.levels.memory.chunk = 4, 4
    exp = nc.build(config)
    assert exp.program.document_grid == 4
    params = exp.program.init(jax.random.key(1)).params
    score = perplexity.make_score_fn(exp.program, EOS)
    tokens = np.random.default_rng(0).integers(0, EOS, (2, T + 1)).astype(np.int32)
    on, off = tokens.copy(), tokens.copy()
    on[:, [3, 11]] = EOS  # documents start at 4 and 12
    off[0, 0], off[1, 9] = EOS, EOS  # at 1 and 10
    for rows in (on, off):
        inputs, targets, mask = rows[:, :-1], rows[:, 1:], np.ones((2, T), np.float32)
        nll, _ = score(params, inputs, targets, mask, None)
        ids = tokens_mod.document_ids(inputs, EOS)
        logits, _ = exp.program.apply(params, inputs, documents=ids, document_grid=1)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        expected = -np.take_along_axis(np.asarray(logp), targets[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(nll, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="document_grid=4"):
        exp.program.apply(params, off[:, :-1], documents=tokens_mod.document_ids(off[:, :-1], EOS))


def write_task(path, examples) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


EXAMPLES = [
    {"context": "alpha beta ", "choices": ["gamma", "x", "longer-word"], "answer": 0},
    {"context": "é", "choices": [" delta", " beta"], "answer": 1},
    {"context": "", "choices": ["alpha", "beta gamma"], "answer": 1},
    {"context": "x " * 20, "choices": ["alpha", "beta"], "answer": 0},  # longer than T: cut
]


def test_multiple_choice_loglikelihoods_and_accuracies(models, tmp_path):
    trained, task = models["sequence"]
    program, params = trained.program, trained.state.params
    examples = choice.read_task(write_task(tmp_path / "t.jsonl", EXAMPLES))
    tokenizer = corpus.prepared_tokenizer(task.path, task.index)
    requests = choice.make_requests(examples, tokenizer, T, "t")
    assert requests["inputs"].shape == (9, T)
    got = choice.choice_metrics(examples, choice.loglikelihoods(trained, requests, 4))
    # Request 0 by hand: the context's trailing space moves to the continuation.
    tokens = np.frombuffer(b"alpha beta gamma", np.uint8).astype(np.int32)
    nll, _ = hand_nll(program, params, tokens[:-1], tokens[1:])
    np.testing.assert_allclose(got["loglikelihoods"][0][0], -nll[-len(" gamma") :].sum(), rtol=1e-5)
    # An empty context is EOS; a long context is cut from the left to T + 1 tokens in all.
    tokens = np.frombuffer(b"beta gamma", np.uint8).astype(np.int32)
    nll, _ = hand_nll(program, params, np.concatenate([[EOS], tokens[:-1]]), tokens)
    np.testing.assert_allclose(got["loglikelihoods"][2][1], -nll.sum(), rtol=1e-5)
    tokens = np.frombuffer(("x " * 20 + "beta").encode()[-(T + 1) :], np.uint8).astype(np.int32)
    nll, _ = hand_nll(program, params, tokens[:-1], tokens[1:])
    np.testing.assert_allclose(got["loglikelihoods"][3][1], -nll[-5:].sum(), rtol=1e-5)
    lengths = {"acc": lambda c: 1, "acc_norm": len, "acc_bytes": lambda c: len(c.encode())}
    for name, length in lengths.items():
        hits = [
            np.argmax(np.array(lls) / [length(c) for c in e.choices]) == e.answer
            for lls, e in zip(got["loglikelihoods"], examples, strict=True)
        ]
        assert got[name] == np.mean(hits), name
    assert got["examples"] == 4


@pytest.mark.parametrize(
    "choices, lls, picked",
    [
        # ll -4 > -10; per character and per byte -2 < -10 / 8 = -1.25
        (("ab", "abcdefgh"), (-4.0, -10.0), (0, 1, 1)),
        # per character -3 / 2 < -4 / 3; per byte -3 / 4 > -4 / 3 (é is 2 bytes)
        (("éé", "abc"), (-3.0, -4.0), (0, 1, 0)),
    ],
)
def test_acc_norm_divides_by_characters_and_acc_bytes_by_bytes(choices, lls, picked):
    for answer in (0, 1):
        got = choice.choice_metrics([choice.Example("c", choices, answer)], np.array(lls))
        expected = tuple(float(p == answer) for p in picked)
        assert (got["acc"], got["acc_norm"], got["acc_bytes"]) == expected


def test_encode_pair_follows_the_harness_with_a_bpe(folders):
    index = json.loads((folders["bpe"] / corpus.INDEX).read_text())
    tokenizer = corpus.prepared_tokenizer(folders["bpe"], index)
    assert tokenizer.eos_id == index["tokenizer"]["eos_id"] == 0
    encode = lambda text: list(tokenizer.encode(text))
    context_enc, continuation_enc = choice.encode_pair(encode, 0, "alpha beta ", "gamma")
    whole = encode("alpha beta gamma")
    assert context_enc == encode("alpha beta") and context_enc + continuation_enc == whole
    assert choice.encode_pair(encode, 0, "", "gamma") == ([0], encode("gamma"))
    (folders["bpe"].parent / "copy").mkdir()
    copy = folders["bpe"].parent / "copy"
    (copy / corpus.TOKENIZER_FILE).write_text("{}")
    with pytest.raises(corpus.PrepareError, match=r"does not match the index's sha256"):
        corpus.prepared_tokenizer(copy, index)


BAD_LINES = {
    "not JSON": ("{oops", r":1: not JSON"),
    "no context": (json.dumps({"choices": ["a", "b"], "answer": 0}), r"no string 'context'"),
    "one choice": (json.dumps({"context": "", "choices": ["a"], "answer": 0}), "2 or more"),
    "no answer": (json.dumps({"context": "", "choices": ["a", "b"]}), r"no int 'answer'"),
    "answer out of range": (
        json.dumps({"context": "", "choices": ["a", "b"], "answer": 2}),
        r"answer=2 is out of range for 2 choices; use 0 \.\. 1",
    ),
    "empty": ("\n", r"no examples"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_task_files_are_one_line(tmp_path, case):
    line, message = BAD_LINES[case]
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        choice.read_task(tmp_path / "t.jsonl")
    assert "\n" not in str(error.value) and "t.jsonl" in str(error.value)


def test_bad_inputs_are_one_line_before_compiling(folders, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("restored a checkpoint: the check came too late")

    monkeypatch.setattr(rundir, "restore_latest", never)
    workdir = fake_run(folders["bytes"], tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "ok.jsonl").write_text(json.dumps(EXAMPLES[0]) + "\n")
    long = {"context": "a", "choices": ["b" * (T + 1), "c"], "answer": 0}
    (tmp_path / "long.jsonl").write_text(json.dumps(long) + "\n")
    cases = [
        (dict(workdir=tmp_path / "nowhere"), ConfigError, r"no run in --workdir"),
        (dict(data=tmp_path / "empty"), ConfigError, r"--data: tokens: path=.* has no index\.json"),
        (dict(data=folders["bpe257"]), ConfigError, r"--data .*another tokenizer \(bpe, sha256="),
        (dict(max_len=24), ConfigError, r"--max_len=24 is not a multiple of the trained seq_len"),
        (dict(max_len=64 * T), ConfigError, r"--max_len=1024: the val split .* fewer than one"),
        (dict(tasks={"t": tmp_path / "no.jsonl"}), ConfigError, r"no\.jsonl: no such file"),
        (dict(tasks={"t": tmp_path / "long.jsonl"}), ConfigError, r"example 1, choice 0: the con"),
    ]
    for change, kind, message in cases:
        kwargs = {"workdir": workdir, "tasks": {"ok": tmp_path / "ok.jsonl"}, **change}
        with pytest.raises(kind, match=message) as error:
            lm_eval.evaluate_lm(**kwargs)
        assert "\n" not in str(error.value), error.value
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .*train it until"):
        lm_eval.evaluate_lm(fake_run(folders["bytes"], tmp_path / "b", steps=False))
    mqar = fake_run(folders["bytes"], tmp_path / "c")
    (mqar / "config.json").write_text(
        nc.build(tiny_configs.config("mqar")).config.to_json_best_effort()
    )
    with pytest.raises(ConfigError, match=r"trained on the task 'mqar'; eval_lm evaluates"):
        lm_eval.evaluate_lm(mqar)
    for spec in (["copa"], ["val=x.jsonl"], ["a=x", "a=y"]):
        with pytest.raises(ConfigError, match=r"--tasks: "):
            choice.parse_tasks(spec)
    assert choice.parse_tasks(["a=x.jsonl", "b.c=y"]) == {"a": Path("x.jsonl"), "b.c": Path("y")}


def run(processes, script: str, *args: str) -> tuple[int, str, list[str]]:
    done = processes.run(script, *args)
    return done.returncode, done.stdout, processes.stderr_lines(done)


@pytest.mark.slow
def test_eval_lm_runs_end_to_end_on_a_trained_workdir(folders, tmp_path, processes):
    config = tmp_path / "lm.py"
    config.write_text(
        "from helpers import lm\n\n\ndef get_config():\n"
        f"    return lm.lm_config({str(folders['bytes'])!r}, 'stream')\n"
    )
    workdir = tmp_path / "run"
    rc, _, lines = run(processes, TRAIN, f"--config={config}", f"--workdir={workdir}")
    assert rc == 0, lines
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    rc, out, lines = run(
        processes, EVAL_LM, f"--workdir={workdir}", f"--tasks=mc={tmp_path / 't.jsonl'}"
    )
    assert rc == 0, lines
    result = json.loads((workdir / "eval_lm.json").read_text())
    assert result["step"] == 2 and result["val"]["carried"]
    assert result["position"]["max_len"] == 4 * T and result["tasks"]["mc"]["examples"] == 4
    assert 0 < result["val"]["bits_per_byte"] < 20 and "perplexity" in out
    records = [json.loads(line) for line in (workdir / "eval_lm" / "metrics.jsonl").open()]
    assert {r["split"] for r in records} == {"val", "position", "mc"}
    assert all(r["step"] == 2 for r in records)
    assert any((workdir / "eval_lm" / "tensorboard").iterdir())
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    rc, out, lines = run(
        processes, EVAL_LM, f"--workdir={workdir}", f"--tasks=bad={tmp_path / 'bad.jsonl'}"
    )
    assert rc == 1 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith("error: task file ") and "bad.jsonl:1: not a JSON object" in lines[0]
