"""DSA (V3.2) kernels: the pallas_triton backend against the jitted XLA reference, on a GPU.

Parts (V3.2 shapes: L=512, R=64, 64-token pages, top-k 2048, indexer 64 heads x 128, fp8 keys):
  sparse   sparse attention, T in {64, 128, 4096}, N in {16, 32, 64, 128}, bf16 and fp8_ds_mla
           caches, each case timed for pallas_triton and pallas_mosaic (the Mosaic GPU kernel
           runs N < 64 heads in a 64-head tile, or bf16 at N <= 32 in wgmma's N, heads_in "n";
           FLOPs count the N asked for), and for the Mosaic kernel's other configs (its SWEEP;
           cache "<cache> <field>=<value>"; not with --no-sweep-rows; only those named with
           --sweep-rows; fp8_pipeline, fp8_stage_halves, wide_widening, landing_groups, gather_by
           only with the fp8_ds_mla cache; heads_in=n only at N <= 32, and with the fp8_ds_mla cache
           only beside fp8_pipeline=serial or in_place).
           Decode rows (T <= 128) pick 2048 slots each, uniformly from a 1M-token cache (1.2 GB
           bf16), so gathers do not hit L2; a 4096-row prefill chunk picks from one 32K-token
           context (one request: rows share rows, and L2 helps). Bytes = T*2048*row bytes (1152
           bf16, 656 fp8_ds_mla) + q + o, FLOPs = 2*T*N*2048*(576+512). --sparse-valid V: each
           row's first V picks, -1 after (a short context's top-k list; column "valid"), bytes
           and FLOPs over V. --caches-in-turn adds a row a shape timing pallas_mosaic with both
           caches in turn, repeat by repeat, on the same q and slots: "fp8_ds_mla/bf16" (< 1: the
           fp8_ds_mla cache is faster). --against-rev REV adds, in each case's rows, the Mosaic
           kernel's default as git revision REV had it ("<cache> mosaic_sparse at REV": that
           revision's `pallas_kernels/mosaic_sparse.py` beside today's other modules) and today's
           ("<cache> mosaic_sparse now"): what a change moved, timed in turn.
  indexer  logits, T in {128, 2048} over 32K and 128K contexts. T=128: one row per request (decode),
           each sees its whole context; T=2048: one request's last 2048 tokens (causal prefill).
           Bytes = keys each distinct context holds (132 B a token) + the logits written;
           FLOPs = 2*64*128 per visible (row, position). Further rows time the Triton kernel with
           widen_fp8 (e4m3 multiplied as bf16: wgmma instead of f16 mma.sync), pallas_mosaic's
           kernel (fp8 wgmma) and the `pallas` default, against the same XLA.
  topk     top-2048 positions of 128 x 32K, 128 x 128K and 4096 x 32K float32 logits, every
           position visible. Bytes = one read of the logits + the positions written. Further rows
           time the four-kernel path (where the default is v11b's one kernel: "four-kernel") and
           its other threshold forms with its theta: v2 (block-wide compaction per chunk), v3's
           per-lane threshold, v9's (`sectors`: the threshold reads only the 8-position sectors
           whose maximum reaches theta; from 32768 positions), its theta flipped (fused with the
           group maxima or not), v10b's (`lean_select` flipped: for many rows; also at 8 select
           warps), and at rows up to 32K v11 (`row_resident`: one kernel a row, its keys in
           registers, bisecting) and v11b (its search interpolating: the default there); v12
           (the four-kernel path's select interpolating, flipped: many rows' default);
           --topk-rows keeps only some of them (named by their first word). --against-rev REV
           adds the top-k's default as REV had it ("topk at REV": that revision's
           `pallas_kernels/topk.py`) and today's ("topk now"), timed in turn. --topk-shapes
           names other cases (128x8192: rows short of v11b's one kernel).
  step     one layer's DSA decode step: indexer logits + top-k + slots + sparse attention (N=128,
           fp8_ds_mla latent cache), 128 decode rows at 32K context each; pallas_triton's and the
           `pallas` default's, the slots written by the top-k (`topk_slots`, as the layer runs
           it); the default's again with them mapped by XLA after the top-k, as before.
Columns: S is the context a row selects from or scores (positions). Two input sets are rotated
per case, and a case's rows (backends, configs, forms) are timed in turn, repeat by repeat, so the
machine's drift between timings falls on all of them alike (the reference once, after them).
`--quick` (~3 minutes on the H200): T=128 for sparse and indexer, the two 128-row top-k cases and
the step. `--sweep` times each kernel's tuning variants (SWEEPS) at one case a part
instead: sparse at T=128, N=128 (both caches), indexer at T=2048 over 32K (and pallas_mosaic's at
T=128 over 128K too), top-k at 128 x 131072; `--sweep-kernels` narrows it to some kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import (jax_calls, make_parser, module_at_revision, rates, require_gpu,
                               time_interleaved, time_ms, write_results)
from mla_jax import reference
from mla_jax.backends import REFERENCE, get_backend
from mla_jax.cache import DSMLACache, IndexerKCache, LatentCache, positions_to_slots
from mla_jax.indexer import SCORE_BYTES_BOUND
from mla_jax.quant import quantize_indexer_q
from pallas_kernels import indexer as pallas_indexer
from pallas_kernels import mosaic_indexer as pallas_mosaic_indexer
from pallas_kernels import mosaic_sparse as pallas_mosaic_sparse
from pallas_kernels import sparse_attention as pallas_sparse
from pallas_kernels import topk as pallas_topk

L, R, PAGE, TOPK, H, D = 512, 64, 64, 2048, 64, 128
SCALE = (128 + R) ** -0.5
ROW_BYTES = {"bf16": (L + R) * 2, "fp8_ds_mla": L + 4 * L // 128 + 2 * R}
DECODE_CACHE_TOKENS = 1 << 20
# Variants --sweep times, as keyword arguments of the kernels' jit entries.
# MosaicSparseConfig fields that only the fp8_ds_mla entry takes (how its rows are widened).
FP8_DS_MLA_FIELDS = ("fp8_pipeline", "fp8_stage_halves", "wide_widening", "landing_groups",
                     "gather_by")
BF16_FIELDS = ("hand_over_first",)  # MosaicSparseConfig fields only the bf16 entry takes
SWEEPS = {
    "sparse": [dataclasses.asdict(config) for config in pallas_sparse.SWEEP],
    "indexer": [dataclasses.asdict(config) for config in pallas_indexer.SWEEP],
    # pallas_mosaic's indexer: rows, positions and ring slots per program, compute warpgroups, at
    # T=2048 over 32K (rows=4, one request) and at T=128 over 128K (rows=1, a request per row).
    "mosaic_indexer": [dict(rows=rows, chunk=config.chunk, stages=config.stages,
                            compute_wgs=config.compute_wgs)
                       for rows, config in pallas_mosaic_indexer.SWEEP],
    "topk": [dataclasses.asdict(config) for config in pallas_topk.SWEEP],
}
PREFILL_CONTEXT = 32768
K_TOKEN_BYTES = D + 4


def latent_cache(kind, tokens, key):
  """A `tokens`-row latent cache of randn/10 rows (bf16 LatentCache or fp8_ds_mla DSMLACache)."""
  rows = jax.random.normal(key, (tokens, L + R), jnp.float32) / 10
  if kind == "bf16":
    return LatentCache(rows.astype(jnp.bfloat16).reshape(-1, PAGE, L + R), jnp.float32(1.0))
  cache = DSMLACache.allocate(tokens // PAGE, PAGE, L, R)
  return cache.write(rows[:, :L], rows[:, L:], jnp.arange(tokens, dtype=jnp.int32))


def indexer_inputs(t, context, decode, key):
  """(q e4m3, weights, the IndexerKCache, block tables, seq lens) for t rows: one request per row
  when decoding, else one request whose last t tokens are the rows."""
  requests = t if decode else 1
  pages = context // PAGE
  keys = jax.random.split(key, 4)
  perm = jax.random.permutation(keys[0], requests * pages).astype(jnp.int32)
  tables = perm.reshape(requests, pages)
  k = jax.random.normal(keys[1], (requests * context, D), jnp.float32)
  k_cache = IndexerKCache.allocate(requests * pages, PAGE, D).write(
      k, jnp.arange(requests * context, dtype=jnp.int32))
  q, q_scale = quantize_indexer_q(jax.random.normal(keys[2], (t, H, D), jnp.float32))
  weights = jax.random.normal(keys[3], (t, H), jnp.float32) * (H * D) ** -0.5 * q_scale
  if decode:
    lens = jnp.full((t,), context, jnp.int32)
  else:
    tables = jnp.broadcast_to(tables, (t, pages))
    lens = context - t + 1 + jnp.arange(t, dtype=jnp.int32)
  return q, weights, k_cache, tables, lens


def kernel_inputs(q, weights, k_cache, tables, lens):
  """`indexer_inputs` as the kernels take them: the K cache's values and scales as arrays."""
  return q, weights, k_cache.values, k_cache.scales, tables, lens


