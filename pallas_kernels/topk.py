"""Exact top-k positions per row for DSA (SPEC 6), as a threshold select: no sort anywhere.

Selection works on int32 keys that order like the floats (`_keys`); positions outside the row's
window, -inf and NaN logits get INT32_MIN, which nothing selects (`reference.topk_positions` reports
those as -1 too). The k-th largest key v of a row decides everything: positions with key > v are in,
and enough of those with key == v to make k. Three steps:

1. XLA: the maximum of each strided group {j, j+m, j+2m, ...} of G positions (G a power of two with
   m = S/G between 4k and 8k groups); strided groups decorrelate neighbouring positions. (A Pallas
   program per row streaming the G slices measured slower on the H200: benchmarks/RESULTS.md.)
2. Pallas: theta = the k-th largest group maximum, by a 32-step bitwise bisection over the maxima
   held in registers (at least k groups reach theta, so v >= theta): in a program per row of its
   own when rows are split into segments (several per row when rows are few), else at the start of
   the row's one segment program. Each segment program streams its segment once; every position
   with key >= theta is compacted (cumsum) into the row's candidate list of `cap` = 4k entries, at
   places the segments claim with an atomic add. Typically ~1.1k candidates; at most k*G plus ties.
3. Pallas, a program per row: v by the same bisection over the candidates (in registers), then the
   selection is compacted into the output, -1 padded. A row whose candidates overflowed `cap`
   (many ties at theta) takes an exact but slow path: the bisection streams the whole row 32 times.
Which of several positions tied at v are taken is unspecified (the order segments claimed places).

Stores compact by cumsum; lanes that do not store point one past the end of their ref (masked off
on the GPU; interpret mode's scatter drops out-of-range indices) so they never collide with a lane
that does. Pure arrays in and out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_triton_config, is_pow2, next_pow2, sm_count

_INT_MIN = -2 ** 31
_CAP_PER_K = 4  # candidate slots per selected position


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """Launch knobs of both kernels; the field names are the jit entry's keyword arguments."""
  chunk: int  # positions per streamed step (short rows take the next power of two >= 16)
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_triton_config(self, ("chunk",))


# The chosen config: 8 warps spread the 8K-32K register-resident keys at 32-128 a thread; the H200
# sweep behind it: benchmarks/RESULTS.md, "DSA kernels (pallas_triton)".
DEFAULT = TopkConfig(2048, 8, 1)  # 128 x 131072: 0.171 ms
# The sweep space: the variants `benchmarks/bench_sparse.py --sweep` times.
SWEEP = tuple(TopkConfig(*v) for v in [(2048, 8, 1), (1024, 8, 1), (4096, 8, 1), (2048, 4, 1),
                                       (2048, 16, 1), (2048, 8, 2)])


