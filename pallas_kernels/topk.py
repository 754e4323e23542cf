"""Exact top-k positions per row for DSA (SPEC 6), as a threshold select: no sort anywhere.

Selection works on int32 keys that order like the floats (`_keys`); positions outside the row's
window, -inf and NaN logits get INT32_MIN, which nothing selects (`reference.topk_positions` reports
those as -1 too). The k-th largest key v of a row decides everything: positions with key > v are in,
and of those with key == v the lowest positions, enough to make k (what `lax.top_k` takes). Four
kernels, each reading the logits at most once (steps 1 and 2 fuse into one where rows are many):

1. maxima: the maximum of each strided group {j, j+m, j+2m, ...} of G positions (G a power of two
   with m = S/G between 4k and 8k groups; strided groups decorrelate neighbouring positions), a
   program per (row, tile of groups), so every SM streams (one program per row was too few:
   benchmarks/RESULTS.md).
2. theta: a lower bound of the k-th largest group maximum (at least k groups reach it, so v >=
   theta), found by bisection on the key bits between the row's smallest and largest maximum, only
   the top `_THETA_BITS` bits: a lower theta only admits a few more candidates. Where rows alone
   fill the SMs, one program a row takes its maxima in registers and theta from them (no maxima
   written: `fused_theta`).
3. threshold: a row is split into segments (several per row when rows are few); each streams its
   segment once and compacts every position with key >= theta into its own `cap` = 4k places of
   the row's candidate list: by a block-wide cumsum per chunk, in position order, or (`per_lane`,
   v3; no shape's default since v9) into each lane's own slots, with no cross-lane work per
   chunk, moved into the list by one cumsum of the lanes' counts at the end. Typically ~1.16k
   candidates a row (H200, random rows); at most k*G plus ties.
4. select, a program per row: v by bisection over the candidates (in registers; bits shared by
   theta and the largest candidate are known), then the lowest positions among ties at v (a second
   bisection, only when more tie than fit), and the selection compacted into the output, -1
   padded. A row whose candidates overflowed `cap` (many ties at theta) takes an exact but slow
   path: the bisections stream the whole row.

v9 (`TopkConfig.sectors`, the default for rows from 32768 positions and for many rows): step 1
also writes the maximum of every 8 positions (a 32-byte sector; groups {j, j + m8, ...} with m8
rounded up to whole sectors), and step 3 reads a row's sector maxima, keeps the sectors that reach
theta (every candidate lies in one) and reads the logits of those only: ~14% of the sectors at
131072 positions, ~44% at 32768 (random rows).

v10b (`TopkConfig.lean_select`, the default for many rows): the select's rare full-width path
streams its candidates, so the kernel's registers are the common path's. (v10, searches deciding 2
or 4 bits a pass, lost on the H200 and was removed: RESULTS.md.)

v11 (`TopkConfig.row_resident`): rows of at most 32768 positions in one kernel, a
program a row holding the row's keys in registers (64 a thread at 16 warps): the bisection for v
runs on them directly, stopping at the first threshold exactly k keys reach (random rows: ~21 of
32 passes); only rows tied at v search again, on s-1-pos, for the lowest ties. The selection is
compacted in column order (a thread's keys are a column: a running count in the thread, one
cumsum across the threads). One read of the logits, one launch. v11b (`TopkConfig.interpolate`):
the search interpolates its next threshold between its bounds' counts (~12 passes on random
rows), bisecting where interpolation stalls: the default for rows of 16384 to 32768 positions
(`default_config`; H200, session 15: 1.06-1.6x the four kernels at 16 to 4096 rows). v12 (the
same `TopkConfig.interpolate` on the four-kernel path): step 4's search for v interpolates too,
from theta to the largest candidate (`_select_among`); many rows' default (H200, session 25: the
select 179 -> 87 us at 4096 x 32768). Theta keeps its bisection of the top bits, which measured
faster than an exact interpolated theta. v16: the maxima kernels write the group and sector maxima
as int16, their top 16 bits (`_high`), all theta (16 bits) and the sectors' test against it read:
half the bytes written and read back (H100, session 39: 1.02-1.03x at 128 x 131072 and 1024 x
65536).

Not a radix select: a histogram of the keys' high bits needs scatter-adds into shared memory (or a
warp's match). jax 0.11.2 offers none with an interpreter path: Pallas-Triton has no scratch
memory, no sort and no histogram, and its `atomic_add` with vector indices (global memory, acq_rel)
drops repeated indices in interpret mode; Mosaic GPU refuses vector indices into refs and its
atomics add whole arrays, leaving `inline_mgpu`, which the interpreter cannot run. Counting many
thresholds at once needs no scatter but costs ~2 integer ops a key a threshold per pass
(RESULTS.md, "DSA selection", top-k v6). The maxima play the histogram's part: theta bounds v from
below as the histogram's boundary bucket would.

With a block table (`topk_positions(..., block_tables=)`), the kernel that writes the positions
(the select, or v11's) then maps them to cache slots through the row's table (`_map_to_slots`):
what sparse attention reads, without an XLA mapping pass between the two kernels.

Stores compact by cumsum; lanes that do not store point one past the end of their ref (masked off
on the GPU; interpret mode's scatter drops out-of-range indices) so they never collide with a lane
that does. Pure arrays in and out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (check_pow2, check_topk_args, check_triton_config, next_pow2,
                                   sm_count, with_overrides)

_INT_MIN = -2 ** 31
_INT_MAX = 2 ** 31 - 1
_CAP_PER_K = 4  # candidate slots per selected position
# Theta keeps the sign, the exponent and 7 mantissa bits of the k-th largest maximum: at most 1/128
# below it, so the extra candidates are the few maxima-sized values within that margin. So the
# maxima kernels write those 16 bits only (`_high`, v16): all theta and the sectors' test read.
_THETA_BITS = 16
_INT16_MIN = -2 ** 15
_THETA_WARPS = 8  # spread the 8K-16K register-resident maxima at 32-64 a thread
_MAXIMA_TILE = 8192  # positions a maxima program reads: G rows of tile / G groups
_HALVED_MIN = 512  # candidate lists from this size get a half-width select path too
# The sector threshold's first pass (its sector maxima) takes this many chunks a step: half the
# steps, each a block-wide compaction (H100, session 39: 4096 x 65536 1.10x, 1024 x 65536 1.05x,
# few rows within 1%; 4 and 8 slower).
_SECTOR_STEPS = 2
_SECTOR = 8  # positions a sector maximum covers (v9): 32 bytes of logits, one DRAM sector
# v11: keys a thread holds; rows up to 16 warps of them (a 512-thread block may take 128 registers
# a thread, half of them keys).
_RESIDENT_KEYS = 64
RESIDENT_MAX = 16 * 32 * _RESIDENT_KEYS


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """Launch knobs; the field names are the jit entry's keyword arguments."""
  chunk: int  # threshold kernel: positions per streamed step (short rows: next power of two >= 16)
  num_warps: int  # threshold kernel
  num_stages: int  # threshold, theta and select kernels
  select_warps: int  # select kernel
  # Threshold kernel: candidates into per-lane slots (`_lane_threshold_kernel`, v3) instead of a
  # block-wide cumsum per chunk (`_threshold_kernel`, v2).
  per_lane: bool = False
  # Group maxima and theta in one kernel, a program per row (`_maxima_theta_kernel`, v3), instead
  # of the maxima kernel (a program per tile) and the theta kernel.
  fused_theta: bool = False
  # v9: the maxima kernel also writes each 8-position sector's maximum (`_sector_maxima_kernel`,
  # or `_sector_maxima_theta_kernel` with fused_theta), and the threshold kernel reads only the
  # sectors whose maximum reaches theta (`_sector_threshold_kernel`): ~14% of them on random rows
  # at 131072 positions.
  sectors: bool = False
  # v10b: the select's path for more than cap / 2 candidates (rare: random rows fill ~0.3 cap)
  # streams them in two halves from the candidate lists every pass instead of holding all cap
  # lanes in registers, which set the whole kernel's (pip Triton 3.6, sm_90a: 255 and 148 bytes
  # of spills at 4 warps, 225 at 8).
  lean_select: bool = False
  # v11: the whole top-k of a row in one program holding the row's keys in registers
  # (`_resident_kernel`), rows of at most `RESIDENT_MAX` positions; the other fields are the
  # four-kernel path's and it takes none of them.
  row_resident: bool = False
  # v11b: row_resident's search interpolates its next threshold between the bounds' counts
  # (`_interpolated_search`) instead of bisecting the key bits: ~12 passes instead of ~21 on
  # random rows (RESULTS.md, top-k v11b). v12: so does the four-kernel path's select (its
  # theta keeps the bisection of the top `_THETA_BITS` bits: interpolated, it measured slower).
  interpolate: bool = False

  def __post_init__(self):
    check_triton_config(self, ("chunk",))
    check_pow2("select_warps", self.select_warps)
    for name in ("per_lane", "fused_theta", "sectors", "lean_select", "row_resident",
                 "interpolate"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.sectors and self.per_lane:
      raise ValueError("sectors is a threshold kernel of its own: it takes no per_lane")


# The chosen configs, from H200 sweeps of each kernel alone (benchmarks/RESULTS.md, "DSA
# selection", v2). Threshold: 1024 positions x 4 warps 0.080 / 0.489 ms at 128 x 131072 / 4096 x
# 32768, against 2048 x 8 0.086 / 0.565 (2048 x 4: 0.112 / 0.706). Select: 8 warps while rows are at
# most 2 per SM (128 rows: 0.041 ms, 4 warps 0.058), else 4 (4096 rows: 0.204 ms, 8 warps 0.318):
# many rows fill the SMs, and 4 warps let more reside. v3 (RESULTS.md "DSA selection" v3, whole
# top-k): the per-lane threshold kernel only for rows over 32K positions at most 2 rows per SM
# (128 x 131072: 0.120 ms against 0.132; alone 0.0725 against 0.0864); at 128 x 32768 it measured
# slower (0.0645 against 0.059 with theta fused; its fixed cost, a cumsum and the slots' move at the
# end, is not paid back over 7 chunks), and at 4096 x 32768 too (1.08 against 0.838; alone 0.716
# against 0.495: each candidate's slot store is a 32-byte sector of its own, where the block-wide
# compaction writes them contiguously). Theta fused with the maxima where rows are many (4096 x
# 32768: 0.838 against 0.925; alone 0.179 against 0.268, the maxima no longer written and read
# back); at 128 rows, no faster at 32768 (0.059 against 0.0584) and slower at 131072 (0.139 against
# 0.120: 128 programs each streaming 512 KB). v8 (session 13): the per-lane kernel in one register
# layout (`flat_lanes`), 0.102 ms at 128 x 131072 and 0.0658 at 128 x 32768; removed in session 14
# (no shape's default after v9). v9 (sectors; session 13, one process, the v8 default beside it):
# 128 x 131072 0.0785 ms against 0.104, 4096 x 32768 (theta fused) 0.766 against 0.832, 128 x
# 32768 0.0656 against 0.0648 (equal): few rows from 32768 positions and many rows take it. v10b
# (lean_select; session 14, one process): 4096 x 32768 0.770 -> 0.729 ms (its select at 4 warps
# no longer spills), so many rows take it; at 128 rows it moves only the select (13-14 us) and
# timed within noise both ways (131072 0.0758 / 0.0667, 32768 0.0705 / 0.0751): not taken there.
# v12 (interpolate: the select's search interpolating; session 25, in turn, 20-200 calls a
# timing): 4096 x 32768 0.7275 -> 0.6695 ms (the select 179 -> 87 us), so many rows take it; 128 x
# 131072 0.0648 / 0.0647 and 128 x 32768 0.0705 / 0.0719 (equal): not taken there.
DEFAULT = TopkConfig(1024, 4, 1, 8)
DEFAULT_LONG_ROWS = TopkConfig(1024, 4, 1, 8, sectors=True)
DEFAULT_MANY_ROWS = TopkConfig(1024, 4, 1, 4, fused_theta=True, sectors=True, lean_select=True,
                               interpolate=True)
# v11b (session 15, H200, one process, ms, four kernels / v11 / v11b at k=2048): 32768 positions
# 16 rows 0.068 / 0.043 / 0.050, 64 0.0595 / 0.041 / 0.038, 128 0.075 / 0.054 / 0.049, 264 0.069 /
# 0.072 / 0.063, 512 0.108 / 0.124 / 0.102, 4096 0.739 / 0.858 / 0.696; 16384 positions 1.1-1.6x
# at 16-512 rows. Rows of 16384 to RESIDENT_MAX positions take it (shorter rows not timed), with
# the four-kernel path's fields of their shape kept, so row_resident=False alone gives that path.
_RESIDENT_MIN = 16384
_LONG_ROW = 32768  # positions from which few rows take DEFAULT_LONG_ROWS
# The sweep space: the variants `benchmarks/bench_sparse.py --sweep` times (128 x 131072).
SWEEP = tuple(TopkConfig(*v) for v in [
    (1024, 4, 1, 8, True), (2048, 4, 1, 8, True), (2048, 8, 1, 8, True), (4096, 8, 1, 8, True),
    (512, 4, 1, 8, True), (1024, 4, 2, 8, True), (1024, 4, 1, 8), (2048, 8, 1, 8)]) + tuple(
        TopkConfig(chunk, warps, 1, 8, sectors=True)
        for chunk, warps in [(1024, 4), (512, 4), (2048, 8)])


def _keys(x, inside):
  """int32 keys ordered like the float32 values x in IEEE total order, as `lax.top_k` ranks them
  (negative floats get their magnitude bits flipped; -0.0 < 0.0); INT_MIN where not `inside` and
  for -inf / NaN."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(inside & (x > -jnp.inf), bits ^ ((bits >> 31) & 0x7FFFFFFF), _INT_MIN)


def _row_keys(logits_ref, t, end, start, chunk):
  """(keys, positions) [chunk] of row t from `start`; INT_MIN from `end` on."""
  pos = start + jnp.arange(chunk, dtype=jnp.int32)
  inside = pos < end
  x = plgpu.load(logits_ref.at[t, pl.ds(start, chunk)], mask=inside, other=-jnp.inf)
  return _keys(x, inside), pos


def _high(keys):
  """int16: the keys' top `_THETA_BITS` bits, in their order (INT_MIN -> INT16_MIN, which no
  valid key's bits give: those are NaN bit patterns)."""
  return (keys >> (32 - _THETA_BITS)).astype(jnp.int16)


def _widen(high):
  """int32 keys from `_high`'s, the low bits 0: a maximum's lower bound which compares with a
  theta (its low bits 0 too) as the maximum does."""
  return high.astype(jnp.int32) << (32 - _THETA_BITS)


def _leading_equal_bits(a, b):
  """How many leading bits int32 a and b share (32 when equal); may say one fewer (float32
  rounding up), which only costs a bisection step."""
  x = a ^ b
  exponent = (lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 23) - 127
  return jnp.where(x == 0, 32, jnp.where(x < 0, 0, jnp.clip(31 - exponent, 0, 32)))


def _search_start(lo, hi, top_bits=32):
  """Where a search for a key between lo and hi starts on the unsigned image key ^ INT_MIN: how
  many leading bits are known (those lo and hi share, at most top_bits), and lo's image with the
  bits after those cleared."""
  lo_image, hi_image = jnp.int32(lo) ^ _INT_MIN, jnp.int32(hi) ^ _INT_MIN
  known = jnp.minimum(_leading_equal_bits(lo_image, hi_image), top_bits)
  # lo with the bits after the shared ones cleared (none when known == 0, all when 32).
  clear = lax.shift_right_logical(jnp.int32(-1), jnp.minimum(known, 31))
  return known, jnp.where(known == 0, 0, jnp.where(known == 32, lo_image, lo_image & ~clear))


def _kth_largest(keys_of, num_chunks, k, lo=_INT_MIN, hi=_INT_MAX, top_bits=32):
  """The k-th largest key over chunks `keys_of(i)`, i < num_chunks, given lo <= it <= hi; INT_MIN
  if fewer than k keys are above INT_MIN (then lo must be INT_MIN). Builds it bit by bit from the
  top on the unsigned image key ^ INT_MIN, starting below the bits lo and hi share: a bit stays set
  when at least k keys reach the threshold with it set. With top_bits < 32, only those bits: a
  lower bound whose other bits are 0."""
  known, start = _search_start(lo, hi, top_bits)

  def count_at_least(threshold):
    return lax.fori_loop(0, num_chunks,
                         lambda i, n: n + (keys_of(i) >= threshold).astype(jnp.int32).sum(), 0)

  def one_bit(b, image):
    trial = image | jnp.left_shift(jnp.int32(1), 31 - b)
    return jnp.where(count_at_least(trial ^ _INT_MIN) >= k, trial, image)

  return lax.fori_loop(known, top_bits, one_bit, start) ^ _INT_MIN


def _compact(take, base, bound):
  """Destinations base, base+1, ... of the taken lanes, `bound` (out of range) elsewhere; and the
  number taken."""
  taken = take.astype(jnp.int32)
  dst = base + jnp.cumsum(taken) - 1
  return jnp.where(take & (dst < bound), dst, bound), taken.sum()


def _pad(out_ref, written, k, fill):
  """-1 into out_ref[written:k], `fill` places a step."""
  def step(i, carry):
    idx = i * fill + jnp.arange(fill, dtype=jnp.int32)
    dst = jnp.where((idx >= written) & (idx < k), idx, k)
    plgpu.store(out_ref.at[dst], jnp.full((fill,), -1, jnp.int32), mask=dst < k)
    return carry

  lax.fori_loop(0, pl.cdiv(k, fill), step, 0)


def _outputs(refs, paging):
  """A select kernel's refs after its inputs: (out_ref,), or with paging (table_ref [T, MB]
  int32, out_ref, slot_ref) -> (table_ref or None, out_ref, slot_ref or None)."""
  return (None, *refs, None) if paging is None else refs


def _map_to_slots(t, out_ref, table_ref, slot_ref, paging, fill, barrier):
  """The row's positions, just written to out_ref [k] (-1 padded), as cache slots into slot_ref
  [k] through row t's table (`Paging`; as `mla_jax.cache.positions_to_slots` maps them: -1 for
  -1, past the table, or at a -1 / out-of-cache block). A pass over the k places after a block
  barrier (a thread reads positions other threads wrote): `fill` places a step, a few a thread,
  where mapping at the selection's own stores would take a masked table load for every one of
  the row's candidate lanes (v11: 64 a thread). barrier: False in interpret mode, which runs a
  program's threads as one (and has no block barrier)."""
  block_size, num_blocks = paging
  k, mb = out_ref.shape[0], table_ref.shape[1]
  if barrier:
    plgpu.debug_barrier()

  def step(i, carry):
    idx = i * fill + jnp.arange(fill, dtype=jnp.int32)
    inside = idx < k
    pos = plgpu.load(out_ref.at[jnp.minimum(idx, k - 1)], mask=inside, other=-1)
    blk = pos // block_size
    listed = inside & (pos >= 0) & (blk < mb)
    block = plgpu.load(table_ref.at[t, jnp.where(listed, blk, 0)], mask=listed, other=-1)
    slot = jnp.where(listed & (block >= 0) & (block < num_blocks),
                     block * block_size + pos % block_size, -1)
    plgpu.store(slot_ref.at[jnp.where(inside, idx, k)], slot, mask=inside)
    return carry

  lax.fori_loop(0, pl.cdiv(k, fill), step, 0)


def _maxima_kernel(logits_ref, len_ref, max_ref, *, groups):
  # logits_ref [T, S] f32; len_ref [T] int32; max_ref [w] int16 (row t's maxima of groups
  # c*w ... c*w + w - 1, `_high`; past the last group INT16_MIN)
  t, c = pl.program_id(0), pl.program_id(1)
  s = logits_ref.shape[1]
  g, w = groups, max_ref.shape[0]
  m = -(-s // g)
  col = c * w + jnp.arange(w, dtype=jnp.int32)
  pos = jnp.arange(g, dtype=jnp.int32)[:, None] * m + col[None, :]  # [G, w]
  inside = (pos < jnp.clip(len_ref[t], 0, s)) & (col < m)[None, :]
  x = plgpu.load(logits_ref.at[t, pos], mask=inside, other=-jnp.inf)
  max_ref[...] = _high(_keys(x, inside).max(axis=0))


def _theta(maxima, k, bits):
  """Theta of a row from its group maxima (INT_MIN padded): the top `bits` bits of the k-th
  largest."""
  valid = maxima > _INT_MIN
  enough = valid.astype(jnp.int32).sum() >= k
  lo = jnp.where(enough, jnp.where(valid, maxima, _INT_MAX).min(), _INT_MIN)
  return _kth_largest(lambda i: maxima, 1, k, lo, maxima.max(), bits)


def _theta_kernel(max_ref, theta_ref, *, k):
  # max_ref [mp] int16 (this row's group maxima, `_high`, INT16_MIN padded); theta_ref [T] int32
  theta_ref[pl.program_id(0)] = _theta(_widen(max_ref[...]), k, _THETA_BITS)


def _maxima_theta_kernel(logits_ref, len_ref, theta_ref, *, k, bits, groups, width):
  # Steps 1 and 2 in one program per row, the maxima in registers (never written): for many rows,
  # which fill the SMs a program a row. logits_ref [T, S] f32; len_ref [T] int32; theta_ref [T]
  # int32. Group c is {c, c + m, c + 2m, ...}, as in `_maxima_kernel`; a step reads one member of
  # every group (contiguous positions).
  t = pl.program_id(0)
  s = logits_ref.shape[1]
  m = -(-s // groups)
  col = jnp.arange(width, dtype=jnp.int32)
  length = jnp.clip(len_ref[t], 0, s)

  def member(g, maxima):
    pos = g * m + col
    inside = (pos < length) & (col < m)
    x = plgpu.load(logits_ref.at[t, pos], mask=inside, other=-jnp.inf)
    return jnp.maximum(maxima, _keys(x, inside))

  maxima = lax.fori_loop(0, groups, member, jnp.full((width,), _INT_MIN, jnp.int32))
  theta_ref[t] = _theta(maxima, k, bits)


def _threshold_kernel(theta_ref, logits_ref, len_ref, cand_key_ref, cand_pos_ref, count_ref, *,
                      chunk, segment):
  # theta_ref [T] int32 (every row's theta); logits_ref [T, S] f32; len_ref [T] int32;
  # cand_key_ref, cand_pos_ref [cap] int32 (this row's and segment's place); count_ref [T, P] int32
  # (candidates per row and segment, counted past cap)
  t, p = pl.program_id(0), pl.program_id(1)
  cap = cand_key_ref.shape[0]
  theta = theta_ref[t]
  # This program streams positions [start, end) of the row, its segment clipped to the window.
  start = p * segment
  end = jnp.minimum(start + segment, jnp.clip(len_ref[t], 0, logits_ref.shape[1]))

  def body(i, carry):
    (key, pos), count = carry
    # Issue the next chunk's load before working on this one (past the end it is all masked).
    nxt = _row_keys(logits_ref, t, end, start + (i + 1) * chunk, chunk)
    dst, taken = _compact((key >= theta) & (key > _INT_MIN), count, cap)
    plgpu.store(cand_key_ref.at[dst], key, mask=dst < cap)
    plgpu.store(cand_pos_ref.at[dst], pos, mask=dst < cap)
    return nxt, count + taken

  _, count = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), chunk), body,
                           (_row_keys(logits_ref, t, end, start, chunk), jnp.int32(0)))
  count_ref[t, p] = count


