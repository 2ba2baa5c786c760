"""Reading a config section's keys off signatures: config types, level slots, defaults,
the Level fields a recipe's ``**level_kwargs`` pass on, writing and listing sections."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import pytest

from nested.core.level import Level
from nested.run import config_fields as cf
from nested.run.config_fields import REQUIRED, Field


@pytest.mark.parametrize(
    ("hint", "kind"),
    [
        (int, int),
        (float, float),
        (bool, bool),
        (int | None, int),
        (Literal["sequence", "stream"], str),
        (tuple[tuple[int, int], ...], tuple),
        (Sequence[float], tuple),
        (tuple, tuple),
        (int | str, None),  # two config types: not configurable
        (Callable[[int], int], None),
        (list, None),
    ],
)
def test_type_hints_become_config_types(hint, kind):
    assert cf.value_type(hint) is kind


@pytest.mark.parametrize(
    ("hint", "kind"),
    [(Level, str), (Level | None, str), (Sequence[Level], tuple), (str, None), (Level | int, None)],
)
def test_level_slots_hold_a_level_name_or_a_tuple_of_names(hint, kind):
    assert cf.slot_kind(hint) is kind


def _layer(
    level: Level,
    *,
    dim: int,
    heads: int = 2,
    scale: float | None = None,
    mode: Literal["a", "b"] = "a",
    experts=1,  # unannotated: the default's type
    cms: Sequence[Level] = (),
    activation: Callable = max,  # not a config type: no key
    dtype=None,  # no annotation and no default type: no key
    rngs: object = None,
    **kwargs,
):
    pass


def test_configurable_parameters_keep_their_defaults_and_types():
    assert cf.configurable(_layer, skip=("rngs",)) == {
        "level": Field(REQUIRED, str),
        "dim": Field(REQUIRED, int),
        "heads": Field(2, int),
        "scale": Field(None, float),
        "mode": Field("a", str),
        "experts": Field(1, int),
        "cms": Field((), tuple),
    }
    assert cf.parameters(_layer)[2]  # takes **kwargs
    assert "dim" not in cf.configurable(_layer, skip=("dim",))


def test_a_class_is_read_from_its_init():
    class Block:
        def __init__(self, width: int = 4, *, gated: bool = False):
            pass

    assert cf.configurable(Block) == {"width": Field(4, int), "gated": Field(False, bool)}


def test_level_kwargs_pass_on_the_level_fields_the_recipe_does_not_take():
    def recipe(name: str = "memory", *, d_k: int, every: int, lr: float = 0.1, **level_kwargs):
        pass

    fields = cf.level_fields("mine", recipe)
    assert list(fields)[:5] == ["rule", "owner", "d_k", "every", "lr"]
    assert fields["rule"] == Field("mine", str) and fields["owner"] == Field(None, str)
    assert fields["every"] == Field(REQUIRED, int)  # the recipe's own, not Level's default 1
    defaults = {f.name: f.default for f in dataclasses.fields(Level)}
    for name, kind in cf.LEVEL_FIELDS.items():
        if name != "every":
            assert fields[name] == Field(defaults[name], kind)
    assert "name" not in fields and "fast" not in fields and "memory" not in fields


def test_a_recipe_without_level_kwargs_gets_no_level_fields():
    def recipe(name: str = "memory", *, d_k: int):
        pass

    assert cf.level_fields("fixed", recipe) == {
        "rule": Field("fixed", str),
        "owner": Field(None, str),
        "d_k": Field(REQUIRED, int),
    }


def test_task_fields_are_the_dataclass_fields():
    @dataclasses.dataclass(frozen=True)
    class Task:
        seq_len: int = 64
        settings: tuple[tuple[int, int], ...] = ((8, 2),)
        path: str | None = None

    assert cf.task_fields("toy", Task) == {
        "name": Field("toy", str),
        "seq_len": Field(64, int),
        "settings": Field(((8, 2),), tuple),
        "path": Field(None, str),
    }


def _model(level: Level, *, vocab: int, dim: int, mixer: str = "memory", rngs=None, **kwargs):
    pass


def test_model_keys_add_those_of_the_callables_receiving_its_kwargs():
    fields = cf.model_fields("toy", _model, also=(_layer,), unset=("experts",))
    assert list(fields) == [
        *("name", "level", "dim", "mixer"),  # the model's own: vocab and rngs are not keys
        *("heads", "scale", "mode", "experts", "cms"),  # the layer's, less the model's
    ]
    assert fields["dim"] == Field(REQUIRED, int)  # the model's, not the layer's
    assert fields["experts"] == Field(None, int)  # unset: None, "as the rule needs"
    assert cf.model_slots(_model, also=(_layer,)) == {"level": False, "cms": True}


def test_a_section_holds_every_key_and_typed_placeholders():
    fields = {
        "dim": Field(REQUIRED, int),
        "chunk": Field(None, int),
        "sizes": Field([1, 2], tuple),
        "rule": Field("delta", str),
    }
    section = cf.section(fields, {"rule": "titans"})
    assert section.to_dict() == {"dim": None, "chunk": None, "sizes": (1, 2), "rule": "titans"}
    section.lock()
    section.chunk = 16  # a placeholder accepts its type
    with pytest.raises(TypeError):
        section.dim = "wide"
    with pytest.raises(AttributeError):
        section.dimm = 3


def test_a_section_rejects_unknown_keys_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"^unknown key\(s\) \['dimm'\]; allowed: \['dim'\]$"):
        cf.section({"dim": Field(4, int)}, {"dimm": 3})


def test_listing_is_one_line_per_key_sorted_in_each_section():
    sections = {
        "model": {"heads": Field(2, int), "dim": Field(REQUIRED, int)},
        "levels[rule=x]": {"mode": Field("a", str), "odd": Field(None, None)},
    }
    assert cf.listing(sections).splitlines() == [
        f"{'model.dim':<40}  int    required",
        f"{'model.heads':<40}  int    2",
        f"{'levels[rule=x].mode':<40}  str    'a'",
        f"{'levels[rule=x].odd':<40}  any    None",
    ]
