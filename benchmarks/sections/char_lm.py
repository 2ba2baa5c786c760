"""The "Character-level language modelling" section: bits per character on held-out files of
the ``configs/char_lm.py`` variants, trained fewer steps than the configs' 3000."""

from __future__ import annotations

from nested.run import metrics
from sections import text
from sections.rows import Row, Runs, Section

STEPS = 200  # the configs train 3000 steps: hours here for the neural memories
# Hope's two-layer model takes ~2 s a step here (each CMS window's gradient runs through the
# second layer's Titans memory, and the outer gradient differentiates that gradient); it also
# runs with one layer, next to DeltaNet in the same setting. Titans in chunks of 16 gets the
# step range (0, 0.1/16) by default (the config notes why).
ONE_LAYER = (("model.layers", 1),)
VARIANTS = (  # row id, config variant, overrides, note
    ("delta", "delta", (), ""),
    ("ttt_linear", "ttt_linear", (), ""),
    ("ttt_mlp", "ttt_mlp", (), ""),
    ("titans", "titans", (), ""),
    ("titans_mag", "titans_mag", (), ""),
    ("titans_mac", "titans_mac", (), "segments of 32, Titans in chunks of 16"),
    ("hope", "hope", (), ""),
    ("delta_1layer_200", "delta", ONE_LAYER, "1 layer"),
    ("hope_1layer_200", "hope", ONE_LAYER, "1 layer"),
    (
        "hope_first_order",
        "hope",
        tuple((f"levels.cms{i}.first_order", True) for i in (1, 2, 3)),
        "CMS levels first order",
    ),
    (
        "titans_every16",
        "titans",
        (("levels.memory.every", 16),),
        "Titans in chunks of 16, step range (0, 0.1/16)",
    ),
)


def rows() -> list[Row]:
    out = []
    for row_id, variant, overrides, note in VARIANTS:
        if "train.steps" not in dict(overrides):
            overrides = (("train.steps", STEPS), *overrides)
        out.append(Row(f"char_lm/{row_id}", f"configs/char_lm.py:{variant}", overrides, note))
    return out


def table(runs: Runs) -> list[str]:
    notes = {r.id: r.note for r in rows()}
    lines = text.head(["variant", "val bpc", "steps", "note", "wall", "command"])
    for row_id, (record, records) in runs.rows("char_lm/").items():
        final = metrics.final_eval(records)
        bpc = text.outcome(record, final) or f"{final['val']['bpc']:.3f}"
        steps = max((r["step"] for r in final.values()), default=0)
        name = row_id.removeprefix("char_lm/")
        note = notes.get(row_id, "")
        lines.append(text.row([name, bpc, str(steps), note, text.wall(record), text.cmd(record)]))
    return lines


def render(runs: Runs) -> str:
    section = text.parts("char_lm")["section"]
    return text.fill(section, steps=STEPS, kbytes=STEPS * 16 * 128 // 1000, table=table(runs))


SECTIONS = (Section("char_lm", text.title("char_lm"), render),)
