"""python benchmarks/results.py --out RESULTS.md

The results table: every row is one training run of a shipped config, launched exactly as a
user launches it (``python experiments/train.py --config ... --workdir ...``, a subprocess),
its wall time measured around the subprocess and its final held-out metrics read from the
workdir's ``metrics.jsonl``. Each section of the page is a module of ``benchmarks/sections``
that declares its rows and renders its tables, its prose a markdown template beside it
(``sections/<module>.md``); ``sections/rows.py`` runs the rows. Sections:

* MQAR test accuracy per test setting and their mean, for every rule of
  ``nested.recipes.RULES`` at two model widths (``--widths``), and the Hope variant;
* bits per character on held-out files for the character-LM configs;
* needle-in-a-haystack accuracy by context length;
* the continual stream: accuracy from the context and from memory, and forgetting;
* functional plasticity: rows trained, then measured by ``experiments/plasticity.py`` (its
  ``plasticity.json``): the continual-learning matrix, forgetting and regret utility of three
  models of equal slow-parameter count on agents of the continual stream, and the alignment
  of TTT-style levels at initialisation and after training;
* multi-frequency memory and forgetting, on four streams;
* the agent companion's study (``experiments/companion_study.py``);
* language modelling on real text (``experiments/eval_lm.py``).

A row that fails shows its error; nothing is dropped. A finished row is not rerun unless
``--rerun`` (its workdir keeps ``row.json``: command, wall time, exit status), so an
interrupted table resumes. ``--only REGEX`` runs the rows whose id matches (``mqar/.*_d64``);
the table always holds every row that has a result. ``--sections`` rewrites only some sections
of the page. Overrides a row needs to fit a CPU budget are part of its command and listed
next to it.
"""

from __future__ import annotations

import re
from pathlib import Path

from absl import app, flags
from sections import lm, page, rows

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "RESULTS.md", "Markdown file written (relative to the repository).")
flags.DEFINE_string("workdir", "runs/results", "Root of the rows' workdirs.")
flags.DEFINE_string("only", None, "Run only the rows whose id matches this regex.")
flags.DEFINE_list("widths", ["64", "128"], "MQAR model widths (model.dim).")
flags.DEFINE_boolean("rerun", False, "Rerun rows that already have a result.")
flags.DEFINE_boolean("dry_run", False, "Print the commands, run nothing.")
flags.DEFINE_integer("timeout", 3600, "Seconds before a row is stopped (and reported failed).")
flags.DEFINE_list(
    "sections",
    None,
    f"Rewrite only these sections of --out ({', '.join(page.SECTIONS)}), keeping the rest of "
    "the page.",
)


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.sections or ()) - set(page.SECTIONS))
    if unknown:
        raise app.UsageError(f"--sections: no section {unknown}; sections: {list(page.SECTIONS)}")
    workdir = Path(FLAGS.workdir)
    table = page.rows([int(w) for w in FLAGS.widths])
    chosen = [r for r in table if FLAGS.only is None or re.search(FLAGS.only, r.id)]
    if not FLAGS.dry_run and any(r.id.startswith("lm/") for r in chosen):
        lm.prepare_corpus()
    rows.run_rows(chosen, workdir, FLAGS.rerun, FLAGS.dry_run, FLAGS.timeout)
    if FLAGS.dry_run:
        return
    out = rows.ROOT / FLAGS.out
    runs = rows.Runs(rows.load(table, rows.ROOT / workdir), rows.ROOT / workdir, out.parent)
    previous = out.read_text() if out.exists() else ""
    if FLAGS.sections:
        out.write_text(page.replace(previous, runs, FLAGS.sections))
        print(f"wrote the sections {FLAGS.sections} of {out}")
    else:
        out.write_text(page.render(runs, previous))
        print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
