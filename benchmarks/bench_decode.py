"""Latent (MLA) decode: the Pallas-Triton kernel against the jitted XLA reference, on a GPU, with
the Mosaic GPU kernel (pallas_mosaic) beside it (bf16 and fp8 caches).

Every request sees the full S tokens through a shuffled 64-token page table, so the bytes that
must move are exactly the cache rows (B*S*576*elem) plus q and o; FLOPs are 2*B*N*S*(576+512).
Several input sets are rotated so the 60 MB L2 never holds a whole set. `--sweep` times the
Triton kernel's (block_h, num_warps, num_stages) variants and then split counts (and the Mosaic
kernel's split counts) instead of the reference. Mosaic columns: "mosaic ms", "triton/mosaic"
(> 1: Mosaic faster) and the largest difference between the two kernels' outputs.
`--mosaic-configs` adds the Mosaic kernel's other configs (its SWEEP, e.g. fp8_pipeline=half_pages;
each only with the cache dtype whose program it changes: the fp8 pipelines only with fp8 caches):
"mosaic <field>=<value> ms" and the largest difference from the chosen config's output, the
chosen config and these timed in turn, repeat by repeat (as with `--no-triton`). `--fp8-vs-bf16`
adds a row a shape timing the Mosaic kernel's default with an fp8 and a bf16 cache in turn:
"fp8/bf16" (< 1: the fp8 cache is faster), each one's ms and GB/s.
`--against-rev REV` adds a row a case timing the Mosaic kernel's default as git revision REV had
it (`pallas_kernels/mosaic_decode.py` of REV, beside today's other modules) and today's, in turn:
"REV ms", "now ms", "REV/now" (> 1: today's is faster) and the largest output difference.
`--no-triton` leaves the Triton kernel out (then also the reference; the row's "ms" is the Mosaic
kernel's). `--batch-invariant` adds each kernel's batch-invariant mode (fixed splits of
BATCH_INVARIANT_SPLIT_TOKENS tokens, merged in a fixed order): "<kernel> inv ms" and its cost
against the default splits in %.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp

from benchmarks.common import (jax_calls, make_parser, module_at_revision, rates, require_gpu,
                               time_interleaved, time_ms, write_results)
from mla_jax import reference
from pallas_kernels import common as kernel_common
from pallas_kernels import latent_decode as kernel
from pallas_kernels import mosaic_decode as mosaic

L, R = 512, 64
SCALE = (128 + R) ** -0.5
FP8_SCALE = 0.05
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def input_sets(batch, heads, seq, page, dtype, num_sets):
  """num_sets independent (q, cache, block_tables, seq_lens) on the device, random, no NaN."""
  per_req = seq // page
  sets = []
  for i in range(num_sets):
    kq, kc, kp = jax.random.split(jax.random.key(i), 3)
    q = jax.random.normal(kq, (batch, heads, L + R), jnp.bfloat16)
    cache = jax.random.normal(kc, (batch * per_req, page, L + R), jnp.float32) / 10
    cache = (cache / FP8_SCALE if dtype == jnp.float8_e4m3fn else cache).astype(dtype)
    tables = jax.random.permutation(kp, batch * per_req).astype(jnp.int32).reshape(batch, per_req)
    sets.append((q, cache, tables, jnp.full((batch,), seq, jnp.int32)))
  return sets


def ref_fn(k_scale):
  return jax.jit(lambda q, c, t, s: reference.latent_decode(q, c, t, s, scale=SCALE,
                                                            k_scale=k_scale))


def case_inputs(args, batch, heads, seq, dtype_name):
  """(sets, bytes a call must move, k_scale) of one case: enough input sets that one pass over
  them is 4x the L2."""
  dtype = DTYPES[dtype_name]
  case_bytes = (batch * seq * (L + R) * jnp.dtype(dtype).itemsize
                + batch * heads * (L + R + L) * 2)
  sets = input_sets(batch, heads, seq, args.page, dtype, max(2, math.ceil(4 * 60e6 / case_bytes)))
  k_scale = jnp.float32(FP8_SCALE) if dtype == jnp.float8_e4m3fn else None
  return sets, case_bytes, k_scale


def run_case(args, batch, heads, seq, dtype_name):
  dtype = DTYPES[dtype_name]
  sets, case_bytes, k_scale = case_inputs(args, batch, heads, seq, dtype_name)
  flops = 2 * batch * heads * seq * (L + R + L)
  base = {"B": batch, "N": heads, "S": seq, "cache": dtype_name}

  def kernel_fn(module=kernel, **cfg):
    return lambda q, c, t, s: module.latent_decode(q, c, t, s, scale=SCALE, k_scale=k_scale, **cfg)

  def timed(fn):
    return time_ms(fn, sets, iters=args.iters, repeats=args.repeats)

  if args.sweep:
    ref_o = ref_fn(k_scale)(*sets[0])[0].astype(jnp.float32)

    def variant(module=kernel, **cfg):
      # A variant may not compile (shared memory, registers): record that and go on.
      head = {**base, "kernel": "pallas_mosaic" if module is mosaic else "pallas_triton", **cfg}
      try:
        fn = kernel_fn(module, **cfg)
        err = float(jnp.abs(fn(*sets[0])[0].astype(jnp.float32) - ref_o).max())
        row = {**head, **rates(timed(fn), bytes_moved=case_bytes, flops=flops), "max err": err}
      except Exception as e:  # noqa: BLE001
        row = {**head, "error": f"{type(e).__name__}: {str(e)[:80]}"}
      print(row, flush=True)
      return row

    rows = [variant(**dataclasses.asdict(cfg)) for cfg in kernel.SWEEP[heads]]
    best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    cfg = {k: best[k] for k in ("block_h", "block_n", "num_warps", "num_stages")}
    rows += [variant(**cfg, num_kv_splits=k) for k in (1, 2, 4, 8, 16, 32)]
    if not args.no_mosaic:
      rows += [variant(mosaic, num_kv_splits=k) for k in (1, 2, 4, 8, 16)]
    return rows

  if args.no_triton:
    row = mosaic_configs(base, kernel_fn, args.iters, args.repeats, sets, case_bytes, flops)
    print(row, flush=True)
    return [row]
  cfg = kernel.tuned_config(heads, args.page, kernel.operand_kind(jnp.bfloat16, dtype))
  splits = kernel_common.default_num_kv_splits(batch, -(-heads // cfg.block_h), seq,
                                               kernel_common.sm_count())
  row = {**base,
         "config": f"h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} k{splits}",
         **rates(timed(kernel_fn()), bytes_moved=case_bytes, flops=flops)}
  if args.mosaic_configs and not args.no_mosaic:
    row.update({k: v for k, v in mosaic_configs(base, kernel_fn, args.iters, args.repeats, sets,
                                                case_bytes, flops).items()
                if k.startswith("mosaic ")})
    if "mosaic ms" in row:
      row["triton/mosaic"] = row["ms"] / row["mosaic ms"]
  elif not args.no_mosaic:
    # The Mosaic kernel on the same inputs; one that does not compile is recorded, not fatal.
    row["mosaic config"] = f"k{mosaic.num_kv_splits_for(batch, heads, seq)}"
    try:
      mosaic_fn = kernel_fn(mosaic)
      outs = [fn(*sets[0])[0].astype(jnp.float32) for fn in (mosaic_fn, kernel_fn())]
      row["mosaic ms"] = timed(mosaic_fn)
      row["triton/mosaic"] = row["ms"] / row["mosaic ms"]
      row["mosaic vs triton max diff"] = float(jnp.abs(outs[0] - outs[1]).max())
    except Exception as e:  # noqa: BLE001
      row["mosaic error"] = f"{type(e).__name__}: {str(e)[:80]}"
  if args.batch_invariant:
    inv = {"split_tokens": kernel_common.BATCH_INVARIANT_SPLIT_TOKENS}
    timed_kernels = (("triton", kernel, row["ms"]), ("mosaic", mosaic, row.get("mosaic ms")))
    for name, module, ms in timed_kernels:
      if ms is not None:
        row[f"{name} inv ms"] = timed(kernel_fn(module, **inv))
        row[f"{name} inv cost %"] = 100 * (row[f"{name} inv ms"] / ms - 1)
  if not args.no_ref:
    row["xla ms"] = time_ms(ref_fn(k_scale), sets, iters=max(2, args.iters // 4), repeats=3)
    row["speedup"] = row["xla ms"] / row["ms"]
  print(row, flush=True)
  return [row]


def fp8_vs_bf16(args, batch, heads, seq):
  """The Mosaic kernel's default with an fp8 and a bf16 cache on the same shape, timed in turn
  repeat by repeat: "fp8/bf16" (issue 15 asks <= 0.6 at N=16), and each one's ms and GB/s."""
  calls, case_bytes = {}, {}
  for name in ("fp8", "bf16"):
    sets, case_bytes[name], k_scale = case_inputs(args, batch, heads, seq, name)
    calls[name] = jax_calls(lambda q, c, t, s, k_scale=k_scale: mosaic.latent_decode(
        q, c, t, s, scale=SCALE, k_scale=k_scale), sets)
  ms = time_interleaved(calls, iters=args.iters, repeats=args.repeats)
  row = {"B": batch, "N": heads, "S": seq, "cache": "fp8 vs bf16 (Mosaic, in turn)",
         "fp8/bf16": ms["fp8"] / ms["bf16"]}
  for name in ("fp8", "bf16"):
    row[f"{name} ms"] = ms[name]
    row[f"{name} GB/s"] = rates(ms[name], bytes_moved=case_bytes[name])["GB/s"]
  print(row, flush=True)
  return [row]


