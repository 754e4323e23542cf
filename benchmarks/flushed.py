"""Kernel time per call with the L2 cache flushed before each call: how FlashMLA, DeepGEMM and
Triton's `do_bench` time a kernel, so that their published figures and ours are the same measure.

The benchmarks' own timer (`common.time_interleaved`) queues calls back to back and takes the
slope: device time and launch gaps under sustained load. A kernel on the board's power cap (the
bf16 decode at 128 heads, benchmarks/RESULTS.md session 46) runs at a lower SM clock under that
load than when each call follows a 256 MB write of the L2-flush buffer, which is how `do_bench`
(FlashMLA's tests/test_flash_mla.py) and DeepGEMM's `bench_kineto` time: there the card spends part
of every call's period on a memset, its mean power drops and the clock rises. This runs one of the
benchmark modules with its timer replaced: each timed entry is queued `--calls` times after a
256 MB fill (one XLA kernel, module `jit_l2_flush`) under `jax.profiler.trace`, and each call's
time is read from the device trace, from the start of its first kernel to the end of its last
(what do_bench's two CUDA events around the call measure, less their own launch). It prints a line
per entry (median, min and max over the calls) and returns the median to the benchmark, whose
table then holds these timings:

    python3 -m benchmarks.flushed decode --batch 128 --heads 128 --seq 8192 --dtype bf16 \\
        --no-triton --no-ref

Report them beside the sustained figures, never instead: a serving step runs its kernels back to
back. XLA's command buffers (CUDA graphs) are turned off for the run (as `kernel_times` does), so
every kernel appears in the trace.
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import tempfile

from benchmarks.common import (TIMED_BENCHMARKS, launch_kernels_one_by_one, make_parser,
                               run_measuring_each_entry)

L2_FLUSH_BYTES = 256 * 10**6  # do_bench's and DeepGEMM's flush buffer, 5x the H200's 50 MB L2
FLUSH_MODULE = "jit_l2_flush"  # the XLA module of `l2_flush` below, jitted
STREAM_LINE = "Stream"  # the device plane's lines of kernel executions are named "Stream #..."


def l2_flush(value):
  """Writes L2_FLUSH_BYTES (value a traced scalar, so XLA cannot fold the fill away)."""
  import jax.numpy as jnp
  return jnp.full((L2_FLUSH_BYTES // 4,), value, jnp.int32)


def call_spans(events, flush_module: str = FLUSH_MODULE) -> list[float]:
  """Kernel executions (start_ns, end_ns, hlo_module) of one device -> ms of each call: from the
  start of the first kernel after a flush to the end of the last before the next flush. Kernels
  before the first flush are not a timed call."""
  spans, call = [], None
  for start, end, module in sorted(events):
    if module == flush_module:
      if call:
        spans.append((call[1] - call[0]) / 1e6)
      call = []
    elif call is not None:
      call = [start, end] if not call else [call[0], max(call[1], end)]
  if call:
    spans.append((call[1] - call[0]) / 1e6)
  return spans


def device_kernels(xspace_path: str, device: str = "/device:GPU:0",
                   line_prefix: str = STREAM_LINE) -> list[tuple]:
  """(start_ns, end_ns, hlo_module or "") of every event on `device`'s lines named line_prefix...
  (the GPU's streams; the CPU tests read the host's XLA thunk lines)."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(xspace_path)
  planes = [p for p in data.planes if p.name == device]
  if not planes:
    raise RuntimeError(f"the trace has no {device} plane: {[p.name for p in data.planes]}")
  lines = [line for line in planes[0].lines if line.name.startswith(line_prefix)]
  if not lines:
    raise RuntimeError(f"{device} has no '{line_prefix} ...' line: "
                       f"{[line.name for line in planes[0].lines]}")
  return [(e.start_ns, e.end_ns, dict(e.stats).get("hlo_module", ""))
          for line in lines for e in line.events]


def flushed_ms(launch, sync, calls: int, **device) -> dict:
  """launch(i) queued `calls` times, each after an L2 flush, under the profiler: the calls' ms
  (median, min, max) from the device trace (device: `device_kernels`'s keywords)."""
  import jax

  flush = jax.jit(l2_flush)
  for i in range(3):
    flush(i)
    launch(i)
  sync()
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for i in range(calls):
        flush(i)
        launch(i)
      sync()
    (xspace,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    spans = call_spans(device_kernels(xspace, **device))
  if len(spans) < calls:
    raise RuntimeError(f"the trace holds {len(spans)} calls after a flush, {calls} were queued")
  spans = spans[-calls:]  # (a trace that began early may hold a warm-up call's)
  return {"ms": statistics.median(spans), "min": min(spans), "max": max(spans)}


def format_line(name: str, m: dict) -> str:
  return (f"{name or 'call'}: {m['ms']:.4f} ms a call, L2 flushed (median; "
          f"min {m['min']:.4f}, max {m['max']:.4f})")


def main(argv=None):
  parser = make_parser("benchmarks.flushed", __doc__)
  parser.add_argument("benchmark", choices=TIMED_BENCHMARKS, help="the benchmark module to run")
  parser.add_argument("--calls", type=int, default=100, help="flushed calls per timed entry")
  args, rest = parser.parse_known_args(argv)
  if args.calls < 1:
    parser.error(f"--calls must be positive, got {args.calls}")
  launch_kernels_one_by_one()

  run_measuring_each_entry(args.benchmark, rest,
                           lambda launch, sync: flushed_ms(launch, sync, args.calls),
                           format_line)


if __name__ == "__main__":
  sys.exit(main())
