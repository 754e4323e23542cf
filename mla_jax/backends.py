"""The backend table: a backend name maps to a value of pure functions plus what they support.

Contracts (every backend, same shapes and dtypes; see `mla_jax.reference` for the semantics).
Caches come in as cache objects (`mla_jax.cache`), which the backend asks for their arrays and
scale; the kernels under it take and return plain arrays.
  decode(q [T,N,L+R], cache (LatentCache), block_tables [T,MB], seq_lens [T], *, scale,
         kv_lora_rank, num_kv_splits=None, batch_invariant=False) -> (o [T,N,L], lse [T,N] f32);
         batch_invariant: each row's output bit-identical alone and in any batch (splits of a
         fixed number of tokens, merged in a fixed order)
  prefill(q [Tq,N,Dk], k [Tk,N,Dk], v [Tk,N,Dv], cu_seqlens_q [R+1], cu_seqlens_k [R+1], *, scale,
          causal, max_seqlen_q, k_pe=None) -> (o [Tq,N,Dv], lse [Tq,N] f32);
          k_pe [Tk,R] (q's dtype): the split form, k [Tk,N,Dk-R] holding each head's own key
          columns and k_pe the last R, the same for every head (MLA's rope keys): the keys are
          [k | k_pe broadcast to every head], never built by the caller (pallas_mosaic's kernel
          never builds them; the others join them inside: a copy)
  write_cache(cache (a LatentCacheKind), kv_c_normed [T,L], k_pe [T,R], slot_mapping [T]) -> cache
  gather_cache(cache (a LatentCacheKind), slots [W]) -> rows [W, L+R] f32
  sparse_attention(q [T,N,L+R], cache (LatentCache | DSMLACache), slots [T,K], *, scale,
                   kv_lora_rank) -> (o [T,N,L], lse [T,N] f32)
  indexer_logits(q [T,H,D], weights [T,H], k_cache (IndexerKCache), block_tables [T,MB],
                 seq_lens [T], *, distinct_tables=False) -> logits [T, MB*BS] f32;
                 distinct_tables: a speed hint, never a correctness one: True says consecutive
                 rows (almost always) belong to different requests (decode rows), so a kernel
                 that groups rows sharing a table need not look for groups (pallas_mosaic's, which
                 otherwise checks on the device); the logits are the same either way up to
                 float32 rounding (pallas_mosaic on the H200: a few ulps where rows share tables;
                 bit for bit in the interpreter), rows that share tables included (only slower)
  topk(logits [T,S], seq_lens [T], topk) -> positions [T, topk] int32 (-1 padded)
  topk_slots(logits [T,S], seq_lens [T], topk, block_tables [T,MB], *, block_size, num_blocks)
             -> (positions, slots [T, topk] int32): topk's positions and their cache slots,
             `cache.positions_to_slots` of them exactly (the Pallas kernels write both, so no
             mapping pass runs between the selection and sparse attention)
  write_indexer_cache(k_cache (IndexerKCache), k [T,D], slot_mapping [T]) -> k_cache
Every entry checks its arguments against the contract first (a ValueError naming what was wrong
and what is supported, before any kernel is traced); -1 and out-of-range slots or blocks are masked.
Selection: an explicit name, else $MLA_JAX_BACKEND, else by platform (GPU -> Pallas, else the
XLA reference).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from typing import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from mla_jax import cache as caches
from mla_jax import reference
from mla_jax.metadata import CONTEXT_MIN_QUERY_ROWS
from pallas_kernels import indexer as pallas_indexer
from pallas_kernels import latent_decode as pallas_latent_decode
from pallas_kernels import mla_prefill as pallas_mla_prefill
from pallas_kernels import mosaic_decode as pallas_mosaic_decode
from pallas_kernels import mosaic_indexer as pallas_mosaic_indexer
from pallas_kernels import mosaic_prefill as pallas_mosaic_prefill
from pallas_kernels import mosaic_sparse as pallas_mosaic_sparse
from pallas_kernels import sparse_attention as pallas_sparse
from pallas_kernels import topk as pallas_topk
from pallas_kernels.common import (BATCH_INVARIANT_SPLIT_TOKENS, FLOAT_DTYPES, check_decode_args,
                                   check_indexer_args, check_prefill_args, check_sparse_args,
                                   check_topk_args, join_k_pe)

ENV_VAR = "MLA_JAX_BACKEND"


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  decode: Callable
  prefill: Callable
  write_cache: Callable
  write_indexer_cache: Callable
  gather_cache: Callable
  sparse_attention: Callable
  indexer_logits: Callable
  topk: Callable
  topk_slots: Callable
  cache_dtypes: frozenset[str]
  block_size_multiple: int = 1
  max_heads: int | None = None
  platforms: frozenset[str] = frozenset({"cpu", "gpu"})

  def check(self, *, cache_dtype: DTypeLike, block_size: int, num_heads: int) -> None:
    """Raises ValueError when this backend cannot run the combination."""
    dtype_name = jnp.dtype(cache_dtype).name
    if dtype_name not in self.cache_dtypes:
      raise ValueError(f"backend {self.name!r} does not support cache dtype {dtype_name}; "
                       f"supported: {sorted(self.cache_dtypes)}")
    if block_size % self.block_size_multiple:
      raise ValueError(f"backend {self.name!r} needs a block size that is a multiple of "
                       f"{self.block_size_multiple}, got {block_size}")
    if self.max_heads is not None and num_heads > self.max_heads:
      raise ValueError(f"backend {self.name!r} supports at most {self.max_heads} heads, got "
                       f"{num_heads}")


# Every backend's entries run the contract's checks (pallas_kernels.common) before anything else, so
# bad input gets the same ValueError from each, the XLA reference included; the kernels' jit entries
# run them too, with their own limits after.


def _check_decode(q, cache, block_tables, seq_lens, kv_lora_rank):
  if not cache.dense_attention:
    raise ValueError(f"decode reads a dense latent cache (LatentCache); a {cache.dtype_name} cache "
                     f"is read by sparse attention only")
  check_decode_args(q, cache.data, block_tables, seq_lens, kv_lora_rank)


def _check_sparse(q, cache, slots, kv_lora_rank):
  check_sparse_args(q, slots)
  if q.shape[2] != cache.row_width or not 0 < kv_lora_rank < cache.row_width:
    raise ValueError(f"q's head dim must be the cache's row width {cache.row_width} (kv_lora_rank "
                     f"+ the rope dim, kv_lora_rank in [1, {cache.row_width})); got q {q.shape}, "
                     f"kv_lora_rank {kv_lora_rank}")
  if cache.dtype_name == caches.FP8_DS_MLA and cache.kv_lora_rank != kv_lora_rank:
    raise ValueError(f"kv_lora_rank {kv_lora_rank} != the fp8_ds_mla cache's "
                     f"{cache.kv_lora_rank}")


def _reference_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, max_seqlen_q,
                       k_pe=None):
  check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, FLOAT_DTYPES, k_pe)
  # max_seqlen_q: the reference walks query blocks of the packed rows, no per-request grid.
  return reference.mha_prefill(q, join_k_pe(k, k_pe), v, cu_seqlens_q, cu_seqlens_k, scale=scale,
                               causal=causal)


def _reference_decode(q, cache, block_tables, seq_lens, *, scale, kv_lora_rank,
                      num_kv_splits=None, batch_invariant=False):
  del num_kv_splits  # one pass over the whole row: equal to any split count
  _check_decode(q, cache, block_tables, seq_lens, kv_lora_rank)
  return reference.latent_decode(
      q, cache.data, block_tables, seq_lens, scale=scale, kv_lora_rank=kv_lora_rank,
      k_scale=cache.scale_or_none,
      split_tokens=BATCH_INVARIANT_SPLIT_TOKENS if batch_invariant else None)


def _write_cache(cache, kv_c_normed, k_pe, slot_mapping):
  """The cache kind's own write (an XLA scatter, quantizing as the kind does)."""
  return cache.write(kv_c_normed, k_pe, slot_mapping)


