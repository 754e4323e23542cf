import os
import sys
import threading

# XLA:CPU sizes its worker pool from NPROC (else the core count). The Mosaic GPU interpreter's
# warpgroup threads block in barrier callbacks that can hold those workers; with 2 (CI's cores) a
# warpgroup of a prefill grid never started in 3 of 4 runs (intra_overlap; 4 of 5 with ping-pong's
# turns), with 8 it ran every time.
os.environ.setdefault("NPROC", "8")

import jax  # noqa: E402  (after NPROC: the CPU client reads it when created)
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests share oracles.py and the contract bases


def _serialize_interpreter_compiles():
  """The Mosaic GPU interpreter (jax 0.11-0.12) compiles each simulated warpgroup's program in
  its own thread, all at once. Late in the CI suite's one process XLA:CPU crashed compiling them
  (2026-12-01, TestPallasMosaicPrefillItemVariants, which passes alone): a segfault with the
  compiles concurrent, then an abort with them serialized; the suite passed with them serialized
  and the caches cleared between files (the fixture below), the configuration kept. The programs
  still run concurrently, as their barriers need. A jax without that private helper is left
  alone."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return
  if not (hasattr(thread_map, "_run_jaxpr") and hasattr(thread_map, "_run")):
    return
  lock = threading.Lock()

  def run_jaxpr(jaxpr, consts, *args):
    with lock:
      compiled = jax.jit(thread_map._run, static_argnums=(0,)).trace(jaxpr, consts, *args)
      compiled = compiled.lower().compile()
    compiled(consts, *args)

  thread_map._run_jaxpr = run_jaxpr


_serialize_interpreter_compiles()


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  # Each test file compiles hundreds of programs (the Mosaic interpreter's among them), which the
  # CI suite's one process kept; XLA:CPU crashed mid-compile late in the run (twice, at a test
  # that passes alone; the process was at ~1.7 GB, so not memory) until they were dropped here.
  yield
  jax.clear_caches()

