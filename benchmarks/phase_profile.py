"""Clocks of each phase of the Mosaic decode and sparse kernels' warpgroups, measured on the GPU.

Mosaic GPU's on-device profiler: while `pallas_kernels.common.phase_profile` is active, the kernels
built with `mosaic_compiler_params` record `%clock` at the entry and exit of each `in_phase` scope
(warpgroup 0: wg0_page_wait or wg0_rows_wait, wg0_scores, wg0_softmax, wg0_hand_off, wg0_values
where it has value columns; warpgroup 1: wg1_p_wait, wg1_values; the memory warpgroup:
memory_slot_wait, memory_copy or memory_gather, fp8_ds_mla's memory_staged_wait and memory_widen
at 64 heads and more, memory_landing_wait at 16 and 32) into shared memory beside the kernel's,
and dump a Perfetto trace after the call. A kernel's shared memory leaves room for a few steps a
program (the decode at 128 heads: 41 scopes a warpgroup, its first ~6 steps; sparse attention at
128 heads: 19; at 16 heads, fp8_ds_mla's register_a kernel: 64 and more): the tool lowers the
kernel first and takes the most scopes that fit. The trace's clocks are the SM's (`%clock`): a
phase's cycles, whatever the clock rate.

Prints a phase a row: occurrences counted (a program's first --skip of each are left out: the
pipeline filling), the median, 25th and 75th percentile clocks; then the step period (warpgroup
0's scores from one step to the next). The kernel's outputs are checked against an unprofiled
call (the profiler reads clocks and stores to its own buffer; the products are the same).

Usage (on a GPU; the kernel's keywords with --set FIELD=VALUE, Python literals):
  python -m benchmarks.phase_profile decode --batch 128 --heads 128 --seq 8192 --dtype bf16
  python -m benchmarks.phase_profile sparse --t 4096 --heads 128 --cache fp8_ds_mla
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import math
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import field_value, make_parser, require_gpu
from pallas_kernels.common import phase_profile

# Shared memory a unit of profile_space takes: a scope is 2 events of 2 int32 entries, a trace a
# warpgroup, 3 warpgroups in both kernels (Mosaic GPU's ProfilerSpec).
_BYTES_PER_SCOPE = 2 * 2 * 4 * 3
_SMEM_ERROR = re.compile(
    r"exceeds available shared memory: smem_bytes=(\d+) > max_smem_bytes=(\d+)")
# Lowered for CUDA on a CPU, a profiled kernel gets past the shared-memory check, then fails on its
# trace's dump (a host callback on another platform): it fits.
_CPU_LOWERING_ERROR = "is different from the lowering platform"


def fit_space(fn, args, space, platform=None):
  """The most scopes a warpgroup, at most `space`, for which fn(*args)'s profiled kernel fits in
  shared memory (lowering only: for `platform`, e.g. "cuda" on a CPU, else the default)."""
  if space < 1:
    raise ValueError(f"space must be at least 1 scope a warpgroup, got {space}")
  while space > 0:
    with phase_profile(tempfile.gettempdir(), space):
      jax.clear_caches()
      try:
        traced = jax.jit(fn).trace(*args)
        traced.lower(lowering_platforms=(platform,) if platform else None)
        return space
      except ValueError as e:
        if _CPU_LOWERING_ERROR in str(e):
          return space
        found = _SMEM_ERROR.search(str(e))
        if found is None:
          raise
        space -= math.ceil((int(found[1]) - int(found[2])) / _BYTES_PER_SCOPE)
      finally:
        jax.clear_caches()
  raise ValueError("the kernel leaves no shared memory for the profiler")


def phase_table(events, skip):
  """({phase: (n, median, p25, p75)}, (n, median, p25, p75) of the step period) in clocks, from a
  Perfetto trace's events (Mosaic GPU's dump: ts in microseconds of clocks / 1e3, one tid a
  warpgroup of a program), each trace's first `skip` occurrences of a phase left out."""
  durations, starts, seen = collections.defaultdict(list), {}, collections.Counter()
  steps = collections.defaultdict(list)
  for e in events:
    key = (e["tid"], e["name"])
    if e["ph"] == "B":
      starts[key] = e["ts"]
      if e["name"] == "wg0_scores":
        steps[e["tid"]].append(e["ts"])
      continue
    if seen[key] >= skip:
      durations[e["name"]].append((e["ts"] - starts[key]) * 1e3)
    seen[key] += 1
    del starts[key]
  stats = lambda d: (len(d), *np.percentile(d, [50, 25, 75])) if len(d) else (0, *[math.nan] * 3)
  periods = [x for ts in steps.values() for x in np.diff(ts[skip:]) * 1e3]
  return {name: stats(d) for name, d in sorted(durations.items())}, stats(periods)