def _write_indexer_cache(k_cache, k, slot_mapping):
  """The indexer K cache's own write (quantizing as its dtype does)."""
  return k_cache.write(k, slot_mapping)


def _gather_cache(cache, slots):
  """The cache kind's own gather, dequantized to float32 rows."""
  return cache.dequantize_rows(slots)


def _indexer_logits(kernel):
  """An array-in indexer logits function as a backend entry taking the IndexerKCache; it scores
  every row alone (no row groups), so the distinct_tables hint changes nothing."""
  @functools.wraps(kernel)
  def run(q, weights, k_cache, block_tables, seq_lens, *, distinct_tables=False):
    del distinct_tables  # no row groups to skip looking for
    check_indexer_args(q, weights, k_cache.values, k_cache.scales, block_tables, seq_lens)
    return kernel(q, weights, k_cache.values, k_cache.scales, block_tables, seq_lens)
  return run


def _latent_decode(kernel):
  """An array-in latent decode as a backend entry taking the LatentCache; batch_invariant=True
  becomes the kernel's fixed splits of BATCH_INVARIANT_SPLIT_TOKENS tokens."""
  @functools.wraps(kernel)
  def run(q, cache, block_tables, seq_lens, *, scale, kv_lora_rank, num_kv_splits=None,
          batch_invariant=False):
    _check_decode(q, cache, block_tables, seq_lens, kv_lora_rank)
    return kernel(q, cache.data, block_tables, seq_lens, scale=scale, kv_lora_rank=kv_lora_rank,
                  k_scale=cache.scale_or_none, num_kv_splits=num_kv_splits,
                  split_tokens=BATCH_INVARIANT_SPLIT_TOKENS if batch_invariant else None)
  return run


