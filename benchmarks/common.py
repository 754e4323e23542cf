"""Shared benchmark plumbing: device timing, the H200's ceilings, and result tables."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import jax

# Measured on the H200 of this workplace (SPEC section 9): device-to-device copy and bf16 matmul.
H200_COPY_GBPS = 4200.0
H200_BF16_TFLOPS = 790.0


ROOT = Path(__file__).resolve().parents[1]


def module_at_revision(module: str, rev: str, root: Path = ROOT) -> types.ModuleType:
  """`module` (dotted, under the repository root: "pallas_kernels.mosaic_decode") as git revision
  `rev` holds it, imported beside today's under its own name, so that a change can be timed in
  turn with the code before it (the benchmarks' `--against-rev`). Only that file is old: what it
  imports is today's, so a change that spans modules compares this way only where the old file
  still works with today's others. root: the git checkout (this repository). A revision or file
  git does not know: ValueError."""
  path = module.replace(".", "/") + ".py"
  shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True,
                         text=True, check=False)
  if shown.returncode:
    raise ValueError(f"git show {rev}:{path} failed: {shown.stderr.strip()}")
  name = module + "_at_" + re.sub(r"\W", "_", rev)
  old = types.ModuleType(name)
  old.__file__, old.__package__ = f"{rev}:{path}", module.rpartition(".")[0]
  sys.modules[name] = old  # dataclasses look their module up while the file runs
  exec(compile(shown.stdout, old.__file__, "exec"), old.__dict__)  # noqa: S102
  return old


def field_value(text: str) -> tuple[str, object]:
  """argparse type of "FIELD=VALUE" (VALUE a Python literal, or a bare word taken as a string) ->
  (FIELD, VALUE): a kernel's keyword argument on the command line."""
  field, _, value = text.partition("=")
  if not field or not value:
    raise argparse.ArgumentTypeError(f"want FIELD=VALUE, got {text!r}")
  try:
    return field, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return field, value


def make_parser(module_name: str, doc: str) -> argparse.ArgumentParser:
  """The parser of `python -m <module_name>`: the module's whole docstring as its description,
  each option's default (where it has one) after its help."""
  class Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):
      shown = action.default not in (None, False, argparse.SUPPRESS)
      return (action.help or "") + (" (default: %(default)s)" if shown else "")

  epilog = ("Run from the repository root, in an environment with a GPU jax\n"
            "(pip install -e \".[cuda13]\" or \".[cuda12]\"). Tables go to --out as NAME.json and\n"
            "NAME.md; log every measurement in benchmarks/RESULTS.md.")
  return argparse.ArgumentParser(prog=f"python -m {module_name}", description=doc, epilog=epilog,
                                 formatter_class=Formatter)


def require_gpu(module_name: str, min_devices: int = 1):
  """Exits with a message (not a Pallas traceback) unless jax sees `min_devices` CUDA GPUs."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:  # no GPU backend in this jax, or no GPU visible
    gpus = []
  if len(gpus) < min_devices:
    need = "a CUDA GPU" if min_devices == 1 else f"{min_devices} CUDA GPUs"
    seen = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    sys.exit(f"python -m {module_name} needs {need} (it times GPU kernels); jax sees {len(gpus)} "
             f"GPU(s) (devices: {seen}). Install a GPU jax with pip install -e \".[cuda13]\" (or "
             "\".[cuda12]\"); on a CPU the test suite checks the same kernels in interpret mode.")


def time_ms(fn, arg_sets, *, warmup=3, iters=20, repeats=5):
  """Median milliseconds per call of `fn(*args)`, as `time_interleaved` times one.

  `arg_sets` rotates among several input sets so that repeated calls do not find their inputs in
  the L2 cache.
  """
  return time_interleaved({"": jax_calls(fn, arg_sets)}, warmup=warmup, iters=iters,
                          repeats=repeats)[""]


def jax_calls(fn, arg_sets):
  """`(launch, sync)` for `time_interleaved`: launch(i) calls `fn` on the i-th of `arg_sets` (in
  rotation), sync() waits for the last call's outputs."""
  last = []

  def launch(i):
    last[:] = [fn(*arg_sets[i % len(arg_sets)])]
  return launch, lambda: jax.block_until_ready(last)


def _queued_seconds(run, n):
  start = time.perf_counter()
  run(n)
  return time.perf_counter() - start


def per_call_ms(run, iters):
  """Milliseconds a call of `run(n)` (n calls queued back to back, then one sync), by the slope
  between `iters` and 2 `iters` calls: device time plus launch gaps, without the fixed cost of a
  timing (the first call's dispatch onto an idle device and the final sync: ~0.2-0.4 ms on the
  H200 machine, so 0.403 ms for the DSA step at 20 calls against 0.386 at 200 before session 37;
  benchmarks/RESULTS.md, sessions 20-21 and 37)."""
  once = _queued_seconds(run, iters)
  return (_queued_seconds(run, 2 * iters) - once) * 1e3 / iters


