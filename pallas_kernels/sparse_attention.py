"""DSA sparse attention for GPUs, in Pallas lowered through Triton: absorbed MQA over top-k slots.

Every query head of a token attends to the same cache rows, the ones its top-k slots name (SPEC 6);
the values are their first L columns. Each program takes one token, a block of heads and a share of
the token's slot list (one split). It walks its share block_k slots at a time: loads the slot
indices, gathers the rows they name from the flattened cache with index vectors
(`ref[rows, cols]`), and keeps an online softmax in float32. -1 and out-of-range slots are masked
and their index clamped to 0: nothing out of bounds, and no row nothing selected, is ever read
(such rows may hold NaN). Splits are merged by their log-sum-exps in XLA, as in latent decode.

Two cache layouts, both flattened to one row per slot:
  latent      [slots, L+R] bf16/f16/f32, or e4m3 of `x / k_scale` (one per-tensor scale); the L and
              R columns are loaded as two power-of-two blocks.
  fp8_ds_mla  nope e4m3 [slots, L] with one float32 scale per 128-column tile, rope bf16 [slots, R].
              Dequantized in the kernel: each gathered 128-column tile times its rows' scales,
              then one product (and one accumulator) per tile.

Pure arrays in and out; no dependency on the rest of the project.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (DS_MLA_TILE, F8, FLOAT_DTYPES, LATENT_CACHE_DTYPES, LN2, LOG2E,
                                   M_INIT, MAX_FP8_ELEMENTS, check_sparse_args,
                                   check_triton_config, default_num_kv_splits, is_pow2, sm_count,
                                   split_kv_call, with_overrides)


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
  """Launch knobs of one call; the field names are the jit entries' keyword arguments."""
  block_h: int  # query heads per program
  block_k: int  # top-k slots per step (short slot lists take the next power of two >= 16)
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_triton_config(self, ("block_h", "block_k"))


_C = SparseAttentionConfig
# The chosen configs by (largest head count it is for, operand kind: "16bit", "fp8" for an
# fp8_ds_mla cache, "fp8_latent" for a per-tensor e4m3 latent cache, "32bit"); the first row whose
# head count covers N wins. Figures, sweeps and how the untimed rows were chosen (sm_90 compiles on
# a CPU host: spills, shared memory): benchmarks/RESULTS.md, "DSA kernels (pallas_triton)".
TUNING = (
    (16, "16bit", _C(16, 64, 4, 2)),  # latent decode's H200 rows: the same 64 x 576 step tiles
    (32, "16bit", _C(32, 64, 4, 2)),
    (None, "16bit", _C(64, 64, 8, 2)),
    (16, "fp8", _C(16, 64, 8, 2)),  # 8 warps keep h16/h32 free of spills (compiled for sm_90)
    (32, "fp8", _C(32, 64, 8, 2)),
    (None, "fp8", _C(64, 64, 8, 2)),  # wgmma products like bf16's
    (16, "fp8_latent", _C(16, 64, 8, 2)),
    (32, "fp8_latent", _C(32, 64, 8, 2)),
    (None, "fp8_latent", _C(64, 64, 8, 1)),  # s2 asks 236 KB of smem; 0.668 ms, fastest (Session 3)
    (None, "32bit", _C(16, 32, 4, 2)),  # dense decode's 4-byte row (about 184 KB), untimed
)
# The sweep space: the variants `benchmarks/bench_sparse.py --sweep` times.
SWEEP = tuple(_C(*v) for v in [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 4, 3), (32, 64, 4, 2),
                               (32, 64, 8, 2), (32, 32, 4, 3), (64, 64, 8, 1), (128, 32, 8, 2)])


def tuned_config(num_heads: int, kind: str) -> SparseAttentionConfig:
  """The table's config for N heads and an operand kind (see TUNING)."""
  for heads, row_kind, config in TUNING:
    if row_kind == kind and (heads is None or num_heads <= heads):
      return config
  raise AssertionError("the tuning table ends with a catch-all row per cache kind")


