"""The MLA layer over 2 GPUs: equality with one GPU, then decode throughput of TP=2 (DCP=2) vs 1.

For the 2-GPU machine (kind nvidia-h200-x2). DeepSeek-V3 layer shapes (hidden 7168, N=128,
Lq 1536, L 512, R 64), page 64; the backend is pallas_triton when registered, else the reference.
Meshes: "1 GPU" is the plain layer (no mesh); "tp=2" splits heads, "dcp=2" the cache's blocks.
1. Equality, fp32 with matmuls at HIGHEST precision, reference and benchmark backends: two prompts
   prefilled (one in two chunks, so earlier context is read back from the cache), then decode
   steps; every step's output within 1e-4 of the largest 1-GPU value, and the caches the same.
2. Equality, bf16 at the benchmark size: one decode step of B requests over S cached tokens each
   (random cache, shuffled page tables); cosine difference < 1e-3, max abs <= 4/128 of the largest.
   The programs round bf16 at different points (XLA may keep excess precision inside one fusion
   and not across a shard_map boundary), which costs ~1e-5 to 1e-4; a wrong head or merge > 1e-2.
3. Throughput of that decode step, jitted, the cache donated and threaded through the steps:
   median over repeats of `iters` back-to-back steps; tokens/s, speedup over 1 GPU, and the rate
   at which the whole cache (B*S*576*2 bytes) is read.
Prints every measurement, then exits 1 if any check failed.
"""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import make_parser, require_gpu, time_steps, write_results
from mla_jax import backends, sharding
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step

CONFIG = MLAConfig.preset("DeepSeek-V3")
PAGE = 64
MESHES = {"1 GPU": None, "tp=2": dict(tp=2), "dcp=2": dict(dcp=2)}
# Check 1: tokens per request per step (a 96-token prompt in two chunks, a 40-token one, decodes).
SCHEDULE = [[64, 40], [32, 1], [1, 1], [1, 1]]
SMALL_BLOCKS, SMALL_TABLE = 16, 4  # check 1's cache: 16 pages, 4 per request (256 tokens)


def make_layer(backend, dtype, mesh_kw):
  """The layer with seed-0 weights, sharded on a mesh of `mesh_kw` (None: one GPU, no mesh)."""
  layer = DeepseekV2MLAAttention(CONFIG, backend=backend, dtype=dtype, param_dtype=dtype,
                                 rngs=nnx.Rngs(0))
  return layer if mesh_kw is None else sharding.shard_layer(layer, sharding.make_mesh(**mesh_kw))


def place(cache, layer):
  """A fresh copy of `cache` (every step donates the one it takes) on the layer's mesh."""
  cache = jax.tree.map(jnp.copy, cache)
  mesh = layer.mla_attn.mesh
  return cache if mesh is None else sharding.shard_cache(cache, mesh)


def check_prefill_decode(backend):
  """Check 1 for one backend: {mesh name: (max output diff / max |1-GPU output|, cache diff)}."""
  rng = np.random.default_rng(0)
  tables = rng.permutation(SMALL_BLOCKS)[:2 * SMALL_TABLE].reshape(2, SMALL_TABLE)
  steps, done = [], [0, 0]
  for q_lens in SCHEDULE:
    md, layout = build_metadata([RequestState(done[i], q, tables[i]) for i, q in enumerate(q_lens)],
                                block_size=PAGE, num_blocks=SMALL_BLOCKS,
                                max_blocks_per_seq=SMALL_TABLE, context_workspace=32)
    x = layout.pack([rng.standard_normal((q, CONFIG.hidden_size)).astype(np.float32)
                     for q in q_lens])
    steps.append((jnp.asarray(x), md))
    done = [d + q for d, q in zip(done, q_lens)]
  nan_cache = LatentCache(jnp.full((SMALL_BLOCKS, PAGE, CONFIG.latent_dim), jnp.nan),
                          jnp.float32(1))
  results = {}
  with jax.default_matmul_precision("highest"):
    for name, mesh_kw in MESHES.items():
      layer = make_layer(backend, jnp.float32, mesh_kw)
      step, cache = jitted_step(layer), place(nan_cache, layer)
      outs = []
      for x, md in steps:
        out, cache = step(x, cache, md)
        outs.append(np.asarray(out))
      results[name] = (outs, np.asarray(cache.data))
  ref_outs, ref_cache = results.pop("1 GPU")
  scale = max(np.abs(o).max() for o in ref_outs)
  return {name: (max(np.abs(a - b).max() for a, b in zip(outs, ref_outs)) / scale,
                 np.array_equal(np.isnan(cache), np.isnan(ref_cache))
                 and np.nanmax(np.abs(cache - ref_cache)) <= 1e-5 * np.nanmax(np.abs(ref_cache)))
          for name, (outs, cache) in results.items()}


