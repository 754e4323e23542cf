"""MLA prefill (causal, q/k 192, v 128, bf16): the Pallas-Triton kernel against XLA, cuDNN and SDPA,
and the Mosaic GPU kernel (pallas_mosaic) beside it.

FLOPs count the causal half only: 2 * N * S*S/2 * (192 + 128) per request. Two input sets are
rotated (each is 4-40x the 60 MB L2). The timed path is the pallas_triton backend's prefill (the
kernel at its tuned configuration); rivals, each timed as a backend would call it:
  xla    mla_jax.reference.mha_prefill, jitted (f32 HIGHEST inside);
  cudnn  jax.nn.dot_product_attention(implementation='cudnn'), v zero-padded to 192 and o sliced
         back to 128 (cuDNN refuses Dv != Dk), requests as a [B, S] batch of equal lengths;
  sdpa   torch scaled_dot_product_attention (is_causal, bf16) on the same [T, N, D] memory layout,
         timed with CUDA events.
Mosaic columns: "mosaic ms", "mosaic TFLOP/s", "triton/mosaic" (> 1: Mosaic is faster) and the
largest difference of its output from the Triton kernel's; a compile or run failure is recorded in
"mosaic error" and the row goes on.
`--sweep` times the Triton kernel's (block_q, block_k, num_warps, num_stages) variants and the
Mosaic kernel's (block_k, num_stages, ping_pong) ones instead.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics

import jax
import jax.numpy as jnp

from benchmarks.common import make_parser, rates, require_gpu, time_ms, write_results
from mla_jax import reference
from mla_jax.backends import get_backend
from pallas_kernels import mla_prefill as kernel
from pallas_kernels import mosaic_prefill as mosaic_kernel

DK, DV = 192, 128
SCALE = DK**-0.5


def input_sets(batch, seq, heads, num_sets=2):
  """num_sets (q, k, v, cu_seqlens) of `batch` equal requests, random bf16, packed [T, N, D]."""
  cu = jnp.arange(batch + 1, dtype=jnp.int32) * seq
  sets = []
  for i in range(num_sets):
    kq, kk, kv = jax.random.split(jax.random.key(i), 3)
    shape = (batch * seq, heads)
    sets.append((jax.random.normal(kq, shape + (DK,), jnp.bfloat16),
                 jax.random.normal(kk, shape + (DK,), jnp.bfloat16),
                 jax.random.normal(kv, shape + (DV,), jnp.bfloat16), cu))
  return sets


def pallas_fn(seq, **cfg):
  return lambda q, k, v, cu: kernel.mla_prefill(q, k, v, cu, cu, scale=SCALE, causal=True,
                                                max_seqlen_q=seq, **cfg)


def backend_fn(seq, name="pallas_triton"):
  prefill = get_backend(name).prefill
  return lambda q, k, v, cu: prefill(q, k, v, cu, cu, scale=SCALE, causal=True, max_seqlen_q=seq)


def xla_fn():
  return jax.jit(lambda q, k, v, cu: reference.mha_prefill(q, k, v, cu, cu, scale=SCALE,
                                                           causal=True))


def cudnn_fn(batch, seq):
  @jax.jit
  def fn(q, k, v, cu):
    del cu  # equal lengths: a plain [B, S] batch
    split = lambda x: x.reshape(batch, seq, *x.shape[1:])
    v = jnp.pad(v, ((0, 0), (0, 0), (0, DK - DV)))
    o, lse = jax.nn.dot_product_attention(split(q), split(k), split(v), scale=SCALE, is_causal=True,
                                          implementation="cudnn", return_residual=True)
    return o[..., :DV].reshape(batch * seq, -1, DV), lse
  return fn


def sdpa_ms(sets, batch, seq, iters, repeats):
  """Median ms of torch SDPA on the same device buffers (shared through DLPack, no copy)."""
  import torch  # only on machines that have it
  import torch.nn.functional as F

  def to_torch(x):  # [B*S, N, D] -> a [B, N, S, D] view of the [B, S, N, D] memory, like ours
    t = torch.from_dlpack(x)
    return t.reshape(batch, seq, *t.shape[1:]).transpose(1, 2)

  tsets = [[to_torch(x) for x in s[:3]] for s in sets]
  call = lambda i: F.scaled_dot_product_attention(*tsets[i % len(tsets)], is_causal=True,
                                                  scale=SCALE)
  for i in range(3):
    call(i)
  samples = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
      call(i)
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) / iters)
  return statistics.median(samples)


def run_case(args, batch, seq, heads):
  sets = input_sets(batch, seq, heads)
  flops = batch * 2 * heads * seq * seq / 2 * (DK + DV)
  base = {"case": f"{batch}x{seq}", "N": heads}
  timed = functools.partial(time_ms, arg_sets=sets, iters=args.iters, repeats=args.repeats)

  if args.sweep:
    rows = []
    for config in kernel.SWEEP:
      cfg = dataclasses.asdict(config)
      try:  # a variant may not compile (shared memory): record that and go on
        row = {**base, **cfg, **rates(timed(pallas_fn(seq, **cfg)), flops=flops)}
      except Exception as e:  # noqa: BLE001
        row = {**base, **cfg, "error": f"{type(e).__name__}: {str(e)[:80]}"}
      print(row, flush=True)
      rows.append(row)
    # The Mosaic kernel's variants, timed unless --no-mosaic.
    for config in () if args.no_mosaic else mosaic_kernel.SWEEP:
      cfg = dataclasses.asdict(config)
      fn = lambda q, k, v, cu, cfg=cfg: mosaic_kernel.mla_prefill(
          q, k, v, cu, cu, scale=SCALE, causal=True, max_seqlen_q=seq, **cfg)
      try:
        row = {**base, "kernel": "mosaic", **cfg, **rates(timed(fn), flops=flops)}
      except Exception as e:  # noqa: BLE001
        row = {**base, "kernel": "mosaic", **cfg, "error": f"{type(e).__name__}: {str(e)[:80]}"}
      print(row, flush=True)
      rows.append(row)
    return rows

  ms = {"backend": timed(backend_fn(seq))}
  row = {**base, **rates(ms["backend"], flops=flops)}
  if not args.no_mosaic:
    try:  # a first GPU run may not compile: record that and go on
      mosaic_fn = backend_fn(seq, "pallas_mosaic")
      outs = [fn(*sets[0])[0].astype(jnp.float32) for fn in (mosaic_fn, backend_fn(seq))]
      row["mosaic ms"] = timed(mosaic_fn)
      row["mosaic TFLOP/s"] = flops / row["mosaic ms"] / 1e9
      row["triton/mosaic"] = ms["backend"] / row["mosaic ms"]
      row["mosaic vs triton max diff"] = float(jnp.abs(outs[0] - outs[1]).max())
    except Exception as e:  # noqa: BLE001
      row["mosaic error"] = f"{type(e).__name__}: {str(e)[:80]}"
  rivals = {"xla": lambda: time_ms(xla_fn(), sets, warmup=1, iters=2, repeats=3),
            "cudnn": lambda: timed(cudnn_fn(batch, seq)),
            "sdpa": lambda: sdpa_ms(sets, batch, seq, args.iters, args.repeats)}
  for name in args.rivals:
    try:
      ms[name] = rivals[name]()
      row[f"{name} TFLOP/s"] = flops / ms[name] / 1e9
      row[f"x {name}"] = ms[name] / ms["backend"]
    except Exception as e:  # noqa: BLE001  (torch absent, cuDNN refusing a shape)
      row[f"x {name}"] = f"{type(e).__name__}: {str(e)[:60]}"
  print(row, flush=True)
  return [row]


def main(argv=None):
  parser = make_parser("benchmarks.bench_prefill", __doc__)
  parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384],
                      help="prompt lengths S (one request each)")
  parser.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="heads N")
  parser.add_argument("--batched", action="store_true", help="also 4 requests of 4096 tokens")
  parser.add_argument("--rivals", nargs="*", default=["xla", "cudnn", "sdpa"],
                      choices=["xla", "cudnn", "sdpa"], help="implementations timed beside ours")
  parser.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic GPU kernel")
  parser.add_argument("--sweep", action="store_true", help="time kernel variants, no rivals")
  parser.add_argument("--iters", type=int, default=10, help="back-to-back calls per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result tables")
  args = parser.parse_args(argv)
  require_gpu("benchmarks.bench_prefill")
  shapes = [(1, s) for s in args.tokens] + ([(4, 4096)] if args.batched else [])
  rows = []
  for (batch, seq), heads in itertools.product(shapes, args.heads):
    rows += run_case(args, batch, seq, heads)
  print(write_results(rows, "prefill_sweep" if args.sweep else "prefill", args.out))


if __name__ == "__main__":
  main()
