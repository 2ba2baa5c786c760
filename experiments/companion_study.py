"""The companion study of a run: ``python experiments/companion_study.py --workdir DIR``.

Deploys the trained companion run of ``--workdir`` (``configs/companion.py``) on held-out
agents (its task with ``--agent_seed`` added to the seed) and compares its learning memory
with retrieval memories (embedding keys and raw events) and online learners of the task's own
hypothesis class (logistic regression, its learning rate tuned on training agents, and vote
counts), all at equal bytes, an unbounded store, no memory and a per-agent offline oracle,
session by session; then on held-out agents whose rule differs in kind (``--variants``: 2 or 4
features per input, one feature deciding alone, answers of feature pairs). A run of the text
task (``configs/companion.py:text``) is studied on its sentences: its "text task" line holds the
companion against retrieval by the frozen model's embeddings and logistic regression on the
bag of tokens. Writes
``DIR/companion_study.json`` and prints the headline figures. Everything is in
``studies.companion`` (``experiments/studies/companion``).
"""

import json
import sys
from pathlib import Path

from absl import flags
from tqdm import tqdm

from nested import files
from nested.data import CompanionTask
from nested.run import cli, loading
from studies.companion import study

_DEFAULTS = study.Settings()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the trained companion run.")
_AGENTS = flags.DEFINE_integer("agents", _DEFAULTS.agents, "Held-out agents.")
_AGENT_SEED = flags.DEFINE_integer("agent_seed", _DEFAULTS.agent_seed, "Added to the seed.")
_QUERIES = flags.DEFINE_integer("queries", _DEFAULTS.queries, "Novel queries per session.")
_LATENCY = flags.DEFINE_integer(
    "latency_agents", _DEFAULTS.latency_agents, "Agents per call in the latency measurement."
)
_VARIANTS = flags.DEFINE_list(
    "variants",
    list(_DEFAULTS.variants),
    "Held-out agents of other rules: some of k2, k4, one_feature, pairs (empty: none).",
)
_TUNE_AGENTS = flags.DEFINE_integer(
    "tune_agents", _DEFAULTS.tune_agents, "Training agents the logistic learner's lr is tuned on."
)
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    known = [v for v in study.VARIANTS if v != "standard"]
    unknown = [v for v in _VARIANTS.value if v not in known]
    if unknown:
        sys.exit(f"error: --variants={','.join(_VARIANTS.value)}: unknown {unknown}; use {known}")
    with cli.user_errors():
        trained = loading.load_trained(_WORKDIR.value)
        if not isinstance(trained.experiment.task, CompanionTask):
            sys.exit(
                f"error: --workdir={_WORKDIR.value}: the run's task is "
                f"{trained.experiment.task.name!r}; the study needs a companion run "
                f"(configs/companion.py)"
            )
        settings = study.Settings(
            agents=_AGENTS.value,
            agent_seed=_AGENT_SEED.value,
            queries=_QUERIES.value,
            latency_agents=_LATENCY.value,
            tune_agents=_TUNE_AGENTS.value,
            variants=tuple(_VARIANTS.value),
        )
        task = trained.experiment.task
        total = (1 + len(settings.variants)) * task.sessions * (task.session_length + 1)
        with tqdm(total=total, unit="step", file=sys.stderr, disable=None) as bar:
            result = study.run(trained, settings, progress=bar.update)
        out = Path(_WORKDIR.value) / "companion_study.json"
        files.write_atomic(out, json.dumps(result, indent=1) + "\n")
        print(study.format_summary(result))
        print(f"results: {out}")


if __name__ == "__main__":
    cli.run(main)
