"""The "Agent companion" section: ``configs/companion.py`` trained, then studied on held-out
agents by ``experiments/companion_study.py`` (its ``companion_study.json``): the per-session
table of every method, the bytes of each, the logistic learner's tuning, and the variants'
table (:func:`variants_table`)."""

from __future__ import annotations

from sections import text
from sections.rows import Row, Runs, Section

SCRIPT = "experiments/companion_study.py"
RESULT = "companion_study.json"


def rows() -> list[Row]:
    return [
        Row("companion/delta", "configs/companion.py", after=(SCRIPT,)),
        Row(
            "companion/aligned",
            "configs/companion.py:aligned",
            note="answers written under their queries' keys (key_shift, conv=3)",
            after=(SCRIPT,),
        ),
        Row(
            "companion/mixture",
            "configs/companion.py:mixture",
            note="agent families k2/k3/k4/pairs in training, one_feature held out",
            after=(SCRIPT,),
        ),
    ]


def _points(interval: dict | None, percent: bool = False) -> str:
    """``+m [+lo, +hi]`` x100: points to a tenth, or a percentage (``percent``); ``—`` for
    None."""
    if interval is None:
        return "—"
    m, lo, hi = (100 * interval[k] for k in ("mean", "low", "high"))
    if percent:
        return f"{m:+.0f}% [{lo:+.0f}, {hi:+.0f}]"
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def _accuracy(mean: float, low: float, high: float) -> str:
    return f"{100 * mean:.1f} [{100 * low:.0f}, {100 * high:.0f}]"


def sessions_table(result: dict) -> list[str]:
    """Per method: novel accuracy after each session, then facts, stale answers, recovery
    and regret at the end."""
    drift = result["task"]["drift_session"]
    sessions = len(next(iter(result["sessions"].values()))["novel"]["mean"])
    head = ["method"] + [f"{s + 1}{'*' if s == drift else ''}" for s in range(sessions)]
    lines = text.head([*head, "facts (end)", "stale (end)", "recovers in", "regret"])
    for method, rows_ in result["sessions"].items():
        novel = rows_["novel"]
        cells = [
            _accuracy(*v) for v in zip(novel["mean"], novel["low"], novel["high"], strict=True)
        ]
        recover = result["summary"][method]["recover"].get("sessions")
        cells += [
            f"{100 * rows_['facts']['mean'][-1]:.1f}",
            f"{100 * rows_['stale']['mean'][-1]:.1f}",
            "—" if recover is None else f"{recover} session(s)",
            f"{rows_['regret']['mean'][-1]:.1f}",
        ]
        lines.append(text.row([method, *cells]))
    return lines


def _regret(row: dict) -> str:
    """The errors the companion saves against the equal-bytes baseline of least regret, with
    its interval (paired over agents)."""
    saved = row["regret_saved"][row["regret_best"]]
    return (
        f"{saved['mean']:+.1f} [{saved['low']:+.1f}, {saved['high']:+.1f}] ({row['regret_best']})"
    )


def variants_table(result: dict) -> list[str]:
    """The variants' table of a companion study: per variant, each method's novel accuracy
    averaged over the sessions, the companion's advantage over `knn` and over the best
    equal-bytes baseline, the regret it saves against the baseline of least regret, and the
    share of the standard agents' advantage that survives; with a study that records which
    families training saw (``trained``), that, and the regret the companion saves against
    the baseline of least regret; nothing for a study without variants."""
    variants = result.get("variants")
    if not variants:
        return []
    methods = list(next(iter(variants.values()))["novel"])
    families = _has_families(result)
    head = ["variant", "k", "rule", *(["in training"] if families else []), *methods]
    head += ["companion − knn", "companion − best (which)"]
    head += ["regret: best − companion (which)"] if families else []
    lines = text.head([*head, "survives vs knn", "survives vs best"])
    for name, row in variants.items():
        best = row["best"]
        cells = [name, str(row["task"]["features_per_input"]), row["task"]["rule_kind"]]
        cells += [{True: "yes", False: "held out"}[row["trained"]]] if families else []
        cells += [_accuracy(v["mean"], v["low"], v["high"]) for v in row["novel"].values()]
        cells += [_points(row["advantage"]["knn"]), f"{_points(row['advantage'][best])} ({best})"]
        cells += [_regret(row)] if families else []
        survives = row.get("survives")
        cells += (
            ["(reference)", "(reference)"]
            if survives is None
            else [_points(survives["knn"], True), _points(survives[best], True)]
        )
        lines.append(text.row(cells))
    return lines


def _has_families(result: dict) -> bool:
    return any("trained" in row for row in result.get("variants", {}).values())


def study(record: dict, result: dict) -> str:
    """One companion row's tables and sentences."""
    parts = text.parts("companion")
    size, latency = result["bytes"], result["latency"]
    each = size.get("methods", {})
    listed = ", ".join(f"`{m}` {b}" for m, b in each.items() if m != "companion")
    raw = "raw_capacity" in size
    sizes = text.fill(
        parts["bytes"],
        companion=size["companion"],
        knn=size["knn_capacity"],
        raw=parts["raw"].substitute(events=size["raw_capacity"]) if raw else "",
        listed=parts["listed"].substitute(listed=listed) if listed else "",
        agents=latency["agents"],
        observe=f"{1e3 * latency['observe_s']:.0f}",
        recall=f"{1e3 * latency['recall_s']:.0f}",
    )
    tuning = ""
    if "tuning" in result:
        tuned = result["tuning"]
        tried = ", ".join(f"{float(lr):g}: {e:.1f}" for lr, e in tuned["errors"].items())
        tuning = text.fill(
            parts["tuning"], lr=f"{tuned['lr']:g}", agents=tuned["agents"], tried=tried
        )
    variants = variants_table(result)
    return text.fill(
        parts["study"],
        table=sessions_table(result),
        bytes=sizes,
        tuning=tuning,
        variants=text.fill(parts["variants"], table=variants) if variants else "",
        families=parts["families"].substitute() if _has_families(result) else "",
        commands=text.commands(record),
    )


def render(runs: Runs) -> str:
    studies = []
    for row_id, (record, _) in runs.rows("companion/").items():
        result = runs.json(row_id, RESULT)
        failed = text.failed(record, result, RESULT)
        studies.append(f"{row_id}: {failed}\n" if failed else study(record, result))
    return text.fill(text.parts("companion")["section"], studies="\n".join(studies))


SECTIONS = (Section("companion", text.title("companion"), render),)
