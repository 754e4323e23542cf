"""MLA prefill flash attention for Hopper GPUs, in Pallas lowered through Mosaic GPU.

The contract of `pallas_kernels.mla_prefill.mla_prefill` (the Pallas-Triton kernel: packed
variable-length requests, bottom-right causal alignment, Dk != Dv, f32 natural-log lse, rows past
cu_q[-1] give 0 / -inf), for bfloat16 q, k, v. The structure is jax's FlashAttention-3 port
(`jax.experimental.pallas.ops.gpu.attention_mgpu`): one program (CTA) per (query-block slot, head,
request), 128 query rows a block, three warpgroups:
- compute (warpgroups 0 and 1): each bulk-copies its own 64 x Dk query tile, then per 64-key step
  S = Q K^T (wgmma, M = 64 rows, N = 64 keys, K = Dk), the float32 online softmax, P (bf16)
  through shared memory, O += P V (wgmma, N = Dv);
- memory (warpgroup 2): the request's K and V blocks, 64 keys a step, one bulk copy each into a
  ring of slots, refilled as soon as both compute warpgroups are done with a slot's K (or V).
Both compute warpgroups walk the same steps (those the block's last row needs), so they share every
slot; the diagonal, ragged and misaligned steps are masked, the others are not.

Bulk copies move whole 64-row boxes and cannot mask rows, so:
- Mosaic GPU copies (8, 64)-tiled buffers as whole tiles of the global array, so a box must start
  at a row it can prove a multiple of 8: a request's boxes start at its first row rounded down to
  8, and q, k, v are zero-padded to a multiple of 8 rows, at least 64 (a copy only when needed);
- a box that would run past the end of q or k/v is moved back to end there (the row positions in
  the masks account for both shifts);
- a 64-row output tile may run into the next request's rows, so each tile is written to its own slot
  of a padded output (`tile_offsets`: request r's tiles follow the earlier requests' ones), and the
  packed result is gathered from there (`_unpack`); rows past cu_q[-1] are set there too.
Keys outside a request that a box reads get P = 0 exactly; they must be finite (0 * NaN = NaN),
which the Triton kernel does not need (it zeroes them on load).

Shared memory (Dk 192, Dv 128, 3 stages): 2 query tiles 48 KB + 3 x (24 + 16) KB K/V + 2 P tiles
16 KB + output staging 32.5 KB = 216.5 KB of the 227 KB a block may have.

`interpret=True` (or an `InterpretGPUParams`) runs the same kernel on the CPU through Mosaic GPU's
interpreter (see `pallas_kernels.mosaic_decode` for what it does and does not simulate). P goes
through shared memory and each P V product into a fresh accumulator for the same reason as there:
the interpreter (jax 0.11.2) runs wgmma only with shared-memory operands into run_scoped
accumulators.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_prefill import check_prefill_args
from pallas_kernels.mosaic_decode import _row_broadcast, _swizzled

DTYPES = ("bfloat16",)  # what q, k, v may be (the wgmma operands here are 16-bit, f16 untested)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running max before any visible key: finite, so exp2(m_old - m_new) stays 0 or 1, never NaN.
_M_INIT = -1e30
_TILE = 64  # query rows per compute warpgroup: the M of every Hopper wgmma
_COMPUTE_WGS = 2
_BLOCK_Q = _COMPUTE_WGS * _TILE  # query rows per program
_BLOCK_K = 64  # keys per step and bulk copy: N of S = Q K^T, K of P V (one swizzle tile)
_MAX_STAGES = 3  # the Triton kernel's measured best depth; 2 where 3 does not fit
_SMEM_BYTES = 227 * 1024  # what one Hopper block may have
_CONSUMER_REGS = 232  # 2 x 232 + 40 (memory warpgroup) registers x 128 threads fit the 64K file
_MEMORY_REGS = 40
_MAX_DV = 256  # wgmma N limit; the 64 x Dv float32 accumulator is Dv / 2 registers a thread
# Row alignment of a bulk copy's first row: Mosaic GPU copies a (8, 64)-tiled buffer as whole
# tiles of the global array, so it must prove the start a multiple of 8.
_ALIGN = 8


def _smem_bytes(dk, dv, stages):
  """Shared memory of one program: q tiles, K/V ring, P tiles, output and lse staging."""
  q = _COMPUTE_WGS * _TILE * dk * 2
  kv = stages * _BLOCK_K * (dk + dv) * 2
  p = _COMPUTE_WGS * _TILE * _BLOCK_K * 2
  out = _COMPUTE_WGS * _TILE * (dv * 2 + 4)
  return q + kv + p + out


def _stages_for(dk, dv):
  """The deepest K/V ring (at most _MAX_STAGES, at least 2) that fits, or 0 if none does."""
  return next((s for s in range(_MAX_STAGES, 1, -1) if _smem_bytes(dk, dv, s) <= _SMEM_BYTES), 0)


def _aligned_rows(q_len, q_lead):
  """A request's query rows counted from its first row's 8-aligned row down; none if empty."""
  return jnp.where(q_len > 0, q_len + q_lead, 0)


def _prefill_kernel(cu_q_ref, cu_k_ref, tile_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem,
                    k_smem, v_smem, p_smem, o_smem, lse_smem, q_bar, k_ready, v_ready, k_consumed,
                    v_consumed, *, scale, causal, num_q_programs):
  # GMEM: cu_q_ref, cu_k_ref [R+1] int32; tile_ref [R] int32 (request's first output tile);
  # q_ref [Tq, N, Dk], k_ref [Tk, N, Dk], v_ref [Tk, N, Dv] bf16 (Tq, Tk multiples of 8, >= 64);
  # o_ref [tiles*64, N, Dv] bf16 and lse_ref [N, tiles*64] f32: one 64-row slot per output tile.
  # SMEM: q_smem [2, 64, Dk] (a query tile per compute warpgroup); k_smem [stages, 64, Dk];
  # v_smem [stages, 64, Dv]; p_smem [2, 64, 64] (each warpgroup's P); o_smem [2, 64, Dv] bf16,
  # lse_smem [2, 64] f32 (output staging). Barriers: q_bar [2] (query tile landed); k_ready,
  # v_ready [stages] (slot landed); k_consumed, v_consumed [stages] (both compute warpgroups done).
  prog, h, r = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("requests")
  wg = lax.axis_index("wg")
  tq, tk = q_ref.shape[0], k_ref.shape[0]
  stages = k_smem.shape[0]
  qk_scale = scale * _LOG2E  # log2(e) folded in: the softmax runs on exp2
  q_start, k_start = cu_q_ref[r], cu_k_ref[r]
  q_len = cu_q_ref[r + 1] - q_start
  k_len = cu_k_ref[r + 1] - k_start
  diag = k_len - q_len  # row i sees keys j <= i + diag when causal
  # Written as products so that Mosaic GPU sees them divisible by 8.
  q_base, k_base = lax.div(q_start, _ALIGN) * _ALIGN, lax.div(k_start, _ALIGN) * _ALIGN
  q_lead, k_lead = q_start - q_base, k_start - k_base

  # Slot p takes the request's blocks nb-1-p, nb-1-p-P, ...: the heaviest causal blocks launch
  # first, and a request longer than max_seqlen_q is still covered, just serially.
  num_blocks = lax.div(_aligned_rows(q_len, q_lead) + (_BLOCK_Q - 1), _BLOCK_Q)
  trips = lax.div(jnp.maximum(num_blocks - prog, 0) + (num_q_programs - 1), num_q_programs)

  def block_start(trip):
    """The block's first row, counted from q_base."""
    return (num_blocks - 1 - prog - trip * num_q_programs) * _BLOCK_Q

  def key_steps(qs):
    """Step bounds (lo, hi, end) of the block starting at qs: steps [lo, hi) need no mask, steps
    [0, lo) and [hi, end) do. Step j holds the keys k_base + 64j on. Every warpgroup derives the
    same bounds, so their barrier phases agree."""
    first_row = jnp.maximum(qs - q_lead, 0)  # request-local
    if causal:
      k_end = jnp.clip(jnp.minimum(qs + _BLOCK_Q - q_lead, q_len) + diag, 0, k_len)
      k_full = jnp.clip(first_row + 1 + diag, 0, k_len)  # keys the block's first row (hence all) sees
    else:
      k_end = k_full = k_len
    end = jnp.where(k_end > 0, lax.div(k_end + k_lead + (_BLOCK_K - 1), _BLOCK_K), 0)
    # Step 0 also holds the previous request's last k_lead keys.
    lo = jnp.minimum(jnp.where(k_lead > 0, 1, 0), end)
    return lo, jnp.maximum(lax.div(k_full + k_lead, _BLOCK_K), lo), end

  def box(start, rows, total):
    """A `rows`-row box beginning at `start`, moved back to end at `total`: (first row, shift).
    Both are multiples of 8 (start and total are): tiled bulk copies need that."""
    first = jnp.minimum(start, total - rows)
    return first, start - first

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def step(j, carry, qs, q_shift, masked):
      m, l, acc, count = carry
      slot = lax.rem(count, stages)
      plgpu.barrier_wait(k_ready.at[slot])

      def scores(acc_ref):  # acc_ref [64 rows, 64 keys] f32
        plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((_TILE, _BLOCK_K), jnp.float32))
      plgpu.barrier_arrive(k_consumed.at[slot])
      if masked:
        # Made in the step, not carried: a 64 x 64 int32 iota is 32 registers a thread.
        cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        _, k_shift = box(k_base + j * _BLOCK_K, _BLOCK_K, tk)
        keys = cols + (j * _BLOCK_K - k_shift - k_lead)  # request-local key positions
        # cols >= k_shift: keys before those were counted by the previous step.
        visible = (cols >= k_shift) & (keys >= 0) & (keys < k_len)
        if causal:
          rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
          visible &= keys <= rows + (qs + wg * _TILE - q_shift - q_lead + diag)
        s = jnp.where(visible, s, -jnp.inf)
      # Scale the row max, not s: then s * qk_scale - m below is one FMA per element.
      m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s * qk_scale - _row_broadcast(m_new, s.shape))
      l = l * alpha + p.sum(axis=1)
      p_smem.at[wg][...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()  # these plain stores are read next by wgmma (the async proxy)
      plgpu.barrier_wait(v_ready.at[slot])

      def values(acc_ref):  # acc_ref [64 rows, Dv] f32
        plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot])
        return acc_ref[...]

      pv = pl.run_scoped(values, plgpu.ACC(acc.shape, jnp.float32))
      plgpu.barrier_arrive(v_consumed.at[slot])
      return m_new, l, acc * _row_broadcast(alpha, acc.shape) + pv, count + 1

    def q_block(trip, count):
      qs = block_start(trip)
      tile_row = qs + wg * _TILE  # this warpgroup's first row, counted from q_base
      q_first, q_shift = box(q_base + tile_row, _TILE, tq)
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_first, _TILE), h], q_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      lo, hi, end = key_steps(qs)
      carry = (plgpu.layout_cast(jnp.full((_TILE,), _M_INIT, jnp.float32), rows_layout),
               plgpu.layout_cast(jnp.zeros((_TILE,), jnp.float32), rows_layout),
               plgpu.layout_cast(jnp.zeros(o_smem.shape[1:], jnp.float32), plgpu.Layout.WGMMA),
               count)
      run = functools.partial(step, qs=qs, q_shift=q_shift)
      carry = lax.fori_loop(0, lo, functools.partial(run, masked=True), carry)
      carry = lax.fori_loop(lo, hi, functools.partial(run, masked=False), carry)
      m, l, acc, count = lax.fori_loop(hi, end, functools.partial(run, masked=True), carry)

      # A tile wholly past the request (the second half of its last block) writes nothing: its
      # slot belongs to the next request. Rows that saw no key give 0, -inf.
      @pl.when(tile_row < q_lead + q_len)
      def _():
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_smem.at[wg][...] = (acc * _row_broadcast(1.0 / l_safe, acc.shape)).astype(o_smem.dtype)
        lse_smem.at[wg][...] = jnp.where(seen, m * _LN2 + jnp.log(l_safe), -jnp.inf)
        plgpu.commit_smem()
        out_row = (tile_ref[r] + lax.div(tile_row, _TILE)) * _TILE
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[pl.ds(out_row, _TILE), h])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, pl.ds(out_row, _TILE)])
        # The staging is rewritten by the next block.
        plgpu.wait_smem_to_gmem(0)

      return count

    lax.fori_loop(0, trips, q_block, jnp.int32(0))

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGS, action="decrease")

    def q_block(trip, count):
      _, _, n_end = key_steps(block_start(trip))

      @pl.loop(0, n_end)
      def _(j):
        c = count + j
        slot = lax.rem(c, stages)
        first, _ = box(k_base + j * _BLOCK_K, _BLOCK_K, tk)
        rows = pl.ds(first, _BLOCK_K)

        @pl.when(c >= stages)
        def _():
          plgpu.barrier_wait(k_consumed.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem.at[slot], k_ready.at[slot])

        @pl.when(c >= stages)
        def _():
          plgpu.barrier_wait(v_consumed.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem.at[slot], v_ready.at[slot])

      return count + n_end

    total = lax.fori_loop(0, trips, q_block, jnp.int32(0))

    # Sees the last uses of the slots out too: a warpgroup that waits on some phases of a barrier
    # waits on all of them (the interpreter checks this when the barriers are freed).
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(c):
      plgpu.barrier_wait(k_consumed.at[lax.rem(c, stages)])
      plgpu.barrier_wait(v_consumed.at[lax.rem(c, stages)])


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
  check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, DTYPES)
  dk, dv = q.shape[2], v.shape[2]
  if dk % 64 or dv % 64 or dv > _MAX_DV or not _stages_for(dk, dv):
    raise ValueError(f"Dk ({dk}) and Dv ({dv}) must be multiples of 64 (the swizzle tile), Dv at "
                     f"most {_MAX_DV}, and 2 stages of 64-key K/V blocks must fit in shared memory")