def chunked_reference_indexer(q, weights, k_cache, tables, lens):
  """The XLA reference by row chunks, as `mla_jax.indexer.Indexer` calls it (bounded buffers)."""
  k_values, k_scales = k_cache.values, k_cache.scales
  t, span = q.shape[0], tables.shape[1] * PAGE
  rows = max(1, SCORE_BYTES_BOUND // (H * span * 4))
  rows = min(t, 1 << (rows.bit_length() - 1))
  split = lambda a: a.reshape(t // rows, rows, *a.shape[1:])
  out = lax.map(lambda a: reference.indexer_logits(a[0], a[1], k_values, k_scales, a[2], a[3]),
                (split(q), split(weights), split(tables), split(lens)))
  return out.reshape(t, span)


def slot_span(t):
  """The cache rows T sparse rows pick from: the whole 1M-token cache at decode rows (T <= 128),
  one 32K-token context at a prefill chunk."""
  return DECODE_CACHE_TOKENS if t <= 128 else PREFILL_CONTEXT


def sparse_sets(t, n, cache, valid):
  """Two (q, cache, slots) of T rows and N heads: each row's first `valid` of 2048 random slots
  within `slot_span(t)`, -1 after."""
  span = slot_span(t)
  sets = []
  for i in range(2):
    kq, ks = jax.random.split(jax.random.key(100 + i))
    # Duplicate picks (a few per row) are harmless here: they only attend to a row twice.
    slots = jax.random.randint(ks, (t, TOPK), 0, span, jnp.int32)
    # Short rows: each row's first `valid` slots, -1 after (a top-k list of a short context).
    slots = slots.at[:, valid:].set(-1)
    sets.append((jax.random.normal(kq, (t, n, L + R), jnp.bfloat16), cache, slots))
  return sets


def mosaic_default(module):
  """`module`'s sparse attention default (today's `pallas_kernels.mosaic_sparse`, or another
  revision's) over either cache layout, as a function of (q, cache, slots)."""
  def call(q, cache, slots):
    if isinstance(cache, DSMLACache):
      return module.sparse_attention_fp8_ds_mla(q, cache.nope, cache.tile_scales, cache.rope,
                                                slots, scale=SCALE)
    return module.sparse_attention(q, cache.data, slots, scale=SCALE, kv_lora_rank=L)
  return call


def run_sparse(args, t, n, kind, cache, valid=TOPK, old=None):
  span = slot_span(t)
  sets = sparse_sets(t, n, cache, valid)
  case_bytes = t * valid * ROW_BYTES[kind] + t * n * (L + R + L) * 2
  flops = 2 * t * n * valid * (L + R + L)
  case = lambda label: case_row("sparse", t, n=n, context=span, cache=label) | (
      {} if valid == TOPK else {"valid": valid})
  # Caches are arguments, never closed over: jit would embed a closed-over array as a constant.
  fn = lambda be: jax.jit(functools.partial(be.sparse_attention, scale=SCALE, kv_lora_rank=L))
  entries = [(case(kind), fn, "pallas_triton"), (case(kind), fn, "pallas_mosaic")]
  # The Mosaic kernel's other configs: its SWEEP beside the chosen CONFIG.
  for cfg in () if args.no_sweep_rows else pallas_mosaic_sparse.SWEEP:
    changed = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()
                        if v != getattr(pallas_mosaic_sparse.CONFIG, k))
    if (not changed or (args.sweep_rows and changed not in args.sweep_rows)
        or any(getattr(cfg, k) != getattr(pallas_mosaic_sparse.CONFIG, k)
               for k in (BF16_FIELDS if kind == "fp8_ds_mla" else FP8_DS_MLA_FIELDS))
        or (cfg.fp8_pipeline == "register_a" and n not in pallas_mosaic_sparse.HEADS_N_TILES)
        or (cfg.heads_in == "n" and (
            n > pallas_mosaic_sparse.HEADS_N_TILES[-1]
            or (kind == "fp8_ds_mla"
                and cfg.fp8_pipeline not in pallas_mosaic_sparse.HEADS_N_FP8_PIPELINES)))):
      # The chosen config, one not asked for, an fp8_ds_mla pipeline on a bf16 cache (or a bf16
      # knob on an fp8_ds_mla one), or heads in
      # wgmma's N where the kernel refuses them (more than 32 heads; fp8_ds_mla unless the
      # pipeline is named and steps 64 slots; "register_a" at other than 16 or 32 heads).
      continue
    other = lambda be, cfg=cfg: jax.jit(functools.partial(mosaic_sparse_variant, cfg=cfg))
    entries.append((case(f"{kind} {changed}"), other, "pallas_mosaic"))
  if old is not None:  # --against-rev: that revision's module and today's, both their defaults
    for label, module in ((f"at {args.against_rev}", old), ("now", pallas_mosaic_sparse)):
      entries.append((case(f"{kind} mosaic_sparse {label}"),
                      lambda be, module=module: jax.jit(mosaic_default(module)), "pallas_mosaic"))
  return timed_rows(args, entries, sets, case_bytes, flops)


def caches_in_turn(args, t, n, caches, valid=TOPK):
  """pallas_mosaic's sparse attention over each cache layout on the same q and slots, timed in
  turn repeat by repeat (`time_interleaved`): "fp8_ds_mla/bf16" (issue 13 asks <= 1)."""
  fn = jax.jit(functools.partial(get_backend("pallas_mosaic").sparse_attention, scale=SCALE,
                                 kv_lora_rank=L))
  ms = time_interleaved({kind: jax_calls(fn, sparse_sets(t, n, cache, valid))
                         for kind, cache in caches.items()}, iters=args.iters,
                        repeats=args.repeats)
  row = case_row("sparse", t, n=n, context=slot_span(t),
                 cache="fp8_ds_mla vs bf16 (Mosaic, in turn)") | (
      {} if valid == TOPK else {"valid": valid})
  row["fp8_ds_mla/bf16"] = ms["fp8_ds_mla"] / ms["bf16"]
  flops = 2 * t * n * valid * (L + R + L)
  for kind in caches:
    row[f"{kind} ms"] = ms[kind]
    row[f"{kind} TFLOP/s"] = flops / ms[kind] / 1e9
  print(row, flush=True)
  return [row]


def mosaic_sparse_variant(q, cache, slots, *, cfg):
  """The Mosaic sparse kernel with config cfg over either cache layout."""
  if isinstance(cache, DSMLACache):
    kwargs = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in BF16_FIELDS}
    return pallas_mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, slots, scale=SCALE, **kwargs)
  kwargs = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in FP8_DS_MLA_FIELDS}
  return pallas_mosaic_sparse.sparse_attention(q, cache.data, slots, scale=SCALE, kv_lora_rank=L,
                                               **kwargs)


