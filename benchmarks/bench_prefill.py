"""MLA prefill (causal, q/k 192, v 128, bf16): the Pallas-Triton kernel against XLA, cuDNN and SDPA,
and the Mosaic GPU kernel (pallas_mosaic) beside it.

FLOPs count the causal half only: 2 * N * S*S/2 * (192 + 128) per request. Two input sets are
rotated (each is 4-40x the 60 MB L2). The timed path is the pallas_triton backend's prefill (the
kernel at its tuned configuration); rivals, each timed as a backend would call it:
  xla    mla_jax.reference.mha_prefill, jitted (f32 HIGHEST inside);
  cudnn  jax.nn.dot_product_attention(implementation='cudnn'), v zero-padded to 192 and o sliced
         back to 128 (cuDNN refuses Dv != Dk), requests as a [B, S] batch of equal lengths;
  sdpa   torch scaled_dot_product_attention (is_causal, bf16) on the same [T, N, D] memory layout,
         timed as ours are (host clock around queued calls, the slope between iters and 2 iters
         calls), its repeats taken in turn with the Triton and Mosaic kernels'
         (`time_interleaved`).
Mosaic columns: "mosaic ms", "mosaic TFLOP/s", "triton/mosaic" (> 1: Mosaic is faster), "mosaic x
sdpa" and the largest difference of its output from the Triton kernel's; "grid ms" and
"grid/persistent" time the same kernel with one program per (query slot, head, request) instead of
its persistent queue; a compile or run failure is recorded in "mosaic error" and the row goes on.
`--mosaic-variant FIELD=VALUE ...` (repeatable) also times the Mosaic kernel with those
MosaicPrefillConfig fields changed, in the same run; for a variant named "FIELD=VALUE ..." (e.g.
"persistent=True"): "<name> ms", "<name> TFLOP/s", "default/<name>" (> 1: the variant is faster),
"<name> x sdpa" and "<name> max diff" (the largest difference from the default's output).
`--sweep` times the Triton kernel's (block_q, block_k, num_warps, num_stages) variants and the
Mosaic kernel's (its SWEEP: block_k, num_stages, ping_pong, the persistent queue and its L2
sections, intra_overlap) ones instead;
`--no-triton` leaves the Triton variants out.

`--context R NEW CTX` times the chunked-context prefill end to end (SPEC section 5): the MLA layer's
prefill path (`MLAAttention._prefill`, DeepSeek-V3 dims, N heads, bf16, `--backend`) for R requests
of NEW new tokens over CTX cached tokens each, the context read back in `--workspace`-row chunks.
Parts, each timed alone on its own inputs, with its share of their sum: "new" (up-project the new
tokens' latents, causal attention), "ctx gather+up" (every chunk's cache gather and up-projection),
"ctx attention" (every chunk's non-causal attention on those keys/values, for the query rows of
the requests in the chunk: "query rows a chunk"), "merge" (the LSE merges into those rows).
"all rows ms" times the whole path with every chunk attending with all prefill rows (as before
session 7's windows), "all rows / windows" > 1: the windows are faster. The keys go to the prefill
split (`MLAAttention.split_k_pe`, the default: k_nope and k_pe apart, no [T, N, 192] keys built);
the same path with them joined in the same run: "joined ms", "joined / split k_pe" (> 1: the split
is faster), its "new", "ctx gather+up" and "ctx attention" parts, and "split vs joined max diff"
(of the two outputs; 0 if the kernel gives the same bits).
FLOPs: attention 2*N*(NEW^2/2 + NEW*CTX)*(192 + 128) per request; up-projection
2*(NEW + CTX)*512*N*(128 + 128) per request; TFLOP/s are given over attention alone and over both.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import (field_value, jax_calls, make_parser, rates, require_gpu,
                               time_interleaved, time_ms, write_results)
from mla_jax import reference
from mla_jax.attention import MLAAttention, merge_rows
from mla_jax.backends import get_backend
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
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


def sdpa_calls(sets, batch, seq):
  """`(launch, sync)` of torch SDPA on the same device buffers (shared through DLPack, no copy),
  for `time_interleaved`: timed as ours are (host clock around queued calls, `per_call_ms`)."""
  import torch  # only on machines that have it
  import torch.nn.functional as F

  def to_torch(x):  # [B*S, N, D] -> a [B, N, S, D] view of the [B, S, N, D] memory, like ours
    t = torch.from_dlpack(x)
    return t.reshape(batch, seq, *t.shape[1:]).transpose(1, 2)

  tsets = [[to_torch(x) for x in s[:3]] for s in sets]
  launch = lambda i: F.scaled_dot_product_attention(*tsets[i % len(tsets)], is_causal=True,
                                                    scale=SCALE)
  return launch, torch.cuda.synchronize


def run_case(args, batch, seq, heads):
  sets = input_sets(batch, seq, heads)
  flops = batch * 2 * heads * seq * seq / 2 * (DK + DV)
  base = {"case": f"{batch}x{seq}", "N": heads}
  timed = functools.partial(time_ms, arg_sets=sets, iters=args.iters, repeats=args.repeats)

  if args.sweep:
    rows = []
    for config in () if args.no_triton else kernel.SWEEP:
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

  # The Triton kernel, the Mosaic one and SDPA timed in turn, repeat by repeat (time_interleaved).
  calls = {"backend": jax_calls(backend_fn(seq), sets)}
  variants = []  # the --mosaic-variant names timed in this row
  row = dict(base)
  if not args.no_mosaic:
    try:  # a first GPU run may not compile: record that and go on
      mosaic_fn = backend_fn(seq, "pallas_mosaic")
      outs = [fn(*sets[0])[0].astype(jnp.float32) for fn in (mosaic_fn, backend_fn(seq))]
      row["mosaic vs triton max diff"] = float(jnp.abs(outs[0] - outs[1]).max())
      calls["mosaic"] = jax_calls(mosaic_fn, sets)
    except Exception as e:  # noqa: BLE001
      row["mosaic error"] = f"{type(e).__name__}: {str(e)[:80]}"
  if "sdpa" in args.rivals:
    try:
      calls["sdpa"] = sdpa_calls(sets, batch, seq)
    except Exception as e:  # noqa: BLE001  (torch absent)
      row["x sdpa"] = f"{type(e).__name__}: {str(e)[:60]}"
  ms = time_interleaved(calls, iters=args.iters, repeats=args.repeats)
  row.update(rates(ms["backend"], flops=flops))
  if "mosaic" in ms:
    row["mosaic ms"] = ms.pop("mosaic")
    row["mosaic TFLOP/s"] = flops / row["mosaic ms"] / 1e9
    row["triton/mosaic"] = ms["backend"] / row["mosaic ms"]
    try:
      row["grid ms"] = timed(lambda q, k, v, cu: mosaic_kernel.mla_prefill(
          q, k, v, cu, cu, scale=SCALE, causal=True, max_seqlen_q=seq, persistent=False))
      row["grid/persistent"] = row["grid ms"] / row["mosaic ms"]
      for fields in args.mosaic_variant:
        name = " ".join(f"{k}={v}" for k, v in fields.items())
        variant = lambda q, k, v, cu, fields=fields: mosaic_kernel.mla_prefill(
            q, k, v, cu, cu, scale=SCALE, causal=True, max_seqlen_q=seq, **fields)
        row[f"{name} max diff"] = float(jnp.abs(
            variant(*sets[0])[0].astype(jnp.float32) - outs[0]).max())
        row[f"{name} ms"] = timed(variant)
        row[f"{name} TFLOP/s"] = flops / row[f"{name} ms"] / 1e9
        row[f"default/{name}"] = row["mosaic ms"] / row[f"{name} ms"]
        variants.append(name)
    except Exception as e:  # noqa: BLE001
      row["mosaic error"] = f"{type(e).__name__}: {str(e)[:80]}"
  rivals = {"xla": lambda: time_ms(xla_fn(), sets, warmup=1, iters=2, repeats=3),
            "cudnn": lambda: timed(cudnn_fn(batch, seq))}  # sdpa: timed above, with ours
  for name in args.rivals:
    if name == "sdpa" and "sdpa" not in ms:
      continue  # torch absent: the row says why
    try:
      if name in rivals:
        ms[name] = rivals[name]()
      row[f"{name} TFLOP/s"] = flops / ms[name] / 1e9
      row[f"x {name}"] = ms[name] / ms["backend"]
    except Exception as e:  # noqa: BLE001  (torch absent, cuDNN refusing a shape)
      row[f"x {name}"] = f"{type(e).__name__}: {str(e)[:60]}"
  if "sdpa" in ms and "mosaic ms" in row:
    row["mosaic x sdpa"] = ms["sdpa"] / row["mosaic ms"]
  for name in variants if "sdpa" in ms else ():
    row[f"{name} x sdpa"] = ms["sdpa"] / row[f"{name} ms"]
  print(row, flush=True)
  return [row]


def context_setup(contexts, news, heads, workspace, backend):
  """The MLA layer (DeepSeek-V3 dims, `heads` heads, bf16, unit-ish weights, `backend`) and one
  step of requests of news[i] new tokens over contexts[i] cached ones (random bf16 cache, page 64),
  the context read back in `workspace`-row chunks: (layer, q, kv_c, k_pe, cache, md). The same
  arguments give the same weights and inputs on any backend."""
  config = MLAConfig.preset("DeepSeek-V3").replace(num_heads=heads)
  layer = MLAAttention(config, backend=backend, dtype=jnp.bfloat16)
  keys = jax.random.split(jax.random.key(0), 7)
  lora, rope = config.kv_lora_rank, config.qk_rope_head_dim
  # Weights and latents at unit-ish scale, so that keys and values are O(1) like the other cases.
  layer.W_UK_T[...] = (jax.random.normal(keys[0], layer.W_UK_T.shape) * lora**-0.5).astype(
      jnp.bfloat16)
  layer.W_UV[...] = (jax.random.normal(keys[1], layer.W_UV.shape) * lora**-0.5).astype(jnp.bfloat16)
  page = 64
  pages = [-(-(c + n) // page) for c, n in zip(contexts, news)]
  first = [sum(pages[:i]) for i in range(len(pages))]
  cache = LatentCache(jax.random.normal(keys[2], (sum(pages), page, lora + rope), jnp.bfloat16),
                      jnp.float32(1.0))
  md, _ = build_metadata([RequestState(c, n, range(f, f + p))
                          for c, n, f, p in zip(contexts, news, first, pages)],
                         block_size=page, num_blocks=sum(pages), max_blocks_per_seq=max(pages),
                         context_workspace=workspace)
  t = md.num_rows
  q = jax.random.normal(keys[3], (t, heads, config.qk_head_dim), jnp.bfloat16)
  kv_c = jax.random.normal(keys[4], (t, lora), jnp.bfloat16)
  k_pe = jax.random.normal(keys[5], (t, rope), jnp.bfloat16)
  return layer, q, kv_c, k_pe, cache, md


def context_case(args, requests, new, context, heads):
  """The chunked-context prefill through the layer (see the module docstring): total and parts,
  with the keys joined and split (`split_k_pe`, the default)."""
  joined, q, kv_c, k_pe, cache, md = context_setup([context] * requests, [new] * requests, heads,
                                                   args.workspace, args.backend)
  joined.split_k_pe = False
  split = nnx.clone(joined)
  split.split_k_pe = True
  lora = joined.config.kv_lora_rank
  scale, be = joined.config.softmax_scale, joined.backend
  cu = md.prefill_query_start_loc

  def jitted(fn, layer):  # every array an argument (not a constant folded into the program)
    graphdef, _ = nnx.split(layer)
    return jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a))

  def gathered(layer, cache, md):  # every chunk's (keys, values, k_pe or None), stacked [C, W, ...]
    rows = jax.vmap(lambda slots: be.gather_cache(cache, slots))(md.context_slots)
    return jax.vmap(lambda r: layer._up_project(r[:, :lora], r[:, lora:]))(rows)

  def context_attention(layer, q, k, v, k_pe, md):  # each chunk's (first row, o, lse)
    return [layer._context_attention(q, k[c], v[c], md.context_cu_seqlens[c], md,
                                     None if k_pe is None else k_pe[c])
            for c in range(k.shape[0])]

  def new_tokens(layer, q, kv_c, k_pe, md):
    k, v, k_pe = layer._up_project(kv_c, k_pe)
    return be.prefill(q, k, v, cu, cu, scale=scale, causal=True,
                      max_seqlen_q=md.max_prefill_query_len, k_pe=k_pe)

  def merge(o, lse, parts):
    return functools.reduce(lambda acc, part: merge_rows(*acc, *part), parts, (o, lse))

  timed = functools.partial(time_ms, iters=args.iters, repeats=args.repeats)
  # Until session 7 every chunk's attention took all prefill rows: the same path without windows.
  every_row = dataclasses.replace(md, context_query_rows=None)
  ms, outs = {}, {}
  for name, layer in (("", split), (" joined", joined)):
    state = nnx.state(layer)
    total = jitted(lambda layer, *a: layer._prefill(*a), layer)
    gather_part, attention_part = jitted(gathered, layer), jitted(context_attention, layer)
    new_part = jitted(new_tokens, layer)
    keys = gather_part(state, cache, md)
    outs[name] = total(state, q, kv_c, k_pe, cache, md)
    ms["total" + name] = timed(total, [(state, q, kv_c, k_pe, cache, md)])
    if not name:
      ms["total all rows"] = timed(total, [(state, q, kv_c, k_pe, cache, every_row)])
    ms["new" + name] = timed(new_part, [(state, q, kv_c, k_pe, md)])
    ms["ctx gather+up" + name] = timed(gather_part, [(state, cache, md)])
    ms["ctx attention" + name] = timed(attention_part, [(state, q, *keys, md)])
    if not name:  # the same merges either way
      o, lse = new_part(state, q, kv_c, k_pe, md)
      parts = attention_part(state, q, *keys, md)
      ms["merge"] = timed(jax.jit(merge), [(o, lse, parts)])
  chunks = md.context_slots.shape[0]
  attn_flops = requests * 2 * heads * (new * new / 2 + new * context) * (192 + 128)
  up_flops = requests * 2 * (new + context) * lora * heads * (128 + 128)
  parts_ms = sum(ms[name] for name in ("new", "ctx gather+up", "ctx attention", "merge"))
  row = {"case": f"{requests}x{new} over {context} ctx", "N": heads, "backend": be.name,
         "chunks": chunks, "query rows a chunk": md.context_query_rows, "ms": ms["total"],
         "attn TFLOP/s": attn_flops / ms["total"] / 1e9,
         "all TFLOP/s": (attn_flops + up_flops) / ms["total"] / 1e9,
         "all rows ms": ms["total all rows"],
         "all rows / windows": ms["total all rows"] / ms["total"]}
  for name in ("new", "ctx gather+up", "ctx attention", "merge"):
    row[f"{name} ms"] = ms[name]
    row[f"{name} %"] = 100 * ms[name] / parts_ms
  ctx_flops = requests * 2 * heads * new * context * 320
  row["ctx attention TFLOP/s"] = ctx_flops / ms["ctx attention"] / 1e9
  # The joined keys ([T, N, 192] built, as before session 8), in the same run.
  row["joined ms"] = ms["total joined"]
  row["joined attn TFLOP/s"] = attn_flops / ms["total joined"] / 1e9
  row["joined / split k_pe"] = ms["total joined"] / ms["total"]
  for name in ("new", "ctx gather+up", "ctx attention"):
    row[f"{name} joined ms"] = ms[f"{name} joined"]
  row["ctx attention joined TFLOP/s"] = ctx_flops / ms["ctx attention joined"] / 1e9
  row["split vs joined max diff"] = float(jnp.abs(outs[""].astype(jnp.float32)
                                                  - outs[" joined"].astype(jnp.float32)).max())
  print(row, flush=True)
  return [row]


def config_field(text):
  """`field_value`, FIELD a MosaicPrefillConfig field."""
  field, value = field_value(text)
  names = {f.name for f in dataclasses.fields(mosaic_kernel.MosaicPrefillConfig)}
  if field not in names:
    raise argparse.ArgumentTypeError(f"want FIELD=VALUE, FIELD one of {sorted(names)}; got {text}")
  return field, value


def main(argv=None):
  parser = make_parser("benchmarks.bench_prefill", __doc__)
  parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 16384],
                      help="prompt lengths S (one request each); none: only --context")
  parser.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="heads N")
  parser.add_argument("--batched", action="store_true",
                      help="also 4 requests of 4096 tokens and 8 of 1024")
  parser.add_argument("--rivals", nargs="*", default=["xla", "cudnn", "sdpa"],
                      choices=["xla", "cudnn", "sdpa"], help="implementations timed beside ours")
  parser.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic GPU kernel")
  parser.add_argument("--sweep", action="store_true", help="time kernel variants, no rivals")
  parser.add_argument("--no-triton", action="store_true",
                      help="with --sweep: time the Mosaic kernel's variants only")
  parser.add_argument("--mosaic-variant", nargs="+", type=config_field, metavar="FIELD=VALUE",
                      action="append", default=[],
                      help="also time the Mosaic kernel with these config fields changed "
                           "(repeatable: one variant each)")
  parser.add_argument("--iters", type=int, default=10, help="back-to-back calls per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--context", type=int, nargs=3, metavar=("R", "NEW", "CTX"),
                      help="also the chunked-context prefill: R requests of NEW tokens over CTX")
  parser.add_argument("--workspace", type=int, default=8192,
                      help="context rows read back per chunk (--context)")
  parser.add_argument("--backend", default="pallas", help="backend of the --context case")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result tables")
  args = parser.parse_args(argv)
  args.mosaic_variant = [dict(fields) for fields in args.mosaic_variant]
  require_gpu("benchmarks.bench_prefill")
  shapes = [(1, s) for s in args.tokens] + ([(4, 4096), (8, 1024)] if args.batched else [])
  rows = []
  for heads in args.heads if args.context else []:
    rows += context_case(args, *args.context, heads)
  for (batch, seq), heads in itertools.product(shapes, args.heads):
    rows += run_case(args, batch, seq, heads)
  print(write_results(rows, "prefill_sweep" if args.sweep else "prefill", args.out))


if __name__ == "__main__":
  main()
