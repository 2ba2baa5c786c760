"""The lm-evaluation-harness model ``nested`` (nested.run.harness): the harness's own
``simple_evaluate`` on the local tasks of ``tests/run/harness_tasks`` (YAML tasks over JSONL files,
nothing from a hub) scores a workdir's run as ``eval_lm`` does, to 1e-5: multiple choice (acc,
acc_norm, acc_bytes and every loglikelihood) on the same task file, and whole-text perplexity
on the text of the val split (a ``persist="stream"`` memory carried from window to window,
documents restarting after each EOS); ``is_greedy`` against the logits' argmax; generation
against ``sampling.generate`` over the whole prompt, never emitting an id the tokenizer lacks,
stopping at ``until``; bad model_args in one line; the command line end to end (slow)."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import lm_eval
import numpy as np
import pytest
from helpers import tiny_configs
from helpers.lm import T, lm_config, prepare
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from nested.data import corpus
from nested.data.tokens import document_ids
from nested.run import checkpoint, harness, pieces, rundir, sampling
from nested.run import config as nc
from nested.run import lm_eval as eval_lm
from nested.run.config import ConfigError

TASKS = Path(__file__).with_name("harness_tasks")
VOCAB = 300
# The session's compilation cache: the same programs (the initial state, the scores) compile
# once for saving and loading, the harness and eval_lm.
pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Prepared corpora of the same documents: ``bytes`` and a BPE of vocab 300 (EOS id 0)."""
    root = tmp_path_factory.mktemp("harness")
    return prepare(root, {"bytes": ("bytes", VOCAB), "bpe": ("bpe", VOCAB)})


def save_run(config, workdir, step: int = 3):
    """A workdir as experiments/train.py leaves it: ``config.json`` and a checkpoint (of the
    initial state) at ``step``."""
    exp = nc.build(config)
    workdir.mkdir(parents=True)
    rundir.record_config(exp.config, workdir, 0)
    with checkpoint.Checkpointer(workdir / rundir.CHECKPOINTS, every=1, keep=1) as ckpt:
        ckpt.save(step, pieces.init_state(exp), data_position=0, force=True)
    return workdir


@pytest.fixture(scope="module")
def workdir(folders, tmp_path_factory):
    """A run of a tiny DeltaNet LM, its memory ``persist="stream"``, on the BPE corpus."""
    config = lm_config(folders["bpe"], "stream", vocab=VOCAB)
    return save_run(config, tmp_path_factory.mktemp("run") / "run")


