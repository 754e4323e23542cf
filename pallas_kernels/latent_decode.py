"""Split-KV latent (MLA) decode for GPUs, in Pallas lowered through Triton.

Absorbed MQA over a paged latent cache: every query head of a token attends to the same 576-wide
cache rows `[kv_c (L) | k_pe (R)]`, and the values are their first L columns. Stage 1 gives each
program one token, a block of heads and a contiguous range of that token's pages (one split); it
walks the range one page (or block_n tokens of one) per step through the block table with an
online softmax in float32 and writes a normalized partial output and its log-sum-exp. Stage 2
merges the splits by their log-sum-exps. With one split stage 1 writes the final output, and every
row's result depends only on that row's inputs (not on the batch it came in).

An fp8 cache is read as uint16 words of two e4m3 values (a free bitcast): the kernel splits each
word's bytes into two lanes, so q's columns are reordered lane-major outside the kernel, each
lane has its own products and accumulator, and the output's columns are reordered back.

Pure arrays in and out; no dependency on the rest of the project.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (FLOAT_DTYPES, LATENT_CACHE_DTYPES, LN2, LOG2E, M_INIT,
                                   check_decode_args, check_split_args, check_triton_config,
                                   default_num_kv_splits, is_pow2, num_fixed_splits, sm_count,
                                   split_kv_call, split_range, with_overrides)


@dataclasses.dataclass(frozen=True)
class LatentDecodeConfig:
  """Launch knobs of one call; the field names are the jit entry's keyword arguments."""
  block_h: int  # query heads per program
  block_n: int  # cache tokens per inner step (at most the page; capped to its power-of-two part)
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_triton_config(self, ("block_h", "block_n"))


_C = LatentDecodeConfig
# The chosen configs by (largest head count it is for, page size, operand kind: "16bit", "fp8"
# cache, or "32bit" (float32 q or cache)); the first row whose head count covers N wins, the last
# row per page and kind takes the rest. Chosen on an H200 at B=128, S=8192, page 64; the figures
# and the variants behind each row: benchmarks/RESULTS.md, "Latent decode (pallas_triton)".
TUNING = (
    (16, 64, "16bit", _C(16, 64, 4, 2)),  # N=16 0.33 ms; 8 warps or 3 stages >= 6% slower (v1)
    (32, 64, "16bit", _C(32, 64, 4, 2)),  # not swept at N=32: the best block_h 32 row at N=128
    (None, 64, "16bit", _C(64, 64, 8, 2)),  # N=128 1.26-1.29 ms; h32 w4 s2 1.40 (v1)
    (16, 64, "fp8", _C(16, 32, 4, 3)),  # uint16 pairs, N=16 0.435 ms (Session 3)
    (None, 64, "fp8", _C(32, 32, 4, 3)),  # uint16 pairs, N=128 2.00 ms (Session 3)
    (None, 64, "32bit", _C(16, 32, 4, 2)),  # (64, 64, 8, 2) asks 304 KB of smem; speed untimed
)
# The sweep space: the variants `benchmarks/bench_decode.py --sweep` times, by head count.
SWEEP = {
    16: tuple(_C(16, n, 4, s) for n, s in itertools.product((64, 32), (1, 2, 3))),
    128: tuple(_C(h, n, w, s)
               for h, n, w, s in itertools.product((32, 64), (64, 32), (4, 8), (1, 2))),
}
# e4m3 values per word when an fp8 cache is read as uint16. Measured at B=128 S=8192 (N=16 / 128):
# e4m3 loads 0.68 / 3.58 ms, uint8 loads 0.61 / 2.95, uint16 pairs 0.435 / 2.00, uint32 quads
# 0.61 / 2.01. Pallas-Triton (jax 0.11.2) also picks 64-bit offsets only for arrays over 2**32 bytes
# while offsets count elements, so 1-byte elements would overflow int32 from 2**31 of them; 2-byte
# words reach every size.
_FP8_LANES = 2


def operand_kind(q_dtype: jnp.dtype, cache_dtype: jnp.dtype) -> str:
  """The tuning table's operand kind for these dtypes."""
  if jnp.dtype(q_dtype).itemsize == 4 or jnp.dtype(cache_dtype).itemsize == 4:
    return "32bit"
  return "fp8" if jnp.dtype(cache_dtype).name == "float8_e4m3fn" else "16bit"


def tuned_config(num_heads: int, page_size: int, kind: str = "16bit") -> LatentDecodeConfig:
  """The table's config; pages absent from the table use page 64's rows."""
  page_key = page_size if any(p == page_size for _, p, _, _ in TUNING) else 64
  for heads, page, row_kind, config in TUNING:
    if page == page_key and row_kind == kind and (heads is None or num_heads <= heads):
      return config
  raise AssertionError("the tuning table ends with a catch-all row per page size")


