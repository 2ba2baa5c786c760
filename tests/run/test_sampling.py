"""A trained run, used: ``nl.load``, ``nl.generate``, export and import, ``experiments/sample.py``.

One tiny char-LM run trained for 4 steps serves every test; sampling is checked against the
definition: one ``program.apply`` over the prompt and its continuation.
"""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_configs

import nested as nl
from nested.data import decode
from nested.nn.models import MemoryLM
from nested.run import checkpoint, export, sampling, train
from nested.run import config as nc

TEXT = "def add(x, y):\n    return x + y\n\n" * 40
PROMPT = np.frombuffer(b"def add(", np.uint8).astype(np.int32)[None]  # (1, 8)
TINY = {
    "task.seq_len": 16,
    "model.dim": 16,
    "model.heads": 2,
    "model.layers": 1,
    "optimizer.warmup_steps": 1,
    "train.steps": 4,
    "train.batch_size": 2,
    "train.log_every": 2,
    "train.eval_every": 4,
    "train.checkpoint_every": 4,
    "train.eval_batches": 1,
    "train.eval_batch_size": 2,
}


def char_lm(corpus, **more):
    """The tiny char-LM config on ``corpus``; ``more``: overrides with ``__`` for dots."""
    extra = {k.replace("__", "."): v for k, v in more.items()}
    config = nc.load(tiny_configs.path("char_lm"))
    return tiny_configs.override(config, {**TINY, "task.path": str(corpus), **extra})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "add.py"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus, compilation_cache):
    workdir = tmp_path_factory.mktemp("sampling") / "run"
    train.train_and_evaluate(char_lm(corpus), workdir)
    return workdir


@pytest.fixture(scope="module")
def trained(workdir):
    return nl.load_trained(workdir)


def one_call(program, params, prompt, sample):
    """Logits and fast state of one apply over the prompt and its continuation."""
    return jax.jit(program.apply)(params, jnp.concatenate([prompt, sample.tokens], axis=1))


def test_load_restores_the_latest_checkpoint_and_its_config(workdir, trained):
    program, state = nl.load(workdir)
    assert int(state.step) == trained.step == 4
    assert program.vocab == 256
    chex.assert_trees_all_equal(state.params, trained.state.params)


def test_load_of_a_workdir_without_a_run_names_it(workdir, tmp_path):
    user_errors = (nc.ConfigError, checkpoint.CheckpointError)
    with pytest.raises(user_errors, match=f"{tmp_path}.*train"):
        nl.load(tmp_path)
    (tmp_path / "config.json").write_text((workdir / "config.json").read_text())
    with pytest.raises(user_errors, match=f"{tmp_path}.*train"):
        nl.load(tmp_path)


