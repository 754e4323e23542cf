"""MLA prefill flash attention for Hopper GPUs, in Pallas lowered through Mosaic GPU.

The contract of `pallas_kernels.mla_prefill.mla_prefill` (the Pallas-Triton kernel: packed
variable-length requests, bottom-right causal alignment, Dk != Dv, f32 natural-log lse, rows past
cu_q[-1] give 0 / -inf), for bfloat16 q, k, v with Dv <= Dk. The structure is jax's
FlashAttention-3 port (`jax.experimental.pallas.ops.gpu.attention_mgpu`), 128 query rows a block,
persistent: as many programs (CTAs) as SMs walk a queue of (query block, head) work items built in
the jitted entry from the cu_seqlens, in sections of a few heads whose K/V fits in L2
(FlashAttention-3's L2 order), blocks heaviest first (most keys) within a section, so that short
and packed requests keep the SMs full, the programs at work share a few heads' K/V in L2, and one
block's epilogue overlaps the next one's K/V loads (the memory warpgroup runs ahead through the
ring across items). It measured faster than the grid of one program per (query-block slot, head,
request) up to 8192 query rows at 128 heads and below 4096 at 16 (H200: 1.13-1.24x at 1024 and
4096 tokens and 8 x 1024 at N=128), slower from there (0.90-0.97x at 16K and 4 x 4096 tokens), so
the grid stays and is the default from there (`persistent`). Three warpgroups a program:
- compute (warpgroups 0 and 1): each bulk-copies its own 64-row query tile (columns [0, Dv) and
  [Dv, Dk) into two buffers: the first later stages the output), then per step of block_k keys
  S = Q K^T (two wgmma, M = 64 rows, N = block_k keys), the float32 online softmax in exp2,
  O = O * alpha + P V (wgmma with P in registers, accumulating in place); by default
  (`intra_overlap`, FlashAttention-3's intra-warpgroup order, without turns, as FA3 runs head
  dims over 128) each issues step j's S, then step j - 1's P V, then runs step j's softmax
  (H200: 1.04-1.07x the ping-pong schedule at 4096 and 16K tokens and 8 x 1024). ptxas waits
  for both products before the softmax (its SASS; keeping P V in flight through the softmax
  measured 0.93-1.00x, RESULTS.md session 22);
  with `ping_pong` instead the two warpgroups take turns on the tensor cores through a barrier
  (one's softmax overlaps the other's products);
- memory (warpgroup 2): the request's K and V blocks, block_k keys a step, one bulk copy each into a
  ring of slots, refilled as soon as both compute warpgroups are done with a slot's K (or V);
  with `prefetch_q` (on by default from 64 heads) also each item's query tiles, each copied
  once its compute warpgroup's last S of the item before has read the tile (the output then
  staged apart, 64 columns at a time, its stores never waited for in the item loop).
Both compute warpgroups walk the same steps (those the block's last row needs), so they share every
slot; the diagonal, ragged and misaligned steps are masked, the others are not.
Items run in sections of `l2_section_bytes` worth of heads' K/V, heads fastest within a section;
without sections (None), heads fastest from 64 heads, query blocks fastest below. The grid launches
the other way round (Mosaic GPU makes a grid's last axis CUDA's x, the fastest): from 64 heads one
head's query blocks side by side (its K/V shared in L2), below 64 the heads of a query block.

Bulk copies move whole boxes and cannot mask rows, so:
- Mosaic GPU copies (8, 64)-tiled buffers as whole tiles of the global array, so a box must start
  at a row it can prove a multiple of 8: a request's boxes start at its first row rounded down to
  8, and q, k, v are zero-padded to a multiple of 8 rows, at least one box (a copy only when
  needed);
- a box that would run past the end of q or k/v is moved back to end there (the row positions in
  the masks account for both shifts);
- a 64-row output tile may run into the next request's rows, so a batch writes whole only the
  tiles of one request's rows; a request's first and last tile write their request's rows one
  bulk copy a row (from an untiled alias of the staging), and their lse to two slots of their own,
  which the lse's transpose selects from (`_final_lse`; a scatter into o, 25 us at 8 x 1024 and
  128 heads on the H200, did this before); the rows past
  cu_q[-1] are one more request, without keys, which writes them as 0, -inf. One request
  (persistent) writes every tile in place: its blocks then start at row 0 and cover every row of
  q (padded to whole blocks, a copy only when needed), rows outside the request as 0, -inf.
Requests are isolated: keys outside a request that a box reads get S = -inf by a select (so
P = 0), and their V rows are zeroed in shared memory before P V (0 * NaN would be NaN), so no
value of another request, NaN or inf included, reaches a row. Only the masked steps that hold such
rows pay for it (a wait for the V copy and a 64-row select per compute warpgroup); one request
starting at row 0 never does.

Split keys (`k_pe`, the prefill contract's split form: MLA's rope keys, the same for every head):
k holds each head's key columns [0, Dv) and k_pe [Tk, Dk - Dv] the rest, one row a key for all
heads. The memory warpgroup then copies a step's keys as two boxes, the head's [block_k, Dv] and the
shared [block_k, Dk - Dv], into two buffers of the ring slot (one barrier awaits both copies): the
query tile's own split, so S is the same two wgmmas. The caller never builds [Tk, N, Dk] keys with
k_pe copied to every head; the kernel reads a k_pe box once per head and step, from L2 after the
first head. Shared memory and steps are the same as with k whole.

Shared memory (Dk 192, Dv 128): query tiles 48 KB + the K/V ring (128-key steps: 2 x 80 KB;
64-key steps: 4 x 40 KB) + lse staging 0.5 KB (1 KB aligned) + barriers = 214,136 bytes (64-key
steps: 214,216; `prefetch_q`'s output staging apart: 230,520) of the 227 KB (232,448 bytes) a
block may have.

`interpret=True` (or an `InterpretGPUParams`) runs the same kernel on the CPU through Mosaic GPU's
interpreter (see `pallas_kernels.mosaic_decode` for what it does and does not simulate), with one
difference forced by the interpreter (jax 0.11.2): it runs wgmma only with shared-memory operands
into run_scoped accumulators, so there P goes through a shared-memory tile and each P V product into
a fresh accumulator that is added. Lowering for CUDA, which also runs on a CPU, checks the GPU form
(wgmma operand layouts, bulk-copy boxes, the shared-memory bound). The interpreter runs each
warpgroup as a thread whose barrier waits can hold XLA:CPU's worker threads; with as many workers
as a 2-core machine gets, a warpgroup may never start (seen on the grid with intra_overlap and
with ping-pong's turns, which were once taken for a deadlock of the turns): `NPROC=8` in the
environment before jax starts gives XLA:CPU 8 (the test suite sets it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (HOPPER_SMEM_BYTES, LN2, LOG2E, M_INIT, check_at_least,
                                   check_prefill_args, row_broadcast, sm_count, step_variant,
                                   swizzled)

DTYPES = ("bfloat16",)  # what q, k, v may be (the wgmma operands here are 16-bit, f16 untested)
_TILE = 64  # query rows per compute warpgroup: the M of every Hopper wgmma
_COMPUTE_WGS = 2
_BLOCK_Q = _COMPUTE_WGS * _TILE  # query rows per program
_MAX_STAGES = 4
# Head counts from which the queue runs heads fastest and the grid query blocks fastest (H200:
# each faster than the other order at 64 and 128 heads, slower at 16; see mla_prefill).
_HEADS_FIRST_MIN = 64
# Batches of fewer query rows take the persistent queue by default, more the grid (H200, the
# queue in 32 MiB sections against the grid: 1.13x at 1x4096, 1.17x at 8 x 1024 and 0.94x at
# 4 x 4096 for N=128; 0.95x at 1x4096 for N=16; benchmarks/RESULTS.md): below 4096 rows, and up to
# 8192 (8 x 1024 included) from _HEADS_FIRST_MIN heads.
_PERSISTENT_BELOW_TOKENS = 4096
_PERSISTENT_MAX_TOKENS_MANY_HEADS = 8192
# Head counts from which the per-item knobs (prefetch_q, first_step_unmasked, diagonal_half) are
# on by default (MosaicPrefillConfig: timed faster at 128 heads, 0.80x at 16 heads, 1 x 4096).
_KNOBS_MIN_HEADS = 64
_CONSUMER_REGS = 232  # 2 x 232 + 40 (memory warpgroup) registers x 128 threads fit the 64K file
_MEMORY_REGS = 40
_MAX_DV = 256  # wgmma N limit; the 64 x Dv float32 accumulator is Dv / 2 registers a thread
# Row alignment of a bulk copy's first row: Mosaic GPU copies a (8, 64)-tiled buffer as whole
# tiles of the global array, so it must prove the start a multiple of 8.
_ALIGN = 8
# prefetch_q: output columns a staging tile holds (a 128-byte swizzled row of bf16); the output
# goes out in Dv / 64 such pieces.
_STAGE_COLS = 64


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
  """Launch knobs of one call; the field names are the jit entry's keyword arguments."""
  block_k: int = 128  # keys per step and bulk copy (N of S = Q K^T, K of P V)
  num_stages: int | None = None  # K/V ring depth; None: the deepest that fits (_stages_for)
  # The two compute warpgroups take turns on the tensor cores (the schedule before intra_overlap).
  ping_pong: bool = False
  # Programs walk a queue of work items, else one per (query slot, head, request); None: the queue
  # below _PERSISTENT_BELOW_TOKENS query rows (up to _PERSISTENT_MAX_TOKENS_MANY_HEADS from
  # _HEADS_FIRST_MIN heads), where it measured faster.
  persistent: bool | None = None
  num_programs: int | None = None  # persistent programs; None: the device's SM count
  # The persistent queue in sections of as many heads as have their K/V (all of the batch's keys)
  # within this many bytes: a section's blocks, heaviest first, heads fastest, before the next
  # section's, so that the programs at work share a few heads' K/V in L2 (FlashAttention-3's L2
  # swizzle, which budgets 32 MiB; H200, N=128: 1.10-1.17x the unsectioned queue); None: all
  # heads one section from _HEADS_FIRST_MIN heads, else one head a section. The grid has no
  # queue and ignores it.
  l2_section_bytes: int | None = 32 << 20
  # FlashAttention-3's intra-warpgroup order: each compute warpgroup issues step j's S = Q K^T
  # and then step j - 1's P V (a second 64 x block_k f32 accumulator, 64 registers a thread),
  # then runs step j's softmax. ptxas hoists the P V's wait above the softmax, so both products
  # run back to back and the softmax overlaps the other warpgroup's products only; a wait kept
  # after the softmax (a real overlap) measured 0.93-1.00x (benchmarks/RESULTS.md, session 22).
  # Without turn-taking, as FA3 runs it for head dims over 128 (H200, N=128: 1.04x ping-pong at
  # 4096 and 16K tokens, 1.07x at 8 x 1024; session 10). Neither (both False): the steps in order.
  intra_overlap: bool = True
  # The next item's query tiles copied by the memory warpgroup as soon as each compute warpgroup's
  # last S = Q K^T of an item has read its tile (FlashAttention-3's producer-loaded Q), so an item
  # starts on queries already landed; the output then goes out through a staging tile of its own,
  # 64 columns at a time (16 KB more shared memory: 230,520 bytes), and no item waits for its
  # stores to land. None: on with intra_overlap's 128-key steps from _KNOBS_MIN_HEADS heads where
  # the staging fits, else off; so for the two below (H200, the three together, session 14: N=128
  # 8 x 1024 1.07x, 4 x 4096 1.02x, 1 x 4096 0.99-1.02x, 1 x 16384 1.01x; N=16 1 x 4096 0.80x,
  # 1 x 16384 1.00x).
  prefetch_q: bool | None = None
  # intra_overlap's step 0 (apart: no P V before it, its softmax alone on the item's path) masked
  # only where it needs it (a request off 8-aligned keys, a block without a step all its rows
  # see), not always: most causal blocks' first step is whole (8 x 1024: 54 of every 62 items).
  first_step_unmasked: bool | None = None
  # intra_overlap's last step of an item on the first 64 keys of its box for a compute warpgroup
  # whose rows see none of the other 64 (the causal diagonal's first 64 rows, a ragged end of at
  # most 64 keys): S = Q K^T with N = 64, its softmax on 64 columns, P V with K = 64 (128-key
  # steps only).
  diagonal_half: bool | None = None

  def __post_init__(self):
    if self.block_k not in (64, 128):
      raise ValueError(f"block_k must be 64 or 128 (keys per step), got {self.block_k}")
    if self.num_stages is not None:
      check_at_least("num_stages", self.num_stages, 2)
    if not isinstance(self.ping_pong, bool):
      raise ValueError(f"ping_pong must be a bool, got {self.ping_pong!r}")
    if self.persistent is not None and not isinstance(self.persistent, bool):
      raise ValueError(f"persistent must be a bool or None, got {self.persistent!r}")
    if self.num_programs is not None:
      check_at_least("num_programs", self.num_programs, 1)
    if self.l2_section_bytes is not None:
      check_at_least("l2_section_bytes", self.l2_section_bytes, 1)
    if not isinstance(self.intra_overlap, bool):
      raise ValueError(f"intra_overlap must be a bool, got {self.intra_overlap!r}")
    for name in ("prefetch_q", "first_step_unmasked", "diagonal_half"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
    if self.first_step_unmasked and not self.intra_overlap:
      raise ValueError("first_step_unmasked is intra_overlap's step 0: the other schedules mask "
                       "only the steps that need it already")
    if self.diagonal_half and not (self.intra_overlap and self.block_k == 128):
      raise ValueError("diagonal_half halves intra_overlap's 128-key last step: it needs "
                       "intra_overlap=True and block_k=128")
    if self.intra_overlap and self.ping_pong:
      raise ValueError("ping_pong and intra_overlap are two schedules, pick one: "
                       "ping_pong=True needs intra_overlap=False")


# The chosen config (128-key steps, ring as deep as fits, intra-warpgroup overlap, the queue in
# 32 MiB sections) and the sweep space
# `benchmarks/bench_prefill.py --sweep` times; figures: benchmarks/RESULTS.md, "MLA prefill
# (pallas_mosaic)".
DEFAULT = MosaicPrefillConfig()
SWEEP = (DEFAULT, MosaicPrefillConfig(persistent=True),
         MosaicPrefillConfig(persistent=True, l2_section_bytes=8 << 20),
         MosaicPrefillConfig(persistent=True, l2_section_bytes=None),
         MosaicPrefillConfig(ping_pong=True, intra_overlap=False)) + tuple(
    MosaicPrefillConfig(block_k, stages, ping_pong, persistent=False, intra_overlap=overlap)
    for block_k, stages, ping_pong, overlap in [(128, 2, False, True), (128, 2, True, False),
                                                (128, 2, False, False), (64, 4, False, True),
                                                (64, 4, True, False)])


def _smem_bytes(dk, dv, block_k, stages, prefetch_q=False):
  """Shared memory of one program on the GPU, as Mosaic GPU (jax 0.11.2) allocates it (each buffer
  1024-byte aligned, 8 bytes a barrier; the CUDA lowering test checks it against Mosaic GPU's own
  count): the query tiles, one a compute warpgroup, in columns [0, Dv) (also the output staging)
  and [Dv, Dk); the K/V ring (split keys: the same bytes in three buffers); the lse staging (512
  bytes, so 1 KB); the barriers: one a query tile, five a ring slot, the turns. prefetch_q: the
  output staging apart (64 columns a compute warpgroup) and a barrier a query tile more. The
  interpreter's P tiles are left out: it has no shared-memory bound."""
  buffers = (_COMPUTE_WGS * _TILE * dv * 2, _COMPUTE_WGS * _TILE * (dk - dv) * 2,
             stages * block_k * dk * 2, stages * block_k * dv * 2, _COMPUTE_WGS * _TILE * 4,
             _COMPUTE_WGS * _TILE * _STAGE_COLS * 2 * prefetch_q)
  return (sum(-(-b // 1024) * 1024 for b in buffers)
          + 8 * (_COMPUTE_WGS * (1 + prefetch_q) + 5 * stages + 1))


def _stages_for(dk, dv, block_k, prefetch_q=False):
  """The deepest K/V ring (at most _MAX_STAGES, at least 2) that fits, or 0 if none does."""
  return next((s for s in range(_MAX_STAGES, 1, -1)
               if _smem_bytes(dk, dv, block_k, s, prefetch_q) <= HOPPER_SMEM_BYTES), 0)


def _aligned_rows(q_len, q_lead):
  """A request's query rows counted from its first row's 8-aligned row down; none if empty."""
  return jnp.where(q_len > 0, q_len + q_lead, 0)


class _Item(NamedTuple):
  """One work item: a block of 128 query rows of a request, for one head (int32 scalars)."""
  h: jax.Array
  qs: jax.Array  # the block's first row, counted from q_base
  tile: jax.Array  # the request's first edge slot (2r)
  q_start: jax.Array
  k_start: jax.Array
  q_len: jax.Array
  k_len: jax.Array
  q_base: jax.Array  # q_start rounded down to 8 rows (bulk-copy boxes start there)
  k_base: jax.Array
  q_lead: jax.Array  # q_start - q_base
  k_lead: jax.Array


def _interior(first_row, q_start, q_len):
  """Whether the 64-row output tile from first_row (not moved back) holds only the request's rows:
  then a batch writes it in place; works on the kernel's scalars and on arrays alike."""
  return (first_row >= q_start) & (first_row + _TILE <= q_start + q_len)


def _block_keys(qs, q_lead, q_len, k_len, causal):
  """(k_end, k_full) of the block starting at row qs (counted from q_base, q_lead rows before the
  request's first row): the keys its last row sees, and those its first row (hence every row)
  sees; none for a block outside the request. Also the cost of a block in the persistent queue."""
  inside = (qs + _BLOCK_Q > q_lead) & (qs < q_lead + q_len)
  if causal:
    diag = k_len - q_len  # row i sees keys j <= i + diag
    first_row = jnp.maximum(qs - q_lead, 0)  # request-local
    k_end = jnp.clip(jnp.minimum(qs + _BLOCK_Q - q_lead, q_len) + diag, 0, k_len)
    k_full = jnp.clip(first_row + 1 + diag, 0, k_len)
  else:
    k_end = k_full = k_len
  return jnp.where(inside, k_end, 0), jnp.where(inside, k_full, 0)


def _prefill_kernel(sched_ref, q_ref, k_ref, v_ref, *rest, num_bounds, scale,
                    causal, num_q_programs, block_k, ping_pong, p_in_registers, persistent,
                    section_heads, direct, split_k, intra_overlap, prefetch_q,
                    first_step_unmasked, diagonal_half, raw_staging):
  # GMEM: sched_ref [2 (R+1) + 2 (B+1)] int32 (every scalar input in one array, so
  # that one XLA fusion builds them): cu_q and cu_k (R+1 each, num_bounds), then the queue
  # [2, B+1] row by row (persistent: column 0 row 0 the number of blocks, then per block,
  # heaviest first, its request (row 0) and index in the request (row 1); otherwise unused);
  # q_ref [Tq, N, Dk], k_ref [Tk, N, Dk], v_ref [Tk, N, Dv] bf16 (Tq, Tk multiples of 8, >= one
  # box); split_k: k_ref [Tk, N, Dv] (each head's key columns [0, Dv)) and k_pe_ref [Tk, Dk-Dv]
  # (columns [Dv, Dk), the same for every head);
  # o_ref [Tq, N, Dv] bf16 and lse_ref [N, Tq] f32, the rows themselves: direct (one request)
  # every tile writes there whole; a batch (the last request holds the rows past the batch,
  # without keys) whole only the tiles inside a request (`_interior`), and of the others (a
  # request's first and last) its rows one bulk copy a row, their lse to edge_lse_ref [N, E*64],
  # request r's first tile in slot 2r, its last in slot 2r + 1 (none when direct).
  # SMEM: qv_smem [2, 64, Dv] (each compute warpgroup's query columns [0, Dv), then its output
  # staging, unless prefetch_q); stage_raw (a batch on the GPU): the staging's untiled, swizzled
  # alias [2, 8, Dv/64 (prefetch_q: 1), 8, 64] (tile-row, column tile, row in tile, column), from
  # which a single row can be copied (Mosaic GPU slices tiled buffers by whole 8-row tiles);
  # qr_smem [2, 64, Dk-Dv] (columns [Dv, Dk); absent when Dk == Dv); k_smem
  # [stages, block_k, Dk] (split_k: [stages, block_k, Dv], and kr_smem [stages, block_k, Dk-Dv]
  # k_pe's rows); v_smem [stages, block_k, Dv]; p_smem [2, 64, block_k] (each warpgroup's
  # P; only without p_in_registers); lse_smem [2, 64] f32. Barriers: q_bar [2] (a warpgroup's
  # query columns [0, Dv) and the rest landed: both copies on one barrier);
  # k_ready (split_k: both key boxes), v_ready [stages] (slot landed);
  # v_clean [stages] (both compute warpgroups zeroed a slot's rows outside the request);
  # k_consumed, v_consumed [stages] (both compute warpgroups done); schedule (the compute
  # warpgroups' turns on the tensor cores). prefetch_q: o_stage [2, 64, 64] (each compute
  # warpgroup's output staging, 64 columns at a time) and q_free [2] (a warpgroup's last S of an
  # item read its query tile: the memory warpgroup may copy the next item's there).
  k_pe_ref, *rest = rest if split_k else (None, *rest)
  o_ref, lse_ref, *rest = rest
  edge_lse_ref, *rest = (None, *rest) if direct else rest
  qv_smem, *rest = rest
  stage_raw = None
  if raw_staging and not prefetch_q:  # the union of the query tiles and their raw alias
    qv_smem, stage_raw = qv_smem
  if qv_smem.shape[2] < q_ref.shape[2]:
    qr_smem, *rest = rest
  else:
    qr_smem = None
  k_smem, *rest = rest
  kr_smem = rest.pop(0) if split_k else None
  v_smem, *rest = rest
  p_smem = None if p_in_registers else rest.pop(0)
  lse_smem, q_bar, k_ready, v_ready, v_clean, k_consumed, v_consumed, schedule, *rest = rest
  o_stage, q_free = rest if prefetch_q else (None, None)
  if raw_staging and prefetch_q:
    o_stage, stage_raw = o_stage
  wg = lax.axis_index("wg")
  tq, tk, dk = q_ref.shape[0], k_ref.shape[0], q_ref.shape[2]
  num_heads = q_ref.shape[1]
  dv = qv_smem.shape[2]
  stages = k_smem.shape[0]
  qk_scale = scale * LOG2E  # log2(e) folded in: the softmax runs on exp2
  cu_q = lambda r: sched_ref[r]
  cu_k = lambda r: sched_ref[num_bounds + r]
  queue_len = (sched_ref.shape[0] - 2 * num_bounds) // 2
  queue = lambda row, i: sched_ref[2 * num_bounds + row * queue_len + i]

  def request(r):
    q_start, k_start = cu_q(r), cu_k(r)
    # Written as products so that Mosaic GPU sees them divisible by 8. Direct: blocks start at row
    # 0 and cover all Tq rows, those outside the request giving 0, -inf.
    q_base = jnp.int32(0) if direct else lax.div(q_start, _ALIGN) * _ALIGN
    k_base = lax.div(k_start, _ALIGN) * _ALIGN
    return dict(tile=2 * r, q_start=q_start, k_start=k_start,
                q_len=cu_q(r + 1) - q_start, k_len=cu_k(r + 1) - k_start,
                q_base=q_base, k_base=k_base, q_lead=q_start - q_base, k_lead=k_start - k_base)

  def item_schedule():
    """(trips, item): how many items this program takes, and item(trip) -> _Item."""
    if persistent:
      # Program p takes items p, p + P, ... of the queue: the heads in sections of section_heads,
      # one section after another; in a section the blocks heaviest first, each for the section's
      # heads (heads fastest: items side by side do equal work; the section's K/V is what the
      # programs at work read, so it can stay in L2). All heads one section: every block for every
      # head; one head a section: each head for every block.
      prog, num_programs = lax.axis_index("programs"), lax.axis_size("programs")
      num_blocks = queue(0, 0)
      trips = lax.div(jnp.maximum(num_blocks * num_heads - prog, 0) + (num_programs - 1),
                      num_programs)

      def item(trip):
        i = prog + trip * num_programs
        section, i = lax.div(i, section_heads * num_blocks), lax.rem(i, section_heads * num_blocks)
        block, h = lax.div(i, section_heads), section * section_heads + lax.rem(i, section_heads)
        r = queue(0, block + 1)
        return _Item(h=h, qs=queue(1, block + 1) * _BLOCK_Q, **request(r))
    else:
      # Slot p takes its request's blocks nb-1-p, nb-1-p-P, ...: the heaviest causal blocks launch
      # first, and a request longer than max_seqlen_q is still covered, just serially.
      prog, h, r = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("requests")
      fixed = request(r)
      num_blocks = lax.div(_aligned_rows(fixed["q_len"], fixed["q_lead"]) + (_BLOCK_Q - 1),
                           _BLOCK_Q)
      trips = lax.div(jnp.maximum(num_blocks - prog, 0) + (num_q_programs - 1), num_q_programs)

      def item(trip):
        return _Item(h=h, qs=(num_blocks - 1 - prog - trip * num_q_programs) * _BLOCK_Q, **fixed)
    return trips, item

  def key_steps(w):
    """Step bounds (lo, hi, end) of item w's block: steps [lo, hi) need no mask, steps [0, lo)
    and [hi, end) do. Step j holds the keys k_base + block_k * j on. Every warpgroup derives the
    same bounds, so their barrier phases agree."""
    k_end, k_full = _block_keys(w.qs, w.q_lead, w.q_len, w.k_len, causal)
    end = jnp.where(k_end > 0, lax.div(k_end + w.k_lead + (block_k - 1), block_k), 0)
    # Step 0 also holds the previous request's last k_lead keys.
    lo = jnp.minimum(jnp.where(w.k_lead > 0, 1, 0), end)
    return lo, jnp.maximum(lax.div(k_full + w.k_lead, block_k), lo), end

  def box(start, rows, total):
    """A `rows`-row box beginning at `start`, moved back to end at `total`: (first row, shift).
    Both are multiples of 8 (start and total are): tiled bulk copies need that."""
    first = jnp.minimum(start, total - rows)
    return first, start - first

  def foreign_keys(w, j):
    """(any, key0, shift): whether step j's box holds rows other than the request's keys it adds
    (a neighbour's, padding, or keys the previous step counted), its first row's request-local
    key, and how far it was moved back."""
    first, shift = box(w.k_base + j * block_k, block_k, tk)
    key0 = first - w.k_start
    return (key0 < 0) | (key0 + block_k > w.k_len) | (shift > 0), key0, shift

  def copy_queries(w, g, q_first):
    """Starts the copy of compute warpgroup g's query tile of item w (its box from q_first), both
    column ranges on the tile's one barrier."""
    q_rows = pl.ds(q_first, _TILE)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows, w.h, pl.ds(0, dv)], qv_smem.at[g], q_bar.at[g])
    if qr_smem is not None:  # both copies on the tile's barrier (one phase to track)
      plgpu.copy_gmem_to_smem(q_ref.at[q_rows, w.h, pl.ds(dv, dk - dv)], qr_smem.at[g],
                              q_bar.at[g])

  def take_turn():
    """Ping-pong (FA3): a compute warpgroup's softmax runs while the other's products do."""
    if ping_pong:
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def release_queries():
      """prefetch_q: this warpgroup's last read of its query tile in an item is done (its last S
      waited for), so the memory warpgroup may copy the next item's queries there."""
      plgpu.barrier_arrive(q_free.at[wg])

    def zero_foreign_values(w, j, slot):
      """A box's rows outside the request get P = 0, but 0 * NaN (or inf) in V is NaN: step j's
      masked V slot has them zeroed in shared memory first (a select), so another request's
      values never reach a row. Only masked steps hold such rows: the first when the request
      starts off 8 rows, the last when its keys end inside the box, any box moved back from the
      array's end. Returns whether it zeroed (then v_clean, not v_ready, says the slot is
      ready)."""
      clean = foreign_keys(w, j)[0]

      @pl.when(clean)
      def _():
        plgpu.barrier_wait(v_ready.at[slot])
        _, key0, shift = foreign_keys(w, j)

        # Each compute warpgroup takes 64 rows (with 64-key steps, warpgroup 0 all of them).
        @pl.when(wg * _TILE < block_k)
        def _():
          tile = v_smem.at[slot, pl.ds(wg * _TILE, _TILE)]  # [64, Dv]
          vals = tile[...]
          rows = wg * _TILE + plgpu.broadcasted_iota(jnp.int32, vals.shape, 0,
                                                     layout=plgpu.Layout.WGMMA)
          own = (rows >= shift) & (rows + key0 >= 0) & (rows + key0 < w.k_len)
          tile[...] = jnp.where(own, vals, jnp.zeros((), vals.dtype))

        plgpu.commit_smem()  # plain stores read next by wgmma (the async proxy)
        plgpu.barrier_arrive(v_clean.at[slot])

      return clean

    def wait_values(clean, slot):
      """Waits until a slot's V may be read: both warpgroups' rows zeroed (each waited for the
      copy) where `clean` (a traced bool, or False for steps that never zero), else the copy."""
      if clean is False:
        plgpu.barrier_wait(v_ready.at[slot])
      else:
        pl.when(clean)(lambda: plgpu.barrier_wait(v_clean.at[slot]))
        pl.when(~clean)(lambda: plgpu.barrier_wait(v_ready.at[slot]))

    def issue_scores(acc_ref, slot, count, keys=block_k):
      """acc_ref [64 rows, keys] f32 (the box's first `keys` keys); nope then rope. The query
      tiles are read through step_variant(., count) so their descriptors are not hoisted out of
      the step loop and spilled (common.step_variant)."""
      rows = slice(None) if keys == block_k else pl.ds(0, keys)
      plgpu.wgmma(acc_ref, step_variant(qv_smem.at[wg], count),
                  k_smem.at[slot, rows, pl.ds(0, dv)].transpose((1, 0)))
      if qr_smem is not None:
        if split_k:
          k_rope = kr_smem.at[slot] if keys == block_k else kr_smem.at[slot, rows]
        else:
          k_rope = k_smem.at[slot, rows, pl.ds(dv, dk - dv)]
        plgpu.wgmma(acc_ref, step_variant(qr_smem.at[wg], count), k_rope.transpose((1, 0)))

    def mask_scores(s, w, j, q_shift):
      """s with -inf where step j's keys are outside the request or (causal) after the row's."""
      # Made in the step, not carried: an int32 iota of the tile is block_k / 2 registers.
      cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
      _, k_shift = box(w.k_base + j * block_k, block_k, tk)
      keys = cols + (j * block_k - k_shift - w.k_lead)  # request-local key positions
      # Keys before the step's first (j * block_k - k_lead: those before the request, and with
      # a box moved back the previous step's) and past the row's last (the request's end, the
      # diagonal) are hidden: two compares of keys, the bounds made once a step or a row.
      last = jnp.full((_TILE,), w.k_len - 1, jnp.int32)
      if causal:
        rows = plgpu.broadcasted_iota(jnp.int32, (_TILE,), 0, layout=rows_layout)
        diag = w.k_len - w.q_len
        last = jnp.minimum(last, rows + (w.qs + wg * _TILE - q_shift - w.q_lead + diag))
      visible = ((keys >= jnp.maximum(j * block_k - w.k_lead, 0))
                 & (keys <= row_broadcast(last, s.shape)))
      return jnp.where(visible, s, -jnp.inf)

    def softmax(s, m):
      """The online softmax of one step's scores, in exp2: the new row max, the factor that
      rescales the running sums to it, and the unnormalized probabilities."""
      # Scale the row max, not s: then s * qk_scale - m below is one FMA per element.
      m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s * qk_scale - row_broadcast(m_new, s.shape))
      return m_new, alpha, p

    def add_values(acc, p16, slot, in_flight=lambda: None):
      """acc + P V with the slot's V (its first p16.shape[1] rows); in_flight runs while the
      product does."""
      keys = p16.shape[1]
      values_ref = v_smem.at[slot] if keys == block_k else v_smem.at[slot, pl.ds(0, keys)]
      if p_in_registers:
        def values(acc_ref):  # acc_ref [64 rows, Dv] f32, accumulating in place
          plgpu.wgmma(acc_ref, p16, values_ref)
          in_flight()

        return pl.run_state(values)(plgpu.ACC.init(acc))
      # The interpreter's form: wgmma with shared-memory operands into a fresh accumulator.
      p_ref = p_smem.at[wg] if keys == block_k else p_smem.at[wg, :, pl.ds(0, keys)]
      p_ref[...] = p16
      plgpu.commit_smem()  # these plain stores are read next by wgmma (the async proxy)

      def values(acc_ref):
        plgpu.wgmma(acc_ref, p_ref, values_ref)
        return acc_ref[...]

      acc = acc + pl.run_scoped(values, plgpu.ACC(acc.shape, jnp.float32))
      in_flight()
      return acc

    def step(j, carry, w, q_shift, end, masked):
      m, l, acc, count = carry
      slot = lax.rem(count, stages)  # its K landed: waited for by the previous step or the block
      clean = zero_foreign_values(w, j, slot) if masked else False

      def scores(acc_ref):
        issue_scores(acc_ref, slot, count)
        take_turn()
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((_TILE, block_k), jnp.float32))
      plgpu.barrier_arrive(k_consumed.at[slot])
      if prefetch_q:
        pl.when(j + 1 == end)(release_queries)
      if masked:
        s = mask_scores(s, w, j, q_shift)
      m_new, alpha, p = softmax(s, m)
      acc = acc * row_broadcast(alpha, acc.shape)
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(v_smem.dtype)
      # jax's FA3 port measured this order (sums before the turn) faster for value widths <= 128.
      acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
      if ping_pong:
        plgpu.barrier_arrive(schedule)  # softmax done
      wait_values(clean, slot)
      if ping_pong:
        plgpu.barrier_wait(schedule)  # the tensor cores are ours

      def next_keys():  # waited for while P V runs
        @pl.when(j + 1 < end)
        def _():
          plgpu.barrier_wait(k_ready.at[lax.rem(count + 1, stages)])

      acc = add_values(acc, p16, slot, next_keys)
      plgpu.barrier_arrive(v_consumed.at[slot])
      return m_new, l, acc, count + 1

    def overlapped_step(j, carry, w, q_shift, end, masked, first=False, keys=block_k):
      """intra_overlap (FlashAttention-3's intra-warpgroup order): step j's S = Q K^T is issued,
      then step j - 1's P V, then step j's softmax (ptxas waits for both products before it: see
      MosaicPrefillConfig.intra_overlap). After step j, acc holds the P V of the steps before j,
      scaled to step j's row max, and p16 is step j's P, whose P V the next step (or
      `last_values`) adds; `first`: step 0, no P V."""
      m, l, acc, count, p16 = carry
      slot = lax.rem(count, stages)
      prev = lax.rem(count + stages - 1, stages)  # step j - 1's slot
      if masked:
        zero_foreign_values(w, j, slot)
      if not first:  # step 0's K was waited for by the block
        plgpu.barrier_wait(k_ready.at[slot])

      def products(s_ref, o_ref=None):  # s_ref [64, keys], o_ref [64, Dv] f32
        issue_scores(s_ref, slot, count, keys)
        if not first:
          # Only a masked step zeroes V rows; an unmasked one has no foreign keys, so this is
          # False there.
          wait_values(foreign_keys(w, j - 1)[0], prev)
          if p_in_registers:
            o_ref[...] = acc  # accumulating in place
            plgpu.wgmma(o_ref, p16, v_smem.at[prev])
          else:  # the interpreter's form (see add_values)
            p_smem.at[wg][...] = p16
            plgpu.commit_smem()
            plgpu.wgmma(o_ref, p_smem.at[wg], v_smem.at[prev])
        # Waits for the scores only, in the PTX: ptxas moves the P V's wait below to just after.
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if first else 1)
        plgpu.barrier_arrive(k_consumed.at[slot])
        if prefetch_q:
          pl.when(j + 1 == end)(release_queries)
        if masked:
          s = mask_scores(s, w, j, q_shift)
        m_new, alpha, p = softmax(s, m)
        l_new = l * alpha + p.sum(axis=1)
        pv = None
        if not first:
          pv = o_ref[...]  # waits for P V
          plgpu.barrier_arrive(v_consumed.at[prev])
        return m_new, alpha, p, l_new, pv

      accs = [plgpu.ACC((_TILE, keys), jnp.float32)]
      if not first:
        accs.append(plgpu.ACC((_TILE, dv), jnp.float32))
      m_new, alpha, p, l, pv = pl.run_scoped(products, *accs)
      if not first:
        acc = pv if p_in_registers else acc + pv
      acc = acc * row_broadcast(alpha, acc.shape)
      return m_new, l, acc, count + 1, p.astype(v_smem.dtype)

    def last_values(_, carry, w, end):
      """The P V of an item's last step (intra_overlap): run once if the item has steps."""
      m, l, acc, count, p16 = carry
      prev = lax.rem(count + stages - 1, stages)
      wait_values(foreign_keys(w, end - 1)[0], prev)
      acc = add_values(acc, p16, prev)
      plgpu.barrier_arrive(v_consumed.at[prev])
      return m, l, acc, count, p16

    def half_keys_only(w, end, tile_row):
      """diagonal_half: whether this warpgroup's rows see no key of the item's last step past
      the first half of its box (request-local keys from the box's first on)."""
      first_key, _ = box(w.k_base + (end - 1) * block_k, block_k, tk)
      rows_end = jnp.minimum(tile_row + _TILE - w.q_lead, w.q_len)  # past its last row
      seen = jnp.clip(rows_end + (w.k_len - w.q_len), 0, w.k_len) if causal else w.k_len
      return (end > 0) & (seen <= first_key - w.k_start + block_k // 2)

    def half_last_step(_, carry, w, q_shift, end, first):
      """diagonal_half: the item's last step on its box's first 64 keys, then that step's P V
      (K = 64); the carry's P (the step before's, added here) is passed on unused."""
      half = overlapped_step(end - 1, carry, w, q_shift, end, masked=True, first=first,
                             keys=block_k // 2)
      return last_values(None, half, w, end)[:4] + carry[4:]

    def q_block(trip, count):
      w = item(trip)
      tile_row = w.qs + wg * _TILE  # this warpgroup's first row, counted from q_base
      q_first, q_shift = box(w.q_base + tile_row, _TILE, tq)
      if not prefetch_q:  # else the memory warpgroup copied them, an item ahead
        copy_queries(w, wg, q_first)
      plgpu.barrier_wait(q_bar.at[wg])
      lo, hi, end = key_steps(w)
      if prefetch_q:  # an item without steps never reads its queries
        pl.when(end == 0)(release_queries)

      @pl.when(end > 0)
      def _():
        plgpu.barrier_wait(k_ready.at[lax.rem(count, stages)])

      carry = (plgpu.layout_cast(jnp.full((_TILE,), M_INIT, jnp.float32), rows_layout),
               plgpu.layout_cast(jnp.zeros((_TILE,), jnp.float32), rows_layout),
               plgpu.layout_cast(jnp.zeros((_TILE, dv), jnp.float32), plgpu.Layout.WGMMA),
               count)
      if intra_overlap:
        # Step 0 apart (no P V before it), always masked (a mask an unmasked step passes whole;
        # first_step_unmasked: only where needed); then the steps as below, from 1; then the
        # last step's P V.
        first = jnp.minimum(end, 1)
        run = functools.partial(overlapped_step, w=w, q_shift=q_shift, end=end)
        carry += (plgpu.layout_cast(jnp.zeros((_TILE, block_k), v_smem.dtype),
                                    plgpu.Layout.WGMMA),)
        full_end, full_first = end, first  # the steps run whole (all but a halved last one)
        if diagonal_half:
          half = half_keys_only(w, end, tile_row)
          full_end = end - jnp.where(half, 1, 0)
          full_first = jnp.minimum(full_end, 1)
          first = full_first
        if first_step_unmasked:  # masked where it holds keys to hide (see key_steps)
          first_masked = jnp.where((lo > 0) | (hi == 0), first, 0)
          carry = lax.fori_loop(0, first_masked, functools.partial(run, masked=True, first=True),
                                carry)
          carry = lax.fori_loop(first_masked, first,
                                functools.partial(run, masked=False, first=True), carry)
        else:
          carry = lax.fori_loop(0, first, functools.partial(run, masked=True, first=True), carry)
        if diagonal_half:  # a halved last step is masked: lo, hi <= full_end
          lo, hi = jnp.clip(lo, first, full_end), jnp.clip(hi, first, full_end)
        else:
          lo, hi = jnp.maximum(lo, first), jnp.maximum(hi, first)
        carry = lax.fori_loop(first, lo, functools.partial(run, masked=True), carry)
        carry = lax.fori_loop(lo, hi, functools.partial(run, masked=False), carry)
        carry = lax.fori_loop(hi, full_end, functools.partial(run, masked=True), carry)
        if diagonal_half:
          carry = lax.fori_loop(0, jnp.where(half, 0, full_first),
                                functools.partial(last_values, w=w, end=end), carry)
          for alone in (False, True):  # the halved step after others, or the item's only one
            carry = lax.fori_loop(0, jnp.where(half & ((end == 1) == alone), 1, 0),
                                  functools.partial(half_last_step, w=w, q_shift=q_shift,
                                                    end=end, first=alone), carry)
          m, l, acc, count, _ = carry
        else:
          m, l, acc, count, _ = lax.fori_loop(0, first,
                                              functools.partial(last_values, w=w, end=end), carry)
      else:
        run = functools.partial(step, w=w, q_shift=q_shift, end=end)
        carry = lax.fori_loop(0, lo, functools.partial(run, masked=True), carry)
        carry = lax.fori_loop(lo, hi, functools.partial(run, masked=False), carry)
        m, l, acc, count = lax.fori_loop(hi, end, functools.partial(run, masked=True), carry)

      # A tile wholly past the request (the second half of its last block) writes nothing: its
      # slot belongs to the next request (direct: every tile writes its own rows). Rows that saw
      # no key, and rows outside the request, give 0, -inf.
      @pl.when(True if direct else tile_row < w.q_lead + w.q_len)
      def _():
        # Request-local rows, as a column and as the tile (selects: acc may be NaN there).
        rows = q_first - w.q_start + plgpu.broadcasted_iota(jnp.int32, (_TILE,), 0,
                                                            layout=rows_layout)
        tile_rows = q_first - w.q_start + plgpu.broadcasted_iota(jnp.int32, acc.shape, 0,
                                                                 layout=plgpu.Layout.WGMMA)
        seen = (l > 0) & (rows >= 0) & (rows < w.q_len)
        l_safe = jnp.where(seen, l, 1.0)
        o = jnp.where((tile_rows >= 0) & (tile_rows < w.q_len),
                      acc * row_broadcast(1.0 / l_safe, acc.shape), 0.0)
        lse = lambda: jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf)

        def store(o_out, lse_out, row, staged, cols, with_lse):
          plgpu.copy_smem_to_gmem(staged, o_out.at[(pl.ds(row, _TILE), w.h) + cols])
          if with_lse:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_out.at[w.h, pl.ds(row, _TILE)])

        def store_rows(staged, col0, with_lse):
          """A request's first or last tile: only the request's rows of o, from the tile's own
          first row (a box moved back starts on the tile before's), one bulk copy a row and 64
          columns (the other rows are a neighbour's); the lse to the tile's slot."""
          def row(r, _):
            for c in range(staged.shape[1] // _STAGE_COLS):
              src = (staged.at[pl.ds(r, 1), pl.ds(c * _STAGE_COLS, _STAGE_COLS)]
                     if stage_raw is None
                     else stage_raw.at[wg, lax.div(r, 8), c, pl.ds(lax.rem(r, 8), 1)])
              plgpu.copy_smem_to_gmem(src, o_ref.at[pl.ds(q_first + r, 1), w.h,
                                                    pl.ds(col0 + c * _STAGE_COLS, _STAGE_COLS)])

          lax.fori_loop(jnp.maximum(w.q_base + tile_row, w.q_start) - q_first,
                        jnp.minimum(w.q_start + w.q_len, q_first + _TILE) - q_first, row, None)
          if with_lse:
            edge_row = (w.tile + jnp.where(tile_row > 0, 1, 0)) * _TILE
            plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                    edge_lse_ref.at[w.h, pl.ds(edge_row, _TILE)])

        def store_tile(staged, col0=0, with_lse=True):
          """Stores the staged output columns from col0 and the lse if with_lse."""
          cols = (pl.ds(col0, staged.shape[1]),)
          if direct:
            store(o_ref, lse_ref, q_first, staged, cols, with_lse)
          else:
            # A tile of the request's rows only is written whole (not moved back: those end past
            # the request), the request's first or last tile otherwise row by row.
            interior = _interior(w.q_base + tile_row, w.q_start, w.q_len)
            pl.when(interior)(lambda: store(o_ref, lse_ref, q_first, staged, cols, with_lse))
            pl.when(~interior)(lambda: store_rows(staged, col0, with_lse))

        if prefetch_q:
          # The query tile may already hold the next item's queries: the output goes out through
          # its own staging, 64 columns at a time, each piece once the stores before it (the
          # previous piece's, or the previous item's) have read the staging; none is waited for
          # until it lands.
          o16 = o.astype(o_stage.dtype)
          for piece in range(dv // _STAGE_COLS):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            start = piece * _STAGE_COLS
            o_stage.at[wg][...] = o16[:, start:start + _STAGE_COLS]
            if piece == 0:
              lse_smem.at[wg][...] = lse()
            plgpu.commit_smem()
            store_tile(o_stage.at[wg], start, with_lse=piece == 0)
        else:
          qv_smem.at[wg][...] = o.astype(qv_smem.dtype)
          lse_smem.at[wg][...] = lse()
          plgpu.commit_smem()
          store_tile(qv_smem.at[wg])
          # The staging is the next block's query tile: the store must have landed (waiting only
          # until it read shared memory measured no faster; RESULTS, session 8).
          plgpu.wait_smem_to_gmem(0)

      return count

    # Warpgroup 1 starts a turn behind, so the two alternate; warpgroup 0 closes the last turn.
    pl.when(wg == 1)(take_turn)
    # Derived here, after setmaxnreg, not before the branch into the warpgroups, where it was live
    # into both and ptxas spilled it (benchmarks/RESULTS.md, "lean_item_loop").
    trips, item = item_schedule()
    lax.fori_loop(0, trips, q_block, jnp.int32(0))
    if prefetch_q:  # the last item's stores, never waited for in the loop
      plgpu.wait_smem_to_gmem(0)
    pl.when(wg == 0)(take_turn)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGS, action="decrease")

    def q_block(trip, count):
      w = item(trip)
      _, _, n_end = key_steps(w)

      def kv_step(j):
        c = count + j
        slot = lax.rem(c, stages)
        first, _ = box(w.k_base + j * block_k, block_k, tk)
        rows = pl.ds(first, block_k)

        @pl.when(c >= stages)
        def _():
          plgpu.barrier_wait(k_consumed.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[rows, w.h], k_smem.at[slot], k_ready.at[slot])
        if split_k:  # the shared rope columns: the same rows for every head, read from L2
          plgpu.copy_gmem_to_smem(k_pe_ref.at[rows], kr_smem.at[slot], k_ready.at[slot])

        @pl.when(c >= stages)
        def _():
          plgpu.barrier_wait(v_consumed.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[rows, w.h], v_smem.at[slot], v_ready.at[slot])

      if prefetch_q:
        # Step 0's K/V first (its slot was freed by an earlier step than the query tiles, which
        # the previous item's last S frees), then each compute warpgroup's query tile once that
        # S has read it, then the other steps.
        pl.when(n_end > 0)(lambda: kv_step(0))
        for g in range(_COMPUTE_WGS):
          pl.when(trip > 0)(functools.partial(plgpu.barrier_wait, q_free.at[g]))
          copy_queries(w, g, box(w.q_base + w.qs + g * _TILE, _TILE, tq)[0])
        pl.loop(1, n_end)(kv_step)
      else:
        pl.loop(0, n_end)(kv_step)
      return count + n_end

    # Derived here, after setmaxnreg, not before the branch into the warpgroups, where it was live
    # into both and ptxas spilled it (benchmarks/RESULTS.md, "lean_item_loop").
    trips, item = item_schedule()
    total = lax.fori_loop(0, trips, q_block, jnp.int32(0))
    if prefetch_q:  # the last item's releases of the query tiles
      for g in range(_COMPUTE_WGS):
        pl.when(trips > 0)(functools.partial(plgpu.barrier_wait, q_free.at[g]))

    # Sees the last uses of the slots out too: a warpgroup that waits on some phases of a barrier
    # waits on all of them (the interpreter checks this when the barriers are freed).
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(c):
      plgpu.barrier_wait(k_consumed.at[lax.rem(c, stages)])
      plgpu.barrier_wait(v_consumed.at[lax.rem(c, stages)])


