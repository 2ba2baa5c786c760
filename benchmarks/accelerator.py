"""One script for a machine with an accelerator: the kernels checked there, then the CPU
benchmarks' tables measured there.

    python benchmarks/accelerator.py            # GPU or TPU: about 15 minutes
    python benchmarks/accelerator.py --quick --no-write   # a check of the script itself (CPU)

Steps, each a subprocess (the first failure stops the script with its exit status):

1. correctness on the device: the kernel and op equivalence tests
   (``tests/core/test_kernels.py``, ``tests/ops/test_ops_linear.py``,
   ``tests/ops/test_ops_neural.py``: values and gradients against the generic path and
   per-token references, float64 where the device has it);
2. ``ops_throughput.py`` (linear ops), ``neural_throughput.py`` (TTT, Titans, ATLAS) and
   ``scaling.py`` (one training step of a 2-layer LM: tokens/s and temporary memory as T
   grows; float32 and bfloat16 compute) at accelerator sizes, each writing its tables, with
   the device's peak memory, into its own ``accelerator_*`` section of
   ``benchmarks/README.md``;
3. ``lm_throughput.py`` at the ``125m`` size (bfloat16 compute, the configs' ``train.dtype``;
   MFU against the device's nominal dense bf16 peak), the Transformer++ beside the neural
   memories, a large-chunk Titans among them, 8 sequences of 2048-4096 tokens a step, then
   ``--profile`` of Hope's step (``accelerator_lm_throughput``, ``accelerator_lm_profile``).

Install the accelerator wheels first (docs/meshes.md: ``pip install -e '.[cuda,test]'``).
"""

import argparse
import subprocess
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
FULL = {
    "ops_throughput": ["--T", "4096", "16384"],
    "neural_throughput": ["--T", "4096", "--muon-T", "256"],
    "scaling": ["--lengths", "4096", "16384", "65536", "--batch", "4", "--no-devices"],
    "scaling_bf16": [
        "--lengths",
        "4096",
        "16384",
        "65536",
        "--batch",
        "4",
        "--no-devices",
        "--dtype",
        "bfloat16",
    ],
    "lm_throughput": [
        "--models=transformer,gated_deltanet,titans,titans-c512,ttt_mlp,atlas,hope",
        "--size=125m",
        "--batch_size=8",
    ],
    "lm_profile": ["--profile", "--models=hope", "--size=125m", "--batch_size=8", "--steps=2"],
}
QUICK = {
    "ops_throughput": ["--T", "64", "--runs", "1", "--ops", "delta_rule"],
    "neural_throughput": ["--T", "64", "--runs", "1", "--only", "Titans C=16"],
    "scaling": ["--lengths", "64", "--rules", "delta", "--runs", "1", "--no-devices"],
    "scaling_bf16": [
        "--lengths",
        "64",
        "--rules",
        "delta",
        "--runs",
        "1",
        "--no-devices",
        "--dtype",
        "bfloat16",
    ],
    "lm_throughput": ["--models=transformer,titans-c64", "--size=tiny", "--steps=1"],
    "lm_profile": ["--profile", "--models=titans", "--size=tiny", "--steps=1"],
}
# The absl scripts spell the write flags their own way (and name their own sections).
ABSL = {"lm_throughput", "lm_profile"}
TESTS = [
    "tests/core/test_kernels.py",
    "tests/ops/test_ops_linear.py",
    "tests/ops/test_ops_neural.py",
]


def run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode:
        sys.exit(done.returncode)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    parser.add_argument("--no-tests", action="store_true", help="skip the correctness step")
    args = parser.parse_args()
    print(f"devices: {jax.devices()}", flush=True)
    if not args.no_tests:
        tests = TESTS[:1] if args.quick else TESTS
        run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", *tests])
    for name, options in (QUICK if args.quick else FULL).items():
        write = ["--no-write"] if args.no_write else ["--section", f"accelerator_{name}"]
        if name in ABSL:
            write = ["--nowrite"] if args.no_write else [f"--section=accelerator_{name}"]
        script = "lm_throughput" if name in ABSL else name.removesuffix("_bf16")
        run([sys.executable, f"benchmarks/{script}.py", *options, *write])


if __name__ == "__main__":
    main()