def _stage1_kernel(q_ref, kv_ref, bt_ref, len_ref, *rest, scale, lora, rope, step, num_splits,
                   split_steps, has_k_scale, compute_dtype, lanes):
  # q_ref [block_h, L+R] (lane-major columns when lanes > 1); kv_ref [num_blocks, page, (L+R)/lanes]
  # (uint16 e4m3 pairs when lanes == 2); bt_ref [T, max_blocks] int32; len_ref [T] int32;
  # rest = (ks_ref [1] f32 when has_k_scale,) o_ref [block_h, L], lse_ref [block_h]
  *ks_ref, o_ref, lse_ref = rest
  split, t = pl.program_id(1), pl.program_id(2)
  num_blocks, page, _ = kv_ref.shape
  max_blocks = bt_ref.shape[1]
  steps_per_page = page // step
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  k_scale = ks_ref[0][0] if has_k_scale else 1.0
  # Folding log2(e) in lets the softmax use exp2; the per-tensor fp8 scale is linear, so it scales
  # the logits here and the output at the end instead of every cache element.
  qk_scale = scale * LOG2E * k_scale

  length = jnp.clip(len_ref[t], 0, max_blocks * page)
  first, last = split_range(pl.cdiv(length, step), split, num_splits, split_steps)

  lora_w, rope_w = lora // lanes, rope // lanes  # cache columns (words) per part
  q_nope = [q_ref[:, pl.ds(j * lora_w, lora_w)].astype(compute_dtype) for j in range(lanes)]
  q_pe = [q_ref[:, pl.ds(lora + j * rope_w, rope_w)].astype(compute_dtype) for j in range(lanes)]

  def unpack(tile):
    """A loaded cache tile -> one compute-dtype tile per lane (byte j of each word is lane j)."""
    if lanes == 1:
      return [tile.astype(compute_dtype)]
    return [lax.bitcast_convert_type(((tile >> (8 * j)) & 0xFF).astype(jnp.uint8),
                                     jnp.float8_e4m3fn).astype(compute_dtype) for j in range(lanes)]

  def body(i, carry):
    m, l, *acc = carry
    if steps_per_page == 1:
      slot, offset = i, 0
    else:
      slot, offset = i // steps_per_page, i % steps_per_page * step
    block = bt_ref[t, slot]
    block_ok = (block >= 0) & (block < num_blocks)
    block = jnp.where(block_ok, block, 0)
    pos = slot * page + offset + jnp.arange(step)
    valid = (pos < length) & block_ok
    # Masked loads: positions past the length and pages behind bad table entries are never read
    # (they may hold NaN); zeros there keep 0 * NaN out of the value product.
    load = lambda start, width: unpack(plgpu.load(
        kv_ref.at[block, pl.ds(offset, step), pl.ds(start, width)],
        mask=jnp.broadcast_to(valid[:, None], (step, width)), other=0 if lanes > 1 else 0.0))
    k_nope, k_pe = load(0, lora_w), load(lora_w, rope_w)
    s = sum(plgpu.dot(a, b, trans_b=True, precision=precision)
            for a, b in zip(q_nope + q_pe, k_nope + k_pe)) * qk_scale  # [block_h, step]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    p = p.astype(compute_dtype)
    return (m_new, l, *[a * alpha[:, None] + plgpu.dot(p, k, precision=precision)
                        for a, k in zip(acc, k_nope)])

  block_h = q_ref.shape[0]
  init = (jnp.full((block_h,), M_INIT, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          *[jnp.zeros((block_h, lora_w), jnp.float32)] * lanes)
  m, l, *acc = lax.fori_loop(first, last, body, init)
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  for j, a in enumerate(acc):
    o_ref[:, pl.ds(j * lora_w, lora_w)] = (a * (k_scale / l_safe)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)


def _lane_major(x, lanes):
  """Reorders the last axis from (words, lanes) to (lanes, words): column w*lanes+j -> j*words+w."""
  return x.reshape(*x.shape[:-1], -1, lanes).swapaxes(-1, -2).reshape(x.shape)


def _check(q, kv_cache, block_tables, seq_lens, kv_lora_rank, k_scale):
  """The checks that need no tuning config (the split arguments are checked once the step is
  known)."""
  _, d, page = check_decode_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank)
  rope = d - kv_lora_rank
  if not (is_pow2(kv_lora_rank) and kv_lora_rank >= 16 and is_pow2(rope) and rope >= 16):
    raise ValueError(f"head dim {d} must be kv_lora_rank ({kv_lora_rank}) + a rope dim ({rope}), "
                     "both powers of two >= 16 (Triton loads power-of-two blocks)")
  if page % 16:
    raise ValueError(f"page size must be a multiple of 16, got {page}")
  if q.dtype.name not in FLOAT_DTYPES:
    raise ValueError(f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype.name}")
  if kv_cache.dtype.name not in LATENT_CACHE_DTYPES:
    raise ValueError(f"cache dtype must be one of {LATENT_CACHE_DTYPES}, got {kv_cache.dtype.name}")
  if kv_cache.dtype.name == "float8_e4m3fn" and k_scale is None:
    raise ValueError("a float8_e4m3fn cache needs k_scale")
  if kv_cache.dtype.name == "float8_e4m3fn" and min(kv_lora_rank, rope) < 16 * _FP8_LANES:
    raise ValueError(f"an fp8 cache is read in pairs of values, so kv_lora_rank ({kv_lora_rank}) "
                     f"and the rope dim ({rope}) must be >= {16 * _FP8_LANES}")
  if k_scale is not None and jnp.ndim(k_scale) != 0:
    raise ValueError(f"k_scale must be a scalar, got shape {jnp.shape(k_scale)}")


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "num_kv_splits",
                                             "split_tokens", "block_h", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def latent_decode(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                  *, scale: float, kv_lora_rank: int = 512,
                  k_scale: jax.Array | float | None = None,
                  num_kv_splits: int | None = None, split_tokens: int | None = None,
                  block_h: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Absorbed MQA decode over a paged latent cache (semantics of `mla_jax.reference.latent_decode`).

  q [T, N, L+R] bf16/f16/f32; kv_cache [num_blocks, page, L+R] bf16/f16/f32, or float8_e4m3fn
  holding `x / k_scale` (k_scale a float32 scalar); block_tables [T, max_blocks] int32 (the row's
  request's table; -1 or out-of-range entries are masked); seq_lens [T] int32 (0 gives o = 0,
  lse = -inf). num_kv_splits=None picks a split count from static shapes; 1 makes each row's
  result independent of the batch. split_tokens (instead of num_kv_splits): splits of that many
  tokens (a multiple of the inner step), merged in a fixed order, so each row's result is
  bit-identical in any batch and with any table width (batch-invariant mode). block_h / block_n /
  num_warps / num_stages override the tuning table (block_n: cache tokens per inner step, a power
  of two >= 16 dividing the page).
  Returns o [T, N, L] in q.dtype and lse [T, N] float32 (natural log).
  """
  _check(q, kv_cache, block_tables, seq_lens, kv_lora_rank, k_scale)
  t, n, d = q.shape
  _, page, _ = kv_cache.shape
  lora, rope = kv_lora_rank, d - kv_lora_rank
  tuned = tuned_config(n, page, operand_kind(q.dtype, kv_cache.dtype))
  config = with_overrides(tuned, block_h=block_h, block_n=block_n, num_warps=num_warps,
                          num_stages=num_stages)
  if block_n is not None and page % block_n:
    raise ValueError(f"block_n must divide the page ({page}), got {block_n}")
  block_h = config.block_h
  num_head_blocks = pl.cdiv(n, block_h)
  # Triton blocks hold a power-of-two element count: a page that is not a power of two is walked in
  # steps of its largest power-of-two divisor.
  step = block_n or min(tuned.block_n, page & -page)
  check_split_args(num_kv_splits, split_tokens, step)
  max_len = block_tables.shape[1] * page
  if split_tokens:
    splits = num_fixed_splits(split_tokens, max_len)
  else:
    splits = num_kv_splits or default_num_kv_splits(t, num_head_blocks, max_len, sm_count())
  if n % block_h:
    q = jnp.pad(q, ((0, 0), (0, num_head_blocks * block_h - n), (0, 0)))
  fp8 = kv_cache.dtype.name == "float8_e4m3fn"
  if fp8 or kv_cache.dtype == q.dtype:
    compute_dtype = q.dtype  # fp8 -> bf16/f16/f32 is exact
  else:
    compute_dtype = jnp.promote_types(q.dtype, kv_cache.dtype)
  lanes = _FP8_LANES if fp8 else 1
  if fp8:
    q = jnp.concatenate([_lane_major(q[..., :lora], lanes), _lane_major(q[..., lora:], lanes)], -1)
    kv_cache = lax.bitcast_convert_type(
        kv_cache.reshape(*kv_cache.shape[:2], d // lanes, lanes), jnp.uint16)
  k_scale_args = () if k_scale is None else (jnp.asarray(k_scale, jnp.float32).reshape(1),)

  kernel = functools.partial(_stage1_kernel, scale=scale, lora=lora, rope=rope, step=step,
                             num_splits=splits, split_steps=split_tokens and split_tokens // step,
                             has_k_scale=k_scale is not None,
                             compute_dtype=compute_dtype, lanes=lanes)
  o, lse = split_kv_call(kernel, q, (kv_cache, block_tables, seq_lens, *k_scale_args),
                         block_h=block_h, splits=splits, lora=lora, num_warps=config.num_warps,
                         num_stages=config.num_stages, interpret=interpret,
                         name=f"latent_decode_h{block_h}_p{page}_s{splits}",
                         fixed_order=split_tokens is not None)
  if lanes > 1:
    o = _lane_major(o, lora // lanes)  # the inverse reorder: lanes x words -> words x lanes
  return o[:, :n], lse[:, :n]