def head_sizes_fit(dk: int, dv: int, block_k: int = DEFAULT.block_k, *,
                   split_k_dim: int | None = None) -> bool:
  """Whether the kernel takes q/k heads of dk and v heads of dv (at block_k keys a step);
  split_k_dim: k's own columns in the split form (k_pe apart), which must be dv: the query tile is
  split there too, so each key box meets its own query columns in one wgmma."""
  return (dk % 64 == 0 and dv % 64 == 0 and dv <= min(dk, _MAX_DV)
          and split_k_dim in (None, dv) and bool(_stages_for(dk, dv, block_k)))


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, config, k_pe):
  check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, DTYPES, k_pe)
  dk, dv, block_k, num_stages = q.shape[2], v.shape[2], config.block_k, config.num_stages
  if k_pe is not None and k.shape[2] != dv:
    raise ValueError(f"with k_pe apart, k must hold Dv ({dv}) columns a head (the query tile's "
                     f"split), got {k.shape[2]}")
  if not head_sizes_fit(dk, dv, block_k):
    raise ValueError(f"Dk ({dk}) and Dv ({dv}) must be multiples of 64 (the swizzle tile), Dv at "
                     f"most Dk (the output is staged in the query tile) and at most {_MAX_DV}, and "
                     f"2 stages of {block_k}-key K/V blocks must fit in shared memory")
  most = _stages_for(dk, dv, block_k, config.prefetch_q)
  if config.prefetch_q and not most:
    raise ValueError(f"prefetch_q: 2 stages of {block_k}-key K/V blocks and the output staging "
                     f"do not fit in shared memory at Dk {dk}, Dv {dv}")
  if num_stages is not None and not 2 <= num_stages <= most:
    raise ValueError(f"num_stages must be in [2, {most}] (what fits in "
                     f"shared memory at block_k {block_k}), got {num_stages}")


