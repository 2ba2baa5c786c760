"""Functional plasticity of a run: ``python experiments/plasticity.py --workdir DIR``.

Restores the latest checkpoint of ``--workdir`` (the model its ``config.json`` builds), deploys
it on held-out agents (the task with ``--agent_seed`` added to its seed) with its slow weights
frozen, and measures what its fast levels' online updates do (``--protocols``, default all
that apply): the alignment of every update with the future loss, the continual-learning
matrix over the task ids (or windows of the stream), the regret utility of a session on one
task for another (fast state and slow weights) and the plasticity capacity over a long
stream. Prints the model's budget first (slow parameters, bytes carried per agent:
``nested.plasticity.budget``). Writes ``DIR/plasticity.json`` and ``DIR/plasticity_*.png``.
Everything is in ``nested.plasticity.report``.
"""

import json
import sys
from pathlib import Path

from absl import flags
from tqdm import tqdm

from nested import files
from nested.plasticity import budget, report
from nested.run import cli, loading

_DEFAULTS = report.Settings()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run to measure.")
_PROTOCOLS = flags.DEFINE_list(
    "protocols", None, f"Which of {list(report.PROTOCOLS)}; default: all that apply."
)
_TASKS = flags.DEFINE_list("tasks", None, "Task ids in phase order; default: all.")
_BATCH = flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Streams side by side.")
_AGENT_SEED = flags.DEFINE_integer(
    "agent_seed", _DEFAULTS.agent_seed, "Added to the task's seed: held-out agents."
)
_SESSIONS = flags.DEFINE_integer("sessions", _DEFAULTS.sessions, "Sessions per phase.")
_LENGTH = flags.DEFINE_integer(
    "session_length", _DEFAULTS.session_length, "Batches (sequences) per session."
)
_EVAL = flags.DEFINE_integer("eval_batches", _DEFAULTS.eval_batches, "Held-out batches per score.")
_WINDOWS = flags.DEFINE_integer("windows", _DEFAULTS.windows, "Windows of a stream without ids.")
_WINDOW_BATCHES = flags.DEFINE_integer(
    "window_batches", _DEFAULTS.window_batches, "Batches per window."
)
_CYCLES = flags.DEFINE_integer("cycles", _DEFAULTS.cycles, "Passes over the tasks (capacity).")
_OUTER = flags.DEFINE_integer("outer_steps", _DEFAULTS.outer_steps, "Slow regret: outer steps.")
_LR = flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Slow regret: Adam step.")
_RESET = flags.DEFINE_list(
    "reset_levels", [], "Transfer: levels restarted after each phase (where retention lives)."
)
_OUT = flags.DEFINE_string("out", None, "The JSON to write; default: DIR/plasticity.json.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    with cli.user_errors():
        try:
            tasks = None if _TASKS.value is None else tuple(int(t) for t in _TASKS.value)
        except ValueError:
            sys.exit(f"error: --tasks={','.join(_TASKS.value)}: task ids are integers")
        settings = report.Settings(
            protocols=tuple(_PROTOCOLS.value or report.PROTOCOLS),
            batch_size=_BATCH.value,
            agent_seed=_AGENT_SEED.value,
            tasks=tasks,
            sessions=_SESSIONS.value,
            session_length=_LENGTH.value,
            eval_batches=_EVAL.value,
            windows=_WINDOWS.value,
            window_batches=_WINDOW_BATCHES.value,
            cycles=_CYCLES.value,
            outer_steps=_OUTER.value,
            learning_rate=_LR.value,
            reset_levels=tuple(_RESET.value),
        )
        trained = loading.load_trained(_WORKDIR.value)
        spent = budget.budget(trained.program)
        print(f"budget: {spent.describe()}", flush=True)
        print(
            f"measuring {', '.join(settings.protocols)} on {_WORKDIR.value} (step "
            f"{trained.step}); the first measurement compiles the model",
            flush=True,
        )
        with tqdm(unit="measurement", file=sys.stderr, disable=None) as bar:
            try:
                result = report.run(
                    trained, settings, explicit=_PROTOCOLS.value is not None, progress=bar.update
                )
            except report.PlasticityError as error:
                sys.exit(f"error: {' '.join(str(error).split())}")
        result["budget"] = spent._asdict()
        out = Path(_OUT.value or Path(_WORKDIR.value) / "plasticity.json")
        files.write_atomic(out, json.dumps(result, indent=1) + "\n")
        plots = report.plot(result, out.parent)
        for protocol, why in result["skipped"].items():
            print(f"skipped {protocol}: {why}")
        print(report.format_summary(result))
        print(f"results: {out}")
        for path in plots:
            print(f"plot: {path}")


if __name__ == "__main__":
    cli.run(main)
