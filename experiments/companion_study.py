"""The companion study of a run: ``python experiments/companion_study.py --workdir DIR``.

Deploys the trained companion run of ``--workdir`` (``configs/companion.py``) on held-out
agents (its task with ``--agent_seed`` added to the seed) and compares its learning memory
with retrieval memories at equal bytes, an unbounded store, no memory and a per-agent offline
oracle, session by session; writes ``DIR/companion_study.json`` and prints the headline
figures. Everything is in ``nested.companion.study``.
"""

import json
import sys
from pathlib import Path

from absl import flags
from tqdm import tqdm

from nested.companion import study
from nested.data import CompanionTask
from nested.run import cli, loading, train

_DEFAULTS = study.Settings()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the trained companion run.")
_AGENTS = flags.DEFINE_integer("agents", _DEFAULTS.agents, "Held-out agents.")
_AGENT_SEED = flags.DEFINE_integer("agent_seed", _DEFAULTS.agent_seed, "Added to the seed.")
_QUERIES = flags.DEFINE_integer("queries", _DEFAULTS.queries, "Novel queries per session.")
_LATENCY = flags.DEFINE_integer(
    "latency_agents", _DEFAULTS.latency_agents, "Agents per call in the latency measurement."
)
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
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
        )
        sessions = trained.experiment.task.sessions
        total = sessions * (trained.experiment.task.session_length + 1)
        with tqdm(total=total, unit="step", file=sys.stderr, disable=None) as bar:
            result = study.run(trained, settings, progress=bar.update)
        out = Path(_WORKDIR.value) / "companion_study.json"
        train.write_atomic(out, json.dumps(result, indent=1) + "\n")
        print(study.format_summary(result))
        print(f"results: {out}")


if __name__ == "__main__":
    cli.run(main)