def _lane_threshold_kernel(theta_ref, logits_ref, len_ref, slot_key_ref, slot_pos_ref,
                           cand_key_ref, cand_pos_ref, count_ref, *, chunk, segment, interpret):
  # As `_threshold_kernel`, but the stream keeps no block-wide state: lane j of the chunk (positions
  # j, j + chunk, ...) stores its candidates in its own slots, slot s at slot_*_ref[s * chunk + j]
  # ([slots * chunk] int32, this row's and segment's), so a chunk costs no cumsum. After the stream,
  # one cumsum of the lanes' counts places every lane's slots in the cap places of the candidate
  # list (lane order, not position order: the select needs no order). A lane that fills its slots
  # marks the segment as overflowed (count past cap: the select's exact row path).
  t, p = pl.program_id(0), pl.program_id(1)
  cap = cand_key_ref.shape[0]
  slots = slot_key_ref.shape[0] // chunk
  theta = theta_ref[t]
  start = p * segment
  end = jnp.minimum(start + segment, jnp.clip(len_ref[t], 0, logits_ref.shape[1]))
  lane = jnp.arange(chunk, dtype=jnp.int32)
  past = slots * chunk

  def body(i, carry):
    (key, pos), filled = carry
    nxt = _row_keys(logits_ref, t, end, start + (i + 1) * chunk, chunk)
    take = (key >= theta) & (key > _INT_MIN)
    dst = jnp.where(take & (filled < slots), filled * chunk + lane, past)
    plgpu.store(slot_key_ref.at[dst], key, mask=dst < past)
    plgpu.store(slot_pos_ref.at[dst], pos, mask=dst < past)
    return nxt, filled + take.astype(jnp.int32)

  _, filled = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), chunk), body,
                            (_row_keys(logits_ref, t, end, start, chunk),
                             jnp.zeros((chunk,), jnp.int32)))
  # A lane's slots may be read back by other threads than wrote them: a block barrier makes the
  # writes visible (the interpreter runs a program sequentially, and has no barrier).
  if not interpret:
    plgpu.debug_barrier()
  kept = jnp.minimum(filled, slots)
  base = jnp.cumsum(kept) - kept

  def move(slot):
    has = slot < kept
    src = jnp.where(has, slot * chunk + lane, past)
    key = plgpu.load(slot_key_ref.at[src], mask=has, other=0)
    pos = plgpu.load(slot_pos_ref.at[src], mask=has, other=0)
    dst = jnp.where(has & (base + slot < cap), base + slot, cap)
    plgpu.store(cand_key_ref.at[dst], key, mask=dst < cap)
    plgpu.store(cand_pos_ref.at[dst], pos, mask=dst < cap)

  # Unrolled over the slots, so their loads are all in flight at once (a loop waited for each;
  # the slots past a lane's count are masked off and cost no memory traffic).
  for slot in range(slots):
    move(slot)
  count_ref[t, p] = jnp.where(filled.max() > slots, jnp.maximum(filled.sum(), cap + 1),
                              filled.sum())


