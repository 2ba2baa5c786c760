"""Configs: registries by name, the level section, and one clear error per bad input."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_configs
from helpers.hope import hope_program
from ml_collections import config_dict

from nested import data
from nested.learn import memories, objectives
from nested.levels import recipes
from nested.nn.cms import ContinuumMemory
from nested.nn.hope import SelfModifyingLayer
from nested.run import config as nc

CONFIGS = ["mqar", "char_lm", "niah", "continual"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_builds_and_its_docstring_is_the_command(name):
    path = tiny_configs.path(name)
    exp = nc.build(nc.load(path))
    assert exp.task.name == name
    assert [level.name for level in exp.system.fast_levels] == ["memory"]
    module_doc = Path(path).read_text().split('"""')[1]
    assert module_doc.splitlines()[0] == (
        f"python experiments/train.py --config configs/{name}.py --workdir runs/{name}"
    )


CONTINUAL_MODELS = ["hope", "hope_carried", "one_level", "one_level_wide", "one_level_wider"]
CONTINUAL_MODELS += ["three_level", "two_level"]
CONTINUAL_MODELS += [f"{kind}_1_{c}" for kind in ("periods", "consolidate") for c in (8, 32, 128)]


ZOOLOGY = ", each also as zoology-<variant>"  # configs/mqar.py: Zoology's settings


@pytest.mark.parametrize(
    ("name", "others", "tail"),
    [
        ("mqar", ["attention", "hope"], ZOOLOGY),
        ("niah", [], ""),
        ("continual", CONTINUAL_MODELS, ""),
    ],
)
def test_unknown_variant_names_the_registered_rules(name, others, tail):
    with pytest.raises(nc.ConfigError) as info:
        nc.load(f"{tiny_configs.path(name)}:detla")
    allowed = sorted({*recipes.RULES, *others})
    assert str(info.value) == f"variant 'detla' is unknown; allowed variants: {allowed}{tail}"


@pytest.mark.parametrize("rule", sorted(recipes.RULES))
def test_mqar_has_a_variant_per_registered_rule(rule):
    exp = nc.build(nc.load(f"{tiny_configs.path('mqar')}:{rule}"))
    level = exp.system["memory"]
    reference = recipes.RULES[rule]("memory", d_k=32, d_v=32)
    assert type(level.objective) is type(reference.objective)
    assert sorted(level.gates) == sorted(reference.gates)


def test_a_newly_registered_rule_is_usable_by_name(monkeypatch):
    def slow_delta(name="memory", *, d_k: int, d_v: int, lr_init: float = 0.5, **level_kwargs):
        return recipes.delta(name, d_k=d_k, d_v=d_v, **level_kwargs)

    monkeypatch.setitem(recipes.RULES, "slow_delta", slow_delta)
    config = nc.load(f"{tiny_configs.path('mqar')}:slow_delta")
    assert config.levels.memory.lr_init == 0.5  # the recipe's own hyperparameter is a key
    assert nc.build(config).system["memory"].every == 1


def _mixer(config):
    model = nc.build(config).system.levels[-1].memory(nnx.Rngs(0))  # the outermost level
    return model.blocks[0].mixer


def test_a_rule_override_brings_the_layer_options_the_rule_needs():
    config = nc.load(tiny_configs.path("mqar"))
    assert config.model.key_shift is None  # unset: as the slot's rule needs
    assert _mixer(config).key_shift is False  # delta
    config.levels.memory.rule = "falcon"  # what --config.levels.memory.rule=falcon does
    assert _mixer(config).key_shift is True
    config.model.key_shift = False  # set by the user: kept
    assert _mixer(config).key_shift is False
    assert _mixer(nc.load(f"{tiny_configs.path('mqar')}:falcon")).key_shift is True


def test_every_override_turns_the_online_rule_into_mini_batch_ttt():
    config = tiny_configs.config("mqar", levels__memory__every=4, levels__memory__chunk=8)
    level = nc.build(config).system["memory"]
    assert (level.every, level.chunk) == (4, 8)


def test_memory_widths_follow_the_model_unless_set():
    config = tiny_configs.config("mqar", model__dim=24, model__heads=3)
    assert nc.build(config).system["memory"].memory.d_k == 8
    config = tiny_configs.config("mqar", levels__memory__d_k=5, levels__memory__d_v=7)
    memory = nc.build(config).system["memory"].memory
    assert (memory.d_k, memory.d_v) == (5, 7)


