"""A decoder step's attention over 1, 2 and 4 GPUs: tensor parallelism (tp), decode context
parallelism (dcp) and both, against one GPU: equality, wall time, device busy time, bounds.

For the multi-GPU machines (nvidia-h200-x2, -x4): every layout of LAYOUTS that fits the devices
(1 GPU, tp=2, tp=4, dcp=2, dcp=2 x tp=2, dcp=4). The step is `--layers` DeepSeek-V3 attention
layers (hidden 7168, N=128, Lq 1536, L 512, R 64; page 64) with their residual adds in one jitted
program, each with its own latent cache, as a decoder's attention runs in one step (the MLPs and
MoE are left out): per layer the projections, the decode kernel, o_proj and, under tp, o_proj's
all-reduce; under dcp the LSE merge of the cache shards' partial attentions. The backend is
`pallas` (the GPU default) when registered. Metadata is built on the host for the layout's dcp
and placed on the mesh once (`sharding.place_metadata`), as generate does.
1. Equality, fp32 (matmuls at HIGHEST): one layer, two prompts prefilled (one in two chunks, so
   earlier context is read back from the cache), then decode steps, per layout and backend
   (reference and the benchmark's); every output within 1e-4 of the largest 1-GPU value, caches
   the same.
2. Equality, bf16 at the benchmark size: one decode step of B requests over S cached tokens each
   (random caches, shuffled page tables, so every request's pages spread over the dcp ranges);
   cosine difference < 1e-3, max abs <= 4/128 of the largest 1-GPU value.
3. Wall time of that step, jitted, the caches donated and threaded through the steps: median
   over `--repeats` runs of `--iters` back-to-back steps; speedup over 1 GPU.
4. Device busy time per step from a jax.profiler trace of `--trace-steps` steps: per GPU the
   union of its kernels' intervals on its streams, and the shares of Pallas kernels, matmuls,
   collectives (NCCL) and the rest; "busy" is the busiest GPU's. Wall minus busy is host and
   launch time the devices waited for.
5. The bound of each layout: the longer of the bytes one device must read per step (its share of
   the caches: all of them under tp, 1/dcp under dcp; its shards of the weights) at the H200's
   copy rate (benchmarks.common.H200_COPY_GBPS) and its FLOPs (1/tp of the heads, 1/dcp of the
   tokens) at the bf16 rate, "bound by" saying which; and the speedup that bound allows over 1 GPU.
`--dcp-merge` picks how dcp merges its partial attentions (`sharded_backend.DCP_MERGES`): one
float32 all-reduce of o (all_reduce), an all-gather of (o in bf16, lse in float32) (all_gather), or
only the lse reduced, the weighted parts summed by o_proj's all-reduce (o_proj).
`--quick`: a small config (hidden 256, 16 heads), 2 layers, B=4, S=256: a smoke run. `--on-cpu`
runs on host CPU devices with the reference backend (set
XLA_FLAGS=--xla_force_host_platform_device_count=8 first): a check that the benchmark runs, with
no GPU lanes in the trace and timings of no interest.
Prints every measurement, then exits 1 if any check failed.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import tempfile
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import (H200_BF16_TFLOPS, H200_COPY_GBPS, make_parser, require_gpu,
                               time_steps, write_results)
from mla_jax import backends, sharding
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, bucket, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step
from mla_jax.sharded_backend import DCP_AXIS, DCP_MERGES, TP_AXIS, dcp_size, mesh_axis

CONFIG = MLAConfig.preset("DeepSeek-V3")
# V3's head and latent sizes (what the kernels take), a narrow model: 16 heads, hidden 256.
QUICK_CONFIG = CONFIG.replace(hidden_size=256, num_heads=16, q_lora_rank=64)
PAGE = 64
LAYOUTS = {"1 GPU": {}, "tp=2": dict(tp=2), "tp=4": dict(tp=4), "dcp=2": dict(dcp=2),
           "dcp=2 x tp=2": dict(dcp=2, tp=2), "dcp=4": dict(dcp=4)}
# Check 1: tokens per request per step (a 96-token prompt in two chunks, a 40-token one, decodes).
SCHEDULE = [[64, 40], [32, 1], [1, 1], [1, 1]]
SMALL_BLOCKS, SMALL_TABLE = 16, 4  # check 1's cache: 16 pages, 4 per request (256 tokens)
# Trace event names by kind (GPU kernel names: Pallas kernels keep their Python names, cuBLAS /
# CUTLASS matmuls and NCCL kernels theirs).
KINDS = (("collective", re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|"
                                   r"reduce-scatter|reduce_scatter|collective", re.I)),
         ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma_|dot", re.I)),
         ("pallas", re.compile(r"decode|prefill|sparse|indexer|topk|mosaic|triton|pallas|_kernel",
                               re.I)))


class AttentionStack(nnx.Module):
  """`layers` attention layers with residual adds: the attention of a decoder step."""

  def __init__(self, config, layers, *, backend, dtype, rngs):
    self.layers = nnx.List([DeepseekV2MLAAttention(config, backend=backend, dtype=dtype,
                                                   param_dtype=dtype, rngs=rngs)
                            for _ in range(layers)])

  def __call__(self, x, caches, md):
    new = []
    for layer, cache in zip(self.layers, caches):
      h, cache = layer(x, cache, md)
      x = x + h
      new.append(cache)
    return x, tuple(new)


def make_stack(config, layers, backend, dtype, layout, dcp_merge):
  """Seed-0 layers on a mesh of `layout` (1 GPU: no mesh)."""
  stack = AttentionStack(config, layers, backend=backend, dtype=dtype, rngs=nnx.Rngs(0))
  if not layout:
    return stack, None
  mesh = sharding.make_mesh(**layout)
  return sharding.shard_layer(stack, mesh, dcp_merge=dcp_merge), mesh


def place_caches(caches, mesh):
  """Fresh copies of `caches` (every step donates the ones it takes) on the mesh."""
  caches = jax.tree.map(jnp.copy, caches)
  return caches if mesh is None else tuple(sharding.shard_cache(c, mesh) for c in caches)


def place_step(x, md, mesh):
  return (x, md) if mesh is None else (sharding.place(x, mesh), sharding.place_metadata(md, mesh))


def check_prefill_decode(config, backend, layouts, merges):
  """Check 1 for one backend: {layout: (max output diff / max |1-GPU output|, caches equal)}."""
  rng = np.random.default_rng(0)
  tables = rng.permutation(SMALL_BLOCKS)[:2 * SMALL_TABLE].reshape(2, SMALL_TABLE)
  xs, done = [], [0, 0]
  for q_lens in SCHEDULE:
    xs.append([rng.standard_normal((q, config.hidden_size)).astype(np.float32) for q in q_lens])
  nan_cache = LatentCache(jnp.full((SMALL_BLOCKS, PAGE, config.latent_dim), jnp.nan),
                          jnp.float32(1))
  results = {}
  with jax.default_matmul_precision("highest"):
    for name, layout, merge in layout_runs(layouts, merges):
      stack, mesh = make_stack(config, 1, backend, jnp.float32, layout, merge)
      step, caches = jitted_step(stack), place_caches((nan_cache,), mesh)
      outs, done = [], [0, 0]
      for q_lens, x in zip(SCHEDULE, xs):
        md, layout_ = build_metadata(
            [RequestState(done[i], q, tables[i]) for i, q in enumerate(q_lens)],
            block_size=PAGE, num_blocks=SMALL_BLOCKS, max_blocks_per_seq=SMALL_TABLE,
            context_workspace=32, dcp=dcp_size(mesh))
        x_step, md = place_step(jnp.asarray(layout_.pack(x)), md, mesh)
        out, caches = step(x_step, caches, md)
        outs.append(np.asarray(out))
        done = [d + q for d, q in zip(done, q_lens)]
      results[name] = (outs, np.asarray(caches[0].data))
  ref_outs, ref_cache = results.pop("1 GPU")
  scale = max(np.abs(o).max() for o in ref_outs)
  return {name: (max(np.abs(a - b).max() for a, b in zip(outs, ref_outs)) / scale,
                 np.array_equal(np.isnan(cache), np.isnan(ref_cache))
                 and np.nanmax(np.abs(cache - ref_cache)) <= 1e-5 * np.nanmax(np.abs(ref_cache)))
          for name, (outs, cache) in results.items()}


def fitting_layouts(names=None):
  """The layouts of `names` (default: all) this machine's devices can hold, 1 GPU first."""
  n = len(jax.devices())
  return {k: v for k, v in LAYOUTS.items() if v.get("tp", 1) * v.get("dcp", 1) <= n
          and (names is None or k in names or not v)}


