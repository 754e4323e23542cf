"""What a benchmark's calls draw from the GPU: energy a call, mean power, the SM clock under load.

A kernel that keeps the tensor cores and HBM busy can reach the board's power limit (700 W on the
H100 and H200 SXM), and then the driver lowers the SM clock until it holds (nvidia-smi's clock
event reason 0x4, "SW power cap"): its time is then about its energy over the limit, and a change
that saves cycles but not energy gains little (benchmarks/RESULTS.md, session 46: the bf16 decode
at 128 heads runs at ~1.4-1.6 GHz of the H100's 1.98 on the cap). This runs one of the benchmark
modules with its timer replaced: each timed entry is called back to back for `--seconds` of load
while nvidia-smi samples the clock, the power and the clock event reasons every 20 ms; the energy
is the mean sampled power times the time. It prints a line per entry and returns the entry's ms a
call to the benchmark (so its table holds these timings, from one long run each):

    python3 -m benchmarks.power decode --batch 128 --heads 128 --seq 8192 --dtype bf16 \\
        --no-triton --no-ref

ms a call, mJ a call, mean W, the median SM MHz of the samples and the share of them on the power
cap. Read them together: on the cap, ms ~ mJ / the limit, and only less energy makes a call faster.
`python3 -m benchmarks.power matmul --size 8192` runs XLA's bf16 matmul (cuBLAS) of that square
size the same way and prints its TFLOP/s: what the tensor cores sustain on this board's power;
`python3 -m benchmarks.power read --gb 1.2` a float32 sum over that many GB of bf16 (one read of
HBM) and its GB/s: with the matmul, the energy a kernel's FLOPs and bytes cost at the least.
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
import time

from benchmarks.common import TIMED_BENCHMARKS, jax_calls, make_parser, run_measuring_each_entry

MATMUL, READ = "matmul", "read"
POWER_CAP = 0x4  # clocks_event_reasons: SW power cap
_SAMPLE_QUERY = "timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active"


def sample_summary(samples: str, start: float, end: float) -> dict:
  """nvidia-smi's `timestamp, clocks.sm, power.draw.instant, clocks_event_reasons.active` lines
  (csv, noheader, nounits) -> over the samples taken between start and end (epoch seconds): the
  median SM MHz, the mean W, the share of samples on the power cap and their count."""
  rows = []
  for line in samples.splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
      continue
    try:
      when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
      row = (float(parts[1]), float(parts[2]), int(parts[3], 16))
    except ValueError:
      continue
    if start <= when <= end:
      rows.append(row)
  if not rows:
    raise ValueError("no power samples within the load: nvidia-smi printed no "
                     "'TIME, MHz, W, 0xREASONS' line between its start and end")
  return {"MHz": statistics.median(r[0] for r in rows),
          "W": statistics.fmean(r[1] for r in rows),
          "power capped": sum(bool(r[2] & POWER_CAP) for r in rows) / len(rows),
          "samples": len(rows)}


def under_load(launch, sync, seconds: float) -> dict:
  """Calls launch(i) back to back for about `seconds` (after a warm-up and a short calibration),
  nvidia-smi sampling every 20 ms meanwhile: ms a call, and from the samples taken during the
  load, mean W, mJ a call (mean W x ms) and the clocks. The energy is sampled, not read from the
  board's counter: nvidia-smi 580 (the H100 and H200 machines) has no total_energy_consumption."""
  for i in range(3):
    launch(i)
  sync()
  start = time.perf_counter()
  for i in range(10):
    launch(i)
  sync()
  n = max(20, round(seconds / ((time.perf_counter() - start) / 10)))
  sampler = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={_SAMPLE_QUERY}",
                              "--format=csv,noheader,nounits", "-lms", "20"],
                             stdout=subprocess.PIPE, text=True)
  time.sleep(0.2)  # nvidia-smi's start-up, before the load
  wall_start, start = time.time(), time.perf_counter()
  for i in range(n):
    launch(i)
  sync()
  seconds_taken, wall_end = time.perf_counter() - start, time.time()
  sampler.terminate()
  m = sample_summary(sampler.communicate()[0], wall_start, wall_end)
  ms = seconds_taken * 1e3 / n
  return {"ms": ms, "mJ": m["W"] * ms, **m}


