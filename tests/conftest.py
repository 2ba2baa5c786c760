"""Strict JAX settings for every test: float64 available, no implicit rank promotion.

The tests' programs are tiny, so their time is mostly XLA's compile time: the CPU backend's code
generation runs unoptimised, without LLVM's expensive passes, and with the loop emitters rather
than the MLIR fusion emitters (which take about three times as long on the tests' programs); the
HLO passes still run. This holds in every test and in the subprocesses the tests start.
Benchmarks and runs keep the default. Nothing comes from a hub: Hugging Face datasets and hub
run offline (the harness's tasks in tests/harness_tasks read local files)."""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",
    ]
).strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
