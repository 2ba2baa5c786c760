"""What ``plasticity.every`` costs a training run: the alignment measurement against a step.

    .venv/bin/python benchmarks/plasticity_cost.py [--configs continual.py mqar.py:ttt_linear]
        [--runs 5] [--every 1 2 10 50]

For each config (the shipped settings): one jitted training step (``Program.train_step``) and
one alignment measurement of the same batch (:func:`nested.run.pieces.make_alignment_fn` on
``plasticity.rows`` of its rows: the probed levels run the generic inner loop with the update
hook, one backward pass, then the per-level summary on the host), each the median of
``--runs`` calls after a compiling one, measured alternately in one process. The overhead a
run pays with ``plasticity.every = N`` is ``measurement / (N x step)``. Prints a markdown
table and writes it into this benchmark's section of benchmarks/README.md (``--no-write``:
printed only).
"""

from __future__ import annotations

import argparse

import numpy as np
import report
import timing

from nested.run import config as nc
from nested.run import pieces


def measure(spec: str, runs: int) -> dict:
    exp = nc.build(nc.load(f"configs/{spec}"))
    state = pieces.init_state(exp)
    batch = pieces.stacked_batches(exp.task, 0, 1, exp.config.train.batch_size)
    one = {k: v[0] for k, v in batch.items()}
    step = pieces.make_train_fn(exp.program)
    rows = exp.plasticity["rows"]
    figures = pieces.make_alignment_fn(exp.program, "through_scan", rows)
    step_fn = lambda: step(state, batch)[1]
    align_fn = lambda: figures(state, one)
    # In turns, so both see the same machine load.
    step_s, align_s = zip(*timing.paired_seconds((step_fn, align_fn), (), runs), strict=True)
    return {"step": float(np.median(step_s)), "alignment": float(np.median(align_s))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["continual.py", "mqar.py:ttt_linear"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--every", nargs="+", type=int, default=[1, 2, 10, 50])
    report.add_flag(parser, "plasticity_cost")
    args = parser.parse_args()
    out = report.Report(args.section)
    head = ["config", "step ms", "alignment ms", "alignment / step"]
    head += [f"overhead at every={n}" for n in args.every]
    out.print("| " + " | ".join(head) + " |")
    out.print("|" + "---|" * len(head))
    for spec in args.configs:
        m = measure(spec, args.runs)
        ratio = m["alignment"] / m["step"]
        cells = [spec, f"{1e3 * m['step']:.1f}", f"{1e3 * m['alignment']:.1f}", f"{ratio:.2f}x"]
        cells += [f"{100 * ratio / n:.1f}%" for n in args.every]
        out.print("| " + " | ".join(cells) + " |")
    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