def test_char_lm_hope_declares_its_levels_and_owners_in_the_config():
    exp = nc.build(nc.load(f"{tiny_configs.path('char_lm')}:hope"))
    system, dim, heads = exp.system, exp.config.model.dim, exp.config.model.heads
    cms = ("cms1", "cms2", "cms3")
    assert system.owners == {"memory": "projections", "projections": "model"} | {
        name: "model" for name in cms
    }
    assert isinstance(system["memory"].memory, memories.MLP)  # Titans, two layers
    assert system["memory"].memory.d_k == dim // heads
    # mini-batches of 16 with the step range shrunk to match (per token its start is rough)
    assert system["memory"].every == 16
    assert system["memory"].gates["lr"].scale == pytest.approx(0.1 / 16)
    projections = system["projections"]
    assert (projections.memory.d_k, projections.memory.d_v, projections.every) == (dim, dim, 16)
    assert projections.gates["beta"].scale == pytest.approx(1 / (dim * 16))  # stable steps
    for name, every in zip(cms, (16, 64, 128), strict=True):
        level = system[name]
        assert level.objective is objectives.outer_loss and not level.gates
        assert (level.every, level.memory.d_k, level.memory.hidden) == (every, dim, 4 * dim)
    block = nnx.eval_shape(lambda: system.outer.memory(nnx.Rngs(0))).blocks[0]
    assert isinstance(block.mixer, SelfModifyingLayer) and isinstance(block.cms, ContinuumMemory)
    assert [level.name for level in block.cms.levels] == list(cms)


def test_char_lm_titans_mac_builds_memory_as_context_mixers_from_the_config():
    from nested.nn.hybrid import MemoryAsContext

    config = nc.load(f"{tiny_configs.path('char_lm')}:titans_mac")
    config.model.persistent = 6
    exp = nc.build(config)
    assert exp.system["memory"].every == 16
    model = nnx.eval_shape(lambda: exp.system.outer.memory(nnx.Rngs(0)))
    mixer = model.blocks[0].mixer
    assert isinstance(mixer, MemoryAsContext) and mixer.window == 32
    assert mixer.persistent.shape == (6, exp.config.model.dim)
    config.model.mixer = "gate"
    with pytest.raises(ValueError, match="persistent tokens of mixer='context'"):
        nnx.eval_shape(lambda: nc.build(config).system.outer.memory(nnx.Rngs(0)))


def test_a_hope_config_builds_the_system_a_hand_written_declaration_does():
    config = nc.load(f"{tiny_configs.path('char_lm')}:hope")
    tiny_configs.override(
        config, {"task.seq_len": 16, "model.dim": 8, "model.heads": 2, "model.layers": 1}
    )
    config.levels.memory = nc.level_config("delta", owner="projections")
    config.levels.projections.every = 4
    for name, every in (("cms1", 4), ("cms2", 8), ("cms3", 16)):
        tiny_configs.override(config.levels[name], {"every": every, "hidden": 16, "lr": 0.1})
    built, by_hand = nc.build(config).program, hope_program(vocab=256)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = []
    for program in (built, by_hand):
        params = jax.jit(program.init)(jax.random.key(0)).params
        losses.append(jax.jit(program.loss)(params, batch)[0])
    assert np.isfinite(losses[0])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-12)


def test_task_and_optimizer_sections_reach_the_experiment():
    config = tiny_configs.config("mqar", optimizer__learning_rate=0.5, optimizer__warmup_steps=0)
    exp = nc.build(config)
    assert exp.task == data.MQARTask(
        vocab_size=16, train_settings=((16, 2), (16, 4)), test_settings=((16, 2), (16, 4))
    )
    assert exp.schedule(0) == pytest.approx(0.5)
    assert exp.schedule(8) == pytest.approx(0.05)  # cosine down to min_lr_ratio = 0.1


def test_every_key_of_a_section_is_overridable_under_lock():
    config = nc.load(tiny_configs.path("mqar"))
    config.lock()
    config.levels.memory.chunk = 16  # placeholders are typed, so they accept their type
    config.task.train_weights = (1.0, 2.0, 3.0)
    with pytest.raises(AttributeError):
        config.model.dimm = 3


def _error(config) -> str:
    with pytest.raises(nc.ConfigError) as info:
        nc.build(config)
    message = str(info.value)
    assert "\n" not in message
    return message


# One test per bad input: the message names the key and the allowed values.


def test_unknown_rule_names_the_key_and_the_registered_rules():
    message = _error(tiny_configs.config("mqar", levels__memory__rule="detla"))
    allowed = sorted([*recipes.RULES, *recipes.LEVELS])
    assert message == (
        f"levels.memory.rule='detla' is unknown; allowed: {allowed} or a recipe's import path, "
        "module:function"
    )