def _pad_rows(x, rows):
  """x with at least `rows` rows and a multiple of 8 (bulk-copy boxes start 8-aligned and hold
  `rows` rows)."""
  padded = max(-(-x.shape[0] // _ALIGN) * _ALIGN, rows)
  pad = ((0, padded - x.shape[0]),) + ((0, 0),) * (x.ndim - 1)
  return jnp.pad(x, pad) if padded != x.shape[0] else x


def _final_lse(lse, edge_lse, cu_q):
  """lse [N, Tq] -> [Tq, N], the rows of each request's first and last tiles that were not written
  in place (`_interior`) taken from their slots (edge_lse [N, 2R*64]: request r's first tile in
  slot 2r, its last in 2r + 1, each holding its tile's box, moved back to end at row Tq if it
  would pass it); a gather and a select in the transpose, no scatter."""
  tq = lse.shape[1]
  rows = jnp.arange(tq, dtype=jnp.int32)
  r = jnp.clip(jnp.searchsorted(cu_q, rows, side="right", method="compare_all") - 1, 0,
               cu_q.shape[0] - 2)
  q_start, q_len = cu_q[r], cu_q[r + 1] - cu_q[r]
  q_base = q_start - q_start % _ALIGN
  tile = (rows - q_base) // _TILE
  last = jnp.maximum(-(-_aligned_rows(q_len, q_start - q_base) // _TILE) - 1, 0)
  first_row = q_base + tile * _TILE
  edge = ((tile == 0) | (tile == last)) & ~_interior(first_row, q_start, q_len)
  slot_row = (2 * r + jnp.where(tile > 0, 1, 0)) * _TILE
  src = jnp.where(edge, slot_row + rows - jnp.minimum(first_row, tq - _TILE), 0)
  return jnp.where(edge, edge_lse[:, src], lse).T


def _work_queue(cu_q, cu_k, tq, causal, direct):
  """[2, B+1] int32: [0, 0] the number of 128-row query blocks, then per block, heaviest first
  (most keys to read; ties in request and block order), its request (row 0) and its index in the
  request (row 1). B bounds the blocks of any batch of tq rows. direct (one request): the blocks
  of all tq rows, from row 0."""
  num_requests = cu_q.shape[0] - 1
  q_len, k_len = jnp.diff(cu_q), jnp.diff(cu_k)
  q_lead, k_lead = cu_q[:-1] % _ALIGN, cu_k[:-1] % _ALIGN
  blocks = -(-_aligned_rows(q_len, q_lead) // _BLOCK_Q)
  bound = -(-(tq + (_ALIGN - 1) * num_requests) // _BLOCK_Q) + num_requests
  if direct:
    q_lead, bound = cu_q[:-1], -(-tq // _BLOCK_Q)
    blocks = jnp.full((1,), bound, jnp.int32)
  ends = jnp.cumsum(blocks)
  j = jnp.arange(bound, dtype=jnp.int32)
  r = jnp.minimum(jnp.searchsorted(ends, j, side="right", method="compare_all"), num_requests - 1)
  b = j - (ends - blocks)[r]
  k_end, _ = _block_keys(b * _BLOCK_Q, q_lead[r], q_len[r], k_len[r], causal)
  order = jnp.argsort(-jnp.where(j < ends[-1], k_end + k_lead[r], -1), stable=True)
  count = jnp.stack([ends[-1], 0])[:, None]
  return jnp.concatenate([count, jnp.stack([r[order], b[order]])], axis=1).astype(jnp.int32)


def _section_heads(num_heads, head_kv_bytes, budget):
  """Heads a section of the persistent queue holds: the most whose K/V (head_kv_bytes each) fit
  in `budget` bytes, at least 1, rounded down to a divisor of num_heads (whole sections)."""
  most = max(1, budget // head_kv_bytes)
  return max(d for d in range(1, min(most, num_heads) + 1) if num_heads % d == 0)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "max_seqlen_q", "block_k",
                                             "num_stages", "ping_pong", "persistent",
                                             "num_programs", "l2_section_bytes", "intra_overlap",
                                             "prefetch_q", "first_step_unmasked",
                                             "diagonal_half", "interpret"))
def mla_prefill(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                cu_seqlens_k: jax.Array, *, scale: float, causal: bool, max_seqlen_q: int,
                k_pe: jax.Array | None = None, block_k: int = DEFAULT.block_k,
                num_stages: int | None = DEFAULT.num_stages,
                ping_pong: bool = DEFAULT.ping_pong, persistent: bool | None = DEFAULT.persistent,
                num_programs: int | None = DEFAULT.num_programs,
                l2_section_bytes: int | None = DEFAULT.l2_section_bytes,
                intra_overlap: bool = DEFAULT.intra_overlap,
                prefetch_q: bool | None = DEFAULT.prefetch_q,
                first_step_unmasked: bool | None = DEFAULT.first_step_unmasked,
                diagonal_half: bool | None = DEFAULT.diagonal_half,
                interpret: bool | plgpu.InterpretGPUParams = False
                ) -> tuple[jax.Array, jax.Array]:
  """Variable-length attention with a running LSE; see the module docstring for the layout.

  q [Tq, N, Dk]; k [Tk, N, Dk]; v [Tk, N, Dv], all bfloat16, Dk and Dv multiples of 64, Dv <= Dk;
  cu_seqlens_q / cu_seqlens_k [R+1] int32. k_pe [Tk, Dk - Dv] bf16 (optional, the split form): the
  keys' last columns, the same for every head, with k then [Tk, N, Dv]; each key step copies the
  head's k box and the shared k_pe box (no [Tk, N, Dk] keys are ever built). max_seqlen_q: static
  bound on any request's query count; it sizes the grid (a request beyond it is still right, only
  slower). block_k (64 or 128 keys a step) and num_stages (K/V ring depth; default: the deepest
  that fits) are tuning knobs, and so is the schedule: intra_overlap (default) runs each compute
  warpgroup's softmax while its previous step's P V does (FA3's intra-warpgroup overlap);
  ping_pong (with intra_overlap False) has the two compute warpgroups take turns on the tensor
  cores instead; neither runs the steps in order. prefetch_q: the memory warpgroup copies each
  item's queries as soon as the item before has read its tiles (see MosaicPrefillConfig).
  first_step_unmasked (with intra_overlap): an item's step 0 masked only where it needs it.
  diagonal_half (with intra_overlap, 128-key steps): a warpgroup's last step on 64 keys where its
  rows see no more of it. Each of the three, None (default): on with intra_overlap's 128-key steps
  from 64 heads (prefetch_q where its staging fits), else off.
  persistent: as many programs (num_programs; default the device's SM count, 4 in the interpreter,
  so that each takes several items) walk a queue of (query block, head) items, the heaviest blocks
  first; else one program per (query slot, head, request); default (None): the queue up to 8192
  query rows at 64 heads or more, below 4096 at fewer, where it measured faster. l2_section_bytes
  (persistent only): walk the queue in sections of as many heads as have their K/V within that many
  bytes (see MosaicPrefillConfig). interpret: True or a `plgpu.InterpretGPUParams` runs Mosaic
  GPU's CPU interpreter. Returns o [Tq, N, Dv] bf16 and lse [Tq, N] float32 (natural log); rows
  past cu_q[-1], and rows that see no key, give (0, -inf).
  """
  # The per-item knobs, None: on where they were timed faster (intra_overlap, 128-key steps, from
  # _KNOBS_MIN_HEADS heads; q's rank is checked below, with every argument).
  timed = intra_overlap and block_k == 128 and q.ndim == 3 and q.shape[1] >= _KNOBS_MIN_HEADS
  if prefetch_q is None:
    prefetch_q = timed and bool(_stages_for(q.shape[-1], v.shape[-1], block_k, True))
  if first_step_unmasked is None:
    first_step_unmasked = timed
  if diagonal_half is None:
    diagonal_half = timed
  config = MosaicPrefillConfig(block_k, num_stages, ping_pong, persistent, num_programs,
                               l2_section_bytes, intra_overlap, prefetch_q, first_step_unmasked,
                               diagonal_half)
  _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, config, k_pe)
  split_k = k_pe is not None
  tq, n, dk = q.shape
  tk, dv = k.shape[0], v.shape[2]
  num_requests = cu_seqlens_q.shape[0] - 1
  if tq == 0 or tk == 0 or num_requests == 0:  # nothing to attend
    return jnp.zeros((tq, n, dv), q.dtype), jnp.full((tq, n), -jnp.inf, jnp.float32)
  if persistent is None:
    persistent = (tq <= _PERSISTENT_MAX_TOKENS_MANY_HEADS if n >= _HEADS_FIRST_MIN
                  else tq < _PERSISTENT_BELOW_TOKENS)
  # One request: the kernel writes o and lse rows in place (no slots to gather from). Its q is then
  # padded to whole 128-row blocks, so that no tile's box is moved back over another tile's rows
  # (a block with none of the request's rows would write 0 over them).
  direct = persistent and num_requests == 1
  q = _pad_rows(q, -(-tq // _BLOCK_Q) * _BLOCK_Q if direct else _TILE)
  k, v = _pad_rows(k, block_k), _pad_rows(v, block_k)
  k_inputs = (k, v) + ((_pad_rows(k_pe, block_k),) if split_k else ())
  cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
  if not direct:
    # The rows past the batch (to the padded end) are one more request, of no keys: its tiles
    # write them as 0, -inf, as the kernel does for any row that sees no key.
    cu_q = jnp.concatenate([cu_q, jnp.full((1,), q.shape[0], jnp.int32)])
    cu_k = jnp.concatenate([cu_k, cu_k[-1:]])
    num_requests += 1
  # No request is longer than Tq, so more slots than that would only idle.
  num_q_programs = max(1, -(-min(max_seqlen_q, tq) // _BLOCK_Q))
  stages = num_stages or _stages_for(dk, dv, block_k, prefetch_q)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  # Mosaic GPU's interpreter (jax 0.11.2) runs wgmma only with shared-memory operands into
  # run_scoped accumulators, so there P goes through shared memory; on the GPU it stays in
  # registers and P V accumulates in place.
  p_in_registers = not interpret
  raw_staging = not (direct or interpret)
  p_tiles = [] if p_in_registers else [swizzled((_COMPUTE_WGS, _TILE, block_k), q.dtype)]
  q_rest = [swizzled((_COMPUTE_WGS, _TILE, dk - dv), q.dtype)] if dk > dv else []
  k_rest = [swizzled((stages, block_k, dk - dv), k.dtype)] if split_k else []

  # Programs (or queue items) launch in grid (queue) order, the grid's last axis fastest. The
  # grid from 64 heads: one head's query blocks side by side, whose K/V stays in L2 (H200, 16K
  # tokens: +14% at N=64, +21-25% at N=128 over heads fastest); below, the heads of a query block
  # (+2.5% at N=16). The queue the other way round: heads fastest in L2-sized sections.
  heads_first = n >= _HEADS_FIRST_MIN
  if persistent:
    # Split keys count as whole (k_pe once a head, though all heads share it): the same sections
    # as the joined form's.
    section_heads = (_section_heads(n, k.shape[0] * (dk + dv) * k.dtype.itemsize,
                                    l2_section_bytes) if l2_section_bytes
                     else n if heads_first else 1)
    queue = _work_queue(cu_q, cu_k, q.shape[0], causal, direct)
    num_programs = num_programs or (4 if interpret else sm_count())
    grid, grid_names = (min(num_programs, (queue.shape[1] - 1) * n),), ("programs",)
  else:
    queue = jnp.zeros((2, 1), jnp.int32)  # unused
    section_heads = None  # the grid has no queue
    if heads_first:
      grid, grid_names = (n, num_q_programs, num_requests), ("heads", "q", "requests")
    else:
      grid, grid_names = (num_q_programs, n, num_requests), ("q", "heads", "requests")
  kernel = functools.partial(_prefill_kernel, num_bounds=cu_q.shape[0], scale=scale, causal=causal,
                             num_q_programs=num_q_programs, block_k=block_k, ping_pong=ping_pong,
                             p_in_registers=p_in_registers, persistent=persistent,
                             section_heads=section_heads, direct=direct, split_k=split_k,
                             intra_overlap=intra_overlap, prefetch_q=prefetch_q,
                             first_step_unmasked=first_step_unmasked, diagonal_half=diagonal_half,
                             raw_staging=raw_staging)
  # A batch's first and last tiles: the lse of each in a slot of its own (2 a request).
  edge_lse = [] if direct else [jax.ShapeDtypeStruct((n, 2 * num_requests * _TILE), jnp.float32)]

  def staging(cols):
    """The output staging [2, 64, cols]; with its raw alias where rows are copied one by one (a
    batch, on the GPU: the interpreter neither aliases a union's members nor needs it)."""
    tiled = swizzled((_COMPUTE_WGS, _TILE, cols), q.dtype)
    if not raw_staging:
      return tiled
    raw = plgpu.SMEM((_COMPUTE_WGS, _TILE // 8, cols // _STAGE_COLS, 8, _STAGE_COLS), q.dtype,
                     transforms=(plgpu.SwizzleTransform(128),))
    return plgpu.RefUnion(tiled, raw)

  outs = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((q.shape[0], n, dv), q.dtype),
                jax.ShapeDtypeStruct((n, q.shape[0]), jnp.float32), *edge_lse),
      scratch_types=(
          swizzled((_COMPUTE_WGS, _TILE, dv), q.dtype) if prefetch_q else staging(dv),
          *q_rest,
          swizzled((stages, block_k, k.shape[2]), k.dtype),
          *k_rest,
          swizzled((stages, block_k, dv), v.dtype),
          *p_tiles,
          plgpu.SMEM((_COMPUTE_WGS, _TILE), jnp.float32),
          # A query tile's columns [0, Dv) and [Dv, Dk): one barrier, both copies.
          plgpu.Barrier(num_arrivals=1 + (dk > dv), num_barriers=_COMPUTE_WGS),
          plgpu.Barrier(num_arrivals=1 + split_k, num_barriers=stages),  # one copy a key box
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
          # prefetch_q: each compute warpgroup's output staging; its query tile read for the
          # last time in an item (one barrier a warpgroup).
          *([staging(_STAGE_COLS), plgpu.Barrier(num_barriers=_COMPUTE_WGS)]
            if prefetch_q else []),
      ),
      grid=grid,
      grid_names=grid_names,
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      # Row reductions of the WGMMA layout stay within a warp (shuffles), so the cross-warp
      # reduction scratch (2 KB by default) is not needed.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=interpret or None,
      kernel_name=(f"mosaic_mla_prefill_{'causal' if causal else 'full'}_k{block_k}_s{stages}"
                   f"{'_pp' if ping_pong else ''}{'_persistent' if persistent else ''}"
                   f"{'_kpe' if split_k else ''}{'' if direct else '_in_place'}"
                   f"{'_overlap' if intra_overlap else ''}{'_prefetch_q' if prefetch_q else ''}"
                   f"{'_first_unmasked' if first_step_unmasked else ''}"
                   f"{'_half_diagonal' if diagonal_half else ''}"),
  )(jnp.concatenate([cu_q, cu_k, queue.reshape(-1)]), q, *k_inputs)
  o, lse = outs[:2]
  lse = lse.T if direct else _final_lse(lse, outs[2], cu_q)
  return o[:tq], lse[:tq]  # a slice (a copy) only where q was padded