def _reference_sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
  _check_sparse(q, cache, slots, kv_lora_rank)
  return reference.sparse_attention(q, cache.dequantize_rows, slots,
                                    cache.num_blocks * cache.block_size, scale=scale,
                                    kv_lora_rank=kv_lora_rank)


def _reference_topk(logits, seq_lens, topk):
  check_topk_args(logits, seq_lens, topk)
  return reference.topk_positions(logits, seq_lens, topk)


def _slots_mapped_after(topk_positions, logits, seq_lens, topk, block_tables, block_size,
                        num_blocks):
  """topk_slots by a top-k's positions, then XLA's `cache.positions_to_slots` of them."""
  check_topk_args(logits, seq_lens, topk, block_tables, block_size, num_blocks)
  positions = topk_positions(logits, seq_lens, topk)
  return positions, caches.positions_to_slots(positions, block_tables, block_size, num_blocks)


def _reference_topk_slots(logits, seq_lens, topk, block_tables, *, block_size, num_blocks):
  return _slots_mapped_after(reference.topk_positions, logits, seq_lens, topk, block_tables,
                             block_size, num_blocks)


REFERENCE = Backend(
    name="reference",
    decode=_reference_decode,
    prefill=_reference_prefill,
    write_cache=_write_cache,
    write_indexer_cache=_write_indexer_cache,
    gather_cache=_gather_cache,
    sparse_attention=_reference_sparse_attention,
    indexer_logits=_indexer_logits(reference.indexer_logits),
    topk=_reference_topk,
    topk_slots=_reference_topk_slots,
    cache_dtypes=frozenset(caches.LATENT_CACHE_DTYPES),
)


def _off_gpu_interpreted(kernel):
  """A kernel's jit entry as a backend function: off the GPU it runs in its interpreter (Pallas
  interpret mode, Mosaic GPU's interpreter), so CPU tests exercise the same kernel."""
  @functools.wraps(kernel)
  def run(*args, **kwargs):
    return kernel(*args, **kwargs, interpret=jax.default_backend() != "gpu")
  return run


def _pallas_triton_sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
  _check_sparse(q, cache, slots, kv_lora_rank)
  interpret = jax.default_backend() != "gpu"
  if cache.dtype_name == caches.FP8_DS_MLA:
    return pallas_sparse.sparse_attention_fp8_ds_mla(q, cache.nope, cache.tile_scales, cache.rope,
                                                     slots, scale=scale, interpret=interpret)
  return pallas_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                        kv_lora_rank=kv_lora_rank, k_scale=cache.scale_or_none,
                                        interpret=interpret)


