"""Split-KV latent (MLA) decode in FlashMLA's dense Hopper schedule (Pallas, Mosaic GPU).

`mosaic_decode`'s contract for bf16 q and cache, 512 + 64 columns, heads in tiles of 64 (wgmma's
M) and pages a multiple of 64 rows; `mosaic_decode.latent_decode(seesaw=True)` runs it there. The
design is FlashMLA's (deepseek-ai/FlashMLA, `csrc/kernels/sm90/decode/dense`, its 2025-04-22 deep
dive; benchmarks/RESULTS.md, "Session 30" at the top): one program (CTA) per (64-head tile, split,
token), two warpgroups and no memory warpgroup, each issuing its own bulk copies. Pages go in
pairs, A in slot 0 and B in slot 1, each copied as nine 64-column tiles: tiles 0-3 (V_L, columns
0-255) on a slot's lo barrier, tiles 4-8 (V_R and RoPE) on its hi barrier.
- warpgroup 0 owns O[:, :256]: S_A = Q K_A^T (lo tiles first, then hi), the softmax to m_A, which
  it publishes; O_L = O_L 2^(m - m_A) + P_A V_A,L with P_A in registers. Once warpgroup 1 has m_B
  and P_B: P_A' = P_A 2^(m_A - m_B) into sP0 for warpgroup 1, O_L = O_L 2^(m_A - m_B) + P_B V_B,L
  with P_B from sP1. It is the last reader of both slots' lo tiles, so it refills them.
- warpgroup 1 owns O[:, 256:]: S_B = Q K_B^T (hi tiles first, then lo), m_B = max(m_A, its row
  max), O_R = O_R 2^(m - m_B) + P_B V_B,R (registers), then O_R += P_A' V_A,R (sP0). It refills
  both slots' hi tiles.
So each warpgroup's softmax runs while the other's products hold the tensor cores. Q's RoPE tile
is wgmma's register A for S's RoPE chunk (loaded once by each warpgroup), which frees its shared
memory for sP1: Q 72 KB + 2 x 72 KB of pages + sP0 8 KB + 768 bytes of rows, 224.8 KB. l is
summed by each warpgroup over its own pages (both relative to the same maxima) and added at the
end; the output is staged in the page slots once both are done.

`interpret=True` runs the same schedule in Mosaic GPU's interpreter, which (jax 0.11.2) takes
shared-memory wgmma operands only and accumulates in no register: there Q's RoPE tile stays an
operand in shared memory (sP1 gets its own buffer), warpgroup 0's P_A goes through a buffer of its
own, and each product adds a fresh accumulator. Lowering for CUDA, which runs on a CPU, checks the
GPU form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (LOG2E, M_INIT, check_decode_args, check_grid_tokens,
                                   check_softmax_scale, check_split_args, merge_splits,
                                   num_fixed_splits, partials_dtype, rows_lse, split_range,
                                   step_variant, store_output, swizzled)

_T = 64  # heads a tile, rows a page step, columns a copy tile
LORA, ROPE = 512, 64  # the columns it takes: 8 value tiles and one RoPE tile
_LO = range(0, 4)  # warpgroup 0's value tiles (columns 0-255)
_HI = range(4, 9)  # warpgroup 1's value tiles (256-511) and the RoPE tile
_ROWS = plgpu.Layout.WGMMA.reduce(1)


def _kernel(q_ref, kv_ref, bt_ref, len_ref, o_ref, lse_ref, q_smem, q_rope_smem, buffers, p0_smem,
            row_smem, q_bar, kv_lo, kv_hi, rope_loaded, m_a_ready, b_ready, p0_ready, p0_free,
            p1_free, l_ready, *staging, qk_scale, num_splits, split_steps, interpret):
  # GMEM: q_ref [T, Np, 576] bf16 (Np a multiple of 64); kv_ref [blocks, page, 576] bf16; bt_ref
  # [T, max_blocks] int32; len_ref [T] int32; o_ref [T, splits, Np, 512] (bf16 with one split,
  # else f32 partials); lse_ref [T, splits, Np] f32. SMEM: q_smem [8, 64, 64] bf16 (Q's value
  # column tiles); q_rope_smem [64, 64] bf16 (its RoPE tile, then sP1 once both warpgroups hold it
  # in registers); buffers = union of (kv_smem [2, 9, 64, 64] bf16: pages A and B by column tile)
  # and (o_smem [2, 64, 256]: each warpgroup's output staging, after every step); p0_smem [64, 64]
  # bf16 (sP0); row_smem [3, 64] f32 (m_A, m_B; at the end warpgroup 0's l, the lse, warpgroup 1's
  # l). Barriers: q_bar (9 copies); kv_lo, kv_hi [2] (a slot's 4 or 5 tile copies landed);
  # rope_loaded (both warpgroups hold the RoPE tile); m_a_ready (m_A in row 0); b_ready (m_B in
  # row 1 and P_B in sP1); p0_ready (P_A' in sP0); p0_free, p1_free (sP0, sP1 read); l_ready.
  # staging (the interpreter): sP1 and warpgroup 0's P_A, [64, 64] bf16 each.
  (kv_smem,), (o_smem,) = buffers
  t, split, h = lax.axis_index("tokens"), lax.axis_index("splits"), lax.axis_index("heads")
  wg = lax.axis_index("wg")
  num_blocks, page, _ = kv_ref.shape
  max_blocks = bt_ref.shape[1]
  steps_per_page = page // _T
  length = jnp.minimum(jnp.maximum(len_ref[t], 0), max_blocks * page)
  first, end = split_range(pl.cdiv(length, _T), split, num_splits, split_steps)
  n = jnp.maximum(end - first, 0)  # this split's 64-row steps
  pairs = pl.cdiv(n, 2)
  heads = pl.ds(h * _T, _T)
  sp1, a_smem = staging if interpret else (q_rope_smem, None)

  def source(i):
    """(block, first row, rows that count) of the split's step i; a bad table entry counts none,
    and a step past the split (an odd count's missing page B) reads no entry past the table."""
    step = first + i
    block = bt_ref[t, jnp.minimum(lax.div(step, steps_per_page), max_blocks - 1)]
    ok = (block >= 0) & (block < num_blocks) & (i < n)
    rows = jnp.clip(length - step * _T, 0, _T)
    return (jnp.where(ok, block, 0), lax.rem(step, steps_per_page) * _T,
            jnp.where(ok, rows, 0))

  def fetch(i, slot, tiles, barrier):
    @pl.when(i < n)
    def _():
      block, row, _ = source(i)
      for j in tiles:
        plgpu.copy_gmem_to_smem(kv_ref.at[block, pl.ds(row, _T), pl.ds(j * _T, _T)],
                                kv_smem.at[slot, j], barrier.at[slot])

  def zero_tail(slot, tiles, rows):
    """Zeroes the tiles' rows from `rows` on (past the length, or a bad table entry's): NaN there
    would reach P V as 0 * NaN."""
    @pl.when(rows < _T)
    def _():
      ids = plgpu.broadcasted_iota(jnp.int32, (_T, _T), 0, layout=plgpu.Layout.WGMMA)
      for j in tiles:
        kv_smem[slot, j] = jnp.where(ids < rows, kv_smem[slot, j], 0)
      plgpu.commit_smem()  # plain stores that wgmma (the async proxy) reads next

  # Operands go through `step_variant` (p: the pair): with static slots their wgmma descriptors
  # are loop-invariant, and ptxas spilled them (ptxas 13.5, B=128 N=128 S=8192: 1.4 KB of spills,
  # 223 loads in the step loops; with it 48 bytes, 12).
  def scores(slot, q_rope, p, tiles, later, later_landed):
    """S = Q K^T over the slot's `tiles` (refilled first), then later_landed() (the wait for the
    others), then the `later` tiles: slot 0's lo tiles are refilled early in a pair (after P_A
    V_A,L) and its hi tiles last; slot 1's hi tiles early (after P_B V_B,R), its lo tiles last."""
    q, kv = step_variant(q_smem, p), step_variant(kv_smem, p)

    def product(acc_ref):
      for j in (*tiles, *later):
        if j == later[0]:
          later_landed()
        a = q.at[j] if j < LORA // _T else q_rope_smem if interpret else q_rope
        plgpu.wgmma(acc_ref, a, kv.at[slot, j].transpose((1, 0)))
      return acc_ref[...]
    return pl.run_scoped(product, plgpu.ACC((_T, _T), jnp.float32))

  def masked(s, rows):
    """Keys from `rows` on to -inf: only a row's last page, a bad entry's or an odd count's
    missing page B has any."""
    keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    return lax.cond(rows < _T, lambda x: jnp.where(keys < rows, x, -jnp.inf), lambda x: x, s)

  def values(acc, scale, p, slot, tiles, pair):
    """acc * scale + P V over the warpgroup's 4 value tiles (P from registers or shared memory;
    scale None: acc as it is)."""
    kv = step_variant(kv_smem, pair)
    if not isinstance(p, jax.Array):
      p = step_variant(p, pair)
    if scale is not None:
      acc = tuple(part * lax.broadcast_in_dim(scale, part.shape, [0]) for part in acc)
    if interpret:
      def product(j, acc_ref):
        plgpu.wgmma(acc_ref, p, kv.at[slot, j])
        return acc_ref[...]
      return tuple(part + pl.run_scoped(functools.partial(product, j),
                                        plgpu.ACC((_T, _T), jnp.float32))
                   for part, j in zip(acc, tiles))

    def products(acc_refs):
      for acc_ref, j in zip(acc_refs, tiles):
        plgpu.wgmma(acc_ref, p, kv.at[slot, j])
    return pl.run_state(products)(tuple(plgpu.ACC.init(part) for part in acc))

  def finish(w, acc, m, l_own):
    """Sums both warpgroups' l, stores this one's output columns (O / l) and, warpgroup 0, the
    rows' log-sum-exps. Rows 0 (m_A) and 1 (m_B) were last read before the other warpgroup's last
    hand-off, and the slots once both arrive here."""
    row_smem[2 * w] = l_own
    plgpu.commit_smem()
    plgpu.barrier_arrive(l_ready)
    plgpu.barrier_wait(l_ready)
    l = plgpu.load(row_smem.at[0], layout=_ROWS) + plgpu.load(row_smem.at[2], layout=_ROWS)
    cols = pl.ds(w * LORA // 2, LORA // 2)
    store_output(acc, l, o_smem.at[w], o_ref.at[t, split, heads, cols], 1.0)
    if w == 0:
      row_smem[1] = rows_lse(m, l)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(row_smem.at[1], lse_ref.at[t, split, heads])
    plgpu.wait_smem_to_gmem(0)

  def empty_softmax():
    return (plgpu.layout_cast(jnp.full((_T,), M_INIT, jnp.float32), _ROWS),
            plgpu.layout_cast(jnp.zeros((_T,), jnp.float32), _ROWS),
            tuple(plgpu.layout_cast(jnp.zeros((_T, _T), jnp.float32), plgpu.Layout.WGMMA)
                  for _ in _LO))

  def load_rope():
    plgpu.barrier_wait(q_bar)
    q_rope = plgpu.load(q_rope_smem, layout=plgpu.Layout.WGMMA)
    plgpu.barrier_arrive(rope_loaded)
    return q_rope

  @pl.when(wg == 0)
  def _left():
    for j in range(LORA // _T + 1):
      plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(j * _T, _T)],
                              q_smem.at[j] if j < LORA // _T else q_rope_smem, q_bar)
    fetch(0, 0, _LO, kv_lo)
    fetch(1, 1, _LO, kv_lo)
    q_rope = load_rope()

    def pair(p, carry):
      m, l, acc = carry
      a, b = 2 * p, 2 * p + 1
      rows_a = source(a)[2]
      plgpu.barrier_wait(kv_lo.at[0])
      zero_tail(0, _LO, rows_a)
      s = masked(scores(0, q_rope, p, _LO, _HI, functools.partial(plgpu.barrier_wait,
                                                                   kv_hi.at[0])), rows_a)
      m_a = jnp.maximum(m, s.max(axis=1) * qk_scale)  # the scale inside exp2 (a positive one)
      p_a = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_a, s.shape, [0]))
      alpha = jnp.exp2(m - m_a)
      l = l * alpha + p_a.sum(axis=1)
      row_smem[0] = m_a
      plgpu.commit_smem()
      plgpu.barrier_arrive(m_a_ready)
      p16 = p_a.astype(jnp.bfloat16)
      if interpret:
        a_smem[...] = p16
        plgpu.commit_smem()
      acc = values(acc, alpha, a_smem if interpret else p16, 0, _LO, p)
      fetch(a + 2, 0, _LO, kv_lo)  # slot 0's lo tiles: S_A and P_A V_A,L have read them
      plgpu.barrier_wait(b_ready)
      m_b = plgpu.load(row_smem.at[1], layout=_ROWS)
      r = jnp.exp2(m_a - m_b)
      pl.when(p > 0)(functools.partial(plgpu.barrier_wait, p0_free))
      p0_smem[...] = (p_a * lax.broadcast_in_dim(r, p_a.shape, [0])).astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p0_ready)
      # Without a page B (an odd count's last pair) its slot holds no copy: its rows count none
      # (zeroed) and P_B is 0. No branch around the products: wgmma does not lower inside one.
      pl.when(b < n)(functools.partial(plgpu.barrier_wait, kv_lo.at[1]))
      zero_tail(1, _LO, source(b)[2])
      acc = values(acc, r, sp1, 1, _LO, p)
      fetch(b + 2, 1, _LO, kv_lo)
      plgpu.barrier_arrive(p1_free)
      return m_b, l * r, acc

    m, l, acc = lax.fori_loop(0, pairs, pair, empty_softmax())
    pl.when(pairs > 0)(functools.partial(plgpu.barrier_wait, p0_free))
    finish(0, acc, m, l)

  @pl.when(wg == 1)
  def _right():
    fetch(0, 0, _HI, kv_hi)
    fetch(1, 1, _HI, kv_hi)
    q_rope = load_rope()
    plgpu.barrier_wait(rope_loaded)  # both hold Q's RoPE tile: its memory is sP1 from here

    def pair(p, carry):
      m, l, acc = carry
      a, b = 2 * p, 2 * p + 1
      has_b = b < n
      rows_b = source(b)[2]
      # Without a page B its rows count none (rows_b = 0): S is masked whole and its value tiles
      # zeroed, as warpgroup 0's.
      pl.when(has_b)(functools.partial(plgpu.barrier_wait, kv_hi.at[1]))
      s = masked(scores(1, q_rope, p, _HI, _LO, lambda: pl.when(has_b)(
          functools.partial(plgpu.barrier_wait, kv_lo.at[1]))), rows_b)
      zero_tail(1, range(4, 8), rows_b)  # (after S, which masks these keys; P V reads them)
      plgpu.barrier_wait(m_a_ready)
      m_b = jnp.maximum(plgpu.load(row_smem.at[0], layout=_ROWS), s.max(axis=1) * qk_scale)
      p_b = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_b, s.shape, [0]))
      alpha = jnp.exp2(m - m_b)
      l = l * alpha + p_b.sum(axis=1)
      row_smem[1] = m_b
      p16 = p_b.astype(jnp.bfloat16)
      pl.when(p > 0)(functools.partial(plgpu.barrier_wait, p1_free))
      sp1[...] = p16
      plgpu.commit_smem()
      plgpu.barrier_arrive(b_ready)
      acc = values(acc, alpha, sp1 if interpret else p16, 1, range(4, 8), p)
      fetch(b + 2, 1, _HI, kv_hi)  # slot 1's hi tiles: S_B and P_B V_B,R have read them
      plgpu.barrier_wait(kv_hi.at[0])
      zero_tail(0, range(4, 8), source(a)[2])
      plgpu.barrier_wait(p0_ready)
      acc = values(acc, None, p0_smem, 0, range(4, 8), p)  # P_A' is relative to m_B already
      plgpu.barrier_arrive(p0_free)
      fetch(a + 2, 0, _HI, kv_hi)  # slot 0's hi tiles: S_A and P_A' V_A,R have read them
      return m_b, l, acc

    m, l, acc = lax.fori_loop(0, pairs, pair, empty_softmax())
    pl.when(pairs > 0)(functools.partial(plgpu.barrier_wait, p1_free))
    finish(1, acc, m, l)


