import functools
import importlib.util
import os
import sys
import threading

import numpy as np
import pytest

# XLA:CPU sizes its worker pool from NPROC (else the core count). The Mosaic GPU interpreter's
# warpgroup threads block in barrier callbacks that can hold those workers; with 2 (CI's cores) a
# warpgroup of a prefill grid never started in 3 of 4 runs (intra_overlap; 4 of 5 with ping-pong's
# turns), with 8 it ran every time.
os.environ.setdefault("NPROC", "8")


def _cpu_only_jax() -> bool:
  return not any(importlib.util.find_spec(p) for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


# The suite compiles thousands of small distinct XLA:CPU programs (layers, references, the
# interpreter's warpgroups), so compiling, not running, paces it: LLVM at level 0 took the
# compile-bound files (generation, sharding, attention, model) from 317 to 197 s (-n 2,
# 2026-12-05), every test passing. XLA:CPU is not fast-math either way, so float semantics hold.
# Never with a GPU jax: the flag would reach the GPU's codegen too.
if _cpu_only_jax() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

# jax preallocates 75% of a GPU's memory a process, so two pytest-xdist workers on one card
# over-ask it: on an 80 GB H100 (2026-12-05) `-n 2` lost a worker at its first test and failed the
# rest; with an equal share each, both GPU files passed. A share set by the caller stands.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / _workers:.2f}")

import jax  # noqa: E402  (after NPROC, XLA_FLAGS and the memory share: read when clients start)

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


_INTERPRETER_MODULE = "jax._src.pallas.mosaic_gpu.interpret"


def _interpreter_callbacks_take_host_values():
  """The Mosaic GPU interpreter (jax 0.11-0.12) runs every load, store, barrier and wgmma of the
  simulated kernel as an `io_callback`, and `io_callback_impl` first puts each of the callback's
  arguments on the CPU device as a jax array: ~12 `device_put`s a callback, ~85% of a kernel
  test's time (cProfile, 2026-12-05). The interpreter's callbacks read those arguments as Python
  ints (indices, keys, clocks) or copy them into its numpy buffers, so here they get the host
  values XLA:CPU hands over: integer scalars as ints (what its `_to_int` takes), arrays as numpy.
  Only callbacks defined in the interpreter's modules; every other `io_callback` keeps jax's path.
  The kernel files' tests run ~1.4x faster; `tests/test_interpreter.py` checks the race detector
  still finds a race. A jax without that private function is left alone."""
  try:
    from jax._src import callback, tree_util
  except ImportError:
    return
  original = getattr(callback, "io_callback_impl", None)
  if original is None:
    return

  def host_value(x):
    return x.item() if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biu" else x

  def io_callback_impl(*args, result_avals, callback, sharding, ordered):
    func = getattr(callback, "callback_func", None)
    while isinstance(func, functools.partial):
      func = func.func
    if not getattr(func, "__module__", "").startswith(_INTERPRETER_MODULE):
      return original(*args, result_avals=result_avals, callback=callback, sharding=sharding,
                      ordered=ordered)
    return tree_util.tree_map(np.asarray, callback(*map(host_value, args)))

  callback.io_callback_impl = io_callback_impl


_interpreter_callbacks_take_host_values()


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