def against_revision(args, batch, heads, seq, dtype_name, old):
  """The Mosaic kernel's default at git revision args.against_rev (`old`: that module,
  `module_at_revision`'s) and today's on the same inputs, timed in turn repeat by repeat: what a
  change moved, free of the machine's drift between calls."""
  rev = args.against_rev
  sets, case_bytes, k_scale = case_inputs(args, batch, heads, seq, dtype_name)
  fns = {name: functools.partial(module.latent_decode, scale=SCALE, k_scale=k_scale)
         for name, module in ((rev, old), ("now", mosaic))}
  ms = time_interleaved({name: jax_calls(fn, sets) for name, fn in fns.items()},
                        iters=args.iters, repeats=args.repeats)
  outs = [fn(*sets[0])[0].astype(jnp.float32) for fn in fns.values()]
  row = {"B": batch, "N": heads, "S": seq, "cache": f"{dtype_name} Mosaic, {rev} vs now (in turn)",
         f"{rev} ms": ms[rev], "now ms": ms["now"], f"{rev}/now": ms[rev] / ms["now"],
         "max diff": float(jnp.abs(outs[0] - outs[1]).max())}
  row.update({f"now {k}": v for k, v in rates(ms["now"], bytes_moved=case_bytes,
                                               flops=2 * batch * heads * seq * (L + R + L)).items()
              if k != "ms"})
  print(row, flush=True)
  return [row]