def decode_case(args):
  from benchmarks import bench_decode
  from pallas_kernels import mosaic_decode
  dtype = bench_decode.DTYPES[args.dtype]
  q, cache, tables, lens = bench_decode.input_sets(args.batch, args.heads, args.seq, 64, dtype,
                                                   1)[0]
  k_scale = bench_decode.FP8_SCALE if args.dtype == "fp8" else None
  fn = functools.partial(mosaic_decode.latent_decode, scale=bench_decode.SCALE, k_scale=k_scale,
                         **args.knobs)
  return fn, (q, cache, tables, lens)


def sparse_case(args):
  from benchmarks import bench_sparse
  from pallas_kernels import mosaic_sparse
  cache = bench_sparse.latent_cache(args.cache, bench_sparse.slot_span(args.t), jax.random.key(7))
  q, cache, slots = bench_sparse.sparse_sets(args.t, args.heads, cache, bench_sparse.TOPK)[0]
  default = bench_sparse.mosaic_default(mosaic_sparse)
  if args.knobs:  # (the bf16 and fp8_ds_mla entries' own keywords)
    default = functools.partial(bench_sparse.mosaic_sparse_variant,
                                cfg=mosaic_sparse.MosaicSparseConfig(**args.knobs))
  return default, (q, cache, slots)


def profile(fn, inputs, space, skip, directory):
  """Runs fn(*inputs) profiled; (its phase table, its period, the largest output difference from
  an unprofiled call)."""
  plain = jax.jit(fn)(*inputs)
  before = set(glob.glob(os.path.join(directory, "*.json")))
  with phase_profile(directory, space):
    jax.clear_caches()
    out = jax.block_until_ready(jax.jit(fn)(*inputs))
  jax.clear_caches()
  diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(out, plain))
  dumped = sorted(set(glob.glob(os.path.join(directory, "*.json"))) - before, key=os.path.getmtime)
  with open(dumped[-1]) as f:
    return (*phase_table(json.load(f)["traceEvents"], skip), diff)


def main(argv=None):
  parser = make_parser("benchmarks.phase_profile", __doc__)
  parser.add_argument("kernel", choices=["decode", "sparse"])
  parser.add_argument("--batch", type=int, default=128, help="decode: requests")
  parser.add_argument("--heads", type=int, default=128, help="query heads")
  parser.add_argument("--seq", type=int, default=8192, help="decode: tokens a request")
  parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="decode cache")
  parser.add_argument("--t", type=int, default=4096, help="sparse: query rows")
  parser.add_argument("--cache", choices=["bf16", "fp8_ds_mla"], default="bf16", help="sparse")
  parser.add_argument("--set", type=field_value, nargs="+", action="extend", default=[],
                      metavar="FIELD=VALUE",
                      help="the kernel's keywords (config fields)")
  parser.add_argument("--space", type=int, default=64, help="most scopes a warpgroup")
  parser.add_argument("--skip", type=int, default=2, help="a program's first steps left out")
  parser.add_argument("--dir", default=None, help="where the traces go (default: a temp dir)")
  args = parser.parse_args(argv)
  require_gpu("benchmarks.phase_profile")
  args.knobs = dict(args.set)
  fn, inputs = (decode_case if args.kernel == "decode" else sparse_case)(args)
  space = fit_space(fn, inputs, args.space)
  directory = args.dir or tempfile.mkdtemp(prefix="phase_profile_")
  table, period, diff = profile(fn, inputs, space, args.skip, directory)
  print(f"{args.kernel} {args.set} : {space} scopes a warpgroup, steps from "
        f"{args.skip}, max |profiled - plain| {diff:.3g}, trace in {directory}")
  print("| phase | n | median clk | p25 | p75 |\n|---|---|---|---|---|")
  for name, (n, med, p25, p75) in {**table, "step period": period}.items():
    print(f"| {name} | {n} | {med:.0f} | {p25:.0f} | {p75:.0f} |")


if __name__ == "__main__":
  main()
