"""Pallas-Triton flash attention for MLA prefill: packed variable-length requests, Dk != Dv.

One program per (query-block slot, head, request). Request r's queries are the packed rows
cu_q[r]:cu_q[r+1], its keys cu_k[r]:cu_k[r+1]; causal masking is aligned bottom-right (query i sees
keys j <= i + len_k - len_q). Each program walks only the key blocks its rows can see: first the
blocks every row sees in full (no mask), then the diagonal / ragged tail blocks (masked). An extra
"request" R owns the padding rows past cu_q[-1]; it has no keys, so it writes o = 0, lse = -inf.
Triton needs power-of-two blocks, so a 192-wide head is loaded and dotted as 128 + 64 columns.
Pure arrays in and out: no dependency on the rest of the project.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (FLOAT_DTYPES, LN2, LOG2E, check_prefill_args,
                                   check_triton_config, is_pow2, join_k_pe, with_overrides)


@dataclasses.dataclass(frozen=True)
class MlaPrefillConfig:
  """Launch knobs of one call; the field names are the jit entry's keyword arguments."""
  block_q: int  # query rows per block
  block_k: int  # keys per step
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_triton_config(self, ("block_q", "block_k"))


# The chosen configs by (Dk, Dv, itemsize); others take FALLBACK. Figures and the variants behind
# them: benchmarks/RESULTS.md, "MLA prefill (pallas_triton)".
TUNING = {
    (192, 128, 2): MlaPrefillConfig(128, 64, 8, 3),  # N=128, 16K tokens: 353-355 TFLOP/s (v1)
    # f32 dots are IEEE FMA loops, not tensor-core ops: small tiles keep them out of local memory.
    (192, 128, 4): MlaPrefillConfig(32, 32, 4, 2),
}
FALLBACK = MlaPrefillConfig(64, 32, 4, 2)
# The sweep space: the variants `benchmarks/bench_prefill.py --sweep` times.
SWEEP = (MlaPrefillConfig(128, 64, 8, 3), MlaPrefillConfig(128, 64, 8, 4),
         MlaPrefillConfig(128, 128, 8, 2))


def _column_parts(d):
  """(offset, width) column splits of a head dim into at most two powers of two >= 16, or None."""
  widths = [1 << i for i in reversed(range(d.bit_length())) if d >> i & 1]
  if len(widths) > 2 or widths[-1] < 16:
    return None
  return tuple(zip((0, widths[0]), widths))


def _cdiv(a, b):
  return lax.div(a + b - 1, b)