def run_indexer(args, t, context):
  decode = t <= 128
  sets = [indexer_inputs(t, context, decode, jax.random.key(200 + i)) for i in range(2)]
  lens = sets[0][4]
  visible = int(lens.sum())
  distinct_tokens = t * context if decode else context
  case_bytes = distinct_tokens * K_TOKEN_BYTES + t * context * 4
  flops = 2 * H * D * visible
  fn = lambda be: jax.jit(be.indexer_logits if be is not REFERENCE else chunked_reference_indexer)
  case = lambda label: case_row("indexer", t, context=context, cache=label)
  # The same kernel with the e4m3 inputs multiplied as bf16 (wgmma instead of mma.sync).
  widened = lambda be: jax.jit(lambda *a: pallas_indexer.indexer_logits(
      *kernel_inputs(*a), widen_fp8=True, interpret=jax.default_backend() != "gpu"))
  # The Mosaic GPU kernel (fp8 wgmma) and the `pallas` default, against the same XLA.
  others = [(case(f"fp8 {name}"), lambda be, name=name: jax.jit(get_backend(name).indexer_logits),
             "pallas_triton") for name in ("pallas_mosaic", "pallas")]
  return timed_rows(args, [(case("fp8 x fp8"), fn, "pallas_triton"),
                           (case("fp8 as bf16"), widened, "pallas_triton")] + others,
                    sets, case_bytes, flops)