def decode_inputs(batch, seq):
  """x [B, hidden] bf16, a random bf16 cache of B*S/PAGE pages, and the decode step's metadata."""
  kx, kc, kp = jax.random.split(jax.random.key(1), 3)
  per_req = seq // PAGE
  tables = np.asarray(jax.random.permutation(kp, batch * per_req)).reshape(batch, per_req)
  md, _ = build_metadata([RequestState(seq - 1, 1, t) for t in tables], block_size=PAGE,
                         num_blocks=batch * per_req, max_blocks_per_seq=per_req)
  x = jax.random.normal(kx, (md.num_rows, CONFIG.hidden_size), jnp.bfloat16)
  data = (jax.random.normal(kc, (batch * per_req, PAGE, CONFIG.latent_dim), jnp.float32) / 10)
  return x, LatentCache(data.astype(jnp.bfloat16), jnp.float32(1)), md


def main(argv=None):
  default = "pallas_triton" if "pallas_triton" in backends.BACKENDS else "reference"
  parser = make_parser("benchmarks.bench_tp", __doc__)
  parser.add_argument("--batch", type=int, default=64, help="decode requests B")
  parser.add_argument("--seq", type=int, default=8192, help="cached tokens S of every request")
  parser.add_argument("--backend", default=default, choices=sorted(backends.BACKENDS),
                      help="the layer's backend (checks 1 also run the reference)")
  parser.add_argument("--iters", type=int, default=20, help="back-to-back steps per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result table")
  args = parser.parse_args(argv)
  require_gpu("benchmarks.bench_tp", min_devices=2)
  print(f"devices: {jax.devices()[:2]}; backend {args.backend}; B={args.batch} S={args.seq} "
        f"page {PAGE}", flush=True)
  failures = []

  for backend in dict.fromkeys(["reference", args.backend]):
    try:
      for name, (rel, cache_ok) in check_prefill_decode(backend).items():
        ok = rel <= 1e-4 and cache_ok
        print(f"check 1 ({backend}, fp32, prefill + decode) {name}: max diff {rel:.2e} of the "
              f"largest output, cache {'same' if cache_ok else 'DIFFERENT'}: "
              f"{'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
          failures.append(f"check 1 {backend} {name}")
    except Exception:  # noqa: BLE001 - report it and go on to the other measurements
      traceback.print_exc()
      failures.append(f"check 1 {backend}: raised")

  x, cache, md = decode_inputs(args.batch, args.seq)
  cache_bytes = cache.data.size * cache.data.dtype.itemsize
  rows, ref = [], None
  for name, mesh_kw in MESHES.items():
    row = {"layout": name, "backend": args.backend, "B": args.batch, "S": args.seq}
    try:
      layer = make_layer(args.backend, jnp.bfloat16, mesh_kw)
      step = jitted_step(layer)
      out, _ = step(x, place(cache, layer), md)
      out = np.asarray(out.astype(jnp.float32))[:args.batch]
      if ref is None:
        ref = out
      else:
        cos = 1 - 2 * np.sum(out * ref) / np.sum(out ** 2 + ref ** 2)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        row.update({"cos diff": float(cos), "max err / max": float(err)})
        if not (cos < 1e-3 and err <= 4 / 128):
          failures.append(f"check 2 {name}: cos diff {cos:.2e}, max err {err:.2e}")
      ms = time_steps(step, x, place(cache, layer), md, iters=args.iters, repeats=args.repeats)
      row.update({"ms": ms, "tok/s": args.batch / ms * 1e3, "cache GB/s": cache_bytes / ms / 1e6})
      row["speedup"] = rows[0]["ms"] / ms if rows and "ms" in rows[0] else 1.0
    except Exception as e:  # noqa: BLE001 - report it and go on to the other layouts
      traceback.print_exc()
      row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
      failures.append(f"layout {name}: raised")
    print(row, flush=True)
    rows.append(row)
  print(write_results(rows, "tp", args.out))
  if failures:
    print("FAILED: " + "; ".join(failures))
    sys.exit(1)
  print("all checks passed")


if __name__ == "__main__":
  main()