def _pallas_mosaic_sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
  """The Mosaic GPU sparse kernel for bf16 q over a bf16 latent cache or an fp8_ds_mla cache
  (else the kernel's ValueError), with the kernel's defaults (fp8_ds_mla: the pipeline
  `mosaic_sparse.default_fp8_pipeline` picks for the shapes; bf16 at N <= 32 in one split: heads
  in wgmma's N, `mosaic_sparse.default_heads_in`)."""
  _check_sparse(q, cache, slots, kv_lora_rank)
  interpret = jax.default_backend() != "gpu"
  if cache.dtype_name == caches.FP8_DS_MLA:
    return pallas_mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, slots, scale=scale, interpret=interpret)
  if cache.scale_or_none is not None:
    raise ValueError("pallas_mosaic's sparse kernel reads bf16 or fp8_ds_mla caches, not a "
                     "per-tensor float8 latent cache")
  return pallas_mosaic_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                               kv_lora_rank=kv_lora_rank, interpret=interpret)


def _pallas_topk_slots(logits, seq_lens, topk, block_tables, *, block_size, num_blocks,
                       interpret):
  """pallas_triton's top-k with the selection's slots: mapped by the kernel up to
  `maps_slots_in_kernel`'s shapes (decode steps up to 32K positions), else by XLA after it."""
  if pallas_topk.maps_slots_in_kernel(*logits.shape):
    return pallas_topk.topk_positions(logits, seq_lens, topk, block_tables=block_tables,
                                      block_size=block_size, num_blocks=num_blocks,
                                      interpret=interpret)
  topk_positions = functools.partial(pallas_topk.topk_positions, interpret=interpret)
  return _slots_mapped_after(topk_positions, logits, seq_lens, topk, block_tables, block_size,
                             num_blocks)


# Cache writes and gathers stay the cache module's XLA scatter and gather.
PALLAS_TRITON = dataclasses.replace(
    REFERENCE,
    name="pallas_triton",
    decode=_latent_decode(_off_gpu_interpreted(pallas_latent_decode.latent_decode)),
    prefill=_off_gpu_interpreted(pallas_mla_prefill.mla_prefill),
    sparse_attention=_pallas_triton_sparse_attention,
    indexer_logits=_indexer_logits(_off_gpu_interpreted(pallas_indexer.indexer_logits)),
    topk=_off_gpu_interpreted(pallas_topk.topk_positions),
    topk_slots=_off_gpu_interpreted(_pallas_topk_slots),
    block_size_multiple=16,
)


def _mosaic_indexer_logits(q, weights, k_cache, block_tables, seq_lens, *,
                           distinct_tables=False):
  """The Mosaic GPU indexer kernel for e4m3 q [T, <=64, 128] and keys in 64-token pages; other
  operands go to the Pallas-Triton kernel. distinct_tables=True runs its one-row programs
  (rows=1, right for any tables) without the on-device check for 4-row groups sharing a table and
  the lax.cond around it (12-26 us a call on the H200, session 19); False lets the kernel check."""
  fits = pallas_mosaic_indexer.fits(q, k_cache.values)
  fn = pallas_mosaic_indexer.indexer_logits if fits else pallas_indexer.indexer_logits
  if fits:
    fn = functools.partial(fn, rows=1 if distinct_tables else None)
  return _indexer_logits(_off_gpu_interpreted(fn))(q, weights, k_cache, block_tables, seq_lens)


# The Mosaic decode kernel's launch config wherever a backend runs it (pallas_mosaic, and pallas on
# Hopper), read at each call: its fp8_pipeline (one of its FP8_PIPELINES), heads_in, wide_keys,
# wide_values, e4m3_scores, e4m3_promote_cols, wide_widening, pages_per_step, ring_slots,
# rescale_slack and auto_barriers (see `pallas_kernels.mosaic_decode.MosaicDecodeConfig`) are the
# knobs a backend passes on.
MOSAIC_DECODE_CONFIG = pallas_mosaic_decode.CONFIG


