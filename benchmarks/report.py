"""A benchmark's printed tables, written into its section of ``benchmarks/README.md``.

A benchmark creates a :class:`Report` when it starts (which measures and prints this machine's
matmul rate), prints its tables through :meth:`Report.print`, and ends with :meth:`Report.write`
unless run with ``--no-write`` (:func:`add_flag`). The write replaces the text between the
benchmark's two marker comments, ``<!-- begin NAME -->`` and ``<!-- end NAME -->``, with the
command line, the date, the duration, the machine and the tables of this run; the rest of the
page is left as it is. Figures are the latest run's only: a run replaces them all.
"""

import argparse
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import jax
import jaxlib
import timing

README = Path(__file__).with_name("README.md")
ROOT = README.parents[1]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else its architecture."""
    if os.path.exists("/proc/cpuinfo"):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> str:
    """This machine in words: CPU model, cores, JAX and jaxlib versions, JAX's device."""
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} / jaxlib "
        f"{jaxlib.__version__} on {jax.devices()[0].device_kind}"
    )


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def add_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """``--no-write``: print the tables only; ``--section``: the README section to write
    (default ``name``; ``benchmarks/accelerator.py`` writes its runs under other names)."""
    parser.add_argument(
        "--no-write", action="store_true", help=f"print only; do not write {README.name}"
    )
    parser.add_argument("--section", default=name, help=f"the {README.name} section to write")


def peak_memory() -> str | None:
    """The device's peak memory in use so far, where JAX reports it (GPU, TPU; not the CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    limit = stats.get("bytes_limit")
    total = f" of {limit / 2**30:.1f}" if limit else ""
    return f"{stats['peak_bytes_in_use'] / 2**30:.2f} GiB{total}"


class Report:
    """The lines a benchmark prints, kept for its section ``name`` of the README."""

    def __init__(self, name: str):
        self.name, self.lines, self.start = name, [], time.perf_counter()
        self.gflops = timing.matmul_gflops()  # this machine's float32 matmul rate, this run
        self.machine = (
            f"{machine()}; float32 2048x2048 matmul {self.gflops:.0f} GFLOP/s in this run"
        )
        print(self.machine + "\n", flush=True)

    def print(self, text: str = "") -> None:
        """Print ``text`` now (rows show as they are measured) and keep it for the README."""
        print(text, flush=True)
        self.lines += text.split("\n")

    def write(self) -> None:
        """Replace this benchmark's section of the README (appended if it has none)."""
        seconds = time.perf_counter() - self.start
        script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
        command = shlex.join(["python", script, *sys.argv[1:]])
        begin, end = f"<!-- begin {self.name} -->", f"<!-- end {self.name} -->"
        section = "\n".join(
            [
                begin,
                f"Latest run: `{command}`, {utc_now()}, {seconds:.0f} s.",
                f"Machine: {self.machine}.",
                *([f"Peak device memory: {peak}."] if (peak := peak_memory()) else []),
                "",
                *self.lines,
                end,
            ]
        )
        text = README.read_text()
        marked = re.compile(f"{re.escape(begin)}.*?{re.escape(end)}", re.S)
        if marked.search(text):
            text = marked.sub(lambda _: section, text)
        else:
            text = f"{text.rstrip()}\n\n{section}\n"
        README.write_text(text)
        print(f"wrote the tables into {os.path.relpath(README)}")
