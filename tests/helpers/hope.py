"""A Hope LM compiled by hand (``nl.compile`` of its levels): a self-modifying layer over a
delta memory, its projections learning every ``C`` tokens, three CMS blocks of periods
``C``, ``2C``, ``4C`` learning from the outer loss; width ``DIM``, ``HEADS`` heads."""

import optax

import nested as nl
from nested.nn.models import MemoryLM

DIM, HEADS, C = 8, 2, 4


def hope_program(vocab=11):
    memory = nl.recipes.delta(d_k=DIM // HEADS, d_v=DIM // HEADS)
    projections = nl.recipes.projections(d_k=DIM, d_v=DIM, every=C)
    cms = [
        nl.Level(
            f"cms{c}",
            memory=nl.memories.MLP(DIM, DIM, 2 * DIM),
            objective=nl.objectives.outer_loss,
            update=optax.sgd(0.1),
            every=c,
        )
        for c in (C, 2 * C, 4 * C)
    ]

    def model(rngs):
        return MemoryLM(
            memory,
            vocab=vocab,
            dim=DIM,
            heads=HEADS,
            layers=1,
            mixer="self_modifying",
            projections=projections,
            cms=cms,
            rngs=rngs,
        )

    backbone = nl.Level(
        "backbone",
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.adam(3e-3),
        every="step",
    )
    owners = {
        "memory": "projections",
        "projections": "backbone",
        **{level.name: "backbone" for level in cms},
    }
    return nl.compile(nl.NestedSystem([backbone, memory, projections, *cms], owners=owners))