def _mosaic_decode(q, kv_cache, block_tables, seq_lens, **kwargs):
  return pallas_mosaic_decode.latent_decode(q, kv_cache, block_tables, seq_lens,
                                            fp8_pipeline=MOSAIC_DECODE_CONFIG.fp8_pipeline,
                                            heads_in=MOSAIC_DECODE_CONFIG.heads_in,
                                            wide_keys=MOSAIC_DECODE_CONFIG.wide_keys,
                                            wide_values=MOSAIC_DECODE_CONFIG.wide_values,
                                            e4m3_scores=MOSAIC_DECODE_CONFIG.e4m3_scores,
                                            e4m3_promote_cols=MOSAIC_DECODE_CONFIG.e4m3_promote_cols,
                                            wide_widening=MOSAIC_DECODE_CONFIG.wide_widening,
                                            pages_per_step=MOSAIC_DECODE_CONFIG.pages_per_step,
                                            ring_slots=MOSAIC_DECODE_CONFIG.ring_slots,
                                            rescale_slack=MOSAIC_DECODE_CONFIG.rescale_slack,
                                            auto_barriers=MOSAIC_DECODE_CONFIG.auto_barriers,
                                            **kwargs)


# The Mosaic GPU (Hopper wgmma) decode, prefill, sparse attention and indexer kernels; the others
# are pallas_triton's. The decode kernel reads bf16 or fp8 (e4m3, per-tensor scale) caches with
# bf16 q, pages of a multiple of 64 tokens only; the prefill kernel takes bf16 q, k, v only; the
# sparse kernel bf16 q over bf16 or fp8_ds_mla caches.
PALLAS_MOSAIC = dataclasses.replace(
    PALLAS_TRITON,
    name="pallas_mosaic",
    decode=_latent_decode(_off_gpu_interpreted(_mosaic_decode)),
    prefill=_off_gpu_interpreted(pallas_mosaic_prefill.mla_prefill),
    indexer_logits=_mosaic_indexer_logits,
    sparse_attention=_pallas_mosaic_sparse_attention,
    cache_dtypes=frozenset({"bfloat16", "float8_e4m3fn"}),
    block_size_multiple=pallas_mosaic_decode.PAGE_MULTIPLE,
)