def check_args(q: jax.Array, kv_cache: jax.Array, kv_lora_rank: int) -> None:
  """ValueError for what this kernel does not take (the shared decode checks aside)."""
  if q.dtype != jnp.bfloat16 or kv_cache.dtype != jnp.bfloat16:
    raise ValueError(f"the seesaw decode takes bfloat16 q and cache, got {q.dtype.name} and "
                     f"{kv_cache.dtype.name}")
  if kv_lora_rank != LORA or q.shape[2] != LORA + ROPE:
    raise ValueError(f"the seesaw decode takes kv_lora_rank {LORA} and {LORA + ROPE} columns (8 "
                     f"value tiles and one RoPE tile), got {kv_lora_rank} and {q.shape[2]}")
  if kv_cache.shape[1] % _T:
    raise ValueError(f"page size must be a multiple of {_T}, got {kv_cache.shape[1]}")


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "num_kv_splits",
                                             "split_tokens", "interpret"))
def latent_decode(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                  *, scale: float, kv_lora_rank: int = LORA, num_kv_splits: int | None = None,
                  split_tokens: int | None = None, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """`mosaic_decode.latent_decode`'s contract for bf16 q [T, N, 576] (any N: padded to tiles of 64)
  and cache [num_blocks, page, 576] (page a multiple of 64). num_kv_splits (None: one) or
  split_tokens (fixed splits merged in order: batch-invariant) as there. Returns o [T, N, 512]
  bf16 and lse [T, N] f32 (natural log)."""
  check_decode_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank)
  check_softmax_scale(scale)
  check_args(q, kv_cache, kv_lora_rank)
  check_grid_tokens(q.shape[0])
  check_split_args(num_kv_splits, split_tokens, _T)
  t, n, d = q.shape
  max_len = block_tables.shape[1] * kv_cache.shape[1]
  splits = num_fixed_splits(split_tokens, max_len) if split_tokens else num_kv_splits or 1
  fixed_order = split_tokens is not None
  out_dtype = partials_dtype(q.dtype, splits, fixed_order)
  np_ = pl.cdiv(n, _T) * _T
  if np_ != n:
    q = jnp.pad(q, ((0, 0), (0, np_ - n), (0, 0)))
  tile = swizzled((_T, _T), jnp.bfloat16)
  o_parts, lse_parts = plgpu.kernel(
      functools.partial(_kernel, qk_scale=scale * LOG2E, num_splits=splits,
                        split_steps=split_tokens and split_tokens // _T,
                        interpret=bool(interpret)),
      out_type=(jax.ShapeDtypeStruct((t, splits, np_, LORA), out_dtype),
                jax.ShapeDtypeStruct((t, splits, np_), jnp.float32)),
      scratch_types=(
          swizzled((LORA // _T, _T, _T), jnp.bfloat16),
          tile,
          plgpu.RefUnion((swizzled((2, d // _T, _T, _T), jnp.bfloat16),),
                         (swizzled((2, _T, LORA // 2), out_dtype),)),
          tile,
          plgpu.SMEM((3, _T), jnp.float32),
          plgpu.Barrier(num_arrivals=d // _T),  # q_bar
          plgpu.Barrier(num_arrivals=len(_LO), num_barriers=2),  # kv_lo
          plgpu.Barrier(num_arrivals=len(_HI), num_barriers=2),  # kv_hi
          plgpu.Barrier(num_arrivals=2),  # rope_loaded
          plgpu.Barrier(),  # m_a_ready
          plgpu.Barrier(),  # b_ready
          plgpu.Barrier(),  # p0_ready
          plgpu.Barrier(),  # p0_free
          plgpu.Barrier(),  # p1_free
          plgpu.Barrier(num_arrivals=2),  # l_ready
          *((tile, tile) if interpret else ()),  # the interpreter's sP1 and P_A
      ),
      # As mosaic_decode: the head tiles of a (token, split) side by side in launch order.
      grid=(t, splits, np_ // _T),
      grid_names=("tokens", "splits", "heads"),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None,
      kernel_name=f"mosaic_latent_decode_bf16_seesaw_p{kv_cache.shape[1]}_s{splits}",
  )(q, kv_cache, block_tables, seq_lens)
  if splits == 1 and not fixed_order:
    o, lse = o_parts[:, 0], lse_parts[:, 0]
  else:
    o, lse = merge_splits(o_parts, lse_parts, q.dtype, fixed_order=fixed_order)
  return o[:, :n], lse[:, :n]
