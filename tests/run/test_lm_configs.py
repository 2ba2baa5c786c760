"""``configs/lm.py``: every paper-size model is within 10% of its nominal size, counted from
shapes alone (nothing allocated), the schedules spend the stated budgets, and the ``tiny`` size
of every model trains.

``python -m pytest -s tests/run/test_lm_configs.py`` prints the parameter table of the config's
docstring.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_configs

from nested.run import config as nc

PATH = tiny_configs.path("lm")
_spec = importlib.util.spec_from_file_location("lm_config", PATH)
lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lm)


def config(variant: str):
    return nc.load(f"{PATH}:{variant}")


def _size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def abstract_model(cfg):
    """The model ``cfg`` builds, as shapes only (``nnx.eval_shape``: nothing is allocated)."""
    experiment = nc.build(cfg)
    return nnx.eval_shape(lambda: experiment.system.outer.memory(nnx.Rngs(0)))


def parameters(cfg) -> int:
    """The parameter count of ``cfg``'s model: embedding, head, norms, every block and the
    learned initial states of its fast memories. The blocks are all alike, so the count is
    that of a one-block model plus ``layers - 1`` times its block (a 24-block model takes
    seconds to trace; :func:`test_the_count_is_that_of_the_whole_model` checks the two agree)."""
    cfg = cfg.copy_and_resolve_references()
    layers, cfg.model.layers = cfg.model.layers, 1
    model = abstract_model(cfg)
    block = _size(nnx.state(model.blocks[0], nnx.Param))
    return _size(nnx.state(model, nnx.Param)) + (layers - 1) * block


def table() -> list[tuple]:
    rows = []
    for model in lm.MODELS:
        for size in lm.PAPER_SIZES:
            cfg = config(f"{model}-{size}")
            m = cfg.model
            rows.append((model, size, m.layers, m.dim, m.heads, m.mlp_hidden, parameters(cfg)))
    return rows


def test_every_paper_size_is_within_10_percent_of_its_nominal_size():
    rows, far = table(), []
    for model, size, layers, dim, heads, mlp, count in rows:
        off = count / lm.NOMINAL[size] - 1
        print(
            f"{model:<14}  {size:<5}  {layers:>6}  {dim:>4}  {heads:>5}  {mlp:>4}  "
            f"{count / 1e6:>5.0f}M  {100 * off:>+6.1f}%"
        )
        if abs(off) > 0.10:
            far.append(f"{model}-{size}: {count:,} ({100 * off:+.1f}%)")
    assert not far, f"more than 10% off the nominal size: {far}"


def test_the_small_models_match_the_transformer_within_10_percent():
    """The CPU study's size compares models of equal parameter count (RESULTS.md)."""
    base = parameters(config("transformer-small"))
    counts = {model: parameters(config(f"{model}-small")) for model in lm.MODELS}
    far = {m: f"{100 * (n / base - 1):+.1f}%" for m, n in counts.items() if abs(n / base - 1) > 0.1}
    assert not far and 7e6 < base < 8e6, far


@pytest.mark.parametrize(
    "variant", ["transformer-125m", pytest.param("hope-125m", marks=pytest.mark.slow)]
)
def test_the_count_is_that_of_the_whole_model(variant):
    cfg = config(variant)
    assert _size(nnx.state(abstract_model(cfg), nnx.Param)) == parameters(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(lm.MODELS))
def test_the_count_is_that_of_the_whole_model_at_every_size(model):
    for size in lm.PAPER_SIZES:
        cfg = config(f"{model}-{size}")
        assert _size(nnx.state(abstract_model(cfg), nnx.Param)) == parameters(cfg), size


def test_the_schedules_spend_the_papers_budgets():
    for variant, tokens in {
        "transformer-340m": 15e9,
        "gated_deltanet-1.3b": 100e9,
        "deltanet-340m": 15e9,
        "titans-760m": 30e9,
        "hope-1.3b": 100e9,
        "ttt_linear-1.3b": 50000 * 2**19,  # TTT's 50000 steps of 0.5M tokens
    }.items():
        cfg = config(variant)
        t = cfg.train.steps * cfg.train.batch_size * cfg.task.seq_len
        assert cfg.train.batch_size * cfg.task.seq_len == lm.BATCH_TOKENS, variant
        assert abs(t / tokens - 1) < 1e-3, (variant, t)
        assert 0 < cfg.optimizer.warmup_steps <= cfg.train.steps // 10, variant
    ttt = config("ttt_mlp-125m")
    assert (ttt.task.seq_len, ttt.optimizer.learning_rate, ttt.train.steps) == (2048, 3e-3, 4800)
    assert ttt.optimizer.learning_rate * ttt.optimizer.min_lr_ratio == pytest.approx(1e-5)
    paper = config("hope-760m")
    assert (paper.task.vocab_size, paper.train.dtype, paper.task.path) == (32000, "bfloat16", None)