# Where the Mosaic GPU kernels measured faster than the Pallas-Triton ones on the H200
# (benchmarks/RESULTS.md, "pallas_mosaic" sections). Prefill: bf16 from 1024 tokens at 16 and 128
# heads (session 7, the queue in L2 sections: 1.13x at 1x1024 and 1.21x at 8 x 1024 for N=16,
# 1.32-1.77x elsewhere); fewer tokens were not measured.
# Decode: 1.85-1.92x at 128 heads, 0.85-0.94x at 16; 64 heads fill one 64-row tile as each half of
# 128 does. Session 12 (fewer heads unpadded, one-wave splits), S=8192 bf16, Triton and Mosaic in
# interleaved rounds in one process: 1.03-1.07x at N=16 (B 32, 64, 128), 1.30-1.32x at N=32; heads
# in wgmma's N (Mosaic's default at N <= 16 since) 1.04-1.10x more: bf16 takes Mosaic from 16 heads.
# fp8 decode (the "shared_widening" pipeline, session 7): 1.00 ms at N=128 B=128 S=8192 (Triton:
# 1.94, session 3); at N=16 0.532 ms against Triton's 0.459 (B=128, S=8192; session 12: 0.507 /
# 0.465, B=32 0.155 / 0.149). Session 13 (the "register_a" default at N <= 16), one process, S=8192,
# Triton / Mosaic ms: N=16 B=128 0.454 / 0.357, B=32 0.133 / 0.108; N=32 B=128 0.537 / 0.486,
# B=32 0.161 / 0.142: fp8 takes Mosaic from 16 heads too. Session 14 ("register_a" in N up to 32
# heads): N=32 B=128 0.533 / 0.332, B=32 0.167 / 0.106.
# Sparse attention (RESULTS.md, "DSA sparse attention (pallas_mosaic)", v3: cp.async gather for
# both caches, T in {128, 4096} x N in {16, 32, 64, 128}): the Mosaic kernel measured faster at
# every N >= 32, bf16 1.10-1.91x and fp8_ds_mla 1.22-1.81x, and slower at N=16 in all four
# (bf16 0.74x / 0.65x, fp8_ds_mla 0.93x / 0.98x at T=128 / 4096). Its time does not move with N
# inside a 64-head tile (v3, N 16, 32, 64: within 4% at T=128, 11% at T=4096) while Triton's
# grows with N, hence a head threshold and no token bound. 17-31 heads were not measured: Triton's.
# v4 (the "one_wave" split rule, T=128): Mosaic 0.95x Triton at N=16 bf16, 1.10x fp8_ds_mla (still
# 0.98x at T=4096, where the rule changes nothing), 1.56x / 1.46x at N=32, 2.18x / 1.73x at N=128.
# v6 (fp8_ds_mla "half_rows", session 7): 1.46x Triton at N=16 T=128 (0.150 against 0.219 ms),
# 2.3x at N=128, so fp8_ds_mla takes Mosaic from 16 heads (N=16 at T=4096 not timed with it; it
# was 0.98x with "serial", which "half_rows" beat by 1.29-1.34x at every shape timed).
# v11 (session 10): the fp8_ds_mla default is "in_place" at T=4096 (1.04-1.07x "half_rows"),
# "half_rows" at T=128: Mosaic only got faster there. Session 17 (wide_widening): "in_place" at
# every one-split shape; fp8_ds_mla at T=4096 N=16 2.69 ms against Triton's 4.95.
# Session 11 (Mosaic's fewer-than-64 heads unpadded: no XLA pad and slice around the kernel), T=128
# bf16 in one run: N=16 Triton 0.116 ms, Mosaic 0.107 (1.08x); N=32 0.185 / 0.113. So bf16 takes
# Mosaic from 16 heads up to 128 tokens (T=4096 at N=16 not re-timed: 0.65x in v3, Triton's).
# Session 27 (fp8_ds_mla's "register_a" kernel, Mosaic's default at 16 and 32 heads in one split):
# T=128 over 1M tokens, Triton / Mosaic ms, N=16 0.209 / 0.064, N=32 0.280 / 0.076; T=4096 over
# 32K, N=16 4.87 / 1.59, N=32 6.59 / 2.10.
_MOSAIC_PREFILL_MIN_TOKENS = CONTEXT_MIN_QUERY_ROWS  # context chunks' windows keep to it
_MOSAIC_DECODE_MIN_HEADS = 16  # bf16 and fp8 caches
_MOSAIC_SPARSE_MIN_HEADS = {"bfloat16": 32, caches.FP8_DS_MLA: 16}  # by cache dtype_name
# bf16 below 32 heads: Mosaic from 16 heads where T <= this (measured at 128).
_MOSAIC_SPARSE_FEW_HEADS = (16, 128)


def _on_hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _fastest_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, max_seqlen_q,
                     k_pe=None):
  """pallas_mosaic's prefill where it measured faster (a static choice on shapes and the device),
  else pallas_triton's (which joins split keys)."""
  check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, FLOAT_DTYPES, k_pe)
  split_k_dim = None if k_pe is None else k.shape[2]
  mosaic = (q.dtype == k.dtype == v.dtype == jnp.bfloat16
            and q.shape[0] >= _MOSAIC_PREFILL_MIN_TOKENS
            and pallas_mosaic_prefill.head_sizes_fit(q.shape[2], v.shape[2],
                                                     split_k_dim=split_k_dim) and _on_hopper())
  prefill = PALLAS_MOSAIC.prefill if mosaic else PALLAS_TRITON.prefill
  return prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                 max_seqlen_q=max_seqlen_q, k_pe=k_pe)


