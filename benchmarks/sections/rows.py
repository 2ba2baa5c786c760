"""The rows of RESULTS.md and how they run: every row is one training run of a shipped config,
launched exactly as a user launches it (``python experiments/train.py --config ...
--workdir ...``, a subprocess), then, for some rows, a script measuring the trained workdir
(``after``). A finished row keeps ``row.json`` in its workdir (command, wall time, exit
status), so an interrupted table resumes; the sections read the rows back through :func:`load`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from nested.run import metrics

ROOT = Path(__file__).resolve().parents[2]
ROW_FILE = "row.json"


class Row(NamedTuple):
    """One run: ``id`` (also its workdir under ``--workdir``), the config spec, the overrides
    (``key -> value``, passed as ``--config.key=value``), and why they are there;
    ``after``: a script and its flags run on the trained workdir after training
    (``experiments/plasticity.py``, ``experiments/companion_study.py``; None: none)."""

    id: str
    config: str
    overrides: tuple[tuple[str, object], ...] = ()
    note: str = ""
    after: tuple[str, ...] | None = None


class Runs(NamedTuple):
    """What a section renders from: ``results`` ``{row id: (row.json, metrics records)}`` of
    the rows that have a result, in row order; ``workdir`` the root of the rows' workdirs;
    ``page`` the directory of the page written (figures go under it, linked relative to it)."""

    results: dict[str, tuple[dict, list[dict]]]
    workdir: Path
    page: Path

    def rows(self, prefix: str) -> dict[str, tuple[dict, list[dict]]]:
        """The results of the rows whose id starts with ``prefix`` (``"mqar/"``)."""
        return {k: v for k, v in self.results.items() if k.startswith(prefix)}

    def json(self, row_id: str, name: str) -> dict | None:
        """The row's measurement file ``name`` (``plasticity.json``), None where absent."""
        path = self.workdir / row_id / name
        return json.loads(path.read_text()) if path.exists() else None


class Section(NamedTuple):
    """A section of the page: ``name`` (for ``--sections``), ``title`` (its ``## `` heading)
    and ``render`` (the section's markdown from :class:`Runs`; empty: no section)."""

    name: str
    title: str
    render: Callable[[Runs], str]


def command(row: Row, workdir: Path) -> list[str]:
    flags_ = [f"--config.{k}={v}" for k, v in row.overrides]
    return [
        "python",
        "experiments/train.py",
        f"--config={row.config}",
        f"--workdir={workdir}",
        *flags_,
    ]


def after_command(row: Row, workdir: Path) -> list[str]:
    script, *flags_ = row.after
    return ["python", script, f"--workdir={workdir}", *flags_]


def _run(argv: list[str], workdir: Path, name: str, timeout: int) -> dict:
    """Run ``argv`` (``python ...``) from the repository, its output in ``workdir/<name>.*``:
    ``{"command", "wall_s", "status", "error"}``."""
    start = time.perf_counter()
    out_path, err_path = workdir / f"{name}.stdout.txt", workdir / f"{name}.stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        try:
            status = subprocess.run(
                [sys.executable, *argv[1:]], cwd=ROOT, stdout=out, stderr=err, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    wall = time.perf_counter() - start
    error = None
    if status != 0:
        lines = err_path.read_text().strip().splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        error = (errors or lines or [f"exit status {status}"])[-1][:300]
        if status == "timeout":
            error = f"stopped after {timeout} s"
    return {"command": " ".join(argv), "wall_s": wall, "status": status, "error": error}


def run_row(row: Row, workdir: Path, timeout: int) -> dict:
    """Train ``row`` in a fresh ``workdir`` (relative to the repository, as in the command),
    then run its ``after`` script if it has one; writes ``row.json``: command, wall time,
    exit status (and ``after``: the same of that script)."""
    relative = workdir
    workdir = ROOT / workdir
    if workdir.exists():  # a fresh run: the table's numbers come from one uninterrupted run
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    record = _run(command(row, relative), workdir, "train", timeout)
    if row.after is not None and record["status"] == 0:
        record["after"] = _run(after_command(row, relative), workdir, "after", timeout)
    (workdir / ROW_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_rows(chosen: list[Row], workdir: Path, rerun: bool, dry_run: bool, timeout: int) -> None:
    """Run the ``chosen`` rows in order, each in ``workdir/<id>`` (relative to the
    repository); a row with a ``row.json`` is kept unless ``rerun``; ``dry_run`` prints the
    training commands and runs nothing."""
    for i, row in enumerate(chosen, 1):
        directory = workdir / row.id
        if dry_run:
            print(" ".join(command(row, directory)))
            continue
        done = (ROOT / directory / ROW_FILE).exists()
        if done and not rerun:
            print(f"[{i}/{len(chosen)}] {row.id}: kept (--rerun to run again)", flush=True)
            continue
        print(f"[{i}/{len(chosen)}] {row.id}: {' '.join(command(row, directory))}", flush=True)
        record = run_row(row, directory, timeout)
        print(f"    {record['wall_s']:.0f} s, exit status {record['status']}", flush=True)
        if record["error"]:
            print(f"    {record['error']}", flush=True)


def load(rows: Iterable[Row], workdir: Path) -> dict[str, tuple[dict, list[dict]]]:
    """``{row id: (row.json, metrics records)}`` of the rows with a ``row.json`` under
    ``workdir`` (absolute), in the order of ``rows``."""
    out = {}
    for row in rows:
        path = workdir / row.id / ROW_FILE
        if path.exists():
            out[row.id] = (json.loads(path.read_text()), metrics.read(workdir / row.id))
    return out