def _prefill_kernel(cu_q_ref, cu_k_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal,
                    block_q, block_k, k_parts, num_q_programs):
  # cu_q_ref, cu_k_ref: [R+1] int32 cumulative lengths.
  # q_ref: [Tq, N, Dk]; k_ref: [Tk, N, Dk]; v_ref: [Tk, N, Dv] (whole arrays, sliced here).
  # o_ref: [Tq, N, Dv]; lse_ref: [Tq, N] float32.
  prog, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_requests = cu_q_ref.shape[0] - 1
  dv = v_ref.shape[-1]
  pad = r == num_requests
  nxt = jnp.minimum(r + 1, num_requests)
  q_start, k_start = cu_q_ref[r], cu_k_ref[r]
  q_len = jnp.where(pad, q_ref.shape[0], cu_q_ref[nxt]) - q_start
  k_len = jnp.where(pad, 0, cu_k_ref[nxt] - k_start)
  diag = k_len - q_len  # row i sees keys j <= i + diag when causal
  qk_scale = scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))
  dot = functools.partial(plgpu.dot, precision=lax.Precision.HIGHEST)  # IEEE for f32, not TF32

  def attend(qs):
    rows = qs + jnp.arange(block_q)  # request-local query positions [block_q]
    row_ok = rows < q_len
    q_rows = pl.ds(q_start + qs, block_q)
    # Masked-off rows read 0: they may lie in the next request or past the array.
    qs_parts = [plgpu.load(q_ref.at[q_rows, h, pl.ds(off, w)], mask=row_ok[:, None], other=0.0)
                for off, w in k_parts]  # each [block_q, w]

    def step(j, carry, masked):
      acc, m, l = carry  # [block_q, Dv] f32, [block_q] f32 (log2 units), [block_q] f32
      k_rows = pl.ds(k_start + j * block_k, block_k)
      cols = j * block_k + jnp.arange(block_k)  # request-local key positions [block_k]
      key_ok = cols < k_len
      # Keys past the request are zeroed, not just masked in s: p = 0 times a NaN v is NaN.
      load = (functools.partial(plgpu.load, mask=key_ok[:, None], other=0.0) if masked
              else plgpu.load)
      # dot + dot (no sum() and its leading 0): Triton folds the add into one accumulator chain.
      s = functools.reduce(operator.add, [
          dot(qp, load(k_ref.at[k_rows, h, pl.ds(off, w)]), trans_b=True)
          for qp, (off, w) in zip(qs_parts, k_parts)])  # [block_q, block_k], unscaled
      v = load(v_ref.at[k_rows, h, :])  # [block_k, Dv]
      if masked:
        visible = key_ok[None, :]
        if causal:
          visible = visible & (cols[None, :] <= rows[:, None] + diag)
        s = jnp.where(visible, s, -jnp.inf)
      # Scale the row max, not s: then s * qk_scale - m below is one FMA per element.
      m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
      # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
      m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      p = jnp.exp2(s * qk_scale - m_new_safe[:, None])
      corr = jnp.exp2(m - m_new_safe)
      acc = acc * corr[:, None] + dot(p.astype(v.dtype), v)
      return acc, m_new, l * corr + p.sum(axis=1)

    last_row = jnp.minimum(qs + block_q, q_len)  # one past the block's last real row
    if causal:
      k_end = jnp.clip(last_row + diag, 0, k_len)
      k_full = jnp.clip(qs + 1 + diag, 0, k_len)  # keys the block's first row (hence all) sees
    else:
      k_end = k_full = k_len
    n_full, n_end = k_full // block_k, _cdiv(k_end, block_k)
    carry = (jnp.zeros((block_q, dv), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o = acc / l_safe[:, None]
    lse = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
    plgpu.store(o_ref.at[q_rows, h, :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[q_rows, h], lse, mask=row_ok)

  # Slot p takes the request's blocks nb-1-p, nb-1-p-P, ...: the heaviest causal blocks launch
  # first, and a request longer than max_seqlen_q (or the padding) is still covered, just serially.
  num_blocks = _cdiv(q_len, block_q)
  trips = _cdiv(jnp.maximum(num_blocks - prog, 0), num_q_programs)

  def q_block(t, carry):
    attend((num_blocks - 1 - prog - t * num_q_programs) * block_q)
    return carry

  lax.fori_loop(0, trips, q_block, 0)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, k_pe):
  check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, FLOAT_DTYPES, k_pe)
  if _column_parts(q.shape[2]) is None:
    raise ValueError(f"Dk must be a power of two >= 16 or a sum of two; got {q.shape[2]}")
  if not (is_pow2(v.shape[2]) and v.shape[2] >= 16):
    raise ValueError(f"Dv must be a power of two >= 16; got {v.shape[2]}")


@functools.partial(jax.jit, static_argnames=("scale", "causal", "max_seqlen_q", "block_q",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def mla_prefill(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                cu_seqlens_k: jax.Array, *, scale: float, causal: bool, max_seqlen_q: int,
                k_pe: jax.Array | None = None, block_q: int | None = None,
                block_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, interpret: bool = False
                ) -> tuple[jax.Array, jax.Array]:
  """Variable-length attention with a running LSE; see the module docstring for the layout.

  q [Tq, N, Dk]; k [Tk, N, Dk]; v [Tk, N, Dv]; cu_seqlens_q / cu_seqlens_k [R+1] int32.
  k_pe [Tk, R] (optional, q's dtype): the keys' last R columns, the same for every head, with k
  then [Tk, N, Dk - R]; joined to k here (a copy: the split form saves it in the Mosaic kernel).
  max_seqlen_q: static bound on any request's query count; it sizes the grid (a request beyond it
  is still right, only slower). Returns o [Tq, N, Dv] (q.dtype) and lse [Tq, N] float32 (natural
  log); rows past cu_q[-1], and rows that see no key, give (0, -inf).
  """
  _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, k_pe)
  k = join_k_pe(k, k_pe)
  tq, n, dk = q.shape
  tk, dv = k.shape[0], v.shape[2]
  config = with_overrides(TUNING.get((dk, dv, q.dtype.itemsize), FALLBACK), block_q=block_q,
                          block_k=block_k, num_warps=num_warps, num_stages=num_stages)
  if tq == 0 or tk == 0:  # nothing to attend: Triton cannot take a zero-sized ref
    return jnp.zeros((tq, n, dv), q.dtype), jnp.full((tq, n), -jnp.inf, jnp.float32)
  block_q, block_k = config.block_q, config.block_k
  # No request is longer than Tq, so more slots than that would only idle.
  num_q_programs = max(1, -(-min(max_seqlen_q, tq) // block_q))
  num_requests = cu_seqlens_q.shape[0] - 1
  kernel = functools.partial(_prefill_kernel, scale=scale, causal=causal, block_q=block_q,
                             block_k=block_k, k_parts=_column_parts(dk),
                             num_q_programs=num_q_programs)
  return pl.pallas_call(
      kernel,
      grid=(num_q_programs, n, num_requests + 1),
      out_shape=(jax.ShapeDtypeStruct((tq, n, dv), q.dtype),
                 jax.ShapeDtypeStruct((tq, n), jnp.float32)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="mla_prefill",
  )(cu_seqlens_q, cu_seqlens_k, q, k, v)
