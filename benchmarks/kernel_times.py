"""What one call of each benchmarked function spends, kernel by kernel, read with Nsight Compute.

A benchmark's time is every kernel its jitted call launches: the Pallas kernel and the XLA work
around it (padding, slicing, split merges, index preparation) and their launch gaps. This runs one
of the benchmark modules with its timer replaced: each timed function is called 3 times to warm
up, then once between cudaProfilerStart and cudaProfilerStop (through PyTorch), after a one-kernel
PyTorch marker that separates the calls in the profile. Under ncu, started with profiling off:

    ncu --profile-from-start off --target-processes all --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --page raw \\
        python3 -m benchmarks.kernel_times sparse --parts sparse --sparse-t 128 --sparse-n 16 \\
        --no-ref --no-sweep-rows > ncu.log
    python3 -m benchmarks.kernel_times --table ncu.log

the second command prints, per timed call in the benchmark's order (rows the benchmark times in
turn, `time_interleaved`, each once, in their order), each kernel's microseconds
and their sum (kernels serialized by ncu: launch gaps are not in it; the benchmark's own figures
printed by the run are meaningless, its timer returns 1 ms). XLA's command buffers (CUDA graphs)
are turned off for the run, so every kernel is launched, and profiled, on its own.
benchmarks/RESULTS.md, sessions 11 and 15, has what it found.
"""

from __future__ import annotations

import csv
import io
import sys

from benchmarks.common import (TIMED_BENCHMARKS, jax_calls, launch_kernels_one_by_one, make_parser,
                               run_with_timers)

MARKER = "elementwise"  # the PyTorch marker's kernel name contains it; no JAX kernel's does


def _profile_one(launch, sync):
  """3 warm calls, then launch(0) inside a profiler range, after a one-kernel PyTorch marker."""
  import torch

  for i in range(3):
    launch(i)
  sync()
  marker = torch.zeros(1, device="cuda")
  torch.cuda.synchronize()
  torch.cuda.profiler.start()
  marker.add_(1)
  torch.cuda.synchronize()
  launch(0)
  sync()
  torch.cuda.profiler.stop()


def profiled_once(fn, arg_sets, **_):
  """time_ms's stand-in: one call of fn profiled (`_profile_one`)."""
  _profile_one(*jax_calls(fn, arg_sets))
  return 1.0


def profiled_in_turn(calls, **_):
  """time_interleaved's stand-in (the benchmarks' rows timed in turn): each entry's call profiled
  once (`_profile_one`), in the entries' order."""
  for launch, sync in calls.values():
    _profile_one(launch, sync)
  return {name: 1.0 for name in calls}


def calls(ncu_csv: str) -> list[list[tuple[str, float]]]:
  """ncu's raw CSV page (other lines ignored) -> per profiled call, (kernel name, microseconds)."""
  rows = [line for line in ncu_csv.splitlines() if line.startswith('"')]
  if not rows:
    raise ValueError("no ncu CSV rows (run ncu with --csv --page raw --metrics "
                     "gpu__time_duration.sum)")
  table = list(csv.reader(io.StringIO("\n".join(rows))))
  name_col = table[0].index("Kernel Name")
  time_col = table[0].index("gpu__time_duration.sum")
  unit = table[1][time_col]  # the units row
  scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
  out = []
  for row in table[2:]:
    if MARKER in row[name_col]:
      out.append([])
    elif out:
      out[-1].append((row[name_col], float(row[time_col].replace(",", "")) * scale))
  return out


def format_calls(profiled: list[list[tuple[str, float]]]) -> str:
  lines = []
  for i, kernels in enumerate(profiled):
    lines.append(f"call {i}: {sum(t for _, t in kernels):.1f} us in {len(kernels)} kernels")
    lines += [f"  {t:9.1f} us  {name[:100]}" for name, t in kernels]
  return "\n".join(lines)


def main(argv=None):
  parser = make_parser("benchmarks.kernel_times", __doc__)
  parser.add_argument("benchmark", nargs="?", choices=TIMED_BENCHMARKS,
                      help="the benchmark module to run with one profiled call per timing")
  parser.add_argument("--table", metavar="NCU_LOG",
                      help="print the per-call kernel table of an ncu log instead of running")
  args, rest = parser.parse_known_args(argv)
  if args.table:
    with open(args.table) as f:
      print(format_calls(calls(f.read())))
    return
  if args.benchmark is None:
    parser.error("name a benchmark, or give --table")
  launch_kernels_one_by_one()
  run_with_timers(args.benchmark, rest, time_ms=profiled_once, time_interleaved=profiled_in_turn)


if __name__ == "__main__":
  sys.exit(main())