def _padded_rows(t):
  """Rows a bulk-copied array needs: a multiple of 8 (box starts are), at least one 64-row box."""
  return max(-(-t // _ALIGN) * _ALIGN, _TILE)


def _pad_rows(x):
  rows = _padded_rows(x.shape[0])
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0))) if rows != x.shape[0] else x


def _tile_offsets(cu_q):
  """[R] int32: request r's first 64-row output slot; its tiles start at its first row's 8-aligned
  row down, so a request of L rows led by l rows has ceil((L + l) / 64) (none if L = 0)."""
  lead = cu_q[:-1] % _ALIGN
  tiles = -(-_aligned_rows(jnp.diff(cu_q), lead) // _TILE)
  return (jnp.cumsum(tiles) - tiles).astype(jnp.int32)


def _unpack(o_tiles, lse_tiles, cu_q, tile_offsets, tq_padded, tq):
  """The packed [Tq, N, Dv] output and [Tq, N] lse from the per-tile slots the kernel wrote."""
  t = jnp.arange(tq, dtype=jnp.int32)
  r = jnp.clip(jnp.searchsorted(cu_q, t, side="right") - 1, 0, cu_q.shape[0] - 2)
  aligned = t - cu_q[r] + cu_q[r] % _ALIGN  # row within the request's tiles
  tile = aligned // _TILE
  tile_start = t - aligned + tile * _TILE
  shift = jnp.maximum(tile_start + _TILE - tq_padded, 0)  # the box moved back from the end
  slot_row = (tile_offsets[r] + tile) * _TILE + aligned % _TILE + shift
  valid = t < cu_q[-1]
  slot_row = jnp.where(valid, slot_row, 0)
  o = jnp.where(valid[:, None, None], o_tiles[slot_row], 0).astype(o_tiles.dtype)
  lse = jnp.where(valid[:, None], lse_tiles[:, slot_row].T, -jnp.inf)
  return o, lse


@functools.partial(jax.jit, static_argnames=("scale", "causal", "max_seqlen_q", "interpret"))
def mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, max_seqlen_q,
                interpret=False):
  """Variable-length attention with a running LSE; see the module docstring for the layout.

  q [Tq, N, Dk]; k [Tk, N, Dk]; v [Tk, N, Dv], all bfloat16, Dk and Dv multiples of 64;
  cu_seqlens_q / cu_seqlens_k [R+1] int32. max_seqlen_q: static bound on any request's query count;
  it sizes the grid (a request beyond it is still right, only slower). interpret: True or a
  `plgpu.InterpretGPUParams` runs Mosaic GPU's CPU interpreter. Returns o [Tq, N, Dv] bf16 and
  lse [Tq, N] float32 (natural log); rows past cu_q[-1], and rows that see no key, give (0, -inf).
  """
  _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
  tq, n, dk = q.shape
  tk, dv = k.shape[0], v.shape[2]
  num_requests = cu_seqlens_q.shape[0] - 1
  if tq == 0 or tk == 0 or num_requests == 0:  # nothing to attend
    return jnp.zeros((tq, n, dv), q.dtype), jnp.full((tq, n), -jnp.inf, jnp.float32)
  q, k, v = _pad_rows(q), _pad_rows(k), _pad_rows(v)
  tile_offsets = _tile_offsets(cu_seqlens_q)
  # Output slots of 64 rows, request after request: at most Tq/64 + one partial tile a request.
  num_tiles = tq // _TILE + num_requests
  # No request is longer than Tq, so more slots than that would only idle.
  num_q_programs = max(1, -(-min(max_seqlen_q, tq) // _BLOCK_Q))
  stages = _stages_for(dk, dv)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()

  kernel = functools.partial(_prefill_kernel, scale=scale, causal=causal,
                             num_q_programs=num_q_programs)
  o_tiles, lse_tiles = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((num_tiles * _TILE, n, dv), q.dtype),
                jax.ShapeDtypeStruct((n, num_tiles * _TILE), jnp.float32)),
      scratch_types=(
          _swizzled((_COMPUTE_WGS, _TILE, dk), q.dtype),
          _swizzled((stages, _BLOCK_K, dk), k.dtype),
          _swizzled((stages, _BLOCK_K, dv), v.dtype),
          _swizzled((_COMPUTE_WGS, _TILE, _BLOCK_K), q.dtype),
          _swizzled((_COMPUTE_WGS, _TILE, dv), q.dtype),
          plgpu.SMEM((_COMPUTE_WGS, _TILE), jnp.float32),
          plgpu.Barrier(num_barriers=_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
      ),
      # Query slots vary fastest: programs of one (head, request) read the same K/V from L2.
      grid=(num_q_programs, n, num_requests),
      grid_names=("q", "heads", "requests"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      # Row reductions of the WGMMA layout stay within a warp (shuffles), so the cross-warp
      # reduction scratch (2 KB by default) is not needed.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=interpret or None,
      kernel_name=f"mosaic_mla_prefill_{'causal' if causal else 'full'}_s{stages}",
  )(cu_seqlens_q, cu_seqlens_k, tile_offsets, q, k, v)
  return _unpack(o_tiles, lse_tiles, cu_seqlens_q, tile_offsets, q.shape[0], tq)