def time_interleaved(calls, *, warmup=3, iters=20, repeats=5):
  """Median milliseconds per call of each `name: (launch, sync)` in `calls` (`per_call_ms`: `iters`
  then 2 `iters` calls queued, each run drained by one sync), the repeats taken in turn: repeat r
  of every entry runs before repeat r + 1 of any, so the machine's drift between calls (the H200's
  clocks; SDPA's own time moved 0.75-0.90 ms between calls in session 23) falls on all alike.
  launch(i) queues the i-th call; sync() returns once the device has finished it (any framework).
  """
  for launch, sync in calls.values():
    for i in range(warmup):
      launch(i)
    sync()
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, (launch, sync) in calls.items():
      def run(n, launch=launch, sync=sync):
        for i in range(n):
          launch(i)
        sync()
      samples[name].append(per_call_ms(run, iters))
  return {name: statistics.median(s) for name, s in samples.items()}


# The benchmark modules that time through `time_ms` and `time_interleaved` (by module-level name),
# which `run_with_timers` can replace.
TIMED_BENCHMARKS = ("decode", "prefill", "sparse")


def launch_kernels_one_by_one():
  """Turns XLA's command buffers (CUDA graphs) off, so that every kernel of a call is launched,
  and seen by a profiler, on its own (kernel_times, flushed: a graph's kernels were missing from
  the profile of the DSA step in session 14). XLA reads the flag when the backend starts: call
  this before the first JAX computation."""
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_command_buffer="]).strip()


def run_with_timers(benchmark: str, argv, *, time_ms, time_interleaved):
  """Runs `benchmarks.bench_<benchmark>`'s main(argv) with its two timers replaced (kernel_times:
  one profiled call each; power: long runs under nvidia-smi's samples; flushed: calls after an
  L2 flush)."""
  if benchmark not in TIMED_BENCHMARKS:
    raise ValueError(f"benchmark must be one of {TIMED_BENCHMARKS}, got {benchmark!r}")
  module = importlib.import_module(f"benchmarks.bench_{benchmark}")
  module.time_ms = time_ms
  module.time_interleaved = time_interleaved
  return module.main(argv)


def run_measuring_each_entry(benchmark: str, argv, measure, describe):
  """`run_with_timers` with each timed entry measured by `measure(launch, sync) -> dict` (its "ms"
  goes back to the benchmark), printing `describe(name, result)` for each, in the entries' order
  (power: long loaded runs; flushed: calls after an L2 flush)."""
  def measured_in_turn(calls, **_):
    out = {}
    for name, (launch, sync) in calls.items():
      m = measure(launch, sync)
      print(describe(name, m), flush=True)
      out[name] = m["ms"]
    return out

  return run_with_timers(
      benchmark, argv, time_interleaved=measured_in_turn,
      time_ms=lambda fn, arg_sets, **_: measured_in_turn({"": jax_calls(fn, arg_sets)})[""])


def time_steps(step, x, cache, md, *, iters, repeats, warmup=3):
  """Median ms per call of `step(x, cache, md) -> (out, cache)` with the cache donated (each call
  takes the cache the previous one returned, calls queued back to back), as `per_call_ms`."""
  state = list(step(x, cache, md))
  for _ in range(warmup - 1):
    state[:] = step(x, state[1], md)
  jax.block_until_ready(state)

  def run(n):
    for _ in range(n):
      state[:] = step(x, state[1], md)
    jax.block_until_ready(state)
  return statistics.median(per_call_ms(run, iters) for _ in range(repeats))


def rates(ms, *, bytes_moved=None, flops=None):
  """GB/s, TFLOP/s and their percentages of the H200's ceilings."""
  out = {"ms": ms}
  if bytes_moved is not None:
    out["GB/s"] = bytes_moved / ms / 1e6
    out["%copy"] = 100 * out["GB/s"] / H200_COPY_GBPS
  if flops is not None:
    out["TFLOP/s"] = flops / ms / 1e9
    out["%bf16"] = 100 * out["TFLOP/s"] / H200_BF16_TFLOPS
  return out


def write_results(rows, name, out_dir):
  """Writes `name`.json and `name`.md (a markdown table of the row dicts) under out_dir."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=1))
  table = markdown_table(rows)
  (out_dir / f"{name}.md").write_text(table + "\n")
  return table


def markdown_table(rows):
  cols = list(dict.fromkeys(k for r in rows for k in r))
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
  return "\n".join(lines)