def test_a_rule_by_import_path_and_each_way_it_can_be_wrong(tmp_path, monkeypatch):
    (tmp_path / "rules_of_test_config.py").write_text(
        "from nested.levels import recipes\n\n\n"
        "def my_delta(name='memory', *, d_k, d_v, **level_kwargs):\n"
        "    return recipes.delta(name, d_k=d_k, d_v=d_v, **level_kwargs)\n\n\n"
        "def not_a_recipe(name='memory', *, d_k, d_v, **level_kwargs):\n"
        "    return 'a level'\n"
    )
    (tmp_path / "broken_rules_of_test_config.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_rules_of_test_config.py").write_text("raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def rule(path):
        return tiny_configs.config("mqar", levels__memory__rule=path)

    by_path = nc.build(rule("rules_of_test_config:my_delta")).system.fast_levels
    assert by_path == nc.build(tiny_configs.config("mqar")).system.fast_levels  # equal levels
    cases = {
        "no_such_module_xyz:f": "no module named 'no_such_module_xyz'; install it, add its "
        "folder to PYTHONPATH or run from the folder that holds it",
        "broken_rules_of_test_config:f": "no module named 'no_such_dependency_xyz'; install it",
        "raising_rules_of_test_config:f": "importing raising_rules_of_test_config failed: "
        "RuntimeError: no GPU",
        "rules_of_test_config:my_delat": "module rules_of_test_config has no function "
        "'my_delat'; allowed: ['my_delta', 'not_a_recipe']",
    }
    for path, message in cases.items():
        assert _error(rule(path)).startswith(f"levels.memory.rule='{path}': {message}")
    assert _error(rule("rules_of_test_config:not_a_recipe")) == (
        "levels.memory.rule='rules_of_test_config:not_a_recipe' returned a str, not a "
        "nested.Level; a recipe is (name, *, d_k, d_v, **level_kwargs) -> nested.Level"
    )


def test_unknown_model_and_task_names():
    message = _error(tiny_configs.config("mqar", model__name="transformer"))
    assert message == "model.name='transformer' is unknown; allowed: ['memory_lm']"
    message = _error(tiny_configs.config("mqar", task__name="mqra"))
    assert message == f"task.name='mqra' is unknown; allowed: {sorted(data.TASKS)}"


def test_typo_in_a_key():
    config = tiny_configs.config("mqar")
    config.model.dimm = 3
    message = _error(config)
    allowed = "allowed: ['cms', 'consolidate', 'conv', 'dim',"
    assert message.startswith(f"model.dimm is not a key of model; {allowed}")
    config = tiny_configs.config("mqar")
    config.trian = config_dict.ConfigDict()
    assert _error(config) == (
        "config.trian is not a section; allowed: "
        "['seed', 'task', 'model', 'levels', 'optimizer', 'train', 'plasticity']"
    )


def test_period_that_does_not_divide_the_chunking():
    message = _error(tiny_configs.config("mqar", levels__memory__every=4, levels__memory__chunk=6))
    assert message == (
        "levels.memory.chunk=6 is not a multiple of levels.memory.every=4; "
        "allowed: multiples of 4, e.g. [4, 8, 12, 16]"
    )


def test_carried_stream_period_must_divide_the_sequence_length():
    # the tiny continual task has sequences of 2 * (3 + 3) = 12 tokens
    message = _error(tiny_configs.config("continual", levels__memory__every=8))
    assert message.startswith("levels.memory.every=8 does not divide the sequence length 12")
    assert message.endswith("allowed: [1, 2, 3, 4, 6, 12]")


def test_carried_stream_through_memory_as_context_needs_whole_segments():
    config = tiny_configs.config("continual", model__mixer="context", model__window=5)
    message = _error(config)
    assert message.startswith("model.window=5 (the memory-as-context segment) does not divide")
    assert message.endswith("allowed: [1, 2, 3, 4, 6, 12]")
    config.model.window = 6
    nc.build(config)


def test_dim_not_divisible_by_heads():
    message = _error(tiny_configs.config("mqar", model__dim=18, model__heads=4))
    assert message == (
        "model.dim=18 is not divisible by model.heads=4 (each head's memory is dim/heads wide "
        "unless levels.*.d_k/d_v are set); allowed heads: [1, 2, 3, 6, 9, 18]"
    )


def test_bad_level_field_value_is_reported_with_the_level_key():
    message = _error(tiny_configs.config("mqar", levels__memory__persist="forever"))
    assert message.startswith("levels.memory: ")
    assert "persist='forever'" in message and "('sequence', 'stream')" in message


def test_model_slot_must_name_a_declared_level():
    message = _error(tiny_configs.config("mqar", model__level="mem"))
    assert message == "model.level='mem' is not a declared level; allowed: ['memory']"


def test_owner_must_be_the_model_or_another_declared_level():
    config = nc.load(f"{tiny_configs.path('char_lm')}:hope")
    config.levels.memory.owner = "projection"
    assert _error(config) == (
        "levels.memory.owner='projection' is unknown; allowed: "
        "['model', 'cms1', 'cms2', 'cms3', 'projections']"
    )


def test_window_level_needs_its_period():
    config = nc.load(f"{tiny_configs.path('char_lm')}:hope")
    config.levels.cms2.every = None
    assert _error(config) == "levels.cms2.every=None must be an int >= 1"


def test_train_periods_must_align_with_steps_per_call():
    message = _error(tiny_configs.config("mqar", train__steps_per_call=3))
    assert message == (
        "train.log_every=2 is not a multiple of train.steps_per_call=3; allowed: multiples of 3, "
        "or train.steps=8 and more (at the end only)"
    )


def test_streams_need_eval_batches_as_wide_as_training_batches():
    message = _error(tiny_configs.config("continual", train__eval_batch_size=8))
    assert message.startswith("train.eval_batch_size=8 must equal train.batch_size=4")
    assert message.endswith("allowed: 4")


def test_bad_task_field_value_is_reported_with_the_task_key():
    message = _error(tiny_configs.config("mqar", task__test_settings=((8, 4),)))
    assert message.startswith("task: mqar: test_settings.seq_len=8 is invalid")


def test_unknown_optimizer_and_schedule():
    message = _error(tiny_configs.config("mqar", optimizer__schedule="linear"))
    assert message == "optimizer.schedule='linear' is unknown; allowed: ('constant', 'cosine')"
    message = _error(tiny_configs.config("mqar", optimizer__name="lamb"))
    assert message == f"optimizer.name='lamb' is unknown; allowed: {sorted(nc.OPTIMIZERS)}"


def test_section_helpers_reject_unknown_keys():
    with pytest.raises(nc.ConfigError, match=re.escape("unknown key(s) ['dimm']; allowed: [")):
        nc.model_config("memory_lm", level="memory", dimm=3)
    with pytest.raises(nc.ConfigError, match="levels.\\*.rule='nope' is unknown"):
        nc.level_config("nope")


def test_section_helpers_type_their_keys_as_ml_collections_does():
    """The settings are typed defaults: a value of another type is refused as it is written
    (ml_collections' own check, naming the key); an int is a float, a list a tuple."""
    with pytest.raises(nc.ConfigError, match=r"^Could not override field 'steps' .* 2\.5 .*int"):
        nc.train_config(steps=2.5)
    with pytest.raises(nc.ConfigError, match=r"^Could not override field 'form' .* 2 .*str"):
        nc.plasticity_config(form=2)
    with pytest.raises(nc.ConfigError, match=r"^Could not override field 'data' .* 2 .*str"):
        nc.train_config(mesh={"data": "2"})
    section = nc.train_config(max_skipped_fraction=0, mesh={"rules": {"embed": "tensor"}})
    assert section.max_skipped_fraction == 0.0 and isinstance(section.max_skipped_fraction, float)
    assert section.mesh.rules.embed == "tensor" and section.mesh.data == -1
    assert nc.level_config("delta", lr=1).lr == 1.0  # a placeholder takes its type too


def test_intervals_of_the_run_length_or_more_mean_at_the_end():
    """A short run keeps the config's intervals: 50 and 200 on 8 steps log, evaluate and
    checkpoint at step 8 only, whatever train.steps_per_call; a checkpoint may fall inside a
    log window (the unfinished window is saved with it)."""
    long = {"train__log_every": 50, "train__eval_every": 200, "train__checkpoint_every": 200}
    nc.build(tiny_configs.config("mqar", train__steps_per_call=3, **long))
    nc.build(tiny_configs.config("mqar", train__log_every=4, train__checkpoint_every=6))


def test_smoke_cuts_the_run_and_fits_the_schedule_to_it():
    config = nc.load(tiny_configs.path("char_lm"))
    config.train.smoke = True
    run = nc.build(config).config
    assert (run.train.steps, run.train.log_every, run.train.eval_batches) == (10, 1, 1)
    assert (run.train.eval_every, run.train.checkpoint_every) == (10, 10)
    assert run.optimizer.warmup_steps == 5 and config.train.steps == 3000  # a copy
    assert nc.as_run(run).to_dict() == run.to_dict()  # its config.json rebuilds the same run
    short = tiny_configs.config("mqar", train__smoke=True, train__steps=4)
    assert nc.build(short).config.train.steps == 4  # at most 10 steps