def layout_runs(names, merges):
  """(name, layout, dcp merge) of every fitting layout of `names`, each dcp layout once per merge
  of `merges` (its name then saying which), the others once."""
  runs = []
  for name, layout in fitting_layouts(names).items():
    for merge in (merges if "dcp" in layout else merges[:1]):
      runs.append((f"{name} ({merge})" if "dcp" in layout and len(merges) > 1 else name, layout,
                   merge))
  return runs


def decode_inputs(config, batch, seq):
  """x [B (bucketed), hidden] bf16, the key of the random caches (`random_caches`), and the B
  requests' page tables over a pool of B*S/PAGE pages: each request's pages a random draw."""
  kx, kc, kp = jax.random.split(jax.random.key(1), 3)
  per_req = seq // PAGE
  tables = np.asarray(jax.random.permutation(kp, batch * per_req)).reshape(batch, per_req)
  x = jax.random.normal(kx, (bucket(batch, 8), config.hidden_size), jnp.bfloat16)  # md's rows
  return x, kc, tables


def random_caches(config, key, num_blocks, layers, mesh):
  """`layers` random bf16 latent caches, made where they live (blocks split over dcp)."""
  spec = P() if mesh is None else P(mesh_axis(mesh, DCP_AXIS))
  where = {} if mesh is None else {"out_shardings": NamedSharding(mesh, spec)}
  fill = jax.jit(lambda k: jax.random.normal(k, (num_blocks, PAGE, config.latent_dim),
                                             jnp.bfloat16) * 0.1, **where)
  caches = tuple(LatentCache(fill(k), jnp.float32(1)) for k in jax.random.split(key, layers))
  return caches if mesh is None else tuple(sharding.shard_cache(c, mesh) for c in caches)