@pytest.fixture(scope="module")
def lm(workdir):
    return harness.NestedLM(workdir=str(workdir), batch_size=4)


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def by_doc(samples) -> list:
    return [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_the_harness_scores_as_eval_lm_on_the_same_data(lm, workdir, folders, tmp_path):
    # The text of the val split: its documents, each followed by EOS as the shards hold them.
    task = lm.task
    stream = np.concatenate(task.source("val").shards).astype(np.int32)
    hf = lm.tokenizer.hf
    eos_text = hf.id_to_token(lm.eos)
    texts = hf.decode_batch(
        [d.tolist() for d in np.split(stream, np.flatnonzero(stream == 0))[:-1]]
    )
    val_text = eos_text.join(t for t in texts) + eos_text
    assert lm.tok_encode(val_text) == stream.tolist()  # the same tokens
    assert len(stream) > 4 * T  # windows that carry the memory
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS, tasks)
    shipped = (TASKS / "rolling.jsonl").read_text()
    (tasks / "rolling.jsonl").write_text(json.dumps({"text": val_text}) + "\n" + shipped)

    got = lm_eval.simple_evaluate(
        model=lm,
        tasks=["nested_choice", "nested_greedy", "nested_rolling"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
    )
    # eval_lm with one row: a stream memory is carried along the whole val split, as along
    # the harness's one text.
    want = eval_lm.evaluate_lm(
        workdir,
        tasks={"choice": TASKS / "choice.jsonl"},
        max_len=T,
        batch_size=1,
        out=tmp_path / "eval_lm.json",
    )
    results, choices = got["results"], want["tasks"]["choice"]
    for metric in ("acc", "acc_norm", "acc_bytes"):
        assert results["nested_choice"][f"{metric},none"] == choices[metric], metric
    lls = [[r[0][0] for r in resps] for resps in by_doc(got["samples"]["nested_choice"])]
    for ours, theirs in zip(lls, choices["loglikelihoods"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    examples = [json.loads(line) for line in (TASKS / "choice.jsonl").read_text().splitlines()]
    right = [lls[i][e["answer"]] for i, e in enumerate(examples)]
    greedy = [resps[0][0] for resps in by_doc(got["samples"]["nested_greedy"])]
    np.testing.assert_allclose([g[0] for g in greedy], right, rtol=1e-5)
    assert results["nested_greedy"]["acc,none"] == np.mean([g[1] for g in greedy])
    rolling = [resps[0][0] for resps in by_doc(got["samples"]["nested_rolling"])]
    val = want["val"]
    np.testing.assert_allclose(-rolling[0], val["nll"] * val["tokens"], rtol=1e-5)
    assert all(ll < 0 for ll in rolling)


@functools.cache
def jitted_apply(program):
    return jax.jit(program.apply)


def hand_logp(lm, tokens: list[int]) -> np.ndarray:
    """(L, V) float64 log-probabilities of ``Program.apply`` over ``tokens`` (L <= T) from the
    learned initial state, documents restarting after each EOS (padded to T with EOS: the
    model is causal)."""
    inputs = np.full((1, T), lm.eos, np.int32)
    inputs[0, : len(tokens)] = tokens
    program, params = lm.trained.program, lm.trained.state.params
    logits, _ = jitted_apply(program)(params, inputs, documents=document_ids(inputs, lm.eos))
    return np.asarray(jax.nn.log_softmax(np.asarray(logits[0, : len(tokens)], np.float64)))


def test_is_greedy_is_the_argmax_of_every_continuation_token(lm):
    context = lm.tok_encode("alpha")
    best = int(hand_logp(lm, context)[-1].argmax())  # the model's own next token
    assert lm.tok_encode("alpha" + lm.tok_decode([best])) == context + [best]
    pairs = [
        ("alpha beta", " gamma"),
        ("", "delta x"),
        ("x", "é"),
        ("alpha", lm.tok_decode([best])),
    ]
    got = lm.loglikelihood([request("loglikelihood", *p) for p in pairs])
    for pair, (ll, is_greedy) in zip(pairs, got, strict=True):
        context_enc, continuation_enc = harness.choice.encode_pair(lm.tok_encode, lm.eos, *pair)
        logp = hand_logp(lm, (context_enc + continuation_enc)[:-1])
        positions = np.arange(len(context_enc) - 1, len(logp))
        np.testing.assert_allclose(ll, logp[positions, continuation_enc].sum(), rtol=1e-5)
        assert is_greedy == bool((logp[positions].argmax(-1) == continuation_enc).all()), pair
    assert [g for _, g in got] == [False, False, False, True]


@pytest.fixture(scope="module")
def bytes_lm(lm):
    """The run's model read with the bytes tokenizer (257 ids of the model's 300), the output
    layer's columns of the other ids scaled by 30: the model's argmax often lies past 257."""

    def boost(path, x):
        return x.at[:, 257:].multiply(30.0) if "head" in jax.tree_util.keystr(path) else x

    state = lm.trained.state
    params = jax.tree_util.tree_map_with_path(boost, state.params)
    trained = lm.trained._replace(state=dataclasses.replace(state, params=params))
    return harness.NestedLM.from_trained(
        trained, tokenizer="bytes", batch_size=4, max_length=64, seed=1
    )


CONTEXT = "x x x x x alpha beta"  # 20 tokens: read in pieces of 16, 2 and 1, then sampled


def test_generation_continues_the_prompt_as_one_call_within_the_tokenizer(bytes_lm):
    program, params = bytes_lm.trained.program, bytes_lm.trained.state.params
    prompts = np.array([bytes_lm.tok_encode(CONTEXT)] * 4)
    greedy = bytes_lm.generation_options(0, {"max_gen_toks": 12})
    got = bytes_lm.continuations(prompts[:3].tolist(), greedy)
    assert [len(g) for g in got] == [12] * 3 and max(max(g) for g in got) < 257
    want = sampling.generate(program, params, prompts, max_new_tokens=12, vocab=257)
    assert got == np.asarray(want.tokens[:3]).tolist()
    logits, _ = jitted_apply(program)(params, prompts)
    assert np.argmax(logits, axis=-1).max() >= 257  # the model's own argmax lies past it


def test_generation_stops_at_until(bytes_lm):
    greedy = {"max_gen_toks": 12, "until": []}
    prompts = [bytes_lm.tok_encode(CONTEXT)] * 3
    got = bytes_lm.continuations(prompts, bytes_lm.generation_options(0, greedy))[0]
    texts = bytes_lm.generate_until([request("generate_until", CONTEXT, greedy)] * 3)
    text = bytes_lm.tok_decode(got)
    assert texts == [text] * 3
    # An ASCII byte is one token and one character: generation stops at it.
    ascii = [k for k in range(1, len(got) - 1) if 32 <= got[k] < 127]
    single = chr(got[ascii[0]])
    until = bytes_lm.generation_options(0, {**greedy, "until": [single]})
    assert bytes_lm.continuations(prompts, until)[0] == got[: got.index(ord(single)) + 1]
    pair = next(chr(got[k]) + chr(got[k + 1]) for k in ascii[1:] if 32 <= got[k + 1] < 127)
    for until in ([single], [pair, "never"]):
        [cut, *_] = bytes_lm.generate_until(
            [request("generate_until", CONTEXT, {**greedy, "until": until})] * 3
        )
        assert cut == text.split(until[0])[0] and len(cut) < len(text), until


def test_bad_model_args_and_requests_are_one_line(lm, workdir, folders, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("restored a checkpoint: the check came too late")

    monkeypatch.setattr(rundir, "restore_latest", never)
    mqar = save_config(tiny_configs.config("mqar"), tmp_path / "mqar")
    cases = [
        (dict(), r"model_args has no workdir; pass model_args workdir="),
        (dict(workdir=tmp_path / "nowhere"), r"no run in --workdir"),
        (dict(workdir=mqar), r"trained on the task 'mqar'; the harness evaluates"),
        (dict(workdir=workdir, batch_size="x"), r"model_args batch_size='x': use an int >= 1"),
        (dict(workdir=workdir, max_length=0), r"model_args max_length=0: use an int >= 1"),
        (
            dict(workdir=workdir, pretrained="gpt2"),
            r"model_args \['pretrained'\]: unknown; the mod",
        ),
        (dict(workdir=workdir, tokenizer=str(tmp_path / "no.json")), r"tokenizer=.*no such file"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            harness.NestedLM(**args)
        assert "\n" not in str(error.value), error.value
    small = save_config(lm_config(folders["bytes"]), tmp_path / "bytes")  # vocab 257
    bpe = str(folders["bpe"] / corpus.TOKENIZER_FILE)
    with pytest.raises(ConfigError, match=r"its vocabulary \(287\) is larger than the model's"):
        harness.NestedLM(workdir=small, tokenizer=bpe)
    with pytest.raises(
        ConfigError,
        match=r"request 0: the continuation ' x x x.* is 20 tokens, not 1 \.\. 16; pass",
    ):
        lm.loglikelihood([request("loglikelihood", "a", " x" * 20)])
    # The harness finds the model by name and builds it from its model_args string.
    assert lm_eval.api.registry.get_model("nested") is harness.NestedLM
    with pytest.raises(ConfigError, match=r"model_args \['pretrained'\]: unknown"):
        harness.NestedLM.create_from_arg_string(f"workdir={workdir},pretrained=gpt2", {})
    with pytest.raises(ConfigError, match=r"gen_kwargs \['top_p'\] are not supported"):
        lm.generate_until([request("generate_until", "a", {"until": [], "top_p": 0.9})])


def save_config(config, workdir):
    """A workdir with ``config.json`` and an empty checkpoint folder."""
    (workdir / rundir.CHECKPOINTS).mkdir(parents=True)
    rundir.record_config(nc.build(config).config, workdir, 0)
    return workdir


def test_generation_options_follow_the_harness(lm):
    options = lambda **kwargs: lm.generation_options(0, kwargs)
    assert options() == {"until": [], "max_new_tokens": 256, "temperature": 0.0, "top_k": None}
    assert options(until="\n", max_gen_toks=5)["until"] == ["\n"]
    assert options(do_sample=True)["temperature"] == 1.0
    assert options(temperature=0.7)["temperature"] == 0.0  # no do_sample: greedy
    sampled = options(do_sample=True, temperature=0.5, top_k=5)
    assert (sampled["temperature"], sampled["top_k"]) == (0.5, 5)
    with pytest.raises(
        ConfigError, match=r"request 0: until=\[1\]: use a string or a list of strings"
    ):
        options(until=[1])


def run_module(processes, *args: str) -> tuple[int, list[str]]:
    done = processes.run("-m", "nested.run.harness", *args, timeout=600)
    return done.returncode, processes.stderr_lines(done)


@pytest.mark.slow
def test_the_command_line_evaluates_a_trained_run(folders, tmp_path, processes):
    """experiments/train.py trains a run; ``python -m nested.run.harness`` (the harness's own
    command line) evaluates it on the local tasks as ``simple_evaluate`` does in process."""
    config = tmp_path / "lm.py"
    config.write_text(
        "from helpers import lm\n\n\ndef get_config():\n"
        f"    return lm.lm_config({str(folders['bpe'])!r}, 'stream', vocab={VOCAB})\n"
    )
    workdir = tmp_path / "run"
    train = tiny_configs.ROOT / "experiments" / "train.py"
    processes.run(train, f"--config={config}", f"--workdir={workdir}", timeout=600, status=0)
    tasks = "nested_choice,nested_rolling,nested_generate"
    common = ["--model", "nested", "--tasks", tasks, "--include_path", str(TASKS)]
    rc, lines = run_module(
        processes,
        *common,
        "--model_args",
        f"workdir={workdir}",
        "--batch_size",
        "2",
        "--output_path",
        str(tmp_path / "out"),
    )
    assert rc == 0, lines[-20:]
    [written] = list((tmp_path / "out").rglob("results_*.json"))
    got = json.loads(written.read_text())["results"]
    lm = harness.NestedLM(workdir=str(workdir), batch_size=2)
    assert lm.trained.step == 2
    want = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks.split(","),
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        bootstrap_iters=0,
    )["results"]
    for task, metrics in want.items():
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                np.testing.assert_allclose(got[task][name], value, rtol=1e-6, err_msg=name)
    assert 0 < got["nested_rolling"]["bits_per_byte,none"] < 20
    rc, lines = run_module(processes, *common, "--model_args", f"workdir={tmp_path / 'none'}")
    assert rc == 1 and lines[-1].startswith("error: no run in --workdir"), lines[-5:]