def _keys(x, inside):
  """int32 keys ordered like the float32 values x (negative floats get their magnitude bits
  flipped); INT_MIN where not `inside` and for -inf / NaN."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(inside & (x > -jnp.inf), bits ^ ((bits >> 31) & 0x7FFFFFFF), _INT_MIN)


def _row_keys(logits_ref, t, end, start, chunk):
  """(keys, positions) [chunk] of row t from `start`; INT_MIN from `end` on."""
  pos = start + jnp.arange(chunk, dtype=jnp.int32)
  inside = pos < end
  x = plgpu.load(logits_ref.at[t, pl.ds(start, chunk)], mask=inside, other=-jnp.inf)
  return _keys(x, inside), pos


def _kth_largest(keys_of, num_chunks, k):
  """The k-th largest key over chunks `keys_of(i)`, i < num_chunks; INT_MIN if fewer than k are
  above INT_MIN. Builds it bit by bit from the top on the unsigned image key ^ INT_MIN: a bit stays
  set when at least k keys reach the threshold with it set."""
  def count_at_least(threshold):
    return lax.fori_loop(0, num_chunks,
                         lambda i, n: n + (keys_of(i) >= threshold).astype(jnp.int32).sum(), 0)

  def one_bit(b, image):
    trial = image | jnp.left_shift(jnp.int32(1), 31 - b)
    return jnp.where(count_at_least(trial ^ _INT_MIN) >= k, trial, image)

  return lax.fori_loop(0, 32, one_bit, jnp.int32(0)) ^ _INT_MIN


def _compact(take, base, bound):
  """Destinations base, base+1, ... of the taken lanes, `bound` (out of range) elsewhere; and the
  number taken."""
  taken = take.astype(jnp.int32)
  dst = base + jnp.cumsum(taken) - 1
  return jnp.where(take & (dst < bound), dst, bound), taken.sum()


def _theta_kernel(max_ref, theta_ref, *, k):
  # max_ref [m] int32 (this row's group maxima, INT_MIN padded); theta_ref [T] int32
  maxima = max_ref[...]
  theta_ref[pl.program_id(0)] = _kth_largest(lambda i: maxima, 1, k)


def _threshold_kernel(max_ref, logits_ref, len_ref, _, cand_key_ref, cand_pos_ref, count_ref, *,
                      k, chunk, segment):
  # max_ref [m] int32 (this row's group maxima, INT_MIN padded), or [T] int32 (every row's theta,
  # computed once per row) when k is None; logits_ref [T, S] f32; len_ref [T] int32; _ [T] int32
  # zeros, aliased to count_ref; cand_key_ref, cand_pos_ref [cap] int32 (this row); count_ref [T]
  # int32 (candidates per row, counted past cap)
  t, p = pl.program_id(0), pl.program_id(1)
  cap = cand_key_ref.shape[0]
  if k is None:
    theta = max_ref[t]
  else:
    maxima = max_ref[...]
    theta = _kth_largest(lambda i: maxima, 1, k)
  # This program streams positions [start, end) of the row, its segment clipped to the window.
  start = p * segment
  end = jnp.minimum(start + segment, jnp.clip(len_ref[t], 0, logits_ref.shape[1]))

  def body(i, current):
    key, pos = current
    # Issue the next chunk's load before working on this one (past the end it is all masked).
    nxt = _row_keys(logits_ref, t, end, start + (i + 1) * chunk, chunk)
    take = (key >= theta) & (key > _INT_MIN)
    # Segments of a row claim places in its list atomically; within a chunk, by position.
    base = plgpu.atomic_add(count_ref, t, take.astype(jnp.int32).sum())
    dst, _ = _compact(take, base, cap)
    plgpu.store(cand_key_ref.at[dst], key, mask=dst < cap)
    plgpu.store(cand_pos_ref.at[dst], pos, mask=dst < cap)
    return nxt

  lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), chunk), body,
                _row_keys(logits_ref, t, end, start, chunk))


def _select_kernel(cand_key_ref, cand_pos_ref, count_ref, logits_ref, len_ref, out_ref, *, k,
                   chunk, fill):
  # cand_key_ref, cand_pos_ref [cap] int32 (this row); count_ref [T] int32; logits_ref [T, S] f32;
  # len_ref [T] int32; out_ref [k] int32 (this row's positions)
  t = pl.program_id(0)
  cap = cand_key_ref.shape[0]
  count = count_ref[t]
  length = jnp.clip(len_ref[t], 0, logits_ref.shape[1])

  def select(source, num_chunks):
    """Writes the selection among `source(i)` -> (keys, positions), i < num_chunks; returns how
    many positions it wrote."""
    v = _kth_largest(lambda i: source(i)[0], num_chunks, k)
    above = lax.fori_loop(0, num_chunks,
                          lambda i, n: n + (source(i)[0] > v).astype(jnp.int32).sum(), 0)
    # Ties at v fill the rest; with fewer than k valid keys (v = INT_MIN) there are none to take.
    need = jnp.where(v > _INT_MIN, k - above, 0)

    def body(i, carry):
      written, ties = carry
      key, pos = source(i)
      tie = key == v
      tie_rank = ties + jnp.cumsum(tie.astype(jnp.int32)) - 1
      dst, taken = _compact((key > v) | (tie & (tie_rank < need)), written, k)
      plgpu.store(out_ref.at[dst], pos, mask=dst < k)
      return written + taken, ties + tie.astype(jnp.int32).sum()

    written, _ = lax.fori_loop(0, num_chunks, body, (jnp.int32(0), jnp.int32(0)))
    return written

  def from_candidates():
    valid = jnp.arange(cap, dtype=jnp.int32) < count  # past count: never written
    keys = jnp.where(valid, cand_key_ref[...], _INT_MIN)
    return select(lambda i: (keys, cand_pos_ref[...]), 1)

  def from_row():
    return select(lambda i: _row_keys(logits_ref, t, length, i * chunk, chunk),
                  pl.cdiv(length, chunk))

  written = lax.cond(count > cap, from_row, from_candidates)

  def pad(i, carry):
    idx = i * fill + jnp.arange(fill, dtype=jnp.int32)
    dst = jnp.where((idx >= written) & (idx < k), idx, k)
    plgpu.store(out_ref.at[dst], jnp.full((fill,), -1, jnp.int32), mask=dst < k)
    return carry

  lax.fori_loop(0, pl.cdiv(k, fill), pad, 0)


def group_size(num_positions: int, k: int) -> int:
  """G: the largest power of two leaving at least 4k strided groups (1 for short rows)."""
  ratio = num_positions // (4 * k)
  return 1 << (ratio.bit_length() - 1) if ratio else 1


@functools.partial(jax.jit, static_argnames=("topk", "chunk", "num_warps", "num_stages",
                                             "theta_per_row", "interpret"))
def topk_positions(logits: jax.Array, seq_lens: jax.Array, topk: int, *, chunk: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   theta_per_row: bool | None = None, interpret: bool = False) -> jax.Array:
  """Top-`topk` positions of each row within its window (semantics of
  `mla_jax.reference.topk_positions`): logits [T, S] float32, seq_lens [T] int32 (row t sees
  s < seq_lens[t]) -> int32 [T, topk], -1 padded, in no particular order (nor which of tied
  positions). chunk: positions per streamed step, a power of two >= 16. theta_per_row: compute
  theta in its own kernel, once per row, instead of in each of a row's segment programs (None:
  when rows have several segments).
  """
  if logits.ndim != 2 or seq_lens.shape != logits.shape[:1]:
    raise ValueError(f"want logits [T, S] and seq_lens [T]; got {logits.shape} and "
                     f"{seq_lens.shape}")
  if logits.dtype != jnp.float32 or seq_lens.dtype != jnp.int32:
    raise ValueError(f"logits must be float32 and seq_lens int32; got {logits.dtype.name} and "
                     f"{seq_lens.dtype.name}")
  if not isinstance(topk, int) or topk < 1:
    raise ValueError(f"topk must be a positive int, got {topk!r}")
  if chunk is not None and not (is_pow2(chunk) and chunk >= 16):
    raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
  t, s = logits.shape
  if t == 0 or s == 0:
    return jnp.full((t, topk), -1, jnp.int32)
  chunk = chunk or min(DEFAULT.chunk, max(16, next_pow2(s)))
  params = plgpu.CompilerParams(num_warps=num_warps or DEFAULT.num_warps,
                                num_stages=num_stages or DEFAULT.num_stages)
  g = group_size(s, topk)
  m = -(-s // g)
  cap = next_pow2(min(_CAP_PER_K * topk, s))

  keys = _keys(logits, jnp.arange(s)[None, :] < seq_lens[:, None])
  keys = jnp.pad(keys, ((0, 0), (0, g * m - s)), constant_values=_INT_MIN)
  maxima = keys.reshape(t, g, m).max(axis=1)
  maxima = jnp.pad(maxima, ((0, 0), (0, next_pow2(m) - m)), constant_values=_INT_MIN)

  # Rows split into segments until the grid holds ~4 programs per SM, each at least 4 chunks long.
  segments = max(1, min(pl.cdiv(s, 4 * chunk), pl.cdiv(4 * sm_count(), t)))
  segment = pl.cdiv(pl.cdiv(s, segments), chunk) * chunk
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  row = lambda width: pl.BlockSpec((None, width), lambda i, *_: (i, 0))
  counts_in = jnp.zeros((t,), jnp.int32)
  if theta_per_row is None:
    theta_per_row = segments > 1
  if theta_per_row:  # one bisection per row, not one per segment program
    maxima = pl.pallas_call(
        functools.partial(_theta_kernel, k=topk),
        grid=(t,),
        in_specs=[row(maxima.shape[1])],
        out_specs=whole(counts_in),
        out_shape=jax.ShapeDtypeStruct((t,), jnp.int32),
        compiler_params=params,
        interpret=interpret,
        name="topk_theta",
    )(maxima)
  cand_keys, cand_pos, counts = pl.pallas_call(
      functools.partial(_threshold_kernel, k=None if theta_per_row else topk, chunk=chunk,
                        segment=segment),
      grid=(t, pl.cdiv(s, segment)),
      in_specs=[whole(maxima) if theta_per_row else row(maxima.shape[1]), whole(logits),
                whole(seq_lens), whole(counts_in)],
      out_specs=[row(cap), row(cap), whole(counts_in)],
      out_shape=[jax.ShapeDtypeStruct((t, cap), jnp.int32)] * 2
                + [jax.ShapeDtypeStruct((t,), jnp.int32)],
      input_output_aliases={3: 2},
      compiler_params=params,
      interpret=interpret,
      name="topk_threshold",
  )(maxima, logits, seq_lens, counts_in)
  return pl.pallas_call(
      functools.partial(_select_kernel, k=topk, chunk=chunk, fill=min(1024, next_pow2(topk))),
      grid=(t,),
      in_specs=[row(cap), row(cap), whole(counts), whole(logits), whole(seq_lens)],
      out_specs=row(topk),
      out_shape=jax.ShapeDtypeStruct((t, topk), jnp.int32),
      compiler_params=params,
      interpret=interpret,
      name="topk_select",
  )(cand_keys, cand_pos, counts, logits, seq_lens)