def test_transformer_has_no_fast_level_and_full_attention():
    cfg = config("transformer-1.3b")
    assert dict(cfg.levels) == {} and cfg.model.level is None
    assert (cfg.model.mixer, cfg.model.window) == ("attention", None)
    assert nc.build(cfg).system.fast_levels == ()


def test_a_bad_variant_names_the_models_and_sizes():
    for variant in ("mamba-340m", "hope-7b", "hope"):
        with pytest.raises(nc.ConfigError, match=r"<model>-<size>, models \['transformer'"):
            config(variant)


def test_attention_takes_no_level_and_memory_mixers_need_one():
    cfg = config("transformer-tiny")
    cfg.model.level = "memory"
    with pytest.raises(nc.ConfigError, match="mixer='attention' runs no fast level"):
        nc.build(cfg)
    cfg = config("deltanet-tiny")
    cfg.model.level = None
    with pytest.raises(nc.ConfigError, match="model.level is required with model.mixer='memory'"):
        nc.build(cfg)
    cfg = config("deltanet-tiny")
    del cfg.levels["memory"]
    cfg.model.level = None
    with pytest.raises(nc.ConfigError, match="or set model.mixer='attention'"):
        nc.build(cfg)


FAST = ["transformer"]  # the others: with -m slow


@pytest.mark.parametrize(
    "model", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in lm.MODELS]
)
def test_tiny_trains(model):
    cfg = config(f"{model}-tiny")
    experiment = nc.build(cfg)
    count = parameters(cfg)
    assert 1e5 <= count <= 1e6, count  # a few hundred thousand
    program, train = experiment.program, cfg.train
    state = program.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.task.vocab_size, (train.batch_size, cfg.task.seq_len + 1))
    batch = {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "mask": jnp.ones((train.batch_size, cfg.task.seq_len), jnp.float32),
    }
    step = jax.jit(program.train_step)
    first = state.params
    for _ in range(2):
        state, metrics = step(state, batch)
        assert bool(jnp.isfinite(metrics["loss"])), metrics
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), first, state.params)
    assert all(jax.tree.leaves(moved)), "some parameters did not move"


@pytest.mark.parametrize(
    ("variant", "overrides", "align"),
    [
        ("hope-tiny", {}, None),  # the shortest CMS period
        ("titans_mac-tiny", {}, None),  # the memory-as-context segment
        ("titans-tiny", {}, None),  # the memory's mini-batch
        ("gated_deltanet-tiny", {}, 1),  # updates every token
        ("transformer-tiny", {}, 1),
        ("hope-tiny", {"documents": False}, None),  # nothing to align: the state flows on
        ("hope-tiny", {"align": 1}, 1),  # packed densely by choice
    ],
)
def test_the_task_aligns_documents_to_the_models_grid(variant, overrides, align):
    cfg = config(variant)
    cfg.task.update(overrides)
    task = nc.build(cfg).task
    if variant == "hope-tiny" and not overrides:
        align = min(cfg.levels[name].every for name in cfg.model.cms)
        assert align == cfg.levels.projections.every == cfg.levels.memory.every
    elif variant == "titans_mac-tiny":
        align = cfg.model.window
        assert align % cfg.levels.memory.every == 0
    elif variant == "titans-tiny":
        align = cfg.levels.memory.every
    assert task.align == align
    assert align is None or align == 1 or align >= 4


def test_a_chunk_suffix_declares_the_memory_period_and_scales_the_titans_step():
    base, large = config("titans-small"), config("titans-small-c256")
    assert (base.levels.memory.every, large.levels.memory.every) == (lm.CHUNK, 256)
    # The same step range a token: the recipe's bound is per update of C summed gradients.
    assert large.levels.memory.lr_scale * 256 == pytest.approx(base.levels.memory.lr_scale * 16)
    assert large.levels.memory.read == "after_write"  # the dual form reads every token's state
    assert config("ttt_mlp-125m-c2048").levels.memory.every == 2048
    large.levels.memory.every = lm.CHUNK  # all else is the model without the suffix
    assert large.to_dict() == {**base.to_dict(), "levels": large.levels.to_dict()}
    assert large.levels.memory.lr_scale != base.levels.memory.lr_scale
    for bad in ("titans-small-c100", "hope-small-c256", "transformer-tiny-c64"):
        with pytest.raises(nc.ConfigError, match=r"-c<C> takes C in \[64, 128"):
            config(bad)