def step_metadata(tables, seq, num_blocks, mesh):
  md, _ = build_metadata([RequestState(seq - 1, 1, t) for t in tables], block_size=PAGE,
                         num_blocks=num_blocks, max_blocks_per_seq=tables.shape[1],
                         dcp=dcp_size(mesh))
  return md


def device_busy(trace_dir, steps: int) -> dict | None:
  """Per GPU of a jax.profiler trace under `trace_dir`: busy ms per step (the union of its kernel
  intervals) and ms per step by kind (KINDS, else "other"); None when it has no GPU lanes."""
  path = next(Path(trace_dir).rglob("perfetto_trace.json.gz"), None)
  if path is None:
    return None
  events = json.loads(gzip.open(path).read())
  return busy_from_events(events["traceEvents"] if isinstance(events, dict) else events, steps)


def busy_from_events(events, steps: int) -> dict | None:
  """`device_busy` of a list of Chrome trace events: processes named "/device:GPU:<i>", their
  threads named "Stream ..." (the kernels; XLA's op and module lines span them), complete ("X")
  events with microsecond ts and dur."""
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpus = {pid: name for pid, name in procs.items() if re.search(r"/device:GPU:\d+", name)}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpus}
  out = {}
  for pid, name in sorted(gpus.items(), key=lambda kv: kv[1]):
    streams = {tid for (p, tid), t in threads.items() if p == pid and t.startswith("Stream")}
    kernels = [e for e in events if e.get("ph") == "X" and e["pid"] == pid
               and (not streams or e.get("tid") in streams)]
    if not kernels:
      continue
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, -np.inf
    for a, b in spans:
      busy += max(0.0, b - max(a, end))
      end = max(end, b)
    kinds = dict.fromkeys([k for k, _ in KINDS] + ["other"], 0.0)
    for e in kernels:
      kinds[next((k for k, pattern in KINDS if pattern.search(e["name"])), "other")] += e["dur"]
    out[re.search(r"GPU:\d+", name).group()] = {
        "busy": busy / steps / 1e3, **{k: v / steps / 1e3 for k, v in kinds.items()}}
  return out or None