def _sector_maxima_kernel(logits_ref, len_ref, max_ref, sec_ref, *, groups, m8, masked):
  # `_maxima_kernel` for v9 (`sectors`): the groups are {j, j + m8, j + 2 m8, ...} with m8 a
  # multiple of 8, so each of the tile's G rows of w positions is w / 8 whole sectors, whose
  # maxima come from the same load. Both written as `_high`. logits_ref [T, S] f32; len_ref [T]
  # int32; max_ref [w / 8, 8] int16 (row t's maxima of groups c*w ... c*w + w - 1, INT16_MIN past
  # m8); sec_ref [G, w / 8] int16 (entry [g, j]: the maximum of positions g*m8 + c*w + 8j ...
  # + 7). masked: a tile can reach past the row's S positions or its m8 groups (else the load
  # takes no mask, only static offsets).
  t, c = pl.program_id(0), pl.program_id(1)
  s = logits_ref.shape[1]
  sectors = max_ref.shape[0]
  g = jnp.arange(groups, dtype=jnp.int32)[:, None, None]
  j = jnp.arange(sectors, dtype=jnp.int32)[None, :, None]
  col = c * (sectors * _SECTOR) + j * _SECTOR + jnp.arange(_SECTOR, dtype=jnp.int32)
  pos = g * m8 + col  # [G, w / 8, 8]
  if masked:  # -inf past m8 or S: INT_MIN keys
    x = plgpu.load(logits_ref.at[t, pos], mask=(col < m8) & (pos < s), other=-jnp.inf)
  else:
    x = plgpu.load(logits_ref.at[t, pos])
  keys = _keys(x, pos < jnp.clip(len_ref[t], 0, s))
  max_ref[...] = _high(keys.max(axis=0))
  sec_ref[...] = _high(keys.max(axis=2))


