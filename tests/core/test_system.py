"""Declarations fail early, with a ValueError naming the level and the field."""

import jax
import jax.numpy as jnp
import optax
import pytest

import nested as nl
from nested.core import inner
from nested.nn.models import MemoryLM


def fast(name="memory", every=1, **kwargs):
    return nl.recipes.delta(name, d_k=4, d_v=4, every=every, **kwargs)


def outer(*levels, name="backbone"):
    def model(rngs):
        return MemoryLM(levels[0], vocab=11, dim=8, heads=2, layers=len(levels), rngs=rngs)

    return nl.Level(
        name,
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.sgd(0.1),
        every="step",
    )


def test_valid_system_orders_levels_fastest_first():
    slow, quick = fast("slow", every=4), fast("quick", every=1)
    system = nl.NestedSystem(
        [outer(quick), slow, quick], owners={"slow": "backbone", "quick": "slow"}
    )
    assert [level.name for level in system.levels] == ["quick", "slow", "backbone"]
    assert system.outer.name == "backbone"


def test_duplicate_names():
    with pytest.raises(ValueError, match="'memory' is used by 2 levels"):
        nl.NestedSystem([outer(fast()), fast(), fast()], owners={"memory": "backbone"})


def test_period_that_does_not_divide_its_owners():
    with pytest.raises(ValueError, match="'quick': every=3 does not divide the period every=4"):
        nl.NestedSystem(
            [outer(fast()), fast("slow", every=4), fast("quick", every=3)],
            owners={"slow": "backbone", "quick": "slow"},
        )


def test_periods_must_divide_one_another_across_owners():
    with pytest.raises(ValueError, match="every=6 is not a multiple of the faster period 4"):
        nl.NestedSystem(
            [outer(fast()), fast("a", every=4), fast("b", every=6)],
            owners={"a": "backbone", "b": "backbone"},
        )


def test_fast_level_without_owner():
    with pytest.raises(ValueError, match="level 'memory' has no owner"):
        nl.NestedSystem([outer(fast()), fast()])


def test_owner_that_is_not_a_level():
    with pytest.raises(ValueError, match="owner 'nobody' is not a level"):
        nl.NestedSystem([outer(fast()), fast()], owners={"memory": "nobody"})


def test_owner_cycle():
    with pytest.raises(ValueError, match="cycle"):
        nl.NestedSystem(
            [outer(fast()), fast("a"), fast("b")],
            owners={"a": "b", "b": "a"},
        )


def test_exactly_one_outermost_level():
    with pytest.raises(ValueError, match="exactly one outermost level"):
        nl.NestedSystem([fast()])
    with pytest.raises(ValueError, match="exactly one outermost level"):
        nl.NestedSystem([outer(fast()), outer(fast(), name="other")])


@pytest.mark.parametrize("every", [0, -4, 2.5, True])
def test_non_positive_period(every):
    with pytest.raises(ValueError, match=r"Level 'memory': every=.* must be a positive int"):
        fast(every=every)


def test_bad_persist_and_read():
    with pytest.raises(ValueError, match="Level 'memory': persist='forever'"):
        fast(persist="forever")
    with pytest.raises(ValueError, match="Level 'memory': read='before'"):
        fast(read="before")


def test_chunk_and_truncate_must_be_multiples_of_the_period():
    with pytest.raises(ValueError, match="Level 'memory': chunk=6 must be a positive multiple"):
        fast(every=4, chunk=6)
    with pytest.raises(ValueError, match="Level 'memory': truncate=2 must be a positive multiple"):
        fast(every=4, truncate=2)


def test_memory_must_be_a_memory():
    with pytest.raises(ValueError, match="Level 'memory': memory dict has no apply"):
        nl.Level("memory", memory={}, objective=nl.objectives.l2, update=nl.rules.sgd())


def test_update_must_be_a_rule_or_optax():
    with pytest.raises(ValueError, match="update must be a nested.rules.UpdateRule"):
        nl.Level(
            "memory", memory=nl.memories.Linear(2, 2), objective=nl.objectives.l2, update="sgd"
        )


def test_context_that_does_not_fit_the_memory():
    level = fast()  # d_k = d_v = 4
    state = inner.initial_state(level, ({"w": jnp.zeros((1, 2, 4, 4))},))
    k = jnp.zeros((1, 5, 2, 3))  # d_k = 3 does not fit
    ctx = inner.Context(k=k, v=jnp.zeros((1, 5, 2, 4)), q=k, gates={"beta": jnp.zeros((1, 5, 2))})
    with pytest.raises(ValueError, match=r"level 'memory': context k has shape \(1, 5, 2, 3\)"):
        inner.run(level, state, ctx)


def test_missing_gate():
    level = fast()
    state = inner.initial_state(level, ({"w": jnp.zeros((1, 2, 4, 4))},))
    x = jnp.zeros((1, 5, 2, 4))
    with pytest.raises(
        ValueError, match=r"level 'memory': the owner emits no gate\(s\) \['beta'\]"
    ):
        inner.run(level, state, inner.Context(k=x, v=x, q=x, gates={}))


def test_model_running_an_undeclared_level():
    used, declared = fast("used"), fast("declared")
    system = nl.NestedSystem([outer(used), declared], owners={"declared": "backbone"})
    with pytest.raises(ValueError, match=r"runs level\(s\) \['used'\] that are not declared"):
        nl.compile(system)


def test_a_name_declared_twice_as_different_levels():
    """Equal names must be equal levels: the model runs its own declaration, the system
    schedules (and reports) the other one."""
    owners = {"memory": "backbone"}
    system = nl.NestedSystem([outer(fast(every=1)), fast(every=16)], owners=owners)
    with pytest.raises(
        ValueError,
        match=r"level 'memory' is declared twice, differently: the system's has every=16, "
        r"the model's every=1; build the model and the system from the same Level",
    ):
        nl.compile(system)
    same = fast(every=16)  # declared equal: the same level
    nl.compile(nl.NestedSystem([outer(fast(every=16)), same], owners=owners))


def test_compiled_program_runs():
    level = fast()
    program = nl.compile(nl.NestedSystem([outer(level), level], owners={"memory": "backbone"}))
    state = program.init(jax.random.key(0))
    tokens = jnp.arange(14).reshape(2, 7) % 11
    logits, final = program.apply(state.params, tokens)
    assert logits.shape == (2, 7, 11)
    assert final[0]["mixer"].params[0]["w"].shape == (2, 2, 4, 4)