def mosaic_configs(base, kernel_fn, iters, repeats, sets, case_bytes, flops):
  """The Mosaic kernel's chosen config ("mosaic ms") and each other config of its SWEEP ("mosaic
  <field>=<value> ms" and "... max diff" from the chosen config's output) that changes the program
  for this cache dtype (`mosaic.DTYPE_KNOBS`), each program once, all timed in turn repeat by
  repeat (`time_interleaved`: a config timed first ran ~5% slow at fp8 N=16 in session 24, the
  same program timed later did not); one that does not compile is recorded, not fatal."""
  row = dict(base)
  try:
    chosen = kernel_fn(mosaic)
    ref = chosen(*sets[0])[0].astype(jnp.float32)
  except Exception as e:  # noqa: BLE001
    row["mosaic error"] = f"{type(e).__name__}: {str(e)[:80]}"
    return row
  cache_dtype = sets[0][1].dtype
  calls = {"mosaic": jax_calls(chosen, sets)}
  timed_knobs = [{}]
  for cfg in mosaic.SWEEP:
    changed = {k: v for k, v in dataclasses.asdict(cfg).items()
               if v != getattr(mosaic.CONFIG, k)
               and mosaic.DTYPE_KNOBS.get(k, cache_dtype) == cache_dtype}
    if changed in timed_knobs:  # the same program for this cache dtype (or the chosen one)
      continue
    timed_knobs.append(changed)
    name = "mosaic " + " ".join(f"{k}={v}" for k, v in changed.items())
    try:
      fn = kernel_fn(mosaic, **changed)
      row[f"{name} max diff"] = float(jnp.abs(fn(*sets[0])[0].astype(jnp.float32) - ref).max())
      calls[name] = jax_calls(fn, sets)
    except Exception as e:  # noqa: BLE001
      row[f"{name} error"] = f"{type(e).__name__}: {str(e)[:80]}"
  ms = time_interleaved(calls, iters=iters, repeats=repeats)
  row.update(rates(ms.pop("mosaic"), bytes_moved=case_bytes, flops=flops))
  row["mosaic ms"] = row["ms"]
  for name, variant_ms in ms.items():
    row[f"{name} ms"] = variant_ms
    row[f"{name} speedup"] = row["mosaic ms"] / variant_ms
  return row


