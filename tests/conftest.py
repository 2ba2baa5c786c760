"""Strict JAX settings for every test, and what the test files share: the compilation cache
and the runner of Python processes (fixtures); importable helpers are in ``tests/helpers``.

Float64 is available and implicit rank promotion raises. The tests' programs are tiny, so their
time is mostly XLA's compile time: the CPU backend's code generation runs unoptimised, without
LLVM's expensive passes, and with the loop emitters rather than the MLIR fusion emitters (which
take about three times as long on the tests' programs); the HLO passes still run. This holds in
every test and in the processes the tests start, whose ``PYTHONPATH`` also holds ``tests/`` (a
config file a test writes imports ``helpers``). Benchmarks and runs keep the default. Nothing
comes from a hub: Hugging Face datasets and hub run offline (the harness's tasks in
``tests/run/harness_tasks`` read local files)."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

TESTS = ROOT / "tests"

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",
    ]
).strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
from jax.experimental.compilation_cache import compilation_cache as jax_cache  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache shared by the runs of the test session on this worker
    (the tests train the same tiny programs many times; each compiles once), from this fixture's
    first use to the end of the module: in process, and in the processes started meanwhile (its
    variables set in ``os.environ``). Yields those variables; JAX's settings and the
    environment are restored afterwards."""
    options = {
        "jax_compilation_cache_dir": str(tmp_path_factory.getbasetemp() / "jax_cache"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    variables = {name.upper(): str(value) for name, value in options.items()}
    before = {name: getattr(jax.config, name) for name in options}
    jax_cache.reset_cache()
    for name, value in options.items():
        jax.config.update(name, value)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in variables.items():
            patch.setenv(name, value)
        yield variables
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


class Processes:
    """Python processes started as a user starts the entry points: ``python ARGV...`` (a
    script and its flags, ``-m module ...`` or ``-c code ...``) from the repository root, in
    this process's environment (``env``: variables added to it); stdout and stderr captured
    as text (``text=False``: bytes). A process that runs past ``timeout`` seconds, or ends
    with another exit status than ``status`` (when given), fails the test with the tail of
    its stderr."""

    def start(self, *argv, cwd=ROOT, env=None, **options) -> subprocess.Popen:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        env = None if env is None else {**os.environ, **env}
        return subprocess.Popen(
            [sys.executable, *map(str, argv)], cwd=cwd, env=env, **pipes | options
        )

    def finish(self, process, *, timeout=300, status=None) -> subprocess.CompletedProcess:
        """Wait for ``process``: its :class:`subprocess.CompletedProcess`."""
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"{process.args} ran past {timeout} s; stderr ends:\n{_tail(err)}")
        if status is not None and process.returncode != status:
            pytest.fail(
                f"{process.args} exited {process.returncode}, not {status}; stderr ends:\n"
                f"{_tail(err)}"
            )
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    @staticmethod
    def stderr_lines(done: subprocess.CompletedProcess) -> list[str]:
        """The non-empty lines of a completed process's stderr."""
        return [line for line in done.stderr.splitlines() if line]

    def run(self, *argv, cwd=ROOT, env=None, timeout=300, status=None, **options):
        """:meth:`start` then :meth:`finish`: the completed process."""
        process = self.start(*argv, cwd=cwd, env=env, **options)
        return self.finish(process, timeout=timeout, status=status)


def _tail(err) -> str:
    text = err.decode(errors="replace") if isinstance(err, bytes) else err or ""
    return text[-3000:]


@pytest.fixture(scope="session")
def processes() -> Processes:
    """The runner of Python processes (:class:`Processes`)."""
    return Processes()