def revision_rows(t, s, rev, old):
  """--against-rev's top-k entries: the top-k's default as git revision `rev` had it (`old`: that
  revision's `pallas_kernels.topk`) and today's, each called as (logits, lens, tables)."""
  return [(case_row("topk", t, context=s, cache=f"topk {label}"),
           lambda be, module=module: jax.jit(
               lambda x, lens, _: module.topk_positions(x, lens, TOPK)), "pallas_triton")
          for label, module in ((f"at {rev}", old), ("now", pallas_topk))]


def run_topk(args, t, s, old=None):
  # Each row's block table (64-token pages of its own request, shuffled over a cache of t * s
  # tokens) for the forms that map the selection to slots too.
  num_blocks = t * s // PAGE
  sets = [(jax.random.normal(jax.random.key(300 + i), (t, s), jnp.float32),
           jnp.full((t,), s, jnp.int32),
           jax.random.permutation(jax.random.key(310 + i), num_blocks).astype(jnp.int32).reshape(
               t, s // PAGE)) for i in range(2)]
  case_bytes = t * s * 4 + t * TOPK * 4
  fn = lambda be: jax.jit(lambda x, lens, _: be.topk(x, lens, TOPK))
  entries = [(case_row("topk", t, context=s, cache="default"), fn, "pallas_triton")]
  # v14: the backend's top-k writing the selection's slots too (what the layer runs), and the
  # same selection with its slots mapped by XLA after it (what ran before).
  entries += [
      (case_row("topk", t, context=s, cache="v14, slots (topk_slots)"),
       lambda be: jax.jit(lambda x, lens, tables: be.topk_slots(
           x, lens, TOPK, tables, block_size=PAGE, num_blocks=num_blocks)), "pallas_triton"),
      (case_row("topk", t, context=s, cache="v14, slots mapped apart"),
       lambda be: jax.jit(lambda x, lens, tables: positions_to_slots(
           be.topk(x, lens, TOPK), tables, PAGE, num_blocks)), "pallas_triton")]
  # Each form beside the default (every knob named; a form equal to the default's is left out):
  # the default's four-kernel path (row_resident off), its v2 (block-wide compaction per chunk),
  # v3's per-lane threshold, v9's sector threshold (the other way from the shape's), each with its
  # theta, its theta flipped (fused with the maxima or not), v10b's lean select flipped (8 warps
  # too: fewer registers a thread let two 8-warp programs reside an SM), and v11's one kernel a
  # row (rows up to its limit; v11b: its search interpolating); v12: the four-kernel path's select
  # interpolating (flipped).
  default = pallas_topk.default_config(t, s)
  knobs_of = lambda c: dict(per_lane=c.per_lane, fused_theta=c.fused_theta, sectors=c.sectors,
                            lean_select=c.lean_select, select_warps=c.select_warps,
                            row_resident=c.row_resident, interpolate=c.interpolate)
  four = knobs_of(pallas_topk.four_kernel_config(t, s))  # the four-kernel path
  plain = dict(four, per_lane=False, sectors=False)
  forms = {"four-kernel (row_resident=False)": four,
           "v2 (block compaction)": dict(plain, fused_theta=False),
           "v3, per_lane": dict(plain, per_lane=True),
           f"v9, sectors={not default.sectors}": (
               dict(plain) if default.sectors else dict(plain, sectors=True)),
           f"v3, fused_theta={not default.fused_theta}": dict(
               four, fused_theta=not default.fused_theta),
           f"v10b, lean_select={not default.lean_select}": dict(
               four, lean_select=not default.lean_select),
           "v10b, lean_select, select_warps=8": dict(four, lean_select=True, select_warps=8),
           f"v12, interpolate={not four['interpolate']}": dict(
               four, interpolate=not four["interpolate"])}
  if s <= pallas_topk.RESIDENT_MAX:
    forms["v11, row_resident (bisection)"] = dict(four, row_resident=True, interpolate=False)
    forms["v11b, row_resident, interpolate"] = dict(four, row_resident=True, interpolate=True)
  variants = {}
  for name, knobs in forms.items():  # each program once, the default's not again
    if knobs != knobs_of(default) and knobs not in variants.values():
      variants[name] = knobs
  if args.topk_rows:
    variants = {name: knobs for name, knobs in variants.items()
                if name.split(" ")[0].rstrip(",") in args.topk_rows}
  for name, knobs in variants.items():
    variant = lambda be, knobs=knobs: jax.jit(lambda x, lens, _: pallas_topk.topk_positions(
        x, lens, TOPK, interpret=jax.default_backend() != "gpu", **knobs))
    entries.append((case_row("topk", t, context=s, cache=name), variant, "pallas_triton"))
  if old is not None:
    entries += revision_rows(t, s, args.against_rev, old)
  return timed_rows(args, entries, sets, case_bytes, None)


def run_step(args, t=128, context=32768):
  """Indexer + top-k + slot mapping + sparse attention of one layer, 128 decode rows."""
  latent = latent_cache("fp8_ds_mla", t * context, jax.random.key(400))
  sets = []
  for i in range(2):
    q_idx, w, k_cache, tables, lens = indexer_inputs(t, context, True, jax.random.key(410 + i))
    q = jax.random.normal(jax.random.key(420 + i), (t, 128, L + R), jnp.bfloat16)
    sets.append((q_idx, w, k_cache, tables, lens, q, latent))
  case_bytes = (t * context * K_TOKEN_BYTES + 2 * t * context * 4
                + t * TOPK * ROW_BYTES["fp8_ds_mla"])
  flops = 2 * H * D * t * context + 2 * t * 128 * TOPK * (L + R + L)

  def fn(be, mapped=False):
    # Decode rows of distinct requests: the hint the layer passes (mla_jax.indexer) for such steps.
    logits_fn = (functools.partial(be.indexer_logits, distinct_tables=True) if be is not REFERENCE
                 else chunked_reference_indexer)

    @jax.jit
    def step(q_idx, w, k_cache, tables, lens, q, latent):
      logits = logits_fn(q_idx, w, k_cache, tables, lens)
      if mapped:  # the slots mapped by XLA after the top-k, as before session 28
        slots = positions_to_slots(be.topk(logits, lens, TOPK), tables, PAGE, latent.num_blocks)
      else:  # the top-k writes them (what the layer runs: Indexer.select)
        _, slots = be.topk_slots(logits, lens, TOPK, tables, block_size=PAGE,
                                 num_blocks=latent.num_blocks)
      return be.sparse_attention(q, latent, slots, scale=SCALE, kv_lora_rank=L)
    return step

  # pallas_triton's step and the same step through the `pallas` default (its indexer:
  # pallas_mosaic's where faster), and that one with the slots mapped apart.
  return timed_rows(args, [
      (case_row("step", t, n=128, context=context, cache="fp8_ds_mla"), fn, "pallas_triton"),
      (case_row("step", t, n=128, context=context, cache="fp8_ds_mla pallas"),
       lambda be: fn(get_backend("pallas")), "pallas_triton"),
      (case_row("step", t, n=128, context=context, cache="fp8_ds_mla pallas, slots mapped apart"),
       lambda be: fn(get_backend("pallas"), mapped=True), "pallas_triton")],
      sets, case_bytes, flops)


def run_sweep(args):
  """Each kernel's SWEEPS variants at one case a part (no reference), the variants of a case timed
  in turn (`timed_rows`): config, ms, rates."""
  rows = []

  def timed(cases, sets, case_bytes, flops):
    # cases: (row, fn) of one case's variants; a variant may not compile (shared memory,
    # registers): its row records that.
    rows.extend(timed_rows(args, [(row, lambda be, fn=fn: jax.jit(fn), "pallas_triton")
                                  for row, fn in cases], sets, case_bytes, flops,
                           reference=False))

  t, n = 128, 128
  if "sparse" in args.parts and "sparse" in args.sweep_kernels:
    for kind in ("bf16", "fp8_ds_mla"):
      cache = latent_cache(kind, DECODE_CACHE_TOKENS, jax.random.key(1))
      sets = [(jax.random.normal(jax.random.key(100 + i), (t, n, L + R), jnp.bfloat16), cache,
               jax.random.randint(jax.random.key(110 + i), (t, TOPK), 0, DECODE_CACHE_TOKENS,
                                  jnp.int32)) for i in range(2)]
      if kind == "bf16":
        variant = lambda q, c, s, cfg: pallas_sparse.sparse_attention(
            q, c.data, s, scale=SCALE, kv_lora_rank=L, **cfg)
      else:
        variant = lambda q, c, s, cfg: pallas_sparse.sparse_attention_fp8_ds_mla(
            q, c.nope, c.tile_scales, c.rope, s, scale=SCALE, **cfg)
      timed([({**case_row("sparse", t, n=n, context=DECODE_CACHE_TOKENS, cache=kind), **cfg},
              functools.partial(variant, cfg=cfg)) for cfg in SWEEPS["sparse"]],
            sets, t * TOPK * ROW_BYTES[kind] + t * n * (L + R + L) * 2,
            2 * t * n * TOPK * (L + R + L))
      del cache, sets
  if "indexer" in args.parts:
    if "indexer" in args.sweep_kernels:
      t, context = 2048, 32768
      sets = [kernel_inputs(*indexer_inputs(t, context, False, jax.random.key(200 + i)))
              for i in range(2)]
      timed([({**case_row("indexer", t, context=context, cache="fp8 x fp8"), **cfg},
              functools.partial(pallas_indexer.indexer_logits, **cfg))
             for cfg in SWEEPS["indexer"]],
            sets, context * K_TOKEN_BYTES + t * context * 4, 2 * H * D * int(sets[0][5].sum()))
    # The Mosaic kernel's SWEEP in its two cases (rows=4 at T=2048 over 32K; rows=1, decode rows
    # over 128K), each case's configs in turn.
    mosaic = SWEEPS["mosaic_indexer"] if "mosaic_indexer" in args.sweep_kernels else ()
    for rows_per_program in dict.fromkeys(cfg["rows"] for cfg in mosaic):
      t, context = (2048, 32768) if rows_per_program == 4 else (128, 131072)
      sets = [kernel_inputs(*indexer_inputs(t, context, rows_per_program == 1,
                                            jax.random.key(200 + i))) for i in range(2)]
      distinct = context if rows_per_program == 4 else t * context
      timed([({**case_row("indexer", t, context=context, cache="fp8 pallas_mosaic"), **cfg},
              functools.partial(pallas_mosaic_indexer.indexer_logits, **cfg))
             for cfg in mosaic if cfg["rows"] == rows_per_program],
            sets, distinct * K_TOKEN_BYTES + t * context * 4, 2 * H * D * int(sets[0][5].sum()))
  if "topk" in args.parts and "topk" in args.sweep_kernels:
    t, s = 128, 131072
    sets = [(jax.random.normal(jax.random.key(300 + i), (t, s), jnp.float32),
             jnp.full((t,), s, jnp.int32)) for i in range(2)]
    timed([({**case_row("topk", t, context=s), **cfg},
            lambda x, lens, cfg=cfg: pallas_topk.topk_positions(x, lens, TOPK, **cfg))
           for cfg in SWEEPS["topk"]], sets, t * s * 4 + t * TOPK * 4, None)
  return rows


def case_row(part, t, *, n="", context="", cache=""):
  """The leading columns of a result row, the same for every part."""
  return {"part": part, "T": t, "N": n, "S": context, "cache": cache}


def timed_rows(args, entries, sets, case_bytes, flops, reference=True):
  """One case's rows, each entry (row, fn, backend) timing fn(get_backend(backend)) on the rotated
  sets, all of them in turn, repeat by repeat (`time_interleaved`: the machine's drift between
  separate timings moved a ~65 us top-k by tens of percent in session 25); then, unless --no-ref
  or not `reference`, the first entry's fn(reference) once, every row's "xla ms" and speedup. A
  program that does not compile or fit records its error and is left out of the timing."""
  calls = {}
  for i, (row, fn, backend) in enumerate(entries):
    row["kernel"] = backend
    try:
      built = fn(get_backend(backend))
      jax.block_until_ready(built(*sets[0]))
      calls[i] = jax_calls(built, sets)
    except Exception as e:  # noqa: BLE001  (record it, go on)
      row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
  ms = time_interleaved(calls, iters=args.iters, repeats=args.repeats) if calls else {}
  xla_ms = None
  if reference and ms and not args.no_ref:
    try:
      xla_ms = time_ms(entries[0][1](REFERENCE), sets, warmup=1, iters=max(2, args.iters // 4),
                       repeats=3)
    except Exception as e:  # noqa: BLE001
      entries[0][0]["xla error"] = f"{type(e).__name__}: {str(e)[:80]}"
  for i, (row, _, _) in enumerate(entries):
    if i in ms:
      row.update(rates(ms[i], bytes_moved=case_bytes, flops=flops))
      if xla_ms is not None:
        row["xla ms"] = xla_ms
        row["speedup"] = xla_ms / ms[i]
    print(row, flush=True)
  return [row for row, _, _ in entries]


def _rows_by_positions(text):
  """argparse type of "TxS" -> (T, S): a top-k case of T rows of S logits."""
  rows, _, positions = text.partition("x")
  if not (rows.isdigit() and positions.isdigit() and int(rows) > 0 and int(positions) > 0):
    raise argparse.ArgumentTypeError(f"want ROWSxPOSITIONS, e.g. 128x131072, got {text!r}")
  return int(rows), int(positions)


def main(argv=None):
  parser = make_parser("benchmarks.bench_sparse", __doc__)
  parser.add_argument("--parts", nargs="+", default=["sparse", "indexer", "topk", "step"],
                      choices=["sparse", "indexer", "topk", "step"], help="what to time (above)")
  parser.add_argument("--quick", action="store_true", help="T=128 cases, 128-row top-k, the step")
  parser.add_argument("--sparse-t", type=int, nargs="+",
                      help="sparse cases' T (default 64 128 4096)")
  parser.add_argument("--sparse-n", type=int, nargs="+", default=[16, 32, 64, 128],
                      help="sparse cases' head counts")
  parser.add_argument("--sparse-caches", nargs="+", default=["bf16", "fp8_ds_mla"],
                      choices=["bf16", "fp8_ds_mla"], help="sparse cases' cache layouts")
  parser.add_argument("--sparse-valid", type=int, nargs="+", default=[TOPK],
                      help=f"sparse cases: valid slots a row (its first ones, -1 after; default "
                           f"{TOPK}, all); bytes and FLOPs count the valid ones")
  parser.add_argument("--caches-in-turn", action="store_true",
                      help="sparse: also time pallas_mosaic with both caches in turn a shape "
                           "(\"fp8_ds_mla/bf16\")")
  parser.add_argument("--sweep", action="store_true", help="time each kernel's tuning variants")
  parser.add_argument("--sweep-kernels", nargs="+", default=list(SWEEPS), choices=list(SWEEPS),
                      help="--sweep: only these kernels' variants (default all)")
  parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
  parser.add_argument("--no-sweep-rows", action="store_true",
                      help="sparse cases: only the Mosaic kernel's chosen config, not its SWEEP")
  parser.add_argument("--sweep-rows", nargs="+", metavar="FIELD=VALUE",
                      help="sparse cases: only these of the Mosaic kernel's SWEEP configs, named "
                           "as in the cache column (e.g. fp8_pipeline=half_rows)")
  parser.add_argument("--topk-shapes", nargs="+", type=_rows_by_positions, metavar="TxS",
                      help="top-k cases instead of 128x32768, 128x131072 and 4096x32768")
  parser.add_argument("--topk-rows", nargs="+", metavar="VERSION",
                      help="top-k cases: beside the default, only these variants' rows, named by "
                           "the version opening their cache column (e.g. v9 v10b)")
  parser.add_argument("--against-rev", metavar="REV",
                      help="sparse and top-k cases: also the Mosaic sparse kernel's (the top-k's) "
                           "default at git revision REV and today's, in the case's rows")
  parser.add_argument("--iters", type=int, default=20, help="back-to-back calls per timing")
  parser.add_argument("--repeats", type=int, default=5, help="timings; the median is reported")
  parser.add_argument("--out", default="benchmarks/out", help="directory for the result tables")
  args = parser.parse_args(argv)
  if not all(1 <= v <= TOPK for v in args.sparse_valid):
    parser.error(f"--sparse-valid takes 1 to {TOPK} slots a row, got {args.sparse_valid}")
  require_gpu("benchmarks.bench_sparse")
  old, old_topk = ((module_at_revision(m.__name__, args.against_rev)
                    for m in (pallas_mosaic_sparse, pallas_topk)) if args.against_rev
                   else (None, None))
  if args.sweep:
    print(write_results(run_sweep(args), "sparse_sweep", args.out))
    return
  sparse_t = args.sparse_t or ([128] if args.quick else [64, 128, 4096])
  indexer_t = [128] if args.quick else [128, 2048]
  topk_shapes = args.topk_shapes or (
      [(128, 32768), (128, 131072)] + ([] if args.quick else [(4096, 32768)]))
  rows = []
  if "sparse" in args.parts:
    for kind in args.sparse_caches:
      decode_cache = latent_cache(kind, DECODE_CACHE_TOKENS, jax.random.key(1))
      for t, n, valid in itertools.product(sparse_t, args.sparse_n, args.sparse_valid):
        rows += run_sparse(args, t, n, kind, decode_cache, valid, old)
      del decode_cache
  if "sparse" in args.parts and args.caches_in_turn:
    caches = {kind: latent_cache(kind, DECODE_CACHE_TOKENS, jax.random.key(1))
              for kind in ("bf16", "fp8_ds_mla")}
    for t, n, valid in itertools.product(sparse_t, args.sparse_n, args.sparse_valid):
      rows += caches_in_turn(args, t, n, caches, valid)
    del caches
  if "indexer" in args.parts:
    for t, ctx in itertools.product(indexer_t, (32768, 131072)):
      rows += run_indexer(args, t, ctx)
  if "topk" in args.parts:
    for t, s in topk_shapes:
      rows += run_topk(args, t, s, old_topk)
  if "step" in args.parts:
    rows += run_step(args)
  print(write_results(rows, "sparse", args.out))


if __name__ == "__main__":
  main()