def test_sampling_continues_a_char_lm_prompt_deterministically_under_a_seed(trained):
    program, params = trained.program, trained.state.params
    draw = lambda rng: nl.generate(
        program, params, PROMPT, max_new_tokens=12, temperature=0.8, top_k=8, rng=rng
    )
    first, again, other = draw(3), draw(3), draw(4)
    assert first.tokens.shape == (1, 12) and list(first.lengths) == [12]
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert (first.tokens != other.tokens).any()
    assert isinstance(decode(first.tokens[0]), str)
    _, fast = one_call(program, params, PROMPT, first)
    chex.assert_trees_all_close(first.fast, fast, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sampling_draws_only_ids_below_vocab(trained):
    """``vocab``: a tokenizer smaller than the model's vocabulary; greedy picks the argmax of
    the first ``vocab`` logits, where the model's own argmax lies past them."""
    program, params = trained.program, trained.state.params
    greedy = nl.generate(program, params, PROMPT, max_new_tokens=4, vocab=40)
    tokens = np.concatenate([PROMPT, np.asarray(greedy.tokens)], axis=1)
    logits, _ = program.apply(params, jnp.asarray(tokens[:, :-1]))
    logits = np.asarray(logits)[0, PROMPT.shape[1] - 1 :]
    np.testing.assert_array_equal(np.asarray(greedy.tokens)[0], np.argmax(logits[:, :40], -1))
    assert np.argmax(logits, -1).max() >= 40


def test_a_level_of_period_4_samples_as_one_call_over_the_stream_and_stops_at_stop_tokens(
    corpus,
):
    """Its state moves on from multiples of 4 tokens (nested.run.sampling): greedy tokens are
    the argmax of one apply over the whole stream, and the fast state the one it ends with."""
    program = nc.build(char_lm(corpus, levels__memory__every=4)).program
    params = jax.jit(program.init)(jax.random.key(0)).params
    assert sampling.stream_period(program, params) == 4
    prompt = jax.random.randint(jax.random.key(1), (2, 6), 0, 256)
    sample = nl.generate(program, params, prompt, max_new_tokens=7)
    logits, fast = one_call(program, params, prompt, sample)
    np.testing.assert_array_equal(sample.tokens, jnp.argmax(logits[:, 5:-1], axis=-1))
    chex.assert_trees_all_close(sample.fast, fast, rtol=1e-5, atol=1e-6)
    stop = int(sample.tokens[0, 2])
    first = int(np.argmax(np.asarray(sample.tokens[0]) == stop))
    stopped = nl.generate(program, params, prompt, max_new_tokens=7, stop=[stop])
    assert stopped.lengths[0] == first + 1 and not stopped.tokens[0, first + 1 :].any()
    np.testing.assert_array_equal(stopped.tokens[0, : first + 1], sample.tokens[0, : first + 1])


def test_bad_sampling_arguments_get_one_line_naming_them(trained):
    program, params = trained.program, trained.state.params
    cases = {
        "prompt has shape \\(8,\\); token ids come as \\(B, T\\)": dict(prompt=PROMPT[0]),
        r"prompt holds token ids in \[32, 300\], outside \[0, 256\)": dict(
            prompt=np.where(np.arange(8) == 1, 300, PROMPT)
        ),
        "prompt is empty": dict(prompt=PROMPT[:, :0]),
        "max_new_tokens=0 must be an int >= 1": dict(max_new_tokens=0),
        "temperature=-1 must be a number >= 0": dict(temperature=-1),
        r"top_k=257 must be at most 256 \(the vocabulary\)": dict(top_k=257),
        r"vocab=257 must be at most 256 \(the vocabulary\)": dict(vocab=257),
        "vocab=0 must be an int >= 1": dict(vocab=0),
        r"top_k=50 must be at most 40": dict(top_k=50, vocab=40),
        "stop token=256 must be at most 255": dict(stop=[256]),
        r"fast has batch size\(s\) \[3\], the prompt 1 row\(s\)": dict(
            fast=program.start_fast(params, 3)
        ),
    }
    for message, change in cases.items():
        kwargs = {"prompt": PROMPT, "max_new_tokens": 4, **change}
        with pytest.raises(sampling.SamplingError, match=message):
            nl.generate(program, params, kwargs.pop("prompt"), **kwargs)


def test_export_and_import_round_trip_and_refuse_another_model(trained, corpus, tmp_path):
    session = nl.generate(trained.program, trained.state.params, PROMPT, max_new_tokens=2).fast
    path = nl.export_model(tmp_path / "lm.msgpack", trained, fast=session)
    back = nl.import_model(path)
    assert back.step == trained.step and back.fingerprint == trained.fingerprint
    chex.assert_trees_all_equal(back.state.params, trained.state.params)
    chex.assert_trees_all_equal(back.state.fast, session)
    other = char_lm(corpus, levels__memory__rule="gated_delta")
    with pytest.raises(export.ExportError, match="lm.msgpack' was written by another model"):
        nl.import_model(path, other)
    (tmp_path / "junk").write_bytes(b"\x00not msgpack")
    for name, message in [("junk", "is not an exported model"), ("none", "no exported model")]:
        with pytest.raises(export.ExportError, match=message):
            nl.import_model(tmp_path / name)
    (tmp_path / "big.png").write_bytes(b"\x89PNG\r\n" + bytes(range(256)) * 400)
    with pytest.raises(export.ExportError, match="is not an exported model") as info:
        nl.import_model(tmp_path / "big.png")
    assert len(str(info.value)) < 400  # the file is not quoted back


@pytest.mark.slow
def test_sample_entry_point_prints_the_continuation(workdir, trained):
    flags = ["--prompt=def add(", "--max_new_tokens=12", "--temperature=0.8", "--top_k=8"]
    script = str(tiny_configs.ROOT / "experiments" / "sample.py")
    done = subprocess.run(
        [sys.executable, script, f"--workdir={workdir}", *flags, "--seed=3"],
        cwd=tiny_configs.ROOT,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    sample = nl.generate(
        trained.program,
        trained.state.params,
        PROMPT,
        max_new_tokens=12,
        temperature=0.8,
        top_k=8,
        rng=3,
    )
    assert done.stdout.decode() == decode(sample.tokens[0]) + "\n"


@pytest.mark.parametrize(
    "mixer", ["attention", pytest.param("adatransformer", marks=pytest.mark.slow)]
)
def test_whole_stream_attention_samples_as_one_call_over_the_stream(mixer):
    """Attention over every earlier token (window=None) keeps no state of them: the sampler runs
    it with a window reaching the whole sequence, so greedy tokens are still the argmax of one
    apply over the prompt and its continuation."""
    level = None if mixer == "attention" else nl.recipes.hebbian(d_k=8, d_v=8)
    model = lambda rngs: MemoryLM(
        level, vocab=64, dim=16, heads=2, layers=1, mixer=mixer, window=None, rngs=rngs
    )
    outer = nl.Level("model", model, nl.objectives.next_token, optax.sgd(0.1), every="step")
    fast = [level] if level else []
    program = nl.compile(nl.NestedSystem([outer, *fast], owners={f.name: "model" for f in fast}))
    params = jax.jit(program.init)(jax.random.key(0)).params
    assert len(sampling.whole_stream_layers(program.model(params))) == 1
    prompt = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
    sample = nl.generate(program, params, prompt, max_new_tokens=6)
    logits, _ = one_call(program, params, prompt, sample)
    np.testing.assert_array_equal(sample.tokens, jnp.argmax(logits[:, 8:-1], axis=-1))
    with pytest.raises(sampling.SamplingError, match="attends to its whole stream"):
        nl.generate(program, params, prompt, max_new_tokens=2, fast=sample.fast)