def _fastest_decode(q, cache, block_tables, seq_lens, *, scale, kv_lora_rank, num_kv_splits=None,
                    batch_invariant=False):
  """pallas_mosaic's decode where it measured faster (a static choice on shapes and the device),
  else pallas_triton's."""
  _check_decode(q, cache, block_tables, seq_lens, kv_lora_rank)
  mosaic = (q.dtype == jnp.bfloat16 and cache.dtype_name in ("bfloat16", "float8_e4m3fn")
            and q.shape[1] >= _MOSAIC_DECODE_MIN_HEADS
            and cache.block_size % pallas_mosaic_decode.PAGE_MULTIPLE == 0
            and pallas_mosaic_decode.head_dims_fit(q.shape[2], kv_lora_rank) and _on_hopper())
  decode = PALLAS_MOSAIC.decode if mosaic else PALLAS_TRITON.decode
  return decode(q, cache, block_tables, seq_lens, scale=scale, kv_lora_rank=kv_lora_rank,
                num_kv_splits=num_kv_splits, batch_invariant=batch_invariant)


def _fastest_indexer_logits(q, weights, k_cache, block_tables, seq_lens, *,
                            distinct_tables=False):
  """pallas_mosaic's indexer (fp8 wgmma) where it measured faster: the e4m3 operands it takes, on
  Hopper (H200, benchmarks/RESULTS.md "DSA selection": 2.4-2.5x at T=2048, 1.8-1.9x at T=128);
  else pallas_triton's."""
  mosaic = pallas_mosaic_indexer.fits(q, k_cache.values) and _on_hopper()
  logits = PALLAS_MOSAIC.indexer_logits if mosaic else PALLAS_TRITON.indexer_logits
  return logits(q, weights, k_cache, block_tables, seq_lens, distinct_tables=distinct_tables)


def _fastest_sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
  """pallas_mosaic's sparse attention where it measured faster: bf16 q over a bf16 latent cache or
  an fp8_ds_mla cache (32 heads or more over bf16, or 16 up to 128 tokens; 16 over fp8_ds_mla),
  on Hopper; else pallas_triton's."""
  _check_sparse(q, cache, slots, kv_lora_rank)
  layout = (cache.dtype_name == caches.FP8_DS_MLA
            or (cache.dtype_name == "bfloat16" and cache.scale_or_none is None))
  few_heads, few_heads_max_tokens = _MOSAIC_SPARSE_FEW_HEADS
  mosaic = (q.dtype == jnp.bfloat16 and layout
            and (q.shape[1] >= _MOSAIC_SPARSE_MIN_HEADS[cache.dtype_name]
                 or (cache.dtype_name == "bfloat16" and q.shape[1] >= few_heads
                     and q.shape[0] <= few_heads_max_tokens))
            and pallas_mosaic_sparse.head_dims_fit(q.shape[2], kv_lora_rank) and _on_hopper())
  sparse = PALLAS_MOSAIC.sparse_attention if mosaic else PALLAS_TRITON.sparse_attention
  return sparse(q, cache, slots, scale=scale, kv_lora_rank=kv_lora_rank)


# The GPU default: per op and shape, the Pallas kernel that measured fastest on the H200.
PALLAS = dataclasses.replace(PALLAS_TRITON, name="pallas", decode=_fastest_decode,
                             prefill=_fastest_prefill, indexer_logits=_fastest_indexer_logits,
                             sparse_attention=_fastest_sparse_attention)

BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType({
    REFERENCE.name: REFERENCE,
    PALLAS.name: PALLAS,
    PALLAS_TRITON.name: PALLAS_TRITON,
    PALLAS_MOSAIC.name: PALLAS_MOSAIC,
})


def default_backend_name(platform: str | None = None) -> str:
  return PALLAS.name if (platform or jax.default_backend()) == "gpu" else REFERENCE.name


def get_backend(name: str | None = None) -> Backend:
  """The backend called `name`, else $MLA_JAX_BACKEND, else the platform's default."""
  name = name or os.environ.get(ENV_VAR) or default_backend_name()
  if name not in BACKENDS:
    raise ValueError(f"unknown MLA backend {name!r}; supported: {sorted(BACKENDS)}")
  return BACKENDS[name]