def _sector_maxima_theta_kernel(logits_ref, len_ref, theta_ref, sec_ref, *, k, bits, groups, m8,
                                masked):
  # `_maxima_theta_kernel` for v9 (`sectors` with `fused_theta`), groups as in
  # `_sector_maxima_kernel`: a step reads one member of every group, m8 contiguous positions, and
  # writes their sector maxima. logits_ref [T, S] f32; len_ref [T] int32; theta_ref [T] int32;
  # sec_ref [G, w8] int16 (row t's sector maxima, `_high`, INT16_MIN past m8 / 8). masked: as
  # there.
  t = pl.program_id(0)
  s = logits_ref.shape[1]
  sectors = sec_ref.shape[1]
  col = jnp.arange(sectors, dtype=jnp.int32)[:, None] * _SECTOR + jnp.arange(_SECTOR,
                                                                             dtype=jnp.int32)
  length = jnp.clip(len_ref[t], 0, s)

  def member(g, maxima):
    pos = g * m8 + col  # [w8, 8]
    if masked:
      x = plgpu.load(logits_ref.at[t, pos], mask=(col < m8) & (pos < s), other=-jnp.inf)
    else:
      x = plgpu.load(logits_ref.at[t, pos])
    keys = _keys(x, pos < length)
    sec_ref[g, :] = _high(keys.max(axis=1))
    return jnp.maximum(maxima, keys)

  maxima = lax.fori_loop(0, groups, member, jnp.full((sectors, _SECTOR), _INT_MIN, jnp.int32))
  theta_ref[t] = _theta(maxima, k, bits)


