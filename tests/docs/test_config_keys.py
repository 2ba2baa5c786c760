"""Every accepted config key is printable, and a change to one is a reviewed change.

``tests/docs/config_keys.txt`` is the committed listing of the keys of every registered rule and
level recipe, model, task and optimizer (and ``train``), with types and defaults. A renamed or
dropped constructor keyword would silently break command lines that set it; here it fails
with the diff and the command that regenerates the listing. Nothing is built or traced.
"""

import difflib
from pathlib import Path

import pytest
from helpers import tiny_configs

from nested.levels import recipes
from nested.run import config as nc
from nested.run import config_fields as cf
from nested.run import config_schema as schema

SNAPSHOT = Path(__file__).with_name("config_keys.txt")
REGENERATE = "python -m nested.run.config --registered > tests/docs/config_keys.txt"


def ours(listing: str) -> str:
    """The listing without the optimizer keys read off optax's own signatures: those change
    with optax's releases (a fresh install takes the newest), not with our code."""
    theirs = {
        f"optimizer[name={name}].{key}"
        for name, fn in schema.OPTIMIZERS.items()
        for key in cf.configurable(fn, skip=("learning_rate",))
    }
    lines = listing.splitlines(keepends=True)
    return "".join(line for line in lines if line.split()[0] not in theirs)


def check_snapshot() -> None:
    """Fail with the diff unless the live listing equals the committed one (our keys)."""
    live, saved = ours(cf.listing(schema.registered())), ours(SNAPSHOT.read_text())
    if live != saved:
        diff = difflib.unified_diff(
            saved.splitlines(keepends=True),
            live.splitlines(keepends=True),
            "tests/docs/config_keys.txt (committed)",
            "live",
        )
        pytest.fail(
            "the keys configs accept changed; a command line setting a renamed or removed key "
            f"now fails:\n{''.join(diff)}If the change is intended, regenerate the listing "
            f"and commit it with the change: {REGENERATE}",
            pytrace=False,
        )


def test_every_accepted_key_matches_the_committed_listing():
    check_snapshot()


def test_a_renamed_recipe_keyword_fails_the_snapshot_with_the_diff(monkeypatch):
    def delta(name="memory", *, key_dim: int, d_v: int, **level_kwargs):  # d_k renamed
        return recipes.delta(name, d_k=key_dim, d_v=d_v, **level_kwargs)

    monkeypatch.setitem(recipes.RULES, "delta", delta)
    with pytest.raises(pytest.fail.Exception) as info:
        check_snapshot()
    message = str(info.value)
    assert "\n-levels[rule=delta].d_k " in message
    assert "\n+levels[rule=delta].key_dim " in message
    assert message.endswith(REGENERATE)


def test_the_command_prints_the_registered_listing(capsys):
    schema.main(["--registered"])
    assert capsys.readouterr().out == cf.listing(schema.registered())


@pytest.mark.parametrize("spec", ["mqar", "char_lm:hope", "niah", "continual"])
def test_the_command_prints_every_key_of_a_config_with_its_value(spec, capsys):
    name, _, variant = spec.partition(":")
    path = tiny_configs.path(name) + (f":{variant}" if variant else "")
    config = nc.load(path)
    schema.main([path])
    lines = capsys.readouterr().out.splitlines()
    printed = {line.split()[0]: line for line in lines}
    flat = config.to_dict()
    keys = []
    for section in ("task", "model", "optimizer", "train", "plasticity"):
        keys += [f"{section}.{k}" for k in flat[section] if k != "mesh"]
    keys += [f"train.mesh.{k}" for k in flat["train"]["mesh"] if k != "rules"]
    keys += [f"train.mesh.rules.{k}" for k in flat["train"]["mesh"]["rules"]]
    keys += [f"levels.{n}.{k}" for n, level in flat["levels"].items() for k in level]
    assert sorted(printed) == sorted(keys)  # the config holds every accepted key
    assert printed["train.steps"].split()[1:] == ["int", repr(config.train.steps)]
    assert printed["levels.memory.rule"].split()[1:] == ["str", repr(config.levels.memory.rule)]


def test_the_command_needs_one_config_or_registered(capsys):
    for argv in ([], ["configs/mqar.py", "--registered"]):
        with pytest.raises(SystemExit) as info:
            schema.main(argv)
        assert info.value.code == 2
    assert "give a config file or --registered" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^error: config file 'nope.py' does not exist$"):
        schema.main(["nope.py"])