def matmul_under_load(size: int, seconds: float) -> dict:
  """`under_load` of XLA's bf16 [size, size] x [size, size] product (two operand pairs in turn),
  with its TFLOP/s."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(0), 4)
  operands = [jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys]
  pairs = [operands[:2], operands[2:]]
  m = under_load(*jax_calls(jax.jit(jnp.matmul), pairs), seconds)
  return {**m, "TFLOP/s": 2 * size**3 / (m["ms"] * 1e9)}


def read_under_load(gb: float, seconds: float) -> dict:
  """`under_load` of XLA's float32 sum over `gb` GB of bf16 (two arrays in turn: neither is in the
  L2 when it is read), with its GB/s."""
  import jax
  import jax.numpy as jnp

  rows = max(1, round(gb * 1e9 / (2 * 8192)))
  arrays = [[jnp.ones((rows, 8192), jnp.bfloat16) * (i + 1)] for i in range(2)]
  total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  m = under_load(*jax_calls(total, arrays), seconds)
  return {**m, "GB/s": rows * 8192 * 2 / (m["ms"] * 1e6)}


def format_line(name: str, m: dict) -> str:
  return (f"{name or 'call'}: {m['ms']:.4f} ms, {m['mJ']:.1f} mJ a call, {m['W']:.0f} W, "
          f"SM {m['MHz']:.0f} MHz (median), {100 * m['power capped']:.0f}% of samples power capped")


def main(argv=None):
  parser = make_parser("benchmarks.power", __doc__)
  parser.add_argument("benchmark", choices=(*TIMED_BENCHMARKS, MATMUL, READ),
                      help="the benchmark module to run, or matmul (XLA's bf16 matmul) or read "
                           "(XLA's sum over bf16)")
  parser.add_argument("--seconds", type=float, default=2.0,
                      help="seconds of back-to-back calls per timed entry")
  parser.add_argument("--size", type=int, help="matmul only: M = N = K of the bf16 product "
                      "(default 8192)")
  parser.add_argument("--gb", type=float, help="read only: GB of bf16 summed (default 1.2)")
  args, rest = parser.parse_known_args(argv)
  if args.seconds <= 0:
    parser.error(f"--seconds must be positive, got {args.seconds}")
  if args.size is not None and args.benchmark != MATMUL:
    parser.error(f"--size is matmul's, not {args.benchmark}'s")
  if args.gb is not None and args.benchmark != READ:
    parser.error(f"--gb is read's, not {args.benchmark}'s")
  if args.benchmark == MATMUL:
    args.size = 8192 if args.size is None else args.size
    if rest or args.size < 1:
      parser.error(f"matmul takes --size (positive) and --seconds only, got {rest or args.size}")
    m = matmul_under_load(args.size, args.seconds)
    print(format_line(f"bf16 matmul {args.size}^3", m) + f", {m['TFLOP/s']:.0f} TFLOP/s")
    return
  if args.benchmark == READ:
    args.gb = 1.2 if args.gb is None else args.gb
    if rest or args.gb <= 0:
      parser.error(f"read takes --gb (positive) and --seconds only, got {rest or args.gb}")
    m = read_under_load(args.gb, args.seconds)
    print(format_line(f"sum over {args.gb:g} GB of bf16", m) + f", {m['GB/s']:.0f} GB/s")
    return

  run_measuring_each_entry(args.benchmark, rest,
                           lambda launch, sync: under_load(launch, sync, args.seconds),
                           format_line)


if __name__ == "__main__":
  sys.exit(main())