def _sector_threshold_kernel(theta_ref, sec_ref, logits_ref, len_ref, ids_ref, cand_key_ref,
                             cand_pos_ref, count_ref, *, chunk, span, m8, row_sectors,
                             interpret):
  # v9's threshold (`sectors`): a position can reach theta only inside a sector whose maximum
  # does, so program p of row t reads its span of the row's sector maxima, keeps the sectors that
  # reach theta, and reads the logits of those only. theta_ref [T] int32; sec_ref [G * w8] int16
  # (this row's sector maxima, `_high`, w8 = row_sectors: sector f covers positions (f // w8) * m8 +
  # 8 (f % w8) ... + 7); logits_ref [T, S] f32; len_ref [T] int32; ids_ref [>= span] int32 (this
  # program's scratch: the first positions of its kept sectors); cand_key_ref, cand_pos_ref [cap]
  # int32 (its places in the row's candidate list, as `_threshold_kernel`'s); count_ref [T, P]
  # int32 (candidates per row and program, counted past cap).
  t, p = pl.program_id(0), pl.program_id(1)
  cap, bound = cand_key_ref.shape[0], ids_ref.shape[0]
  theta = theta_ref[t]
  length = jnp.clip(len_ref[t], 0, logits_ref.shape[1])
  lane = jnp.arange(chunk, dtype=jnp.int32)
  first = p * span
  last = jnp.minimum(first + span, sec_ref.shape[0])
  shift = row_sectors.bit_length() - 1

  # 1. Its sectors that reach theta, `_SECTOR_STEPS` chunks a step: their first positions, in
  # order, to ids_ref.
  # The offsets are hinted to be multiples of 1 only, which is true and leaves the load nothing to
  # align to: where span is a multiple of 4 Triton would give the load a 4-wide layout and convert
  # it to the stores' (pip Triton 3.6, sm_90a: 7 conversions and 29 block barriers in the kernel
  # at 128 x 32768, none and 11 with the hint).
  step = chunk * _SECTOR_STEPS
  sector_lane = jnp.arange(step, dtype=jnp.int32)

  def sector_max(i):
    f = pl.multiple_of(first + i * step + sector_lane, 1)
    return _widen(plgpu.load(sec_ref.at[f], mask=f < last, other=_INT16_MIN)), f

  def keep_sectors(i, carry):
    (smax, f), n = carry
    nxt = sector_max(i + 1)
    dst, taken = _compact((smax >= theta) & (smax > _INT_MIN), n, bound)
    start = lax.shift_right_logical(f, shift) * m8 + (f & (row_sectors - 1)) * _SECTOR
    plgpu.store(ids_ref.at[dst], start, mask=dst < bound)
    return nxt, n + taken

  _, n = lax.fori_loop(0, pl.cdiv(jnp.maximum(last - first, 0), step), keep_sectors,
                       (sector_max(0), jnp.int32(0)))
  # The kept sectors are read back by other threads than wrote them (as the per-lane slots).
  if not interpret:
    plgpu.debug_barrier()

  # 2. Their positions, chunk / 8 sectors a step (lane l: position l % 8 of kept sector l // 8),
  # compacted as `_threshold_kernel` does; each step's logits loaded a step ahead.
  def sector_logits(i):
    idx = i * chunk + lane
    pos = plgpu.load(ids_ref.at[idx // _SECTOR], mask=idx < n * _SECTOR, other=0) + idx % _SECTOR
    inside = (idx < n * _SECTOR) & (pos < length)
    return plgpu.load(logits_ref.at[t, pos], mask=inside, other=-jnp.inf), pos

  def keep_positions(i, carry):
    x, pos, count = carry
    nxt = sector_logits(i + 1)
    key = _keys(x, True)  # -inf where not loaded: INT_MIN
    dst, taken = _compact((key >= theta) & (key > _INT_MIN), count, cap)
    plgpu.store(cand_key_ref.at[dst], key, mask=dst < cap)
    plgpu.store(cand_pos_ref.at[dst], pos, mask=dst < cap)
    return *nxt, count + taken

  count = lax.fori_loop(0, pl.cdiv(n * _SECTOR, chunk), keep_positions,
                        (*sector_logits(0), jnp.int32(0)))[2]
  count_ref[t, p] = count


def _select_among(out_ref, source, num_chunks, hi, reach_theta, *, theta, k, s, interpolate):
  """Writes a row's selection into out_ref [k] (the select step's), in no order, from its
  keys >= theta, `source(i)` -> (keys, positions), i < num_chunks (keys <= hi; reach_theta of them
  reach theta and are valid; s: the row's positions); returns how many positions it wrote."""
  total = lambda f: lax.fori_loop(0, num_chunks,
                                  lambda i, n: n + f(*source(i)).astype(jnp.int32).sum(), 0)
  if interpolate:
    # v12: v is the k-th largest key or a threshold exactly n = k keys reach (then no ties to
    # resolve); INT_MIN when at most k keys are valid (all taken).
    enough = reach_theta > k
    v, n = _interpolated_search(
        lambda threshold: total(lambda key, pos: key >= threshold), k,
        jnp.where(enough, theta, _INT_MIN), jnp.where(enough, hi, _INT_MIN), reach_theta)
  else:
    v, n = _kth_largest(lambda i: source(i)[0], num_chunks, k, theta, hi), jnp.int32(-1)
  tie = lambda key, pos: (key == v) & (v > _INT_MIN)

  def ties(_):
    # Ties at v fill the rest; with fewer than k valid keys (v = INT_MIN) there are none to
    # take. Of the ties, the `need` lowest positions: those whose s-1-pos reaches the need-th
    # largest s-1-pos over the ties; every tie (0) when they all fit. (The branches compute
    # from `need`: a constant result does not lower to Triton.)
    need = jnp.where(v > _INT_MIN, k - total(lambda key, pos: key > v), 0)

    def tie_keys(i):
      key, pos = source(i)
      return jnp.where(tie(key, pos), s - 1 - pos, _INT_MIN)

    return lax.cond(total(tie) > need,
                    lambda m: _kth_largest(tie_keys, num_chunks, m, 0, s - 1),
                    lambda m: m * 0, need)

  last = lax.cond(n == k, lambda m: m * 0, ties, n)

  def body(i, written):
    key, pos = source(i)
    dst, taken = _compact((key > v) | (tie(key, pos) & (s - 1 - pos >= last)), written, k)
    plgpu.store(out_ref.at[dst], pos, mask=dst < k)
    return written + taken

  return lax.fori_loop(0, num_chunks, body, jnp.int32(0))


def _select_kernel(theta_ref, cand_key_ref, cand_pos_ref, count_ref, logits_ref, len_ref, *refs,
                   k, chunk, fill, lean, interpolate, paging, interpret):
  # theta_ref [T] int32; cand_key_ref, cand_pos_ref [P * cap] int32 (this row's segments' places);
  # count_ref [T, P] int32; logits_ref [T, S] f32; len_ref [T] int32; refs: out_ref [k] int32
  # (this row's positions), or with paging table_ref [T, MB] int32, out_ref, slot_ref [k] int32
  # (their cache slots; `_outputs`)
  t = pl.program_id(0)
  table_ref, out_ref, slot_ref = _outputs(refs, paging)
  segments = count_ref.shape[1]
  cap = cand_key_ref.shape[0] // segments
  s = logits_ref.shape[1]
  theta = theta_ref[t]
  counts = [count_ref[t, p] for p in range(segments)]
  count = sum(counts)
  length = jnp.clip(len_ref[t], 0, s)
  select = functools.partial(_select_among, out_ref, theta=theta, k=k, s=s,
                             interpolate=interpolate)

  def candidates(lane):
    # Lane j holds the j-th candidate in segment order: segment p's are after the earlier ones'.
    place, before = lane, 0
    for p in range(segments - 1):
      before += counts[p]
      place += jnp.where(lane >= before, cap - counts[p], 0)
    valid = lane < count  # past count: never written
    keys = plgpu.load(cand_key_ref.at[place], mask=valid, other=_INT_MIN)
    positions = plgpu.load(cand_pos_ref.at[place], mask=valid, other=0)
    return keys, positions

  def from_candidates(lanes):
    keys, positions = candidates(jnp.arange(lanes, dtype=jnp.int32))
    return select(lambda i: (keys, positions), 1, keys.max(), count)

  def streamed(lanes, num_chunks):
    # The candidates in chunks of `lanes`, loaded again by every pass (L2) instead of held.
    source = lambda i: candidates(i * lanes + jnp.arange(lanes, dtype=jnp.int32))
    hi = lax.fori_loop(0, num_chunks, lambda i, m: jnp.maximum(m, source(i)[0].max()), _INT_MIN)
    return select(source, num_chunks, hi, count)

  def from_row():
    source = lambda i: _row_keys(logits_ref, t, length, i * chunk, chunk)
    num_chunks = pl.cdiv(length, chunk)
    if not interpolate:
      return select(source, num_chunks, _INT_MAX, count)
    # v12's search starts from the row's largest key and how many reach theta: two more passes,
    # on this rare path only.
    hi = lax.fori_loop(0, num_chunks, lambda i, m: jnp.maximum(m, source(i)[0].max()), _INT_MIN)
    reach = lax.fori_loop(0, num_chunks, lambda i, n: n + ((source(i)[0] >= theta) & (
        source(i)[0] > _INT_MIN)).astype(jnp.int32).sum(), 0)
    return select(source, num_chunks, hi, reach)

  # Half as many lanes when the candidates fit (typically ~0.3 cap): each bisection pass costs its
  # lanes. lean (v10b): more than cap / 2 candidates stream in two halves, so the kernel's
  # registers are the half-width path's, not the cap lanes' held through every pass.
  full = (functools.partial(streamed, cap // 2, 2) if lean else
          functools.partial(from_candidates, cap))
  half = lambda: lax.cond(count > cap // 2, full, lambda: from_candidates(cap // 2))
  written = lax.cond(count > cap, from_row, half if cap >= _HALVED_MIN else
                     functools.partial(from_candidates, cap))
  _pad(out_ref, written, k, fill)
  if paging is not None:
    _map_to_slots(t, out_ref, table_ref, slot_ref, paging, fill, not interpret)


def _interpolated_search(count, k, lo, hi, n_lo):
  """The threshold search of v11b (`_resident_kernel`) and v12 (the select): the k-th
  largest key, or a threshold exactly k keys reach (then n == k), given lo (n_lo keys reach it,
  n_lo >= k; lo itself when n_lo == k) and the largest key hi (lo == hi == INT_MIN: no pass,
  INT_MIN): (threshold, n). count(threshold) counts the keys that reach a threshold. On the
  unsigned images key ^ INT_MIN, each pass tries the point between the bounds where the count
  would be k if it fell linearly from one bound's to the other's, and moves the bound on that
  side; after two moves of the same bound it bisects until the other moves (the interpolation's
  guard: a pass then at least halves the interval)."""
  unsigned_less = lambda a, b: (a ^ _INT_MIN) < (b ^ _INT_MIN)

  def unsettled(state):
    lo, hi, _, _, _, n = state
    return unsigned_less(1, hi - lo) & (n != k)

  def one_pass(state):
    lo, hi, n_lo, n_hi, run, _ = state
    half = lax.shift_right_logical(hi - lo, 1)  # below 2^31: exact enough as float32
    # An even offset below hi - lo (float32 rounding can give 0 or hi - lo: clamped inside).
    guess = 2 * (half.astype(jnp.float32) * ((n_lo - k).astype(jnp.float32) /
                                             (n_lo - n_hi).astype(jnp.float32))).astype(jnp.int32)
    guess = jnp.where(unsigned_less(guess, 1), 1,
                      jnp.where(unsigned_less(hi - lo - 1, guess), hi - lo - 1, guess))
    trial = lo + jnp.where(jnp.abs(run) >= 2, half, guess)
    reach = count(trial ^ _INT_MIN)
    up = reach >= k
    return (jnp.where(up, trial, lo), jnp.where(up, hi, trial), jnp.where(up, reach, n_lo),
            jnp.where(up, n_hi, reach), jnp.where(up, jnp.maximum(run, 0) + 1,
                                                  jnp.minimum(run, 0) - 1), reach)

  lo, _, _, _, _, n = lax.while_loop(
      unsettled, one_pass,
      (lo ^ _INT_MIN, (hi ^ _INT_MIN) + 1, n_lo, jnp.int32(0), jnp.int32(0),
       jnp.where(n_lo == k, n_lo, -1)))  # (not a select of two constants: Triton refuses it)
  return lo ^ _INT_MIN, n


def _resident_kernel(logits_ref, len_ref, *refs, k, rows, lanes, fill, interpolate, paging,
                     interpret):
  # v11 (`row_resident`): a row's whole top-k in one program, its keys loaded once and held in
  # registers. logits_ref [T, S] f32; len_ref [T] int32; refs: out_ref [k] int32 (this row's
  # positions), or with paging table_ref [T, MB] int32, out_ref, slot_ref (`_outputs`).
  # The row as [rows, lanes], lanes the block's threads: position r * lanes + l at [r, l], so the
  # loads are coalesced and thread l holds column l; sums go down the columns first (in each
  # thread), then across the lanes (`count`).
  t = pl.program_id(0)
  s = logits_ref.shape[1]
  iota = lambda axis: lax.broadcasted_iota(jnp.int32, (rows, lanes), axis)
  # Hinted to be multiples of 1 only (true), so the load takes the layout of the scattered stores
  # at the end (one key a thread a step, not four): else Triton converts the stores' pointers and
  # masks to it through shared memory (as in `_sector_threshold_kernel`).
  pos = pl.multiple_of(iota(0) * lanes + iota(1), (1, 1))
  if rows * lanes == s:
    x = plgpu.load(logits_ref.at[t, pos])
  else:
    x = plgpu.load(logits_ref.at[t, pos], mask=pos < s, other=-jnp.inf)
  key = _keys(x, pos < jnp.clip(len_ref[t], 0, s))
  count = lambda take: take.astype(jnp.int32).sum(axis=0).sum()

  def search(keys, n_keys, known, start):
    # `_kth_largest`'s bisection from the image `start` with `known` bits, stopping at the first
    # threshold exactly n_keys keys reach (n: how many reach the image; -1 until a pass counts
    # it): that threshold, else the n_keys-th largest key.
    def unsettled(state):
      b, _, n = state
      return (b < 32) & (n != n_keys)

    def one_bit(state):
      b, image, n = state
      trial = image | jnp.left_shift(jnp.int32(1), 31 - b)
      reach = count(keys >= (trial ^ _INT_MIN))
      return b + 1, jnp.where(reach >= n_keys, trial, image), jnp.where(reach >= n_keys, reach, n)

    _, image, n = lax.while_loop(unsettled, one_bit, (known, start, jnp.int32(-1)))
    return image ^ _INT_MIN, n

  # With at most k valid keys all are taken (v = INT_MIN, no pass); else the search starts below
  # the bits the smallest and largest valid keys share. Random rows stop after ~21 of the 32
  # passes (RESULTS.md, top-k v11).
  valid = key > _INT_MIN
  n_valid = count(valid)
  enough = n_valid > k
  lo = jnp.where(enough, jnp.where(valid, key, _INT_MAX).min(axis=0).min(), _INT_MIN)
  hi = key.max(axis=0).max()
  if interpolate:
    # The bounds: the smallest and largest valid keys; with at most k valid keys, INT_MIN (no
    # pass).
    v, n = _interpolated_search(lambda threshold: count(key >= threshold), k, lo,
                                jnp.where(enough, hi, _INT_MIN), n_valid)
  else:
    known, start = _search_start(lo, hi)
    v, n = search(key, k, jnp.where(enough, known, 32), start)
  # v is a threshold exactly k keys reach (n == k: those are the selection), the k-th largest key,
  # or INT_MIN (at most k valid keys: all taken). Else of the keys tied at v, the lowest positions,
  # enough to make k: those whose s-1-pos reaches the threshold exactly `need` of the ties' s-1-pos
  # reach (distinct: the search finds it); every tie (0) when they all fit. (A constant result
  # does not lower to Triton: the branches compute from their operand.)
  def lowest_ties(need):
    tie_keys = jnp.where(key == v, s - 1 - pos, _INT_MIN)
    return search(tie_keys, need, *_search_start(0, s - 1))[0]

  def ties(_):
    need = k - count(key > v)
    return lax.cond(count(key == v) > need, lowest_ties, lambda m: m * 0, need)

  # The ties taken are those at positions up to `cut` (none when v is INT_MIN: those are the
  # invalid keys). One compare: past `cut` a key must beat v (v + 1 cannot overflow: keys stop at
  # +inf's bits).
  cut = jnp.where(v > _INT_MIN, s - 1 - lax.cond(n == k, lambda m: m * 0, ties, n), -1)
  take = (key >= v + (pos > cut).astype(jnp.int32)).astype(jnp.int32)
  # Compacted in column order (any order will do): a column's running count in its thread, after
  # the earlier columns' totals (one cumsum across the lanes).
  totals = take.sum(axis=0)
  dst = (jnp.cumsum(totals) - totals)[None, :] + jnp.cumsum(take, axis=0) - 1
  flat = lambda a: a.reshape(rows * lanes)
  table_ref, out_ref, slot_ref = _outputs(refs, paging)
  plgpu.store(out_ref.at[flat(jnp.where(take > 0, dst, k))], flat(pos), mask=flat(take > 0))
  _pad(out_ref, totals.sum(), k, fill)
  if paging is not None:
    _map_to_slots(t, out_ref, table_ref, slot_ref, paging, fill, not interpret)


def default_config(rows: int, positions: int) -> TopkConfig:
  """The chosen config for `rows` rows of `positions` logits: v11b's one kernel a row where rows
  are 16384 to RESIDENT_MAX positions, else the four-kernel path's (`four_kernel_config`)."""
  four = four_kernel_config(rows, positions)
  if _RESIDENT_MIN <= positions <= RESIDENT_MAX:
    return dataclasses.replace(four, row_resident=True, interpolate=True)
  return four


def maps_slots_in_kernel(rows: int, positions: int) -> bool:
  """Whether the backend's top-k with slots has the kernel map them (`topk_positions(...,
  block_tables=)`) for `rows` rows of `positions` logits, rather than XLA after it: up to 2 rows
  an SM (all at once) of up to _LONG_ROW positions. H200 (RESULTS.md, "Top-k v14", session 29, ms,
  kernel / apart): the DSA step (128 x 32768) 0.386 / 0.386; the top-k at 128 x 32768 0.0782 /
  0.0797, at 128 x 131072 0.103 / 0.0886 (the four-kernel path's select maps after its barrier),
  4096 x 32768 0.696 / 0.695."""
  return rows <= 2 * sm_count() and positions <= _LONG_ROW


def four_kernel_config(rows: int, positions: int) -> TopkConfig:
  """The four-kernel path's chosen config for `rows` rows of `positions` logits."""
  if rows > 2 * sm_count():
    return DEFAULT_MANY_ROWS
  return DEFAULT_LONG_ROWS if positions >= _LONG_ROW else DEFAULT


def group_size(num_positions: int, k: int) -> int:
  """G: the largest power of two leaving at least 4k strided groups (1 for short rows)."""
  ratio = num_positions // (4 * k)
  return 1 << (ratio.bit_length() - 1) if ratio else 1


def _whole(x: jax.Array) -> pl.BlockSpec:
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _row(width: int) -> pl.BlockSpec:
  return pl.BlockSpec((None, width), lambda i, *_: (i, 0))


def group_maxima(logits: jax.Array, seq_lens: jax.Array, groups: int, width: int, *,
                 tile: int = _MAXIMA_TILE, num_warps: int = 4,
                 interpret: bool = False) -> jax.Array:
  """Step 1: int16 [T, width] maxima of the `groups`-strided groups of each row's keys, their top
  16 bits (`_high`; INT16_MIN past the last group); width a power of two >= cdiv(S, groups). tile:
  positions a program reads."""
  t = logits.shape[0]
  tile = min(width, max(16, tile // groups))
  return pl.pallas_call(
      functools.partial(_maxima_kernel, groups=groups),
      grid=(t, width // tile),
      in_specs=[_whole(logits), _whole(seq_lens)],
      out_specs=pl.BlockSpec((None, tile), lambda i, c: (i, c)),
      out_shape=jax.ShapeDtypeStruct((t, width), jnp.int16),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="topk_maxima",
  )(logits, seq_lens)


def row_theta(maxima: jax.Array, topk: int, params: plgpu.CompilerParams, *,
              interpret: bool = False) -> jax.Array:
  """Step 2: int32 [T], each row's theta (its top `_THETA_BITS` bits) from int16 maxima [T, w]
  (`group_maxima`'s, `sector_maxima`'s)."""
  t = maxima.shape[0]
  return pl.pallas_call(
      functools.partial(_theta_kernel, k=topk),
      grid=(t,),
      in_specs=[_row(maxima.shape[1])],
      out_specs=pl.BlockSpec((t,), lambda i: (0,)),
      out_shape=jax.ShapeDtypeStruct((t,), jnp.int32),
      compiler_params=params,
      interpret=interpret,
      name="topk_theta",
  )(maxima)


def fused_row_theta(logits: jax.Array, seq_lens: jax.Array, topk: int, groups: int, width: int,
                    params: plgpu.CompilerParams, *, bits: int = _THETA_BITS,
                    interpret: bool = False) -> jax.Array:
  """Steps 1 and 2 fused, a program per row: int32 [T], each row's theta (as `row_theta` of
  `group_maxima`)."""
  t = logits.shape[0]
  return pl.pallas_call(
      functools.partial(_maxima_theta_kernel, k=topk, bits=bits, groups=groups, width=width),
      grid=(t,),
      in_specs=[_whole(logits), _whole(seq_lens)],
      out_specs=pl.BlockSpec((t,), lambda i: (0,)),
      out_shape=jax.ShapeDtypeStruct((t,), jnp.int32),
      compiler_params=params,
      interpret=interpret,
      name="topk_maxima_theta",
  )(logits, seq_lens)


def sector_maxima(logits: jax.Array, seq_lens: jax.Array, groups: int, m8: int, width: int, *,
                  tile: int = _MAXIMA_TILE, num_warps: int = 4,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """v9's step 1: int16 [T, width], the maxima of the groups {j, j + m8, ...} of each row's keys
  (INT16_MIN past m8; m8 a multiple of 8, groups * m8 >= S, width a power of two >= m8), and int16
  [T, groups * width / 8], the maxima of the groups' rows' 8-position sectors: sector f of a row
  covers positions (f // (width / 8)) * m8 + 8 (f % (width / 8)) ... + 7 (INT16_MIN past m8).
  Both as their top 16 bits (`_high`)."""
  t, s = logits.shape
  tile = min(width, max(16, tile // groups))
  maxima, sectors = pl.pallas_call(
      functools.partial(_sector_maxima_kernel, groups=groups, m8=m8,
                        masked=groups * m8 != s or m8 != width),
      grid=(t, width // tile),
      in_specs=[_whole(logits), _whole(seq_lens)],
      out_specs=[pl.BlockSpec((None, tile // _SECTOR, _SECTOR), lambda i, c: (i, c, 0)),
                 pl.BlockSpec((None, groups, tile // _SECTOR), lambda i, c: (i, 0, c))],
      out_shape=[jax.ShapeDtypeStruct((t, width // _SECTOR, _SECTOR), jnp.int16),
                 jax.ShapeDtypeStruct((t, groups, width // _SECTOR), jnp.int16)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="topk_sector_maxima",
  )(logits, seq_lens)
  return maxima.reshape(t, width), sectors.reshape(t, groups * width // _SECTOR)


def threshold_segments(num_rows: int, num_positions: int, chunk: int) -> tuple[int, int]:
  """(segments a row, positions a segment): rows split until the grid holds ~4 programs per SM,
  each segment at least 4 chunks long."""
  segments = max(1, min(pl.cdiv(num_positions, 4 * chunk), pl.cdiv(4 * sm_count(), num_rows)))
  segment = pl.cdiv(pl.cdiv(num_positions, segments), chunk) * chunk
  return pl.cdiv(num_positions, segment), segment


def lane_slots(cap: int, segments: int, chunk: int) -> int:
  """Candidate slots a lane of the per-lane threshold kernel keeps: twice a lane's share of cap
  (the candidates typically fill ~0.3 cap), at least 8, so random rows do not overflow."""
  return max(8, next_pow2(2 * cap // (segments * chunk)))


def threshold_candidates(theta: jax.Array, logits: jax.Array, seq_lens: jax.Array, cap: int,
                         chunk: int, params: plgpu.CompilerParams, *, slots: int = 0,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Step 3: (keys, positions) int32 [T, P * cap] of each row's candidates, each of its P segments'
  at its own `cap` places, and their counts [T, P] (past cap when they overflowed). slots: 0 for
  the block-wide compaction per chunk (`_threshold_kernel`), else the slots a lane keeps
  (`_lane_threshold_kernel`)."""
  t, s = logits.shape
  segments, segment = threshold_segments(t, s, chunk)
  places = lambda width: pl.BlockSpec((None, width), lambda i, p: (i, p))
  counts = [pl.BlockSpec((t, segments), lambda i, p: (0, 0))]
  lists = [jax.ShapeDtypeStruct((t, segments * cap), jnp.int32)] * 2
  counts_shape = [jax.ShapeDtypeStruct((t, segments), jnp.int32)]
  if slots:
    kernel = functools.partial(_lane_threshold_kernel, chunk=chunk, segment=segment,
                               interpret=interpret)
    out_specs = [places(slots * chunk)] * 2 + [places(cap)] * 2 + counts
    out_shape = [jax.ShapeDtypeStruct((t, segments * slots * chunk), jnp.int32)] * 2 + lists
  else:
    kernel = functools.partial(_threshold_kernel, chunk=chunk, segment=segment)
    out_specs, out_shape = [places(cap)] * 2 + counts, lists
  out = pl.pallas_call(
      kernel,
      grid=(t, segments),
      in_specs=[_whole(theta), _whole(logits), _whole(seq_lens)],
      out_specs=out_specs,
      out_shape=out_shape + counts_shape,
      compiler_params=params,
      interpret=interpret,
      name="topk_threshold_lanes" if slots else "topk_threshold",
  )(theta, logits, seq_lens)
  return tuple(out[-3:])


def fused_sector_theta(logits: jax.Array, seq_lens: jax.Array, topk: int, groups: int, m8: int,
                       params: plgpu.CompilerParams, *, bits: int = _THETA_BITS,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """`sector_maxima` and `row_theta` fused, a program per row: (int32 [T], each row's theta;
  int16 [T, groups * next_pow2(m8) / 8], the sector maxima as `sector_maxima`'s)."""
  t, s = logits.shape
  width = next_pow2(m8)
  theta, sectors = pl.pallas_call(
      functools.partial(_sector_maxima_theta_kernel, k=topk, bits=bits, groups=groups, m8=m8,
                        masked=groups * m8 != s or m8 != width),
      grid=(t,),
      in_specs=[_whole(logits), _whole(seq_lens)],
      out_specs=[pl.BlockSpec((t,), lambda i: (0,)),
                 pl.BlockSpec((None, groups, width // _SECTOR), lambda i: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((t,), jnp.int32),
                 jax.ShapeDtypeStruct((t, groups, width // _SECTOR), jnp.int16)],
      compiler_params=params,
      interpret=interpret,
      name="topk_sector_maxima_theta",
  )(logits, seq_lens)
  return theta, sectors.reshape(t, groups * width // _SECTOR)


def sector_candidates(theta: jax.Array, sector_max: jax.Array, logits: jax.Array,
                      seq_lens: jax.Array, m8: int, cap: int, chunk: int,
                      params: plgpu.CompilerParams, *,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """v9's step 3 (`TopkConfig.sectors`), from `sector_maxima`'s sectors (the row's groups rows of
  sector_max.shape[1] / groups sectors; m8 as there): as `threshold_candidates`, P programs a row
  (`threshold_segments`), each over a span of the row's sectors instead of positions."""
  t, s = logits.shape
  num_sectors = sector_max.shape[1]
  segments = threshold_segments(t, s, chunk)[0]
  span = pl.cdiv(num_sectors, segments)
  places = lambda width: pl.BlockSpec((None, width), lambda i, p: (i, p))
  out = pl.pallas_call(
      functools.partial(_sector_threshold_kernel, chunk=chunk, span=span, m8=m8,
                        row_sectors=next_pow2(m8) // _SECTOR, interpret=interpret),
      grid=(t, segments),
      in_specs=[_whole(theta), _row(num_sectors), _whole(logits), _whole(seq_lens)],
      out_specs=[places(next_pow2(span))] + [places(cap)] * 2 + [
          pl.BlockSpec((t, segments), lambda i, p: (0, 0))],
      out_shape=[jax.ShapeDtypeStruct((t, segments * next_pow2(span)), jnp.int32)] + [
          jax.ShapeDtypeStruct((t, segments * cap), jnp.int32)] * 2 + [
          jax.ShapeDtypeStruct((t, segments), jnp.int32)],
      compiler_params=params,
      interpret=interpret,
      name="topk_sector_threshold",
  )(theta, sector_max, logits, seq_lens)
  return tuple(out[1:])


class Paging(NamedTuple):
  """The paged cache the select kernels map positions into: position p of row t is slot
  table[t, p // block_size] * block_size + p % block_size of a cache of num_blocks blocks."""
  block_size: int
  num_blocks: int


def _paged_outputs(t: int, topk: int, paging: Paging | None) -> dict:
  """The select kernels' output specs and shapes: positions [T, topk], and with paging their
  slots too."""
  n = 1 if paging is None else 2
  return dict(out_specs=[_row(topk)] * n,
              out_shape=[jax.ShapeDtypeStruct((t, topk), jnp.int32)] * n)


def _paged_result(out: list[jax.Array], paging: Paging | None):
  return out[0] if paging is None else tuple(out)


def select_positions(theta: jax.Array, cand_keys: jax.Array, cand_pos: jax.Array,
                     counts: jax.Array, logits: jax.Array, seq_lens: jax.Array, topk: int,
                     chunk: int, params: plgpu.CompilerParams, *, lean: bool = False,
                     interpolate: bool = False, block_tables: jax.Array | None = None,
                     paging: Paging | None = None, interpret: bool = False):
  """Step 4: int32 [T, topk] positions, -1 padded (lean: `TopkConfig.lean_select`; interpolate:
  `TopkConfig.interpolate`); with block_tables [T, MB] and paging, (positions, their slots)."""
  t = logits.shape[0]
  width = cand_keys.shape[1]
  tables = () if paging is None else (block_tables,)
  out = pl.pallas_call(
      functools.partial(_select_kernel, k=topk, chunk=chunk, fill=min(1024, next_pow2(topk)),
                        lean=lean, interpolate=interpolate, paging=paging,
                        interpret=interpret),
      grid=(t,),
      in_specs=[_whole(theta), _row(width), _row(width), _whole(counts), _whole(logits),
                _whole(seq_lens)] + [_whole(x) for x in tables],
      **_paged_outputs(t, topk, paging),
      compiler_params=params,
      interpret=interpret,
      name="topk_select" if paging is None else "topk_select_slots",
  )(theta, cand_keys, cand_pos, counts, logits, seq_lens, *tables)
  return _paged_result(out, paging)


def resident_warps(width: int) -> int:
  """v11's warps for rows padded to `width` positions: 64 keys a thread from 8192, 4 below."""
  return min(16, max(4, width // (32 * _RESIDENT_KEYS)))


def resident_positions(logits: jax.Array, seq_lens: jax.Array, topk: int, *,
                       interpolate: bool = False, block_tables: jax.Array | None = None,
                       paging: Paging | None = None, interpret: bool = False):
  """v11 (`TopkConfig.row_resident`): int32 [T, topk] positions, -1 padded, a program a row
  holding its keys in registers; rows of at most `RESIDENT_MAX` positions (interpolate:
  `TopkConfig.interpolate`, v11b); with block_tables [T, MB] and paging, (positions, their
  slots)."""
  t, s = logits.shape
  warps = resident_warps(next_pow2(s))
  lanes = 32 * warps
  tables = () if paging is None else (block_tables,)
  out = pl.pallas_call(
      functools.partial(_resident_kernel, k=topk, rows=max(1, next_pow2(s) // lanes), lanes=lanes,
                        fill=min(1024, next_pow2(topk)), interpolate=interpolate, paging=paging,
                        interpret=interpret),
      grid=(t,),
      in_specs=[_whole(logits), _whole(seq_lens)] + [_whole(x) for x in tables],
      **_paged_outputs(t, topk, paging),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret,
      name="topk_resident" if paging is None else "topk_resident_slots",
  )(logits, seq_lens, *tables)
  return _paged_result(out, paging)


@functools.partial(jax.jit, static_argnames=("topk", "block_size", "num_blocks", "chunk",
                                             "num_warps", "num_stages", "select_warps",
                                             "per_lane", "fused_theta", "sectors", "lean_select",
                                             "row_resident", "interpolate", "interpret"))
def topk_positions(logits: jax.Array, seq_lens: jax.Array, topk: int, *,
                   block_tables: jax.Array | None = None, block_size: int | None = None,
                   num_blocks: int | None = None, chunk: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   select_warps: int | None = None, per_lane: bool | None = None,
                   fused_theta: bool | None = None, sectors: bool | None = None,
                   lean_select: bool | None = None, row_resident: bool | None = None,
                   interpolate: bool | None = None, interpret: bool = False):
  """Top-`topk` positions of each row within its window (semantics of
  `mla_jax.reference.topk_positions`): logits [T, S] float32, seq_lens [T] int32 (row t sees
  s < seq_lens[t]) -> int32 [T, topk], -1 padded, in no particular order; of positions tied at the
  k-th largest value, the lowest. chunk, num_warps, num_stages, select_warps, per_lane,
  fused_theta, sectors, lean_select, row_resident, interpolate: `TopkConfig`'s (None:
  `default_config`'s).

  With block_tables [T, MB] int32 (row t's request's blocks), block_size and num_blocks (the
  paged cache's), returns (positions, slots): slots [T, topk] int32 are the positions' cache
  slots, as `mla_jax.cache.positions_to_slots` maps them (-1 for -1, a position past the table,
  or a -1 / out-of-cache block), written by the kernel that writes the positions (no separate
  mapping pass between the selection and sparse attention).
  """
  check_topk_args(logits, seq_lens, topk, block_tables, block_size, num_blocks)
  config = with_overrides(default_config(*logits.shape), chunk=chunk, num_warps=num_warps,
                          num_stages=num_stages, select_warps=select_warps, per_lane=per_lane,
                          fused_theta=fused_theta, sectors=sectors, lean_select=lean_select,
                          row_resident=row_resident, interpolate=interpolate)
  t, s = logits.shape
  if config.row_resident and s > RESIDENT_MAX:
    raise ValueError(f"row_resident takes rows of at most {RESIDENT_MAX} positions (their keys "
                     f"in one program's registers), got {s}")
  paging = None if block_tables is None else Paging(block_size, num_blocks)
  if t == 0 or s == 0:
    return _paged_result([jnp.full((t, topk), -1, jnp.int32)] * 2, paging)
  paged = dict(block_tables=block_tables, paging=paging)
  if config.row_resident:
    return resident_positions(logits, seq_lens, topk, interpolate=config.interpolate, **paged,
                              interpret=interpret)
  chunk = min(config.chunk, max(16, next_pow2(s)))
  params = lambda warps: plgpu.CompilerParams(num_warps=warps, num_stages=config.num_stages)
  g = group_size(s, topk)
  width = next_pow2(-(-s // g))
  cap = next_pow2(min(_CAP_PER_K * topk, s))
  m8 = pl.cdiv(pl.cdiv(s, g), _SECTOR) * _SECTOR  # v9's groups {j, j + m8, ...}: whole sectors
  if config.sectors and config.fused_theta:
    theta, sector_max = fused_sector_theta(logits, seq_lens, topk, g, m8, params(_THETA_WARPS),
                                           interpret=interpret)
  elif config.sectors:
    maxima, sector_max = sector_maxima(logits, seq_lens, g, m8, next_pow2(m8),
                                       interpret=interpret)
  elif config.fused_theta:
    theta = fused_row_theta(logits, seq_lens, topk, g, width, params(_THETA_WARPS),
                            interpret=interpret)
  else:
    maxima = group_maxima(logits, seq_lens, g, width, interpret=interpret)
  if not config.fused_theta:
    theta = row_theta(maxima, topk, params(_THETA_WARPS), interpret=interpret)
  if config.sectors:
    cand_keys, cand_pos, counts = sector_candidates(theta, sector_max, logits, seq_lens, m8, cap,
                                                    chunk, params(config.num_warps),
                                                    interpret=interpret)
  else:
    slots = lane_slots(cap, threshold_segments(t, s, chunk)[0], chunk) if config.per_lane else 0
    cand_keys, cand_pos, counts = threshold_candidates(theta, logits, seq_lens, cap, chunk,
                                                       params(config.num_warps), slots=slots,
                                                       interpret=interpret)
  return select_positions(theta, cand_keys, cand_pos, counts, logits, seq_lens, topk, chunk,
                          params(config.select_warps), lean=config.lean_select,
                          interpolate=config.interpolate, **paged, interpret=interpret)