def main(argv=None):
  parser = make_parser("benchmarks.bench_decode", __doc__)
  parser.add_argument("--batch", type=int, nargs="+", default=[32, 128], help="requests B")
  parser.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="query heads N")
  parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 32768],
                      help="cached tokens S of every request")
  parser.add_argument("--dtype", nargs="+", default=["bf16", "fp8"], choices=sorted(DTYPES),
                      help="latent cache dtypes (fp8: e4m3 with a per-tensor scale)")
  parser.add_argument("--page", type=int, default=64, help="tokens per cache page (block size)")
  parser.add_argument("--quick", action="store_true", help="B=128, S in {4096, 32768} only")
  parser.add_argument("--sweep", action="store_true",
                      help="time the kernels' tuning variants and split counts, no reference")
  parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
  parser.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic GPU kernel")
  parser.add_argument("--mosaic-configs", action="store_true",
                      help="also time the Mosaic kernel's other configs (its SWEEP)")
  parser.add_argument("--no-triton", action="store_true",
                      help="time the Mosaic kernel (and its configs) only, no Triton, no reference")
  parser.add_argument("--batch-invariant", action="store_true",
                      help="also time each kernel's batch-invariant mode (fixed splits)")
  parser.add_argument("--fp8-vs-bf16", action="store_true",
                      help="also time the Mosaic kernel with both caches in turn a shape: "
                           "\"fp8/bf16\"")
  parser.add_argument("--against-rev", metavar="REV",
                      help="also time the Mosaic kernel's default at git revision REV and today's "
                           "in turn: \"REV/now\"")
  parser.add_argument("--iters", type=int, default=20, help="back-to-back calls per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result tables")
  args = parser.parse_args(argv)
  require_gpu("benchmarks.bench_decode")
  old = module_at_revision(mosaic.__name__, args.against_rev) if args.against_rev else None
  if args.quick:
    args.batch, args.seq = [128], [4096, 32768]
  rows = []
  for batch, heads, seq, dtype_name in itertools.product(args.batch, args.heads, args.seq,
                                                         args.dtype):
    rows += run_case(args, batch, heads, seq, dtype_name)
  for batch, heads, seq in (itertools.product(args.batch, args.heads, args.seq)
                            if args.fp8_vs_bf16 else ()):
    rows += fp8_vs_bf16(args, batch, heads, seq)
  for batch, heads, seq, dtype_name in (itertools.product(args.batch, args.heads, args.seq,
                                                          args.dtype) if old else ()):
    rows += against_revision(args, batch, heads, seq, dtype_name, old)
  print(write_results(rows, "decode_sweep" if args.sweep else "decode", args.out))


if __name__ == "__main__":
  main()