def _kernel(q_ref, slots_ref, extent_ref, nope_ref, rope_ref, *rest, scale, lora, rope, rope_col,
            tile, block_k, num_splits, has_tile_scales, has_k_scale, compute_dtype):
  # q_ref [block_h, L+R]; slots_ref [T, K] int32 (K a multiple of block_k); extent_ref [T] int32
  # (one past each row's last valid slot); nope_ref [num_slots, >= L] (nope in columns [0, L));
  # rope_ref [num_slots, >= rope_col + R] (latent: both are the same [num_slots, L+R] cache).
  # rest = (scales_ref [num_slots, L/tile] f32 when has_tile_scales,) (ks_ref [1] f32 when
  # has_k_scale,) o_ref [block_h, L], lse_ref [block_h]
  *extra, o_ref, lse_ref = rest
  scales_ref = extra.pop(0) if has_tile_scales else None
  k_scale = extra.pop(0)[0] if has_k_scale else 1.0
  split, t = pl.program_id(1), pl.program_id(2)
  num_slots = nope_ref.shape[0]
  num_tiles = lora // tile
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  dot = functools.partial(plgpu.dot, precision=precision)
  # exp2 softmax with log2(e) folded in; a per-tensor fp8 scale is linear, so it scales the logits
  # here and the output at the end instead of every cache element.
  qk_scale = scale * LOG2E * k_scale

  num_steps = pl.cdiv(extent_ref[t], block_k)
  per_split = pl.cdiv(num_steps, num_splits)
  first = split * per_split
  last = jnp.minimum(first + per_split, num_steps)

  q_tiles = [q_ref[:, pl.ds(j * tile, tile)].astype(compute_dtype) for j in range(num_tiles)]
  q_pe = q_ref[:, pl.ds(lora, rope)].astype(compute_dtype)

  def body(i, carry):
    m, l, accs = carry
    slot = slots_ref[t, pl.ds(i * block_k, block_k)]
    valid = (slot >= 0) & (slot < num_slots)
    row = jnp.where(valid, slot, 0)

    def gather(ref, col, width):  # [block_k, width] rows of `ref`, zeros where the slot is invalid
      cols = col + jnp.arange(width, dtype=jnp.int32)
      return plgpu.load(ref.at[row[:, None], cols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_k, width)), other=0.0)

    def nope_tile(j):  # [block_k, tile] in the compute dtype; fp8_ds_mla tiles times their scale
      k_j = gather(nope_ref, j * tile, tile)
      if has_tile_scales:
        # e4m3 times a power-of-two (ue8m0) scale is exact in bf16, so the products see the
        # dequantized cache bit for bit.
        scale_j = plgpu.load(scales_ref.at[row, j], mask=valid, other=0.0)
        k_j = k_j.astype(jnp.float32) * scale_j[:, None]
      return k_j.astype(compute_dtype)

    k_tiles = [nope_tile(j) for j in range(num_tiles)]
    k_pe = gather(rope_ref, rope_col, rope).astype(compute_dtype)
    s = dot(q_pe, k_pe, trans_b=True)  # [block_h, block_k]
    for q_j, k_j in zip(q_tiles, k_tiles):
      s = s + dot(q_j, k_j, trans_b=True)
    s = jnp.where(valid[None, :], s * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    p = p.astype(compute_dtype)
    accs = tuple(acc * alpha[:, None] + dot(p, k_j) for acc, k_j in zip(accs, k_tiles))
    return m_new, l, accs

  block_h = q_ref.shape[0]
  init = (jnp.full((block_h,), M_INIT, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          tuple(jnp.zeros((block_h, tile), jnp.float32) for _ in range(num_tiles)))
  m, l, accs = lax.fori_loop(first, last, body, init)
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  for j, acc in enumerate(accs):
    o_ref[:, pl.ds(j * tile, tile)] = (acc * (k_scale / l_safe)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)


def _check_common(q, slots, lora, rope, num_splits):
  check_sparse_args(q, slots, num_splits)
  if not (is_pow2(lora) and lora >= 16 and is_pow2(rope) and rope >= 16):
    raise ValueError(f"head dim {q.shape[2]} must be kv_lora_rank ({lora}) + a rope dim ({rope}), "
                     "both powers of two >= 16 (Triton loads power-of-two blocks)")
  if q.dtype.name not in FLOAT_DTYPES:
    raise ValueError(f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype.name}")


def _sparse_call(q, slots, cache_args, *, scale, lora, rope_col, tile, fp8, compute_dtype,
                 has_tile_scales, k_scale, num_splits, block_h, block_k, num_warps, num_stages,
                 interpret, name):
  """Pads heads and slots to whole blocks, runs the kernel, merges splits; cache_args are
  (nope, rope[, tile_scales]) flattened to one row per slot."""
  t, n, d = q.shape
  lora_rope = d - lora
  kind = "32bit" if jnp.dtype(compute_dtype).itemsize == 4 else ("fp8" if fp8 else "16bit")
  if kind == "fp8" and not has_tile_scales:
    kind = "fp8_latent"
  tuned = tuned_config(n, kind)
  config = with_overrides(tuned, block_h=block_h, block_k=block_k, num_warps=num_warps,
                          num_stages=num_stages)
  if t == 0:  # Triton cannot take a zero-sized grid
    return jnp.zeros((0, n, lora), q.dtype), jnp.zeros((0, n), jnp.float32)
  block_h, num_warps, num_stages = config.block_h, config.num_warps, config.num_stages
  # Short slot lists (tests, tiny top-k) take one block of the next power of two >= 16.
  block_k = block_k or min(tuned.block_k, max(16, 1 << (slots.shape[1] - 1).bit_length()))
  num_head_blocks = pl.cdiv(n, block_h)
  np_ = num_head_blocks * block_h
  if np_ != n:
    q = jnp.pad(q, ((0, 0), (0, np_ - n), (0, 0)))
  if slots.shape[1] % block_k or slots.shape[1] == 0:
    slots = jnp.pad(slots, ((0, 0), (0, block_k - slots.shape[1] % block_k)), constant_values=-1)
  k = slots.shape[1]
  num_slots = cache_args[0].shape[0]
  valid = (slots >= 0) & (slots < num_slots)
  # Walk only up to each row's last valid slot: top-k lists of short rows are mostly -1 padding.
  extent = jnp.max(jnp.where(valid, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=1)
  splits = num_splits or default_num_kv_splits(t, num_head_blocks, k, sm_count())
  splits = min(splits, k // block_k)
  k_scale_args = () if k_scale is None else (jnp.asarray(k_scale, jnp.float32).reshape(1),)

  kernel = functools.partial(
      _kernel, scale=scale, lora=lora, rope=lora_rope, rope_col=rope_col, tile=tile,
      block_k=block_k, num_splits=splits, has_tile_scales=has_tile_scales,
      has_k_scale=k_scale is not None, compute_dtype=compute_dtype)
  o, lse = split_kv_call(kernel, q, (slots, extent, *cache_args, *k_scale_args),
                         block_h=block_h, splits=splits, lora=lora, num_warps=num_warps,
                         num_stages=num_stages, interpret=interpret,
                         name=f"{name}_h{block_h}_k{block_k}_s{splits}")
  return o[:, :n], lse[:, :n]


_STATIC = ("scale", "num_splits", "block_h", "block_k", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC + ("kv_lora_rank",))
def sparse_attention(q: jax.Array, kv_cache: jax.Array, slots: jax.Array, *, scale: float,
                     kv_lora_rank: int = 512, k_scale: jax.Array | float | None = None,
                     num_splits: int | None = None, block_h: int | None = None,
                     block_k: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA over a latent cache (semantics of `mla_jax.reference.sparse_attention`).

  q [T, N, L+R] bf16/f16/f32; kv_cache [num_blocks, page, L+R] bf16/f16/f32, or float8_e4m3fn
  holding `x / k_scale` (k_scale a float32 scalar); slots [T, K] int32 cache slots
  (block * page + offset; -1 or past the cache: skipped, in any position). num_splits=None picks a
  split count of the slot axis from static shapes; block_h / block_k / num_warps / num_stages
  override the tuning table (block_k: slots per step, a power of two >= 16).
  Returns o [T, N, L] in q.dtype and lse [T, N] float32 (natural log); a row with no valid slot
  gives (0, -inf).
  """
  lora, rope = kv_lora_rank, q.shape[-1] - kv_lora_rank
  _check_common(q, slots, lora, rope, num_splits)
  if kv_cache.ndim != 3 or kv_cache.shape[2] != q.shape[2]:
    raise ValueError(f"want kv_cache [num_blocks, page, {q.shape[2]}] (q's head dim), got "
                     f"{kv_cache.shape}")
  if kv_cache.dtype.name not in LATENT_CACHE_DTYPES:
    raise ValueError(f"cache dtype must be one of {LATENT_CACHE_DTYPES}, got {kv_cache.dtype.name}")
  fp8 = kv_cache.dtype == F8
  if fp8 and k_scale is None:
    raise ValueError("a float8_e4m3fn cache needs k_scale")
  if k_scale is not None and jnp.ndim(k_scale) != 0:
    raise ValueError(f"k_scale must be a scalar, got shape {jnp.shape(k_scale)}")
  if fp8 and kv_cache.size > MAX_FP8_ELEMENTS:
    raise ValueError(f"a float8_e4m3fn cache of {kv_cache.size} elements is over the "
                     f"{MAX_FP8_ELEMENTS} that int32 offsets reach (Pallas-Triton lowering)")
  if fp8 or kv_cache.dtype == q.dtype:
    compute_dtype = q.dtype  # fp8 -> bf16/f16/f32 is exact
  else:
    compute_dtype = jnp.promote_types(q.dtype, kv_cache.dtype)
  flat = kv_cache.reshape(-1, kv_cache.shape[2])
  # The same array serves the nope columns [0, L) and the rope columns [L, L+R).
  return _sparse_call(q, slots, (flat, flat), scale=scale, lora=lora, rope_col=lora, tile=lora,
                      fp8=fp8, compute_dtype=compute_dtype, has_tile_scales=False, k_scale=k_scale,
                      num_splits=num_splits, block_h=block_h, block_k=block_k, num_warps=num_warps,
                      num_stages=num_stages, interpret=interpret, name="sparse_latent")


@functools.partial(jax.jit, static_argnames=_STATIC)
def sparse_attention_fp8_ds_mla(q: jax.Array, nope: jax.Array, tile_scales: jax.Array,
                                rope: jax.Array, slots: jax.Array, *, scale: float,
                                num_splits: int | None = None, block_h: int | None = None,
                                block_k: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None,
                                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA over an fp8_ds_mla cache, dequantized in the kernel.

  q [T, N, L+R] bf16/f16/f32; nope [num_blocks, page, L] float8_e4m3fn; tile_scales
  [num_blocks, page, L/128] float32 (row value = nope * its tile's scale); rope
  [num_blocks, page, R] bfloat16; slots and the tuning overrides as in `sparse_attention`. Returns
  o [T, N, L] in q.dtype and lse [T, N] float32.
  """
  nb, page, lora = nope.shape
  rope_dim = rope.shape[-1]
  _check_common(q, slots, lora, rope_dim, num_splits)
  if (nope.dtype != F8 or tile_scales.dtype != jnp.float32 or rope.dtype != jnp.bfloat16
      or tile_scales.shape != (nb, page, lora // DS_MLA_TILE) or rope.shape[:2] != (nb, page)
      or lora % DS_MLA_TILE or q.shape[2] != lora + rope_dim):
    raise ValueError(f"want nope [NB, BS, L] e4m3 (L a multiple of {DS_MLA_TILE}), tile_scales "
                     f"[NB, BS, L/{DS_MLA_TILE}] f32, rope [NB, BS, R] bf16 and q [T, N, L+R]; got "
                     f"{nope.dtype.name}{nope.shape}, {tile_scales.dtype.name}{tile_scales.shape}, "
                     f"{rope.dtype.name}{rope.shape}, q {q.shape}")
  if nope.size > MAX_FP8_ELEMENTS:
    raise ValueError(f"an fp8 nope cache of {nope.size} elements is over the {MAX_FP8_ELEMENTS} "
                     "that int32 offsets reach (Pallas-Triton lowering)")
  flat = lambda x: x.reshape(nb * page, x.shape[-1])
  return _sparse_call(q, slots, (flat(nope), flat(rope), flat(tile_scales)), scale=scale, lora=lora,
                      rope_col=0, tile=DS_MLA_TILE, fp8=True, compute_dtype=q.dtype,
                      has_tile_scales=True, k_scale=None, num_splits=num_splits, block_h=block_h,
                      block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                      interpret=interpret, name="sparse_ds_mla")