def traced(step, x, caches, md, steps):
  """Device busy figures of `steps` traced steps (see `device_busy`). The caches it takes are
  donated and dropped: a layout's caches must be gone before the next layout's are made (at
  B=256, S=32K one GPU holds 77 GB of them, and tp=2 wants as much again on each GPU)."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(steps):
        out, caches = step(x, caches, md)
      jax.block_until_ready((out, caches))
    return device_busy(d, steps)


def bound_ms(stack, caches, config, batch, seq, mesh):
  """(ms, "bytes" or "flops"): the least time one device needs per step, the longer of reading
  its shards of the caches and of the weights a decode step reads (kv_b_proj's kernel is read as
  the absorbed W_UK_T and W_UV) at H200_COPY_GBPS, and its FLOPs at H200_BF16_TFLOPS: 2 per
  weight element and token, and the attention's 2 * (N/tp) * (S/dcp) * (576 + 512) per layer and
  token (at 128 heads the decode kernel is bound by FLOPs, not bytes)."""
  local = lambda a: a.addressable_shards[0].data
  weights = [a for path, a in jax.tree_util.tree_flatten_with_path(nnx.state(stack))[0]
             if "kv_b_proj" not in jax.tree_util.keystr(path)]
  read_ms = sum(local(a).nbytes for a in weights + [c.data for c in caches]) / H200_COPY_GBPS / 1e6
  tp = 1 if mesh is None else mesh.shape.get(TP_AXIS, 1)
  attn = 2 * (config.num_heads // tp) * (seq // dcp_size(mesh)) * (
      config.latent_dim + config.kv_lora_rank) * len(caches)
  flops = batch * (2 * sum(local(a).size for a in weights) + attn)
  flop_ms = flops / H200_BF16_TFLOPS / 1e9
  return (read_ms, "bytes") if read_ms >= flop_ms else (flop_ms, "flops")


def measure(args, config, backend, batch, seq, ref, failures):
  """The rows of one (B, S): every fitting layout. `ref` holds the 1-GPU output and figures."""
  x, key, tables = decode_inputs(config, batch, seq)
  num_blocks = tables.size
  rows = []
  for name, layout, merge in layout_runs(args.layouts, args.dcp_merge):
    row = {"layout": name, "B": batch, "S": seq, "layers": args.layers}
    try:
      stack, mesh = make_stack(config, args.layers, backend, jnp.bfloat16, layout, merge)
      caches = random_caches(config, key, num_blocks, args.layers, mesh)
      xs, md = place_step(x, step_metadata(tables, seq, num_blocks, mesh), mesh)
      step = jitted_step(stack)
      row["bound ms"], row["bound by"] = bound_ms(stack, caches, config, batch, seq, mesh)
      out, caches = step(xs, caches, md)
      out = np.asarray(out.astype(jnp.float32))[:batch]
      if not layout:
        ref.update(out=out, bound=row["bound ms"])
      else:
        cos = 1 - 2 * np.sum(out * ref["out"]) / np.sum(out ** 2 + ref["out"] ** 2)
        err = np.abs(out - ref["out"]).max() / np.abs(ref["out"]).max()
        row.update({"cos diff": float(cos), "max err / max": float(err)})
        if not (cos < 1e-3 and err <= 4 / 128):
          failures.append(f"check 2 {name} B={batch} S={seq}: cos diff {cos:.2e}, max err "
                          f"{err:.2e}")
      ms = time_steps(step, xs, caches, md, iters=args.iters, repeats=args.repeats)
      row["ms"] = ms
      if not layout:
        ref["ms"] = ms
      row["speedup"] = ref["ms"] / ms if "ms" in ref else float("nan")
      row["bound speedup"] = ref["bound"] / row["bound ms"] if "bound" in ref else float("nan")
      row["% of bound"] = 100 * row["bound ms"] / ms
      try:  # time_steps donated the caches: fresh ones for the trace
        busy = traced(step, xs, random_caches(config, key, num_blocks, args.layers, mesh), md,
                      args.trace_steps)
      except Exception as e:  # noqa: BLE001 - the timings stand without the trace
        traceback.print_exc()
        busy, row["trace error"] = None, f"{type(e).__name__}: {str(e)[:80]}"
        failures.append(f"trace {name} B={batch} S={seq}: raised")
      if busy:
        top = max(busy.values(), key=lambda b: b["busy"])
        row["busy ms"] = top["busy"]
        total = sum(v for k, v in top.items() if k != "busy") or 1.0
        row.update({f"% {k}": 100 * v / total for k, v in top.items() if k != "busy"})
        row["busy per GPU"] = " ".join(f"{g}:{b['busy']:.3f}" for g, b in busy.items())
    except Exception as e:  # noqa: BLE001 - report it and go on to the other layouts
      traceback.print_exc()
      row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
      failures.append(f"layout {name} B={batch} S={seq}: raised")
    print(row, flush=True)
    rows.append(row)
  return rows


def main(argv=None):
  default = "pallas" if "pallas" in backends.BACKENDS else "reference"
  parser = make_parser("benchmarks.bench_tp", __doc__)
  parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="decode requests B")
  parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768],
                      help="cached tokens S of every request")
  parser.add_argument("--layers", type=int, default=8, help="attention layers in the step")
  parser.add_argument("--backend", default=None, choices=sorted(backends.BACKENDS),
                      help=f"the layers' backend (default {default}; reference with --on-cpu; "
                           "check 1 also runs the reference)")
  parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                      help="the layouts to run (1 GPU always runs; default: all that fit)")
  parser.add_argument("--dcp-merge", nargs="+", default=["all_reduce"], choices=DCP_MERGES,
                      help="how dcp merges its partial attentions (several: each dcp layout runs "
                           "once per merge)")
  parser.add_argument("--iters", type=int, default=20, help="back-to-back steps per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--trace-steps", type=int, default=5, help="steps in the profiler trace")
  parser.add_argument("--skip-check1", action="store_true", help="skip the fp32 check 1")
  parser.add_argument("--quick", action="store_true",
                      help="small config, 2 layers, B=4, S=256, 3 iterations: a smoke run")
  parser.add_argument("--on-cpu", action="store_true",
                      help="run on host CPU devices (see above), reference backend")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result table")
  args = parser.parse_args(argv)
  if args.on_cpu:
    if len(jax.devices()) < 2:
      sys.exit("--on-cpu needs several host devices: set "
               "XLA_FLAGS=--xla_force_host_platform_device_count=8 before python starts")
  else:
    require_gpu("benchmarks.bench_tp", min_devices=2)
  backend = args.backend or ("reference" if args.on_cpu else default)
  config = CONFIG
  if args.quick:
    config, args.layers, args.batch, args.seq = QUICK_CONFIG, 2, [4], [256]
    args.iters, args.repeats, args.trace_steps = 3, 1, 2
  print(f"devices: {jax.devices()}; backend {backend}; "
        f"layouts {list(fitting_layouts(args.layouts))}; "
        f"{args.layers} layers; page {PAGE}; dcp merges {args.dcp_merge}", flush=True)
  failures = []

  if not args.skip_check1:
    for be in dict.fromkeys(["reference", backend]):
      try:
        for name, (rel, cache_ok) in check_prefill_decode(config, be, args.layouts,
                                                             args.dcp_merge).items():
          ok = rel <= 1e-4 and cache_ok
          print(f"check 1 ({be}, fp32, prefill + decode) {name}: max diff {rel:.2e} of the "
                f"largest output, cache {'same' if cache_ok else 'DIFFERENT'}: "
                f"{'ok' if ok else 'FAIL'}", flush=True)
          if not ok:
            failures.append(f"check 1 {be} {name}")
      except Exception:  # noqa: BLE001 - report it and go on to the other measurements
        traceback.print_exc()
        failures.append(f"check 1 {be}: raised")

  rows = []
  for seq in args.seq:
    for batch in args.batch:
      rows += measure(args, config, backend, batch, seq, {}, failures)
  print(write_results(rows, "tp", args.out))
  if failures:
    print("FAILED: " + "; ".join(failures))
    sys.exit(1)
  print("all checks passed")


if __name__ == "__main__":
  main()
