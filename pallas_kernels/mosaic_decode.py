"""Split-KV latent (MLA) decode for Hopper GPUs, in Pallas lowered through Mosaic GPU.

The contract and semantics of `pallas_kernels.latent_decode.latent_decode` (the Pallas-Triton
kernel), for bfloat16 q and cache with pages of a multiple of 64 tokens. One program (CTA) per
(64-head tile, split, token) runs three warpgroups:
- memory (warpgroup 2): one bulk copy of the token's 64 x 576 query tile, then the split's cache
  rows 64 tokens per step, one bulk copy of `kv_cache.at[block, rows]` each (the block read from
  the table per step), into a ring of 2 slots in shared memory;
- scores (warpgroup 0): S = Q K^T on the tensor cores (wgmma, M = 64 heads, N = 64 tokens,
  K = 576), the float32 online softmax, and P (bf16) plus the rows' rescale factors handed to
  warpgroup 1 through shared memory; then O[:, :256] = O * alpha + P V[:, :256] (P from its
  registers, accumulated in place);
- values (warpgroup 1): O[:, 256:] += P V[:, 256:].
The 64 x 512 float32 accumulator would take 256 registers per thread of one warpgroup, past the 255
a thread can have: that is why two warpgroups hold it, 256 columns each. Stage 2 merges the splits
by their log-sum-exps (`merge_splits`). With one split stage 1 writes the final output, and a row's
result depends only on that row's inputs.

Shared memory: the query tile and the 2 page slots (3 x 72 KB) + P (8 KB) + 64 floats = 224.3 KB of
the 227 KB a block may have; the output staging (two 64 x 256 tiles, 64 KB each in float32) reuses
the query and page memory once every step is done. An fp8 (e4m3) cache lands in 2 slots of bytes
(36 KB each) that the memory warpgroup widens to bf16 for the products: into one 64-row slot
(fp8_pipeline "serial", widening and products take turns), or into two 32-row slots that the
consumers use 32 tokens a step ("half_pages", widening overlaps the products; 64-byte swizzles,
220.3 KB; "shared_widening": the same, with warpgroup 1 widening its own value columns); see
`MosaicDecodeConfig`. With heads_in="n" (N <= 32; the default there) a
program's 16 or 32 heads are wgmma's N instead: the consumers compute S^T = K Q^T and O^T = V^T
P^T (`MosaicDecodeConfig`); there fp8_pipeline "register_a" (the fp8 default there) drops the
bf16 slot: the e4m3 pages land in a ring of 4 slots (18 + 4 x 36 + 2 KB + the reduction scratch =
166 KB at 16 heads, 188 at 32) and the consumers convert their tiles in registers as wgmma's A
operand, warpgroup 0 the keys and warpgroup 1 all 512 value columns (O^T takes 64 registers a
thread at 16 heads).

`interpret=True` (or an `InterpretGPUParams`) runs the same kernel on the CPU through Mosaic GPU's
interpreter, which simulates the warpgroups, barriers, bulk copies and wgmma, but not registers,
swizzles or timing. One difference: the interpreter (jax 0.11.2) runs wgmma only with
shared-memory operands into run_scoped accumulators, so there both warpgroups read P from shared
memory and add each P V product (128 columns at a time) to the rescaled sum, and "register_a"'s
converted tiles go through a shared-memory tile; lowering for CUDA, which also runs on a CPU,
checks the GPU form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels.common import (F8, HALF_ROWS, HALF_ROWS_LAYOUT, LOG2E,
                                   REDUCTION_BYTES_PER_8_HEADS, RESCALE_SLACK, check_decode_args,
                                   check_rescale_slack, check_softmax_scale, check_split_args,
                                   feed_ring, hand_over_p,
                                   heads_tile, in_phase, leading_rows, length_splits, merge_splits,
                                   mosaic_compiler_params, num_fixed_splits, one_wave_splits,
                                   padded_heads,
                                   partials_dtype, row_broadcast, run_scores, run_values,
                                   sm_count, softmax_step, split_range, step_variant, swizzled,
                                   SWIZZLE)
from pallas_kernels.e4m3_operands import (E4M3_LO_SCALE, FP8_COLS, SWIZZLE_TILE_ROWS,
                                          WIDE_UNITS, WIDE_VALUE_COLS, WIDE_VALUE_GROUP,
                                          WIDE_VALUE_TILES_IN_FLIGHT,
                                          e4m3_queries, split_queries, store_wide_values,
                                          wide_value_order, wide_value_tiles)
from pallas_kernels.mosaic_lanes import (WIDE_MASK, WIDE_UNIT_FACTOR, placed_bf16x2,
                                         rows_rescaled, warpgroup_thread, wide_load, wide_store)


FP8_PIPELINES = ("serial", "half_pages", "shared_widening", "register_a", "in_slot")
HEADS_IN = ("m", "n")
# The fp8 pipelines heads_in="n" takes: its consumers step 64 tokens (wgmma's M), so
# "shared_widening" runs as 64-token steps there (one bf16 slot, warpgroup 1 widening its value
# columns of page i + 1 after its P V of page i, the memory warpgroup the other tiles).
# "register_a" needs heads in N (the page is wgmma's A operand only in S^T = K Q^T, O^T = V^T P^T).
HEADS_N_FP8_PIPELINES = ("serial", "shared_widening", "register_a")


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
  """The kernel's launch knobs. Heads, rows per bulk copy and page slots are fixed by wgmma and
  shared memory; fp8_pipeline is how an fp8 cache's pages are widened to bf16 (bf16 caches ignore
  it):
  - "serial": one 64-row bf16 slot; the memory warpgroup widens page i + 1 into it only once both
    value warpgroups are done with page i, so widening and the products take turns (H200, B=128,
    N=128, S=4096: 0.842 ms against bf16's 0.367; benchmarks/RESULTS.md, "Latent decode
    (pallas_mosaic)", session 5);
  - "half_pages": the same 72 KB as two 32-row slots, and the consumers step 32
    tokens at a time, so the memory warpgroup widens half-page j + 1 while they run half-page j's
    products (H200, B=128: 1.35x "serial" at N=128 S=4096 and N=16 S=8192, 1.37x at N=128 S=8192;
    RESULTS.md, session 6);
  - "shared_widening": "half_pages" with the widening split between two warpgroups: warpgroup 1
    (values) widens its own value columns (256-511) of half-page j + 2 right after its P V of
    half-page j, while warpgroup 0 computes the next scores; the memory warpgroup widens the rest
    (0-255 and the rope columns), 5 of the 9 column tiles instead of all 9 (the default; H200,
    B=128, S=8192: 1.16x "half_pages" at N=128 and N=16, bit-identical outputs; RESULTS.md,
    session 7).
  - "register_a" (heads_in="n" only, a ValueError with "m"; benchmarks/RESULTS.md,
    "fp8_pipeline="register_a""): no bf16 slot. The e4m3 pages land in a ring of 4 e4m3 slots
    (bulk copies, as the bf16 cache's pages), and the consumers load their [64, 64] e4m3 tiles
    from it, convert them to f16 in registers and hand them to wgmma as its register A operand:
    warpgroup 0 the keys of S^T = K Q^T (WGMMA layout; by default, e4m3_scores below, no keys:
    S^T by fp8 wgmma from the slot itself), warpgroup 1 all the V^T tiles of
    O^T = V^T P^T (the transposed view in WGMMA_TRANSPOSED, converted, then relaid to WGMMA;
    `_value_columns`; by default 16-byte loads instead, wide_keys and wide_values below), a few
    tiles in flight (`_KEY_TILES_IN_FLIGHT`); by default two pages a consumer step
    (pages_per_step below: 1.08-1.15x one at 16 and 32 heads, session 24).
    e4m3 -> bf16 does not lower (Mosaic GPU, jax 0.11.2) and wgmma takes one 16-bit type for A
    and B, so the query tile and P^T are f16: q is converted before the call, each token scaled
    by a power of two that keeps it within f16's range and scaled back in its score scale
    (`_f16_queries`; exact, bf16 magnitudes below 2^-14 of the token's largest round in f16's
    subnormals). H200 (session 13), S=8192, N=16, ms, "shared_widening" / "register_a" (both
    heads_in="n", one process): B=128 0.462 / 0.365, B=32 0.138 / 0.112; at N=32 0.490 ("m",
    "shared_widening") / 0.493; without spills (the waits and warpgroup 1's columns above), B=128
    N=16 0.273 (bf16: 0.296), bit-identical; session 14, B=128 N=32 0.332 against "m" 0.481.
  - "in_slot" (heads_in="m" only, a ValueError with "n"; session 28; H200, session 29, B=128
    N=128 S=8192: 0.655 ms against "half_pages"' 0.770, 1.18x, GPU tests bit-identical to
    "serial"): bf16's two 64-row slots and no stage. Each page's e4m3 bytes land inside the slot it
    is widened into (its upper half, `_IN_SLOT_BANDS`), and the memory warpgroup widens them in
    place (`_wide_widen_rows`, lane-level, two halves of 32 rows with a warpgroup barrier
    between), so the consumers run bf16's 64-token steps: one S of N=64 and one softmax a page,
    where "half_pages" runs two of each (session 25's profile: warpgroup 0's half-step chain
    paces fp8 at N=128, 42% of it S at N=32). What it costs: a slot's refill window now holds
    the 36 KB copy and the widening (bf16: the 72 KB copy). Needs wide_widening on the GPU (a
    ValueError without: the Pallas-level widening cannot order its in-place stores).
  fp8_pipeline=None (the default) takes "register_a" where heads_in resolves to "n", else
  "in_slot" with wide_widening, "shared_widening" without (`default_fp8_pipeline`).
  heads_in, where a program's heads sit in the wgmma shapes (benchmarks/RESULTS.md, "Latent decode
  (pallas_mosaic)", session 12). None (the default) picks from static shapes
  (`default_heads_in`): "n" at N <= 32 (with an fp8 cache, where its pipeline takes "n"), else
  "m": 64 heads as wgmma's M (N < 64 in the 64-row tile: at N=16 three quarters of every product
  and of the softmax are padding). "n": N <= 32 heads as wgmma's N, padded to 16 or 32
  (`common.heads_tile`; a ValueError above 32), mosaic_sparse's heads_in="n": S^T = K Q^T [64
  tokens, heads], its softmax over the token rows (the row max a cross-warp reduction a step,
  through `reduction_scratch_bytes`; the row sum kept as partial sums, one a key, and reduced once
  at the end: `common.run_scores`' partial_sums), P^T stored transposed into p_smem [heads, 64],
  O^T = V^T P^T in [64 columns, heads] value tiles; a
  bf16 output (one split) stored transposed into the [heads, columns] staging, float32 partials
  (several splits, fixed splits) stored as they are and written [T, splits, L, Np] (Mosaic GPU,
  jax 0.11.2, does not lower a transposed float32 store), which the XLA merge reads transposed.
  Both caches; an fp8 cache with fp8_pipeline "serial" or "shared_widening" (wgmma's M is 64: the
  half-page pipelines' 32-token steps cannot be S^T's rows, so "shared_widening" runs 64-token
  steps there: one bf16 slot, warpgroup 1 widening its value columns of page i + 1 right after
  its P V of page i while the memory warpgroup widens the other 5 tiles; `HEADS_N_FP8_PIPELINES`),
  or "register_a" (above; "n" only), "half_pages" a ValueError. H200 (session 12), S=8192, N=16,
  ms, "m" / "n" in one process: bf16 B=128 0.309 / 0.296, B=32 0.0994 / 0.0902; fp8
  ("shared_widening") B=128 0.481 / 0.462, B=32 0.142 / 0.142; session 13, bf16 N=32: B=128
  0.301 / 0.297, B=32 0.100 / 0.0954.
  wide_keys (an fp8 cache with fp8_pipeline "register_a" only: True is a ValueError with the other
  fp8 pipelines; bf16 caches ignore it): warpgroup 0 loads each thread's key bytes of a [64, 64]
  e4m3 tile with two 16-byte loads (one a row) instead of 16 2-byte ones. The WGMMA A fragment holds
  columns {8j + 2 (lane % 4) + e} (j < 8, e < 2) of two rows; the kernel gives fragment column
  8j + 2q + e the tile's byte 16q + 2j + e instead (`wide_key_order`), q's columns permuted alike
  before the call (S sums over the permuted index in both operands: the same scores, another
  summation order). Only the GPU form loads wide (`_wide_key_tile`, lane-level code); the
  interpreter loads the tile and permutes it. None (the default): on wherever register_a runs
  its f16 keys, e4m3_scores=False (H200, session 15, B=128 S=8192: N=16 0.277 -> 0.259 ms, N=32
  0.334 -> 0.314; benchmarks/RESULTS.md, "wide_keys"); False keeps the 2-byte fragment loads.
  wide_values (an fp8 cache with fp8_pipeline "register_a" and kv_lora_rank 512 only: True is a
  ValueError elsewhere; bf16 caches ignore it): warpgroup 1 loads V^T's fragments of all 8 value
  tiles with 16-byte loads, one a token row (`WIDE_VALUE_GROUP`: 8-byte loads in two passes at 32
  heads), interleaving token pairs bytewise (prmt) before the e4m3x2 -> f16x2 conversion, instead of
  loading each tile in WGMMA_TRANSPOSED and relaying it through shuffles. The O^T tiles' rows are
  then the value columns in `wide_value_order` (wgmma's M: each row's sums are unchanged, so the
  output is bit-identical), put back as warpgroup 1 stages a bf16 output (one split) for its bulk
  copy (`store_wide_values`: H200, session 26, 1.01x at 16 heads, 1.02x at 32 against an XLA
  transpose after the call), else by the split merge. Only the GPU form loads wide
  (`wide_value_tiles`); the interpreter loads the tiles and permutes them. None (the default): on
  wherever register_a runs with kv_lora_rank 512 (H200, session 17, B=128 S=8192, one process: N=16
  0.257 -> 0.245 ms, N=32 0.318 -> 0.296; benchmarks/RESULTS.md, "wide_values"); False keeps the
  shuffled relayout (the bit-identity test's oracle).
  e4m3_scores (an fp8 cache with fp8_pipeline "register_a" only: True is a ValueError with the other
  fp8 pipelines; bf16 caches ignore it): S^T = K Q^T by fp8 wgmma straight from shared memory, A the
  e4m3 slot itself ([64 tokens, 576], K-major with the 64-byte swizzle), so warpgroup 0 loads and
  converts no keys. q is split exactly into two e4m3 parts per head (`e4m3_queries`, q = hi + 2^-4
  lo) by warpgroup 0 itself before its first product, from q's bf16 row in GMEM (`split_queries`:
  H200, session 26, B=128 S=8192, bit-identical, 1.05x at 16 heads and 1.04x at 32 against the split
  as four XLA kernels before the call), one [2 x heads, 576] e4m3 tile (hi rows, then lo rows) that
  is B of one wgmma of N = 2 x heads: [64 tokens, 2 x heads], its halves combined as K hi^T + 2^-4 K
  lo^T before the score scale. One wgmma, not one a part: ptxas (13.5) kept the two products' 36
  loop-invariant B descriptors in ordinary registers and moved them back each step (warpgroup 0's
  step, B=128 S=8192, SASS instructions a thread: N=16 481 without the knob, 470 with two wgmmas,
  316 with one; N=32 640, 649 (and 2 spill loads a step), 483; warpgroup 1's: 354 and 437). The
  keys' bytes are the products' (no wide_keys: True is a ValueError with it). None (the default): on
  wherever register_a runs, unless wide_keys=True asks for the f16 keys; False keeps the f16 keys in
  registers (H200, session 18, B=128 S=8192, one process: N=16 0.243 -> 0.189 ms, N=32 0.292 ->
  0.273 with 192-column promotion; benchmarks/RESULTS.md, "e4m3_scores"). Session 17's misses of
  SPEC's tolerances were the split's lo parts folded to 0 by XLA (`e4m3_queries`), not the fp8
  accumulation. The accumulation has its own limit: Hopper's fp8 wgmma keeps ~14 bits as it adds, so
  a logit carries an error of ~2^-14 of the partial sums' magnitude. Ordinary logits (tens) stay
  within SPEC's tolerances; nearly one-hot rows with logits in the thousands do not (H200, session
  19: rows of q scaled by 2^15, cosine difference 9.4e-5 at 192-column promotion, 4e-3 at 576,
  against 1e-5): e4m3_scores=False keeps float32 sums there.
  e4m3_promote_cols (one of E4M3_PROMOTE_COLS; e4m3_scores only) promotes as DeepGEMM does: the
  product is split over the columns into chunks this wide (the last one shorter: 4 x 128 + 64),
  each into a fresh accumulator, summed in f32 registers; chunk c + 1's wgmma is issued before
  chunk c's is waited for (wgmma_accumulator_load(wait_n=1)) and read. All the chunks'
  accumulators come from one scope: a scope a chunk (nested) made ptxas wait for chunk 0 before
  issuing chunk 1 (a WARPGROUP.DEPBAR 0 not in the PTX) and spilled more at 32 heads. H200
  (session 18), ms at N=16 / 32: 128 0.203 / 0.298, 192 0.189 / 0.273, 576 (one accumulation)
  0.191 / 0.261. 192 (the default) is the widest whose GPU tests have run (64, 128 and 192 met
  SPEC's tolerances in every case; 576's were cut by a step limit): 576 is 1.05x at 32 heads.
  ptxas (13.5), warpgroup 0's step without zero_rows, SASS instructions a thread, 576 / 192 /
  128 / 64: N=16 316 / 384 / 461 / 622; N=32 483 / 615 / 756 / 1119 (64: 8 spill instructions in
  the step); the chunks' sums (FADD) and each fresh accumulator's zeros (ptxas folds only the
  first's) are the growth.
  wide_widening (the widening pipelines "serial", "half_pages" and "shared_widening", either
  heads_in; a bf16 cache and "register_a", which widen nothing, ignore it): the memory
  warpgroup's widening of the e4m3 stage into the bf16 slots (and warpgroup 1's of its value
  columns with "shared_widening") runs in lane-level code (`_wide_widen_rows`), mosaic_sparse's
  wide_widening: a lane loads 16 e4m3 bytes of a row at once, places each byte's bits into a bf16
  (`mosaic_lanes.placed_bf16x2`: prmt, shl, and, one mul.bf16x2 by 2^120, the scale being 1
  here) and stores 16 bytes at a time into the swizzled slot, instead of HALF_ROWS_LAYOUT's 2-byte
  loads and f16 -> f32 -> bf16 conversions. Bit for bit the same slots (e4m3 values are exact in
  bf16; rows past a step's length +0); the interpreter runs the Pallas-level widening. ptxas
  (13.5, B=128 N=128 S=8192, SASS instructions a lane, Pallas-level / wide): "shared_widening",
  the memory warpgroup's page step 882 / 444 (80 LDS.U16 + 20 STSM / 10 LDS.128 + 20 STS.128),
  warpgroup 1's consumer step 557 / 367; "half_pages" the memory warpgroup's page step 1548 /
  716; "serial" 1522 / 706. True (the default): H200 (session 18, fp8, S=8192, one process each,
  ms, Pallas-level "shared_widening" / wide "shared_widening" / wide "half_pages"; max diff 0):
  B=128 N=128 0.946 / 0.857 / 0.827, N=64 0.489 / 0.433 / 0.422, B=32 N=128 0.279 / 0.242 /
  0.237; GPU tests bit-identical to False (benchmarks/RESULTS.md, "wide_widening"). False keeps
  the Pallas-level widening (the bit-identity test's oracle).
  pages_per_step (None, 1 or 2; 2 takes fp8_pipeline "register_a", a ValueError with the other
  fp8 pipelines; bf16 caches ignore it): the 64-token pages a consumer step covers. With 2, step j
  reads pages 2j and 2j + 1, page p from ring slot p % ring_slots, each slot with its own ready
  (the page's bulk copy) and consumed (both consumers) barrier, as with 1. Warpgroup 0 computes
  both pages' S^T (e4m3_scores: all the promotion chunks of both in one chain, page 2j + 1's
  first issued before page 2j's last is read; at 32 heads a chain a page,
  `_CHAINED_PAGES_MAX_HEADS`), takes their max in registers and does one cross-warp row-max
  reduction and one P^T hand-off for 128 tokens (p_smem [heads, 128]); warpgroup 1 accumulates
  both pages' V^T P^T in one step (all the value tiles of page 2j, then of 2j + 1). Why:
  warpgroup 0's per-page chain paces the fp8 N=16 kernel (H200, session 22's profile), and the
  reduction and the hand-off (barriers, fence, arrive) are per step, not per token. Each page's
  slot is released as soon as both consumers are done with it: warpgroup 0 once its S^T of the
  step is read, warpgroup 1 once it has loaded the page's value tiles, before their products (V^T
  is a register operand: the products read registers and P^T only), so page 2j's slot refills
  while both pages' products run; warpgroup 0 waits for page 2j + 1 only before its first
  product. An odd page count's last step has no page 2j + 1: the memory warpgroup arrives on its
  slot's ready without a copy, and warpgroup 0 zeroes that slot (0 rows: `zero_rows`), so its
  stale or uninitialized bytes give P = 0 and zero values. (Session 23's form released a pair of
  slots together after both pages' products: the memory warpgroup's lead dropped from 3 pages to
  2, 0.95x one page at N=16.) ptxas (13.5, B=128 S=8192; spill stores / loads in warpgroup 0's
  and warpgroup 1's step loops, and warpgroup 1's SASS instructions there): N=16 one page 0 / 0,
  0 / 0 (354), two with 4 slots 0 / 0, 0 / 0 (619), with 5 slots 1 / 1, 1 / 1 (655: a barrier
  phase word); N=32 one page 0 / 0, 0 / 0 (437), two (4 slots) 0 / 1, 3 / 11 (734).
  With a slot released a page (session 24, B=128 S=8192, ms, one page / two with 4 slots / two
  with 5): N=16 0.1924 / 0.1767 / 0.1800 (1.09x; 0.602x bf16's 0.2934), N=32 0.2611 / 0.2272
  (1.15x), B=32 N=16 0.0854 / 0.0854 / 0.0852; max |o| difference 3e-5 against one page. None
  (the default): 2 with register_a (`_REGISTER_A_PAGES`).
  ring_slots (None or one of RING_SLOTS; "register_a" only, a ValueError with the other fp8
  pipelines; bf16 caches ignore it): the e4m3 ring's slots. None: 4 (`_REGISTER_A_STAGES`; with
  two pages a step 5 at 16 heads timed 0.98x 4, above). A ring that does not fit
  (`_MAX_RING_SLOTS`: 5 at 32 heads with two pages a step) is a ValueError. ptxas (as above), one
  page a step with 5 slots: N=16 0 / 0, 0 / 0 (369); N=32 1 / 0, 0 / 1 (454).
  rescale_slack (None or a float >= 0, log2 units; heads in M, either cache; heads in N ignore
  it): FlashAttention-4's conditional rescaling. A row's running max moves only to a step
  maximum above it by more than the slack (`common.softmax_step`; P <= 2^slack), so its rescale
  factor is exactly 1 on the other steps, and on the GPU each consumer warp whose 16 rows all
  keep theirs skips the output's rescale (`mosaic_lanes.rows_rescaled`: 128 FMUL a thread at
  N=128 on each consumer's path from the softmax to P V; in the bf16 SASS warpgroup 0's come
  before it hands P over, so warpgroup 1's P V starts after both warpgroups' multiplies). 0: the
  exact running max (bit-identical to None), skipping where no row of a warp moved; 8.0
  (`common.RESCALE_SLACK`): after the first steps rows seldom move. The outputs are the same
  softmax (P in bf16 has its relative precision at any scale), not the same bits as None. H200
  (session 29, B=128 N=128 S=8192, in turn, ms, None / 8.0): bf16 0.560 / 0.545 (1.03x), fp8
  half_pages 0.770 / 0.722 (1.07x), in_slot 0.655 / 0.636 (1.03x): 8.0 the default
  (`common.RESCALE_SLACK`); None: every step rescales.
  auto_barriers (bf16 caches; fp8 caches keep them, their widening stores and reloads tiles): False
  (the default) compiles with `unsafe_no_auto_barriers`, so Pallas puts no warpgroup barrier around
  each shared-memory store and before each bulk copy (mosaic_sparse's default). Warpgroup 0's P
  hand-off then holds one barrier (commit_smem's) where it holds five (ptxas 13.5, bf16 N=128: two
  around P's store, two around the rescale factors', one in commit_smem), on the chain that paces
  the step at 128 heads (session 33); the kernel 10 BAR.SYNC instead of 44. Its stores are each
  thread's own fragment (the tail zeroing reloads only what the same thread stores) or read by
  another warpgroup after commit_smem and a barrier, as in mosaic_sparse, which shares the
  hand-off. H100 (session 34, B=128 S=8192, in turn, ms, True / False): N=128 0.551 / 0.534
  (1.03x), N=16 0.399 / 0.399; outputs bit for bit the same. True keeps Pallas's barriers."""
  block_h: int = 64  # heads per program: the M of every Hopper wgmma
  block_n: int = 64  # cache rows per bulk copy and step: N of S = Q K^T, K of P V
  num_stages: int = 2  # page slots: a third 72 KB slot does not fit beside the query tile
  fp8_pipeline: str | None = None
  heads_in: str | None = None
  wide_keys: bool | None = None
  wide_values: bool | None = None
  e4m3_scores: bool | None = None
  e4m3_promote_cols: int = 192
  wide_widening: bool = True
  pages_per_step: int | None = None
  ring_slots: int | None = None
  rescale_slack: float | None = RESCALE_SLACK
  auto_barriers: bool = False

  def __post_init__(self):
    if self.block_h != 64:
      raise ValueError(f"block_h must be 64 (the M of a Hopper wgmma), got {self.block_h}")
    if self.block_n != 64:
      raise ValueError(f"block_n must be 64 (one 128-byte swizzle tile of bf16), got "
                       f"{self.block_n}")
    if self.num_stages != 2:
      raise ValueError(f"num_stages must be 2 (what fits in shared memory beside the query tile), "
                       f"got {self.num_stages}")
    if self.fp8_pipeline is not None and self.fp8_pipeline not in FP8_PIPELINES:
      raise ValueError(f"fp8_pipeline must be None or one of {FP8_PIPELINES}, got "
                       f"{self.fp8_pipeline!r}")
    if self.heads_in is not None and self.heads_in not in HEADS_IN:
      raise ValueError(f"heads_in must be None or one of {HEADS_IN}, got {self.heads_in!r}")
    if self.wide_keys is not None and not isinstance(self.wide_keys, bool):
      raise ValueError(f"wide_keys must be None, True or False, got {self.wide_keys!r}")
    if self.wide_values is not None and not isinstance(self.wide_values, bool):
      raise ValueError(f"wide_values must be None, True or False, got {self.wide_values!r}")
    if self.e4m3_scores is not None and not isinstance(self.e4m3_scores, bool):
      raise ValueError(f"e4m3_scores must be None, True or False, got {self.e4m3_scores!r}")
    if not isinstance(self.wide_widening, bool):
      raise ValueError(f"wide_widening must be True or False, got {self.wide_widening!r}")
    if self.pages_per_step is not None and (type(self.pages_per_step) is not int
                                            or self.pages_per_step not in PAGES_PER_STEP):
      raise ValueError(f"pages_per_step must be None or one of {PAGES_PER_STEP}, got "
                       f"{self.pages_per_step!r}")
    if self.ring_slots is not None and (type(self.ring_slots) is not int
                                        or self.ring_slots not in RING_SLOTS):
      raise ValueError(f"ring_slots must be None or one of {RING_SLOTS}, got "
                       f"{self.ring_slots!r}")
    if self.e4m3_promote_cols not in E4M3_PROMOTE_COLS:
      raise ValueError(f"e4m3_promote_cols must be one of {E4M3_PROMOTE_COLS}, got "
                       f"{self.e4m3_promote_cols!r}")
    check_rescale_slack(self.rescale_slack)
    if not isinstance(self.auto_barriers, bool):
      raise ValueError(f"auto_barriers must be True or False, got {self.auto_barriers!r}")


# e4m3_scores' promotion chunks: multiples of the 64-byte-swizzled slot's 64-column tiles (128:
# DeepGEMM's interval, 4 fp8 wgmma k-instructions of 32; 576: none).
E4M3_PROMOTE_COLS = (64, 128, 192, 576)


PAGES_PER_STEP = (1, 2)
RING_SLOTS = (4, 5)  # register_a's e4m3 ring (`MosaicDecodeConfig`)


# heads_in=None runs "n" up to this many heads: bf16 1.01-1.10x "m" at 16 and 32 heads (sessions
# 12, 13); fp8 at 32 heads (B=128, S=8192, session 14) "register_a" 0.332 ms, "serial" in N 0.665,
# against "m" with "shared_widening" 0.481 and "serial" 0.842.
HEADS_N_DEFAULT_MAX = 32


def default_heads_in(num_heads: int, fp8: bool, fp8_pipeline: str | None) -> str:
  """The heads_in that heads_in=None runs (static shapes only): "n" at N <= HEADS_N_DEFAULT_MAX
  (with an fp8 cache where fp8_pipeline takes it, `HEADS_N_FP8_PIPELINES`, or is None), else
  "m"; an fp8 cache with fp8_pipeline="register_a", which has no "m" form, "n". Timings in
  `MosaicDecodeConfig`."""
  if fp8 and fp8_pipeline == "register_a":
    return "n"
  takes_n = not fp8 or fp8_pipeline is None or fp8_pipeline in HEADS_N_FP8_PIPELINES
  return "n" if num_heads <= HEADS_N_DEFAULT_MAX and takes_n else "m"


def default_fp8_pipeline(heads_in: str, wide_widening: bool) -> str:
  """The fp8_pipeline that fp8_pipeline=None runs: "register_a" with heads in N (H200, session
  13: 1.23-1.27x "shared_widening" at N=16); with heads in M "in_slot" where the widening is
  wide (session 29, B=128 N=128 S=8192, in turn: 0.655 ms against "half_pages"' 0.770, 1.18x;
  "half_pages" was 1.02-1.04x wide "shared_widening" at N=64 and 128 in session 18), else
  "shared_widening" (session 18: 1.07-1.21x "half_pages" with the Pallas-level widening; in_slot
  has no Pallas-level form on the GPU)."""
  if heads_in == "n":
    return "register_a"
  return "in_slot" if wide_widening else "shared_widening"


CONFIG = MosaicDecodeConfig()
# The sweep space: the variants `benchmarks/bench_decode.py --mosaic-configs` times beside CONFIG.
SWEEP = (CONFIG, MosaicDecodeConfig(rescale_slack=None), MosaicDecodeConfig(auto_barriers=True),
         MosaicDecodeConfig(fp8_pipeline="half_pages"),
         MosaicDecodeConfig(fp8_pipeline="half_pages", rescale_slack=None),
         MosaicDecodeConfig(fp8_pipeline="serial"),
         MosaicDecodeConfig(fp8_pipeline="shared_widening"),
         MosaicDecodeConfig(wide_widening=False),
         MosaicDecodeConfig(heads_in="n"), MosaicDecodeConfig(fp8_pipeline="serial", heads_in="n"),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n"),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n", wide_values=False),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n", e4m3_promote_cols=576),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n", e4m3_scores=False),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n", e4m3_scores=False,
                            wide_keys=False),
         MosaicDecodeConfig(fp8_pipeline="register_a", heads_in="n", pages_per_step=1))
# Fields that one cache dtype alone reads (with the other, the program is the same whatever they
# are): a sweep times a config only with the cache dtype whose program it changes.
DTYPE_KNOBS = {"fp8_pipeline": jnp.dtype(F8), "wide_keys": jnp.dtype(F8),
               "wide_values": jnp.dtype(F8), "e4m3_scores": jnp.dtype(F8),
               "e4m3_promote_cols": jnp.dtype(F8), "wide_widening": jnp.dtype(F8),
               "pages_per_step": jnp.dtype(F8), "ring_slots": jnp.dtype(F8),
               "auto_barriers": jnp.dtype(jnp.bfloat16)}
_TILE_H, _STEP, _STAGES = CONFIG.block_h, CONFIG.block_n, CONFIG.num_stages
# fp8 caches: 2 slots of e4m3 bytes (36 KB each) that the memory warpgroup widens into the bf16
# slots the products read ("serial": one of 64 rows; "half_pages": two of 32 rows), so the shared
# memory is the bf16 kernel's.
_FP8_STAGES = 2
_HALF = HALF_ROWS  # rows per bf16 slot and consumer step with fp8_pipeline="half_pages"
_VALUE_WGS = 2  # warpgroups sharing the value columns; warpgroup 0 also computes the scores
# Value columns per P V product in the interpreter's form: each lands in a fresh 64 x 128 float32
# accumulator (64 registers a thread) that is added to the running output (128), which keeps a
# warpgroup within its 232.
_CHUNK = 128
_MAX_WGMMA_N = 256
PAGE_MULTIPLE = _STEP  # pages hold whole steps
MAX_GRID_TOKENS = 65535  # tokens launch on the grid's z axis, at most 65535 programs
# (consumer, memory) warpgroup registers a thread. 2 x consumer + memory must stay within
# common.register_pool(3) (504, not 512: the inferred cause of the fp8 path's hang on the H200
# with (224, 64), RESULTS.md). With an fp8 cache the memory warpgroup widens tiles.
_REGS = {False: (232, 40), True: (224, 56)}
# fp8_pipeline="register_a": e4m3 slots in a ring of 4 (18-36 KB query tile + 4 x 36 KB + P^T fit:
# 166 KB at 16 heads, 188 at 32); its memory warpgroup only issues bulk copies (the bf16 split of
# _REGS).
_REGISTER_A_STAGES = 4
# register_a's pages a consumer step with pages_per_step=None (`MosaicDecodeConfig`: 1.09x one
# page at N=16, 1.15x at N=32, H200 session 24).
_REGISTER_A_PAGES = 2
# The most e4m3 slots (36 KB each at D = 576) that fit in a Hopper block's 227 KB (232,448 bytes)
# beside the query tile (2 x heads x D bytes), P^T [heads, 64 x pages] f16, the cross-warp
# reduction scratch (1 KB per 8 heads) and the rest, by (heads tile, pages_per_step). Mosaic GPU's
# counts (bytes, rings of 4 / 5, B=128 S=8192): 16 heads 172,120 / 209,000, two pages a step
# 174,168 / 211,048; 32 heads 194,648 / 231,528, two pages 198,744 / 235,624 (its lowering refuses
# that: tests/test_decode_backends.py).
_MAX_RING_SLOTS = {(16, 1): 5, (16, 2): 5, (32, 1): 5, (32, 2): 4}
# register_a: a register A operand stays pinned until its wgmma completes (16 registers a thread a
# [64, 64] tile), so a consumer waits for all but this many of its tiles' products after issuing
# each (key tiles; value tiles by heads in the tile, whose O^T accumulators take 64 or 128
# registers), loading the next tile meanwhile. With no wait, 9 key tiles beside the value
# accumulators spilled (benchmarks/RESULTS.md, "register_a without spills"); these leave ptxas
# (13.5) room: one more value tile in flight at 32 heads or 5 more key tiles at 16 still fit.
_KEY_TILES_IN_FLIGHT = 4
_VALUE_TILES_IN_FLIGHT = {16: 4, 32: 2}
# pages_per_step=2 with e4m3_scores: both pages' promotion chunks in one chain (one scope) up to
# this many heads; at 32 heads its 6 [64, 64] f32 accumulators spilled in warpgroup 0's step loop
# (ptxas 13.5: 20 spill stores, 37 loads), so a chain (scope) a page there.
_CHAINED_PAGES_MAX_HEADS = 16
_MAX_HEAD_DIM = 576  # 3 x 64 rows x D bf16 + P must fit in shared memory


def _value_columns(lora: int, register_a: bool) -> tuple[int, int]:
  """Value columns of warpgroups 0 and 1: half each, or with register_a all in warpgroup 1 (O^T
  [512, 16 heads] is 64 registers a thread, 128 at 32), so that warpgroup 0's step is the scores
  and softmax only and warpgroup 1 converts every value tile: SASS instructions a thread a step,
  B=128 N=16, 650 and 658 (973 and 343 with the halves; warpgroup 0's chain paced the kernel)."""
  return (0, lora) if register_a else (lora // _VALUE_WGS,) * _VALUE_WGS


# wide_keys: a [64, 64] e4m3 key tile's row is WIDE_UNITS units of 16 bytes, each unit 8 column
# pairs: fragment registers j = 0..7 of a row.
_WIDE_PAIRS = 8


def wide_key_order(x: jax.Array) -> jax.Array:
  """x [..., D] (D a multiple of 64) with each 64-column tile's columns in the order wide_keys'
  16-byte loads hand the WGMMA A fragment: column 8j + 2q + e of a tile (the fragment's register
  j of lane q = lane % 4, half e) takes the tile's column 16q + 2j + e (byte 2j + e of lane q's
  16-byte unit of the row)."""
  *lead, d = x.shape
  tiles = x.reshape(*lead, d // FP8_COLS, WIDE_UNITS, _WIDE_PAIRS, 2)
  return jnp.swapaxes(tiles, -3, -2).reshape(*lead, d)


def _wide_key_tile(slot, c: int):
  """Key tile c [64 tokens, 64] of an e4m3 slot [64, D] (tiled (8, 64), 64-byte swizzled) as the
  f16 WGMMA-layout A fragment of its columns in `wide_key_order`: each thread loads the 16 bytes
  of its unit (lane % 4) of its two rows (16 warp + lane / 4 and 8 below) with one 16-byte load a
  row and converts them pairwise (cvt e4m3x2 -> f16x2), register j of a row from bytes 2j, 2j + 1.
  Lane-level code (`plgpu.inline_mgpu`): no Pallas layout maps 16 loaded bytes onto those
  registers; the interpreter does not run it."""
  tiles = slot.shape[-1] // FP8_COLS
  tile_bytes = SWIZZLE_TILE_ROWS * FP8_COLS
  layout = plgpu.Layout.WGMMA
  transforms = (plgpu.TilingTransform((SWIZZLE_TILE_ROWS, FP8_COLS)),
                plgpu.SwizzleTransform(FP8_COLS))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),),
                     return_type=plgpu.ShapeDtypeStruct((_STEP, FP8_COLS), jnp.float16,
                                                        layout=layout))
  def load(_, slot):
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c32 = lambda v: arith.constant(i32, v)
    _, lane, warp = warpgroup_thread()
    # Rows 16 warp + lane / 4 and + 8: row lane / 4 of the 8-row tiles 2 warp and 2 warp + 1 (each
    # row of tiles holds `tiles` tiles of 512 bytes); the 64-byte swizzle XORs a row's 16-byte
    # unit with (row % 8) / 2 = lane / 8.
    unit = arith.xori(arith.remui(lane, c32(WIDE_UNITS)), arith.divui(lane, c32(8)))
    offset = arith.addi(
        arith.addi(arith.muli(warp, c32(2 * tiles * tile_bytes)),
                   arith.muli(arith.divui(lane, c32(WIDE_UNITS)), c32(FP8_COLS))),
        arith.addi(arith.muli(unit, c32(16)), c32(c * tile_bytes)))
    base = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(slot), [offset], i8)
    words_type = ir.VectorType.get((4,), i32)
    pair_type = ir.VectorType.get((2,), ir.F16Type.get())
    regs = np.empty((_WIDE_PAIRS, 2), dtype=object)  # [register j, row half]
    for half in range(2):
      words = llvm.load(words_type, mgpu_utils.getelementptr(
          base, [c32(half * tiles * tile_bytes)], i8), alignment=16)
      for w in range(4):
        word = vector.extract(words, [], [w])
        for e, part in enumerate(("lo", "hi")):
          pair = llvm.inline_asm(
              i32, [word], "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
              f"cvt.rn.f16x2.e4m3x2 $0, {part}; }}", "=r,r")
          regs[2 * w + e, half] = mgpu_utils.bitcast(pair, pair_type)
    mgpu_layout = layout.to_mgpu()
    return mgpu_fa.FragmentedArray(
        _registers=regs.reshape(mgpu_layout.registers_shape((_STEP, FP8_COLS))),
        _layout=mgpu_layout, _is_signed=None)

  return load(slot)


def _decode_kernel(q_ref, kv_ref, bt_ref, len_ref, ks_ref, qs_ref, o_ref, lse_ref, buffers, p_smem,
                   row_smem, q_bar, ready, consumed, p_ready, p_free, *staging, scale, lora,
                   num_splits, split_steps, in_place, shared_widening, heads_n, register_a,
                   value_cols, wide_keys, wide_values, e4m3_scores, e4m3_promote_cols,
                   wide_widening, pages, lane_queries, lane_output, in_slot, rescale_slack,
                   lazy_rescale):
  # GMEM: q_ref [T, Np, D] bf16 (Np = heads padded to 64, or fewer than 64 unpadded: the tile's
  # first Np rows, the others never stored); kv_ref [num_blocks, page, D] bf16 or
  # e4m3; bt_ref [T, max_blocks] int32; len_ref [T] int32; ks_ref [1] f32 (the cache's scale, 1
  # for bf16); qs_ref [T] f32 (each token's query scale-back, 1 but with register_a's f16 q:
  # `_f16_queries`; [T, Np], per head, with e4m3_scores); o_ref [T, splits, Np, L]; lse_ref
  # [T, splits, Np] f32. SMEM: buffers = union of
  # (q_smem [64, D], kv_smem [slots, rows, D]) bf16 (2 x 64 rows; with an fp8 cache 1 x 64, or
  # 2 x 32 with fp8_pipeline="half_pages"), live while the steps run, and (o_smem [2, 64, L/2] o
  # dtype, lse_smem [64] f32), live after; p_smem [64, rows] bf16 (this step's P); row_smem [64]
  # f32 (this step's rescale factors, then l). The consumers step `rows` tokens at a time.
  # Barriers: q_bar (query tile landed); ready [slots] (slot holds its step's bf16 rows);
  # consumed [slots] (both value warpgroups done with the slot); p_ready (P and row_smem
  # written); p_free (warpgroup 1 done reading them). fp8 only, staging = (stage [FP8_STAGES, 64,
  # D] e4m3, 64-byte swizzled; staged [FP8_STAGES] barriers: a stage slot's bytes landed), and
  # with shared_widening (warpgroup 1 widens its value columns; ready then takes 2 arrivals) a
  # third: stage_free [FP8_STAGES] barriers (warpgroup 1 done reading a stage slot).
  # heads_n (heads_in="n"): the tile's 16 or 32 heads (q_smem [tile_h, D], p_smem [tile_h, 64],
  # row_smem and lse_smem [tile_h]) are wgmma's N: S^T = K Q^T [64 tokens, heads], its softmax over
  # axis 0 (l as [64, heads] partial sums), P^T stored transposed into p_smem, O^T = V^T P^T in
  # [64 columns, heads] value tiles (V^T an MN-major A operand); bf16 outputs stored transposed
  # into o_smem [2, heads, L/2], float32 partials as they are into o_smem [2, L/2, heads] and o_ref
  # [T, splits, L, Np].
  # register_a (fp8_pipeline="register_a", heads_n): kv_smem is a ring of e4m3 slots
  # [ring_slots, 64, D] (4 or 5, `MosaicDecodeConfig`; 64-byte swizzled) filled by bulk copies as
  # the bf16 slots are; q_smem and p_smem are f16; the consumers convert their e4m3 tiles in
  # registers into wgmma's A operand; warpgroup 1 holds all the value columns (value_cols, o_smem
  # [1, heads, L] or [1, L, heads]). No staging then, except in the interpreter form: a_smem [2,
  # 64, 64] f16, warpgroup w's converted tile (`a_operand`).
  # wide_keys (register_a): q_smem's columns are in `wide_key_order`, and so are the key tiles'
  # fragments (16-byte loads on the GPU, `_wide_key_tile`; permuted after the load here).
  # wide_values (register_a): the O^T tiles' rows are the value columns in `wide_value_order` (V^T's
  # fragments from wide loads on the GPU, `wide_value_tiles`; permuted after the load here);
  # with lane_output (the GPU, a bf16 output) warpgroup 1 stages them in the columns'
  # order (`store_wide_values`), else the caller puts the output's columns back.
  # e4m3_scores (register_a): q_smem [2 x tile_h, D] e4m3 (64-byte swizzled) holds q's exact
  # parts hi and lo, and qs_smem [tile_h] f32 (staged first) each head's scale-back
  # (`e4m3_queries`), both written by warpgroup 0 from q_ref's bf16 row before its first product:
  # with lane_queries (the GPU) in lane-level code straight from GMEM (`split_queries`), else
  # (the interpreter) from qb_smem [tile_h, D] bf16 (staged next, the memory warpgroup's copy of
  # the row, q_bar). S^T = K hi^T + 2^-4 K lo^T from one fp8 wgmma (N = 2 x tile_h) a chunk of
  # e4m3_promote_cols columns from the slot itself, the chunks' accumulators summed in f32
  # (promotion). qs_ref is unused then.
  # wide_widening (the widening pipelines, on the GPU): the e4m3 tiles are widened into the bf16
  # slots in lane-level code (`_wide_widen_rows`) by the memory warpgroup and, with
  # shared_widening, warpgroup 1.
  # pages > 1 (register_a's pages_per_step): consumer step j covers pages pages*j .. pages*j +
  # pages - 1, page p in slot p % slots with its own ready and consumed phase, as with one page a
  # step (`step_slots`): every warpgroup takes pages 0 .. pages * steps - 1 in order (a missing
  # last one included), each once on its slot's barriers, so their phases agree whatever the
  # ring's size (with 5 slots a slot holds either page of a step in turn); p_smem [tile_h, 64 x
  # pages] f16 (P^T's pages side by side, page k's tokens in columns 64k ..).
  # in_slot (fp8_pipeline="in_slot"): bf16's kv_smem [2, 64, D], and buffers has a third member,
  # (a pad the size of q_smem, slot_bytes [2, 128, D] e4m3 tiled (8, 64), 64-byte swizzled): each
  # slot's bytes again, where its page's 8-row bands land (`_IN_SLOT_BANDS`) to be widened in
  # place; staging = (staged [2] barriers: a slot's e4m3 page landed).
  (q_smem, kv_smem), (o_smem, lse_smem), *slot_alias = buffers
  if e4m3_scores:
    qs_smem, *staging = staging
    if not lane_queries:
      qb_smem, *staging = staging
  a_smem, staging = (staging[0] if staging else None, ()) if register_a else (None, staging)
  fp8 = bool(staging)  # the widening pipelines (bf16 slots widened from an e4m3 stage)
  slots, step_rows = kv_smem.shape[:2]
  pieces = _STEP // step_rows  # consumer steps per 64-row bulk copy
  consumer_regs, memory_regs = _REGS[fp8]
  h, split, t = lax.axis_index("heads"), lax.axis_index("splits"), lax.axis_index("tokens")
  wg = lax.axis_index("wg")
  num_blocks, page, _ = kv_ref.shape
  max_blocks = bt_ref.shape[1]
  steps_per_page = page // _STEP
  half = lora // _VALUE_WGS
  tile_h = p_smem.shape[0]  # (q_smem holds two e4m3 parts with e4m3_scores)
  heads_axis = 1 if heads_n else 0
  # Value columns per P V product: all of a warpgroup's when it accumulates in place (wgmma's N is
  # at most 256), else _CHUNK-wide fresh accumulators; with heads in N the columns are O^T's rows,
  # wgmma's M: 64 a product.
  if heads_n:
    width = _TILE_H
  else:
    width = half if in_place and half <= _MAX_WGMMA_N else _CHUNK
  acc_shape = (width, tile_h) if heads_n else (_TILE_H, width)
  if register_a:
    value_tiles_in_flight = (WIDE_VALUE_TILES_IN_FLIGHT if wide_values
                             else _VALUE_TILES_IN_FLIGHT)[tile_h]
  # log2(e) folded in: the softmax runs on exp2. The per-tensor fp8 scale is linear: it scales the
  # logits here and the output at the end instead of every cache value.
  k_scale = ks_ref[0]
  qk_scale = scale * LOG2E * k_scale * (1.0 if e4m3_scores else qs_ref[t])

  length = jnp.minimum(jnp.maximum(len_ref[t], 0), max_blocks * page)
  first, end = split_range(pl.cdiv(length, _STEP), split, num_splits, split_steps)
  # 64-row steps of this program (consumer steps: n * pieces); every warpgroup derives the same
  # count, so their barrier phases agree.
  n = jnp.maximum(end - first, 0)

  def consumer_steps():
    return n * pieces if pages == 1 else pl.cdiv(n, pages)

  def step_slots(i):
    """The kv_smem slots of consumer step i's pages (page p in slot p % slots)."""
    if pages == 1:
      return (lax.rem(i, slots),)
    return tuple(lax.rem(pages * i + k, slots) for k in range(pages))

  def step_source(i):
    """(block, first row in it, rows that count) of step i; a bad table entry counts no rows."""
    step = first + i
    block = bt_ref[t, lax.div(step, steps_per_page)]
    block_ok = (block >= 0) & (block < num_blocks)
    rows = jnp.minimum(jnp.maximum(length - step * _STEP, 0), _STEP)
    return (jnp.where(block_ok, block, 0), lax.rem(step, steps_per_page) * _STEP,
            jnp.where(block_ok, rows, 0))

  def piece_rows(k):
    """Rows that count in consumer step k (its part of 64-row step k // pieces)."""
    rows = step_source(lax.div(k, pieces))[2]
    return jnp.clip(rows - lax.rem(k, pieces) * step_rows, 0, step_rows)

  def page_rows(i):
    """Rows that count in page i, which with pages > 1 may be past the split's last (0: the
    table is not read there, its entry may lie past the table's end)."""
    return jnp.where(i < n, step_source(jnp.minimum(i, n - 1))[2], 0)

  def p_operand(k):
    """P^T [64 tokens, heads] of the step's page k, wgmma's B (heads in N)."""
    if pages == 1:
      return p_smem.transpose((1, 0))
    return p_smem.at[:, pl.ds(k * _STEP, _STEP)].transpose((1, 0))

  def a_operand(tile, w):
    """wgmma's A from warpgroup w's converted [64, 64] f16 tile (WGMMA layout): the registers on
    the GPU; Mosaic GPU's interpreter (jax 0.11.2) takes a shared-memory A only, so there the tile
    goes through a_smem[w] (which checks the loads, views and conversions, not the register
    operand's layout: the CUDA lowering and the -m gpu tests do)."""
    if a_smem is None:
      return tile
    a_smem[w] = tile
    plgpu.commit_smem()  # plain stores read next by wgmma (the async proxy)
    return a_smem.at[w]

  def value_tile(values, w):
    """V^T [64 columns, 64 tokens] f16 of an e4m3 slot's [64 tokens, 64 columns] tile, as wgmma's
    A: an 8-bit transposed relayout does not lower (nor a transposed 8-bit ldmatrix before
    Blackwell), so the transposed view is loaded in WGMMA_TRANSPOSED, converted, then relaid as
    16-bit (tests/test_register_a_probe.py)."""
    x = plgpu.load(values.transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED)
    return a_operand(plgpu.layout_cast(x.astype(jnp.float16), plgpu.Layout.WGMMA), w)

  def zero_acc(w):
    return tuple(plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
                 for _ in range(value_cols[w] // width))

  def accumulate_values(acc, alpha, slots, w, p=None, release=None):
    """acc * alpha + P V over warpgroup w's value columns, `width` columns a product; P from
    registers when given (warpgroup 0's own), else from p_smem. heads_n: O^T += V^T P^T, both
    operands from shared memory (P^T is the B operand). slots: the step's pages' kv_smem slots
    (with pages > 1 each page's products take P^T's matching columns as B, page by page), and
    release(k) is called once page k's slot is read for the last time (its consumed arrival).

    On the GPU each product accumulates in place into the rescaled running sum. Mosaic GPU's
    interpreter (jax 0.11.2) runs wgmma only with shared-memory operands into run_scoped
    accumulators, so there each product goes to a fresh accumulator that is added.
    """
    def tile_operands(c, k=0):
      """wgmma's A and B for the warpgroup's value tile c of the step's page k."""
      page_slot = slots[k]
      values = kv_smem.at[page_slot, :, pl.ds(sum(value_cols[:w]) + c * width, width)]  # [64, w]
      if wide_values:  # the interpreter form: the GPU's fragment, from the plain load
        values = plgpu.load(kv_smem.at[page_slot, :, pl.ds(0, lora)], layout=plgpu.Layout.WGMMA)
        tile = wide_value_order(values.astype(jnp.float16),
                                WIDE_VALUE_GROUP[tile_h])[:, c * width:(c + 1) * width]
        return a_operand(tile.T, w), p_operand(k)
      if register_a:
        return value_tile(values, w), p_operand(k)
      if heads_n:
        return values.transpose((1, 0)), p_operand(k)
      return p_smem if p is None else p, values

    if register_a and in_place:
      # One accumulation for all the tiles, value_tiles_in_flight at once: each tile is loaded and
      # converted while the previous ones' products run (a wait after each serialized them).
      # Pages > 1: page by page, every tile of one before the next's (its A into acc_refs[c]).
      def products(acc_refs):
        tiles = len(acc_refs)

        def page_operands(k):
          """Page k's tiles' A and B, each loaded and converted as it is taken. V^T is a register
          operand: once the page's last tile is loaded, its products (issued or running) read
          registers and P^T only, so with pages > 1 the slot is released there (its refill
          overlaps the page's products and the next page's)."""
          if wide_values:  # a group's fragments from one pass of loads, issued as they come
            group = WIDE_VALUE_GROUP[tile_h]
            for c in range(0, tiles, group):
              loaded = wide_value_tiles(kv_smem.at[slots[k]], c, group)
              if release is not None and c + group >= tiles:
                release(k)
              yield from ((a, p_operand(k)) for a in loaded)
          else:
            for c in range(tiles):
              operands = tile_operands(c, k)
              if release is not None and c == tiles - 1:
                release(k)
              yield operands

        for c, ab in enumerate(ab for k in range(pages) for ab in page_operands(k)):
          plgpu.wgmma(acc_refs[c % tiles], *ab)
          if c >= value_tiles_in_flight:
            plgpu.wgmma_wait(value_tiles_in_flight)

      return tuple(pl.run_state(products)(tuple(
          plgpu.ACC.init(part * lax.broadcast_in_dim(alpha, part.shape, [heads_axis]))
          for part in acc)))
    if pages > 1:  # (the interpreter's form) page by page, each slot released after its page
      def page_product(operands, acc_ref):  # acc_ref: acc_shape f32
        plgpu.wgmma(acc_ref, *operands)
        return acc_ref[...]

      out = [part * lax.broadcast_in_dim(alpha, part.shape, [heads_axis]) for part in acc]
      for k in range(pages):
        for c in range(len(out)):  # tile c's operands after tile c - 1's product: a_smem holds one
          out[c] = out[c] + pl.run_scoped(functools.partial(page_product, tile_operands(c, k)),
                                          plgpu.ACC(acc_shape, jnp.float32))
        release(k)
      return tuple(out)
    out = []
    # rescale_slack on the GPU: one warp-uniform skip for all the tiles (`rows_rescaled`).
    rescaled = rows_rescaled(acc, alpha, skip_ones=True) if lazy_rescale else None
    for c, part in enumerate(acc):
      operands = tile_operands(c)
      scaled = (rescaled[c] if rescaled is not None
                else part * lax.broadcast_in_dim(alpha, part.shape, [heads_axis]))
      if in_place:
        def product(acc_ref, operands=operands):  # acc_ref: acc_shape f32, the running sum
          plgpu.wgmma(acc_ref, *operands)

        out.append(pl.run_state(product)(plgpu.ACC.init(scaled)))
      else:
        def product(acc_ref, operands=operands):  # acc_ref: acc_shape f32
          plgpu.wgmma(acc_ref, *operands)
          return acc_ref[...]

        out.append(scaled + pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32)))
    return tuple(out)

  def zero_rows(slot, rows):
    """Zeroes the slot's rows from `rows` on: rows past the length or behind a bad table entry may
    hold NaN, and P = 0 there would still give 0 * NaN = NaN in P V. register_a's e4m3 slot: Mosaic
    GPU (jax 0.11.2) selects no 8-bit values, so its bytes are ANDed with 0 or 0xff (a bitwise
    operation it takes)."""
    row_ids = plgpu.broadcasted_iota(jnp.int32, (_STEP, 64), 0, layout=plgpu.Layout.WGMMA)
    if register_a:
      byte_mask = jnp.where(row_ids < rows, -1, 0).astype(jnp.int8)
    for c in range(kv_smem.shape[-1] // 64):
      cols = kv_smem.at[slot, :, pl.ds(c * 64, 64)]  # [64 rows, 64]
      if register_a:
        x = plgpu.load(cols, layout=plgpu.Layout.WGMMA)
        cols[...] = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int8) & byte_mask, F8)
      else:
        cols[...] = jnp.where(row_ids < rows, cols[...], 0)
    plgpu.commit_smem()  # these plain stores are read next by wgmma (the async proxy)

  # Fewer than 64 heads come unpadded: the tile's first rows are theirs, the others hold whatever
  # shared memory held (every product and reduction is per row, so it reaches no stored row).
  rows_out = pl.ds(h * tile_h, min(tile_h, q_ref.shape[1]))
  cols_first = heads_n and o_ref.dtype == jnp.float32  # o_ref [T, splits, L, Np]

  def out(w):
    """Warpgroup w's output columns (none: no keywords) and their staging (o_smem holds one
    buffer a warpgroup that has columns); k_scale (the fp8 cache's, else 1) scales them once at
    the end."""
    if not value_cols[w]:
      return {}
    cols = pl.ds(sum(value_cols[:w]), value_cols[w])
    return dict(o_smem=o_smem.at[sum(map(bool, value_cols[:w]))], out_scale=k_scale,
                o_gmem=o_ref.at[t, split, cols, rows_out] if cols_first
                else o_ref.at[t, split, rows_out, cols])

  @pl.when(wg == 0)
  def _scores():
    plgpu.set_max_registers(consumer_regs, action="increase")

    @pl.when(n > 0)
    def _():
      if e4m3_scores and lane_queries:
        split_queries(q_ref.at[t], q_smem, qs_smem)
      else:
        plgpu.barrier_wait(q_bar)
      if e4m3_scores:
        if not lane_queries:
          parts, scales = e4m3_queries(qb_smem[...][None])
          q_smem[...] = parts[0]
          qs_smem[...] = scales[0]
        plgpu.commit_smem()  # also a warpgroup barrier: every thread's rows are written

    if e4m3_scores:  # the heads' score scales (read, unused, when there is no step)
      head_scales = plgpu.load(qs_smem, layout=plgpu.Layout.WGMMA.reduce(0)) * qk_scale
    # bf16, heads in M: the wait for P's buffer (warpgroup 1 done with the previous P) while S's
    # products run, not on the chain from S to P V (H100, session 34: ~100 clocks of a ~3,350
    # clock step, 1.012-1.013x in turn; the fp8 and heads-in-N paths, not timed, keep it in the
    # hand-off).
    free_early = not (fp8 or heads_n or register_a)

    def step(i, carry):
      m, l, acc = carry
      page_slots = step_slots(i)
      # Each page's rows that count (an odd page count's last step: its second page none).
      rows = ((piece_rows(i),) if pages == 1
              else tuple(page_rows(pages * i + k) for k in range(pages)))

      def landed(k):
        """Waits for the step's page k. Only the last page of a row (and a bad table entry) has
        rows that do not count; an fp8 tile is masked as it is widened (register_a's e4m3 slot
        here, as a bf16 one)."""
        plgpu.barrier_wait(ready.at[page_slots[k]])
        if not fp8:
          pl.when(rows[k] < _STEP)(functools.partial(zero_rows, page_slots[k], rows[k]))

      # the step's later pages just before their first products (their copies' slack)
      in_phase("wg0_page_wait", landed, 0)

      def e4m3_scores_(chained, *acc_refs):
        """[64 tokens, 2 x heads] f32 a page of the step's pages `chained`: K hi^T, then K lo^T.
        Promotion: each chunk of e4m3_promote_cols columns into its own fresh accumulator
        (Hopper's fp8 wgmma keeps ~14 bits as it accumulates), summed in f32 registers; chunk
        c + 1's wgmma is issued before chunk c's is waited for and read (over several pages one
        chain: a page's first chunk before the previous page's last is read)."""
        chunks = len(acc_refs) // len(chained)
        totals, total = [], None
        for c, acc_ref in enumerate(acc_refs):
          first = c % chunks * e4m3_promote_cols
          cols = pl.ds(first, min(e4m3_promote_cols, kv_smem.shape[-1] - first))
          k = chained[c // chunks]
          if k and not first:
            landed(k)
          plgpu.wgmma(acc_ref, kv_smem.at[page_slots[k], :, cols],
                      q_smem.at[:, cols].transpose((1, 0)))
          if c:  # chunk c - 1: done once at most this chunk's product is in flight
            part = plgpu.wgmma_accumulator_load(acc_refs[c - 1], wait_n=1)
            total = part if total is None else total + part
            if c % chunks == 0:  # the previous page's last chunk
              totals.append(total)
              total = None
        totals.append(acc_refs[-1][...] if total is None else total + acc_refs[-1][...])
        return totals

      def scores(slot, acc_ref):  # acc_ref [64 heads, step_rows] f32 (heads in N: S^T [64, heads])
        if register_a:  # K's e4m3 [64 tokens, 64] tiles converted in registers (WGMMA layout)
          for c in range(kv_smem.shape[-1] // FP8_COLS):
            cols = pl.ds(c * FP8_COLS, FP8_COLS)
            if wide_keys and a_smem is None:
              k = _wide_key_tile(kv_smem.at[slot], c)
            else:
              k = plgpu.load(kv_smem.at[slot, :, cols],
                             layout=plgpu.Layout.WGMMA).astype(jnp.float16)
              if wide_keys:  # the interpreter form: the GPU's fragment, from the plain load
                k = wide_key_order(k)
            plgpu.wgmma(acc_ref, a_operand(k, 0), q_smem.at[:, cols].transpose((1, 0)))
            if c >= _KEY_TILES_IN_FLIGHT:  # frees tile c - _KEY_TILES_IN_FLIGHT's registers
              plgpu.wgmma_wait(_KEY_TILES_IN_FLIGHT)
        elif heads_n:
          plgpu.wgmma(acc_ref, kv_smem.at[slot], q_smem.transpose((1, 0)))
        else:
          plgpu.wgmma(acc_ref, step_variant(q_smem, i), kv_smem.at[slot].transpose((1, 0)))
          if free_early:
            pl.when(i > 0)(functools.partial(plgpu.barrier_wait, p_free))
        return acc_ref[...]

      s_shape = (step_rows, tile_h) if heads_n else (_TILE_H, step_rows)
      if e4m3_scores:  # one scope for all the chunks of a chain (`MosaicDecodeConfig`)
        chains = ((tuple(range(pages)),) if tile_h <= _CHAINED_PAGES_MAX_HEADS
                  else tuple((k,) for k in range(pages)))
        s = []
        for chained in chains:
          both = in_phase("wg0_scores", pl.run_scoped, functools.partial(e4m3_scores_, chained), *[
              plgpu.ACC((_STEP, 2 * tile_h), jnp.float32)
              for _ in range(len(chained) * pl.cdiv(kv_smem.shape[-1], e4m3_promote_cols))])
          s += [x[:, :tile_h] + x[:, tile_h:] * E4M3_LO_SCALE for x in both]
      else:
        s = []
        for k, page_slot in enumerate(page_slots):
          if k:
            landed(k)
          s.append(in_phase("wg0_scores", pl.run_scoped, functools.partial(scores, page_slot),
                            plgpu.ACC(s_shape, jnp.float32)))
      if pages > 1:  # warpgroup 0 reads no slot after S^T (warpgroup 1 releases them later)
        for page_slot in page_slots:
          plgpu.barrier_arrive(consumed.at[page_slot])
      # The scores stay unscaled: the softmax scales them inside exp2's argument (`softmax_step`'s
      # scale, one row scale a head; positive: the softmax scale, checked, and the fp8 cache's and
      # queries' scales, positive by their contracts).
      row_scale = head_scales if e4m3_scores else qk_scale
      mask = functools.partial(_mask_keys, keys_axis=1 - heads_axis)
      s = [lax.cond(page_rows_ < s_shape[1 - heads_axis], mask, lambda x, _: x, x, page_rows_)
           for x, page_rows_ in zip(s, rows)]
      if pages == 1:
        m_new, alpha, p, l = in_phase("wg0_softmax", softmax_step, s[0], m, l, heads_axis,
                                      None if heads_n else rescale_slack, scale=row_scale)
        p16 = in_phase("wg0_hand_off", hand_over_p, i, p, alpha,
                       p_smem.transpose((1, 0)) if heads_n else p_smem, row_smem, p_ready,
                       None if free_early else p_free)
      else:  # one cross-warp row max and one hand-off for all the pages (acc is empty here)
        m_new, alpha, p, l = _softmax_pages(s, m, l, row_scale)
        _hand_over_pages(i, p, alpha, p_smem, row_smem, p_ready, p_free)
      if acc:
        acc = in_phase("wg0_values", accumulate_values, acc, alpha, page_slots, 0,
                       p16 if in_place and not heads_n else None)
      if pages == 1:
        plgpu.barrier_arrive(consumed.at[page_slots[0]])
      return m_new, l, acc

    run_scores(consumer_steps(), step, zero_acc(0), row_smem=row_smem, p_ready=p_ready,
               p_free=p_free, **out(0), lse_smem=lse_smem, lse_gmem=lse_ref.at[t, split, rows_out],
               heads_axis=heads_axis, partial_sums=(step_rows, tile_h) if heads_n else None)

  # Column tiles of the stage each widening warpgroup takes (shared_widening: warpgroup 1 its own
  # value columns, the memory warpgroup the rest; otherwise the memory warpgroup all).
  all_tiles = range(kv_smem.shape[-1] // FP8_COLS)
  value_tiles = range(half // FP8_COLS, lora // FP8_COLS) if shared_widening else range(0)
  memory_tiles = [c for c in all_tiles if c not in value_tiles]

  @pl.when(wg == 1)
  def _values():
    plgpu.set_max_registers(consumer_regs, action="increase")
    widen_own = None
    if shared_widening:
      stage, staged, stage_free = staging

      def widen_own(k):
        """Widens value_tiles of consumer step k (half `part` of 64-row step k // 2; with heads in
        N, 64-row step k into the one slot) into its slot and arrives on ready (the memory
        warpgroup's tiles are the other arrival)."""
        if step_rows == _STEP:
          s = lax.rem(k, _FP8_STAGES)
          plgpu.barrier_wait(staged.at[s])
          if wide_widening:
            _wide_widen_rows(stage.at[s], kv_smem.at[0], 0, step_source(k)[2], value_tiles)
          else:
            keep = plgpu.broadcasted_iota(jnp.int32, (_STEP,), 0,
                                          layout=plgpu.Layout.WGMMA.reduce(1)) < step_source(k)[2]
            _widen_page(stage, kv_smem, s, keep, value_tiles)
          plgpu.commit_smem()  # also a warpgroup barrier: every thread's reads are done
          plgpu.barrier_arrive(stage_free.at[s])
          plgpu.barrier_arrive(ready.at[0])
          return
        i, part = lax.div(k, slots), lax.rem(k, slots)
        s = lax.rem(i, _FP8_STAGES)
        # A stage slot's first half: its bytes must have landed.
        pl.when(part == 0)(functools.partial(plgpu.barrier_wait, staged.at[s]))
        if wide_widening:
          _wide_widen_rows(stage.at[s], kv_smem.at[part], part * _HALF,
                           step_source(i)[2] - part * _HALF, value_tiles)
        else:
          _widen_half(stage, kv_smem, s, part, step_source(i)[2], value_tiles)
        plgpu.commit_smem()  # also a warpgroup barrier: every thread's reads are done
        pl.when(part == slots - 1)(functools.partial(plgpu.barrier_arrive, stage_free.at[s]))
        plgpu.barrier_arrive(ready.at[part])

    # run_values' slot: with pages > 1 the step's slots, and their consumed arrivals (release).
    accumulate = lambda acc, alpha, slot, release=None: accumulate_values(
        acc, alpha, (slot,) if pages == 1 else slot, 1, release=release)
    store = (functools.partial(store_wide_values, o_rows=o_smem.at[0])
             if lane_output else None)
    run_values(consumer_steps(), slots, accumulate, zero_acc(1), ready=ready, consumed=consumed,
               row_smem=row_smem, p_ready=p_ready, p_free=p_free, **out(1), widen=widen_own,
               heads_axis=heads_axis, pages=pages, store=store)

  @pl.when(wg == _VALUE_WGS)
  def _memory():
    plgpu.set_max_registers(memory_regs, action="decrease")

    @pl.when(n > 0)
    def _():
      if not e4m3_scores:
        q_rows = q_ref.at[t, rows_out]
        plgpu.copy_gmem_to_smem(q_rows, leading_rows(q_smem, q_rows), q_bar)
      elif not lane_queries:  # e4m3_scores: heads in N, the whole row
        plgpu.copy_gmem_to_smem(q_ref.at[t], qb_smem, q_bar)

    if in_slot:
      _in_slot_loop(n, step_source, kv_ref, kv_smem, slot_alias[0][1], ready, consumed,
                    wide_widening, *staging)
      return
    if fp8:
      _widening_loop(n, step_source, kv_ref, kv_smem, ready, consumed, memory_tiles,
                     wide_widening, *staging)
      return

    def fetch(i, slot):
      block, offset, _ = step_source(i)
      plgpu.copy_gmem_to_smem(kv_ref.at[block, pl.ds(offset, _STEP)], kv_smem.at[slot],
                              ready.at[slot])

    def fetch_page(i, slot):
      """Page i of the consumer steps' pages; one past the split's last (an odd count's last
      step's second) is only an arrival: warpgroup 0 zeroes its slot."""
      pl.when(i < n)(functools.partial(fetch, i, slot))
      pl.when(i >= n)(functools.partial(plgpu.barrier_arrive, ready.at[slot]))

    if pages == 1:
      feed_ring(n, slots, consumed, fetch)
    else:  # a page at a time, each slot refilled once its page's consumers release it
      feed_ring(pages * consumer_steps(), slots, consumed, fetch_page)


# wide_widening: 16-byte units of e4m3 tiles a lane loads before widening them (8 registers;
# ptxas, N=128 shared_widening: 2 spills fewer in the step loops than 4 at once, the same with 1).
_WIDE_LOAD_GROUP = 2


def _mask_keys(s, rows, *, keys_axis):
  """s (a page's scores: S [64 heads, keys] or S^T [keys, heads], keys along keys_axis) with the
  keys from `rows` on -inf. A select, not a multiply: no tail key's score reaches P. Only a row's
  last page has keys that do not count, so the kernel masks under a branch (FlashMLA masks only
  its last blocks): on a full page the select was 48 instructions a thread on warpgroup 0's path
  from S to P. The iota is made here, not carried: 64 x 64 int32 is 32 registers a thread."""
  keys = plgpu.broadcasted_iota(jnp.int32, s.shape, keys_axis, layout=plgpu.Layout.WGMMA)
  return jnp.where(keys < rows, s, -jnp.inf)


def _softmax_pages(s, m, l, scale):
  """`common.softmax_step` with heads in N (heads_axis=1) and l as [64, heads] partial sums, over
  a step of several pages' S^T tiles s [64 tokens, heads] each (unscaled: `softmax_step`'s
  scale): their elementwise max in registers, then one cross-warp row max for all of them; every
  page's P adds to l."""
  along = lambda x: x if jnp.ndim(x) == 0 else lax.broadcast_in_dim(x, s[0].shape, [1])
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, s).max(axis=0) * scale)
  alpha = jnp.exp2(m - m_new)
  p = [jnp.exp2(x * along(scale) - along(m_new)) for x in s]
  return m_new, alpha, p, functools.reduce(
      jnp.add, p, l * lax.broadcast_in_dim(alpha, l.shape, [1]))


def _hand_over_pages(i, p, alpha, p_smem, row_smem, p_ready, p_free):
  """`common.hand_over_p` of a step's pages' P^T tiles p [64 tokens, heads] each, stored
  transposed side by side into p_smem [heads, 64 x pages] (page k in columns 64k ..): one wait,
  fence and arrival for all of them."""
  @pl.when(i > 0)
  def _():
    plgpu.barrier_wait(p_free)

  for k, x in enumerate(p):
    p_smem.at[:, pl.ds(k * _STEP, _STEP)].transpose((1, 0))[...] = x.astype(p_smem.dtype)
  row_smem[...] = alpha
  plgpu.commit_smem()
  plgpu.barrier_arrive(p_ready)


def _wide_widen_rows(stage_slot, dst, first, valid, tiles, in_slot=False):
  """wide_widening's lane-level form of `_widen_half` / `_widen_page`: the given 64-column tiles
  of stage rows first ... first + R - 1 (stage_slot [64, D] e4m3, tiled (8, 64), 64-byte
  swizzled; first a multiple of 32) into dst [R, D] bf16 (R = 32: tiled (8, 32), 64-byte
  swizzled; R = 64: tiled (8, 64), 128-byte swizzled), exactly; dst rows from valid on (scalars,
  traced) become +0 (they may hold NaN bytes). in_slot ("in_slot", R = 64, first 0): stage_slot
  is dst's own bytes as [128, D] e4m3, row band b of the page (rows 8b ..) in its band
  `_IN_SLOT_BANDS[b]`: a warp's stores overwrite only bytes its own lanes loaded before (rows
  32-63's, each group's stores after a warp barrier), so no warp waits for another.
  Lane (warp w, lane l) takes rows 8w + l % 8 (+ 32)
  and the e4m3 tile's 16-byte unit u = l / 8: per tile one 16-byte load, 8 x (prmt, shl, and,
  mul.bf16x2) by bit placement (`mosaic_lanes.placed_bf16x2`, the scale 1: bf16(2^120); the AND's
  mask is 0 on rows past valid, so their bytes never count) and two 16-byte stores. The 8 lanes of
  a quarter warp (one 16-byte shared access at a time) take the 8 rows of a swizzle period and one
  unit: 8 distinct 16-byte bank groups in the stage and in dst under either swizzle."""
  rows, d = dst.shape
  sw = 2 * rows  # bytes of a bf16 tile row: 64 for 32 rows, 128 for 64
  stage_rows = 2 * _STEP if in_slot else _STEP
  if stage_slot.shape != (stage_rows, d) or rows not in ((_STEP,) if in_slot else (_HALF, _STEP)):
    raise ValueError(f"want stage [{stage_rows}, D], dst [{'64' if in_slot else '32 or 64'}, D]; "
                     f"got {stage_slot.shape}, {dst.shape}")
  # The stage row band of (warp w, half m): w + 4m, or in the slot 2w + m + 8 (`_IN_SLOT_BANDS`).
  band_of_warp, band_of_half, first_band = (2, 1, _STEP // 8) if in_slot else (1, 4, 0)
  stage_t = (plgpu.TilingTransform((8, FP8_COLS)), plgpu.SwizzleTransform(FP8_COLS))
  dst_t = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
  scalar = plgpu.Layout.WG_SPLAT(())

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(stage_t), plgpu.RefType(dst_t), scalar, scalar))
  def run(_, stage_slot, dst, first, valid):
    i32 = ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32, v)
    first, valid = first.registers.item(), valid.registers.item()
    _, lane, warp = warpgroup_thread()
    l = arith.remui(lane, c32(SWIZZLE_TILE_ROWS))  # the row in its 8-row tile
    u = arith.divui(lane, c32(SWIZZLE_TILE_ROWS))  # the e4m3 tile's 16-byte unit
    # e4m3 row r's unit u of tile c at (r / 8) 8D + 512 c + 64 (r % 8) + 16 (u ^ (r % 8) / 2)
    band = arith.addi(c32(first_band), arith.muli(warp, c32(band_of_warp)))
    src = arith.addi(
        arith.muli(arith.addi(first, arith.muli(band, c32(SWIZZLE_TILE_ROWS))), c32(d)),
        arith.addi(arith.muli(l, c32(FP8_COLS)),
                   arith.muli(arith.xori(u, arith.divui(l, c32(2))), c32(16))))
    # Its 16 bf16 values, in two 16-byte units h of tile c's 128 bytes (64-byte swizzle: tiles
    # 2c + u / 2 of 32 columns), row at (r / 8) 16D + 1024 c + sw (r % 8), unit w ^ the swizzle's
    # row bits (r % 8 with 128 bytes, (r % 8) / 2 with 64): w = 2u + h, or 2 (u % 2) + h.
    dst_lane = arith.addi(arith.muli(warp, c32(SWIZZLE_TILE_ROWS * 2 * d)),
                          arith.muli(l, c32(sw)))
    if sw == 2 * FP8_COLS:
      w, period = arith.muli(u, c32(2)), l
    else:
      dst_lane = arith.addi(dst_lane, arith.muli(arith.divui(u, c32(2)),
                                                 c32(SWIZZLE_TILE_ROWS * sw)))
      w, period = arith.muli(arith.remui(u, c32(2)), c32(2)), arith.divui(l, c32(2))
    dst_unit = [arith.addi(dst_lane, arith.muli(arith.xori(arith.addi(w, c32(h)), period),
                                                c32(16))) for h in range(2)]
    factor = c32(WIDE_UNIT_FACTOR)
    tile_bytes = SWIZZLE_TILE_ROWS * 2 * FP8_COLS  # a column tile's 8 rows, e4m3 or bf16
    for m in range(rows // _HALF):  # rows 32 apart: 4 row tiles further in both
      row = arith.addi(arith.addi(arith.muli(warp, c32(SWIZZLE_TILE_ROWS)), l), c32(m * _HALF))
      mask = arith.select(arith.cmpi(arith.CmpIPredicate.slt, row, valid), c32(WIDE_MASK), c32(0))
      convert = lambda word, p, mask=mask: placed_bf16x2(word, p, factor, mask)
      src_off, dst_off = m * band_of_half * SWIZZLE_TILE_ROWS * d, m * _HALF * 2 * d
      # The loads of a group first: the compilers cannot move a load above a store to the same
      # shared memory, which would expose each load's latency.
      for g in range(0, len(tiles), _WIDE_LOAD_GROUP):
        group = tiles[g:g + _WIDE_LOAD_GROUP]
        loaded = [wide_load(stage_slot, src, src_off + c * tile_bytes // 2) for c in group]
        if in_slot and m:  # the stores overwrite what this warp's lanes loaded before them
          mgpu_utils.warp_barrier()
        for c, words in zip(group, loaded):
          wide_store(dst, words, convert,
                     [(dst_unit[h], dst_off + c * tile_bytes) for h in range(2)])

  run(stage_slot, dst, jnp.asarray(first, jnp.int32), jnp.asarray(valid, jnp.int32))


def _widen_half(stage, kv_smem, s, part, rows, tiles):
  """Widens the given 64-column tiles of rows part * 32 ... + 31 of stage slot s (e4m3, exactly:
  every e4m3 value is a bf16 one) into bf16 slot `part`; rows from `rows` on (counted from the
  page step's first row) become 0 (they may hold NaN bytes)."""
  # The WGMMA layout takes 64 rows: each [32, 64] tile is loaded in HALF_ROWS_LAYOUT.
  keep = plgpu.broadcasted_iota(jnp.int32, (_HALF, FP8_COLS), 0,
                                layout=HALF_ROWS_LAYOUT) < rows - part * _HALF
  for c in tiles:
    cols = pl.ds(c * FP8_COLS, FP8_COLS)
    x = plgpu.load(stage.at[s, pl.ds(part * _HALF, _HALF), cols], layout=HALF_ROWS_LAYOUT)
    # e4m3 -> f16 (one instruction per pair) -> f32 -> bf16, all exact
    x = jnp.where(keep, x.astype(jnp.float16).astype(jnp.float32), 0.0)
    kv_smem[part, :, cols] = x.astype(kv_smem.dtype)


def _widen_page(stage, kv_smem, s, keep, tiles):
  """Widens the given 64-column tiles of stage slot s's 64 rows (e4m3, exactly: every e4m3 value
  is a bf16 one) into the one bf16 slot; rows where keep [64] is False become 0 (they may hold NaN
  bytes)."""
  for c in tiles:
    # [64 rows, 64] e4m3 -> f16 (one instruction per pair) -> f32 -> bf16, all exact
    x = stage[s, :, pl.ds(c * FP8_COLS, FP8_COLS)].astype(jnp.float16).astype(jnp.float32)
    x = plgpu.layout_cast(x, plgpu.Layout.WGMMA)
    x = jnp.where(row_broadcast(keep, x.shape), x, 0.0)
    kv_smem[0, :, pl.ds(c * FP8_COLS, FP8_COLS)] = x.astype(kv_smem.dtype)


def _widening_loop(n, step_source, kv_ref, kv_smem, ready, consumed, tiles, wide, stage, staged,
                   stage_free=None):
  """The memory warpgroup's loop for an fp8 cache: e4m3 page tiles are fetched 2 steps ahead into
  the stage ring, and each is widened (exactly: every e4m3 value is a bf16 one) into the bf16
  slots, a slot once both value warpgroups are done with its previous rows: the tile's 64 rows
  into the one slot ("serial"), or rows 0-31 into slot 0, then rows 32-63 into slot 1
  ("half_pages": the consumers already compute on slot 0 while slot 1 is widened). Only the
  column tiles `tiles` (all, unless warpgroup 1 widens the others: then a stage slot is refilled
  once it also arrives on stage_free). Rows that do not count become 0 as they are widened (they
  may hold NaN bytes). wide: in lane-level code (`_wide_widen_rows`)."""
  slots, step_rows = kv_smem.shape[:2]

  def fetch(i, s):
    block, offset, _ = step_source(i)
    plgpu.copy_gmem_to_smem(kv_ref.at[block, pl.ds(offset, _STEP)], stage.at[s], staged.at[s])

  for i in range(_FP8_STAGES):
    pl.when(i < n)(functools.partial(fetch, i, i))
  # Whole pages' row ids, made once ("serial" only: an unused annotated iota leaves Mosaic GPU's
  # layout inference (jax 0.11.2) searching until it gives up).
  row_ids = (plgpu.broadcasted_iota(jnp.int32, (_STEP,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
             if step_rows == _STEP and not wide else None)

  def refill(i, s):
    if stage_free is not None:
      plgpu.barrier_wait(stage_free.at[s])
    fetch(i, s)

  @pl.loop(0, n)
  def _(i):
    s = lax.rem(i, _FP8_STAGES)
    _, _, rows = step_source(i)
    plgpu.barrier_wait(staged.at[s])
    # Slot `part` took consumer step i * slots + part - slots before: wait until it is free.
    for part in range(slots):
      pl.when(i > 0)(functools.partial(plgpu.barrier_wait, consumed.at[part]))
      if wide:
        _wide_widen_rows(stage.at[s], kv_smem.at[part], part * step_rows,
                         rows - part * step_rows, tiles)
      elif step_rows == _STEP:
        _widen_page(stage, kv_smem, s, row_ids < rows, tiles)
      else:
        _widen_half(stage, kv_smem, s, part, rows, tiles)
      # Also a warpgroup barrier: every thread's reads of stage slot s are done before its refill.
      plgpu.commit_smem()
      plgpu.barrier_arrive(ready.at[part])
    pl.when(i + _FP8_STAGES < n)(functools.partial(refill, i + _FP8_STAGES, s))

  for part in range(slots):  # the last use of each slot
    pl.when(n > 0)(functools.partial(plgpu.barrier_wait, consumed.at[part]))
  if stage_free is not None:  # and of each stage slot (every phase is waited on)
    @pl.loop(jnp.maximum(n - _FP8_STAGES, 0), n)
    def _(i):
      plgpu.barrier_wait(stage_free.at[lax.rem(i, _FP8_STAGES)])


# "in_slot": where each 8-row band of a page lands in its slot's bytes, as bands of 8 e4m3 rows
# (4.5 KB; a slot is 16 of them, a bf16 band 2). Page band b widens into the slot's bands 2b and
# 2b + 1, by warp b % 4 (`_wide_widen_rows`), rows 0-31 first. Page bands 0-3 land in bands 8, 10,
# 12, 14 and 4-7 in 9, 11, 13, 15: the first half's stores (bands 0-7) overwrite nothing staged,
# and warp w's second-half stores (bands 8 + 2w, 9 + 2w) only the bands warp w itself read.
_IN_SLOT_BANDS = (8, 10, 12, 14, 9, 11, 13, 15)


def _in_slot_loop(n, step_source, kv_ref, kv_smem, slot_bytes, ready, consumed, wide, staged):
  """The memory warpgroup's loop with fp8_pipeline="in_slot": page i's e4m3 bands land in slot
  i % 2's own bytes (slot_bytes [2, 128, D] e4m3, `_IN_SLOT_BANDS`; 8 bulk copies on staged), and
  are widened there into the bf16 rows the consumers read (kv_smem [2, 64, D]; rows past the
  page's length +0). Page i + 1 is fetched into the other slot once both consumers are done with
  page i - 1 there, after page i is widened. wide: lane-level (`_wide_widen_rows`), else (the
  interpreter, which aliases no union members) the Pallas-level widening of `_widen_page`."""
  slots = kv_smem.shape[0]

  def fetch(i, s):
    block, offset, _ = step_source(i)
    for b, band in enumerate(_IN_SLOT_BANDS):
      plgpu.copy_gmem_to_smem(kv_ref.at[block, pl.ds(offset + b * SWIZZLE_TILE_ROWS,
                                                     SWIZZLE_TILE_ROWS)],
                              slot_bytes.at[s, pl.ds(band * SWIZZLE_TILE_ROWS, SWIZZLE_TILE_ROWS)],
                              staged.at[s])

  def widen(s, valid):
    if wide:
      _wide_widen_rows(slot_bytes.at[s], kv_smem.at[s], 0, valid, range(kv_smem.shape[-1] //
                                                                        FP8_COLS), in_slot=True)
      return
    page = jnp.concatenate([slot_bytes[s, pl.ds(band * SWIZZLE_TILE_ROWS, SWIZZLE_TILE_ROWS)]
                            for band in _IN_SLOT_BANDS])  # [64, D] e4m3
    # e4m3 -> f16 -> f32 -> bf16, all exact; rows past the length +0 (they may hold NaN bytes)
    x = page.astype(jnp.float16).astype(jnp.float32)
    keep = lax.broadcasted_iota(jnp.int32, x.shape, 0) < valid
    kv_smem[s] = jnp.where(keep, x, 0.0).astype(kv_smem.dtype)

  for i in range(slots):
    pl.when(i < n)(functools.partial(fetch, i, i))

  @pl.loop(0, n)
  def _(i):
    s = lax.rem(i, slots)
    plgpu.barrier_wait(staged.at[s])
    widen(s, step_source(i)[2])
    plgpu.commit_smem()  # the widened rows, visible to wgmma (and a warpgroup barrier)
    plgpu.barrier_arrive(ready.at[s])

    @pl.when((i >= 1) & (i + 1 < n))
    def _():
      other = lax.rem(i + 1, slots)
      plgpu.barrier_wait(consumed.at[other])  # page i - 1's consumers are done there
      fetch(i + 1, other)

  @pl.loop(jnp.maximum(n - slots, 0), n)  # the last use of each slot (every phase is waited on)
  def _(i):
    plgpu.barrier_wait(consumed.at[lax.rem(i, slots)])


def num_kv_splits_for(num_tokens: int, num_heads: int, max_len: int) -> int:
  """The split count `latent_decode` picks when num_kv_splits is None: as many as one wave of one
  program a SM holds (`one_wave_splits`; shared memory holds one program a SM), within vLLM's
  length cap. H200, bf16, page 64, ms by split count (benchmarks/RESULTS.md, "Latent decode
  (pallas_mosaic)", sessions 11-12; * this rule's pick): B=128 S=8192 N=16 4 / 2 / 1*: 0.329 /
  0.315 / 0.307; N=128 2 / 1*: 0.588 / 0.572 (S=4096 0.329 / 0.295; fp8 cache 0.997 / 0.955 and
  0.538 / 0.489); B=64 N=128 4 / 2 / 1*: 0.320 / 0.298 (0.303) / 0.286; B=32 N=16 16 / 8 / 4*:
  0.119 / 0.109 (0.107) / 0.096. Its one loss: B=128 N=16 S=32768 4 / 1*: 1.134 / 1.144."""
  head_tiles = pl.cdiv(num_heads, _TILE_H)
  return min(length_splits(max_len, sm_count()), one_wave_splits(num_tokens * head_tiles,
                                                                  sm_count()))


def head_dims_fit(head_dim: int, kv_lora_rank: int) -> bool:
  """Whether the kernel takes rows of head_dim = kv_lora_rank + rope columns."""
  return (kv_lora_rank % (_VALUE_WGS * _CHUNK) == 0 and kv_lora_rank <= head_dim <= _MAX_HEAD_DIM
          and head_dim % 64 == 0)


def _check(q, kv_cache, block_tables, seq_lens, kv_lora_rank, k_scale, num_kv_splits,
           split_tokens, scale):
  _, d, page = check_decode_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank)
  check_softmax_scale(scale)
  if not head_dims_fit(d, kv_lora_rank):
    raise ValueError(f"head dim {d} must be kv_lora_rank ({kv_lora_rank}, a multiple of "
                     f"{_VALUE_WGS * _CHUNK}) + a rope dim, a multiple of 64 and at most "
                     f"{_MAX_HEAD_DIM} (the query tile and 2 pages fill shared memory)")
  if page % PAGE_MULTIPLE:
    raise ValueError(f"page size must be a multiple of {PAGE_MULTIPLE} (the bulk copy and wgmma "
                     f"tile), got {page}")
  if q.shape[0] > MAX_GRID_TOKENS:
    raise ValueError(f"at most {MAX_GRID_TOKENS} tokens a call (the CUDA grid's z extent, where "
                     f"tokens launch), got {q.shape[0]}")
  if q.dtype != jnp.bfloat16 or kv_cache.dtype not in (jnp.bfloat16, F8):
    raise ValueError(f"q must be bfloat16 and the cache bfloat16 or float8_e4m3fn, got "
                     f"{q.dtype.name} and {kv_cache.dtype.name}")
  if (kv_cache.dtype == F8) != (k_scale is not None):
    raise ValueError("a float8_e4m3fn cache needs k_scale (its per-tensor scale), a bfloat16 cache "
                     "takes none")
  if k_scale is not None and jnp.ndim(k_scale) != 0:
    raise ValueError(f"k_scale must be a scalar, got shape {jnp.shape(k_scale)}")
  check_split_args(num_kv_splits, split_tokens, _STEP)


def _f16_queries(q):
  """q [T, Np, D] bf16 as f16 for register_a's products (wgmma takes one 16-bit type for A and B,
  and e4m3 widens to f16 only), each token scaled by the power of two that keeps its largest
  magnitude below 2^15 (f16 ends at 65504, bf16 at 3.4e38), and the inverse powers [T] f32 that
  the kernel folds into each token's score scale. Both exact (powers of two), 1 for a token
  already in range (its products unchanged), and per token: a row's result never depends on the
  batch."""
  _, exponent = jnp.frexp(jnp.max(jnp.abs(q.astype(jnp.float32)), axis=(1, 2)))  # |q| < 2^e
  shift = jnp.maximum(exponent - 15, 0)
  scaled = q.astype(jnp.float32) * jnp.ldexp(jnp.float32(1), -shift)[:, None, None]
  return scaled.astype(jnp.float16), jnp.ldexp(jnp.float32(1), shift)


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "num_kv_splits",
                                             "split_tokens", "fp8_pipeline", "heads_in",
                                             "wide_keys", "wide_values", "e4m3_scores",
                                             "e4m3_promote_cols", "wide_widening",
                                             "pages_per_step", "ring_slots", "rescale_slack",
                                             "auto_barriers", "interpret"))
def latent_decode(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                  *, scale: float, kv_lora_rank: int = 512,
                  k_scale: jax.Array | float | None = None, num_kv_splits: int | None = None,
                  split_tokens: int | None = None, fp8_pipeline: str | None = CONFIG.fp8_pipeline,
                  heads_in: str | None = CONFIG.heads_in, wide_keys: bool | None = CONFIG.wide_keys,
                  wide_values: bool | None = CONFIG.wide_values,
                  e4m3_scores: bool | None = CONFIG.e4m3_scores,
                  e4m3_promote_cols: int = CONFIG.e4m3_promote_cols,
                  wide_widening: bool = CONFIG.wide_widening,
                  pages_per_step: int | None = CONFIG.pages_per_step,
                  ring_slots: int | None = CONFIG.ring_slots,
                  rescale_slack: float | None = CONFIG.rescale_slack,
                  auto_barriers: bool = CONFIG.auto_barriers,
                  interpret: bool | plgpu.InterpretGPUParams = False
                  ) -> tuple[jax.Array, jax.Array]:
  """Absorbed MQA decode over a paged latent cache (semantics of `mla_jax.reference.latent_decode`).

  q [T, N, L+R] bf16 (any N: heads are padded to tiles of 64); kv_cache [num_blocks, page, L+R]
  bf16, or float8_e4m3fn holding `x / k_scale` (k_scale a float32 scalar), page a multiple of 64;
  block_tables [T, max_blocks] int32 (the row's request's table; -1 or out-of-range entries are
  masked); seq_lens [T] int32 (0 gives o = 0, lse = -inf). num_kv_splits=None picks a split count
  from static shapes; 1 makes each row's result independent of the batch. split_tokens (instead of
  num_kv_splits, a multiple of 64): splits of that many tokens merged in a fixed order, so each
  row's result is bit-identical in any batch and with any table width (batch-invariant mode).
  fp8_pipeline: how an fp8 cache's pages are widened (one of FP8_PIPELINES, see
  `MosaicDecodeConfig`; None: `default_fp8_pipeline`; a bf16 cache ignores it). heads_in:
  `MosaicDecodeConfig`'s (None: `default_heads_in`, "n" at N <= 32; "n": N <= 32 heads as
  wgmma's N, with an fp8 cache with fp8_pipeline "serial", "shared_widening" or "register_a",
  the last with "n" only). wide_keys: register_a's 16-byte key loads (`MosaicDecodeConfig`; None:
  with register_a's f16 keys, e4m3_scores=False; True is a ValueError with the other fp8
  pipelines, a bf16 cache ignores it).
  wide_values: register_a's 16-byte value loads (`MosaicDecodeConfig`; None: with register_a at
  kv_lora_rank 512; True is a ValueError with the other fp8 pipelines or kv_lora_rank != 512, a
  bf16 cache ignores it). e4m3_scores: register_a's scores by fp8 wgmma from shared memory
  (`MosaicDecodeConfig`; None: with register_a unless wide_keys=True; True is a ValueError with
  the other fp8 pipelines or wide_keys=True, a bf16 cache ignores it); e4m3_promote_cols: its
  promotion chunks (`MosaicDecodeConfig`). wide_widening: the widening pipelines' lane-level
  widening (`MosaicDecodeConfig`; a bf16 cache and "register_a", which widen nothing, ignore it).
  pages_per_step: register_a's pages a consumer step (`MosaicDecodeConfig`; None: 2 with
  register_a; 2 is a ValueError with the other fp8 pipelines, a bf16 cache ignores it).
  ring_slots: register_a's e4m3 slots (`MosaicDecodeConfig`; None: 4; a number is a ValueError
  with the other fp8 pipelines or where it does not fit, a bf16 cache ignores it).
  rescale_slack: the consumers' lazy rescale (`MosaicDecodeConfig`; by default
  `common.RESCALE_SLACK`, 8.0; None: every step rescales; heads in N ignore it). auto_barriers:
  False (the default) compiles a bf16 cache's kernel without Pallas's automatic warpgroup barriers
  (`MosaicDecodeConfig`; fp8 caches keep them), True with them.
  interpret: True or a `plgpu.InterpretGPUParams` runs Mosaic GPU's CPU interpreter. Returns
  o [T, N, L] bf16 and lse [T, N] float32 (natural log).
  """
  _check(q, kv_cache, block_tables, seq_lens, kv_lora_rank, k_scale, num_kv_splits, split_tokens,
         scale)
  MosaicDecodeConfig(fp8_pipeline=fp8_pipeline, heads_in=heads_in, wide_keys=wide_keys,
                     wide_values=wide_values, e4m3_scores=e4m3_scores,
                     e4m3_promote_cols=e4m3_promote_cols, wide_widening=wide_widening,
                     pages_per_step=pages_per_step, ring_slots=ring_slots,
                     rescale_slack=rescale_slack, auto_barriers=auto_barriers)  # checks
  fp8 = kv_cache.dtype == F8
  if heads_in is None:
    heads_in = default_heads_in(q.shape[1], fp8, fp8_pipeline)
  if fp8_pipeline is None:
    fp8_pipeline = default_fp8_pipeline(heads_in, wide_widening)
  heads_n = heads_in == "n"
  register_a = fp8 and fp8_pipeline == "register_a"
  if register_a and not heads_n:
    raise ValueError("fp8_pipeline=\"register_a\" takes heads_in=\"n\" (or None) only: the page "
                     f"is wgmma's A operand only with heads in N; got heads_in={heads_in!r}")
  if fp8 and wide_keys and not register_a:
    raise ValueError(f"wide_keys takes fp8_pipeline=\"register_a\" (the keys are wgmma's register "
                     f"A operand only there), got fp8_pipeline={fp8_pipeline!r}")
  if fp8 and e4m3_scores and not register_a:
    raise ValueError(f"e4m3_scores takes fp8_pipeline=\"register_a\" (its e4m3 ring is the "
                     f"scores' A operand), got fp8_pipeline={fp8_pipeline!r}")
  if register_a and e4m3_scores and wide_keys:
    raise ValueError("wide_keys loads the keys into registers; e4m3_scores reads them from shared "
                     "memory (take e4m3_scores=False with wide_keys=True)")
  # None: e4m3 scores, unless wide_keys=True asks for the f16 keys.
  e4m3_scores = register_a and (e4m3_scores or (e4m3_scores is None and not wide_keys))
  wide_keys = register_a and not e4m3_scores and wide_keys is not False
  if fp8 and wide_values and not register_a:
    raise ValueError(f"wide_values takes fp8_pipeline=\"register_a\" (V^T is wgmma's register A "
                     f"operand only there), got fp8_pipeline={fp8_pipeline!r}")
  if register_a and wide_values and kv_lora_rank != WIDE_VALUE_COLS:
    raise ValueError(f"wide_values takes kv_lora_rank {WIDE_VALUE_COLS} (a thread's rows of the "
                     f"8 value tiles are one 16-byte unit of a row), got {kv_lora_rank}")
  wide_values = register_a and (kv_lora_rank == WIDE_VALUE_COLS if wide_values is None
                                else wide_values)
  wide_widening = wide_widening and fp8 and not register_a  # only the widening pipelines widen
  if fp8 and pages_per_step not in (None, 1) and not register_a:
    raise ValueError(f"pages_per_step={pages_per_step} takes heads_in=\"n\" with fp8_pipeline="
                     f"\"register_a\" (its ring of e4m3 pages), got fp8_pipeline="
                     f"{fp8_pipeline!r}; other pipelines take pages_per_step=1 or None")
  if fp8 and ring_slots is not None and not register_a:
    raise ValueError(f"ring_slots takes fp8_pipeline=\"register_a\" (its ring of e4m3 pages), "
                     f"got fp8_pipeline={fp8_pipeline!r}")
  pages = (pages_per_step or _REGISTER_A_PAGES) if register_a else 1  # bf16 caches ignore it
  if heads_n and fp8 and fp8_pipeline not in HEADS_N_FP8_PIPELINES:
    raise ValueError(f"heads_in=\"n\" with an fp8 cache takes fp8_pipeline "
                     f"{' or '.join(HEADS_N_FP8_PIPELINES)} (64-token steps: wgmma's M), got "
                     f"{fp8_pipeline!r}")
  t, n, d = q.shape
  tile_h = heads_tile(n, "n" if heads_n else "m")
  if register_a:
    most = _MAX_RING_SLOTS[tile_h, pages]
    ring = ring_slots or _REGISTER_A_STAGES
    if ring > most:
      raise ValueError(f"ring_slots={ring_slots} does not fit in shared memory at {tile_h} heads a "
                       f"tile with pages_per_step={pages} (at most {most} e4m3 slots there: "
                       f"`_MAX_RING_SLOTS`)")
  page = kv_cache.shape[1]
  head_tiles = pl.cdiv(n, tile_h)
  max_len = block_tables.shape[1] * page
  if split_tokens:
    splits = num_fixed_splits(split_tokens, max_len)
  else:
    splits = num_kv_splits or num_kv_splits_for(t, n, max_len)
  # Heads in N take whole tiles (the query tile is the B operand, all of its rows read).
  np_ = tile_h if heads_n else padded_heads(n, tile_h)
  if np_ != n:
    q = jnp.pad(q, ((0, 0), (0, np_ - n), (0, 0)))
  fixed_order = split_tokens is not None
  out_dtype = partials_dtype(q.dtype, splits, fixed_order)
  dtype = q.dtype
  if register_a and not e4m3_scores:  # wgmma's B beside an f16 A (`MosaicDecodeConfig`)
    q, q_scales = _f16_queries(q)
    if wide_keys:  # the key fragments' column order (`wide_key_order`)
      q = wide_key_order(q)
  else:  # e4m3_scores: the kernel splits q into fp8 wgmma's B (`split_queries`)
    q_scales = jnp.ones((t,), jnp.float32)
  # P's (and the interpreter's converted tiles'): register_a's f16 beside f16 or e4m3 queries.
  p_dtype = jnp.float16 if register_a else q.dtype
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()

  shared_widening = fp8 and fp8_pipeline == "shared_widening"
  no_auto_barriers = not (fp8 or auto_barriers)  # fp8's widening keeps Pallas's barriers
  in_slot = fp8 and fp8_pipeline == "in_slot"
  if in_slot and not wide_widening and not interpret:
    raise ValueError("fp8_pipeline=\"in_slot\" widens in place in lane-level code only "
                     "(wide_widening=True; the interpreter runs its own form)")
  # Heads in N step 64 tokens: "shared_widening" without half pages.
  half_pages = fp8 and fp8_pipeline in ("half_pages", "shared_widening") and not heads_n
  value_cols = _value_columns(kv_lora_rank, register_a)
  # Mosaic GPU's interpreter runs no in-place accumulation (see accumulate_values).
  kernel = functools.partial(_decode_kernel, scale=scale, lora=kv_lora_rank, num_splits=splits,
                             split_steps=split_tokens and split_tokens // _STEP,
                             in_place=not interpret, shared_widening=shared_widening,
                             heads_n=heads_n, register_a=register_a,
                             value_cols=value_cols, wide_keys=wide_keys,
                             wide_values=wide_values, e4m3_scores=e4m3_scores,
                             e4m3_promote_cols=e4m3_promote_cols, pages=pages,
                             lane_queries=not interpret, in_slot=in_slot,
                             rescale_slack=None if heads_n else rescale_slack,
                             # The interpreter multiplies every step (by 1 where skipped).
                             lazy_rescale=(rescale_slack is not None and not heads_n
                                           and not interpret),
                             # bf16 (one split): stored in the value columns' order.
                             lane_output=(wide_values and not interpret
                                          and out_dtype == jnp.bfloat16),
                             # The interpreter runs no lane-level code: the Pallas-level widening.
                             wide_widening=wide_widening and not interpret)
  # bf16 slots x rows (the consumers' step). wgmma's K must be a multiple of its operands' swizzle
  # width, and P V's K is the step: 32-row steps take 64-byte swizzles (32 bf16) for the query,
  # the slots and P alike (one wgmma takes one swizzle). Half pages: 72 + 2 x 36 (bf16 slots) +
  # 2 x 36 (e4m3 stage) + 4 KB (P) + 0.25 = 220.3 KB of the 227.
  slots, step_rows = ((2, _HALF) if half_pages else (1, _STEP) if fp8 and not in_slot
                      else (_STAGES, _STEP))
  sw = 2 * _HALF if half_pages else SWIZZLE
  slot_type = swizzled((slots, step_rows, d), q.dtype, sw)
  staging = ()
  if register_a:  # no bf16 slot: the e4m3 pages' ring is the slots
    slots = ring
    slot_type = swizzled((slots, _STEP, d), F8, FP8_COLS)
    if interpret:  # each consumer's converted A tile (`a_operand`)
      staging = (swizzled((_VALUE_WGS, FP8_COLS, FP8_COLS), p_dtype),)
    if e4m3_scores:  # the heads' scale-backs (qs_smem), and the interpreter's bf16 row (qb_smem)
      staging = (plgpu.SMEM((tile_h,), jnp.float32),
                 *((plgpu.SMEM((tile_h, d), q.dtype),) if interpret else ())) + staging
  elif in_slot:  # staged: a slot's e4m3 page landed in its own bytes (a copy a row band)
    staging = (plgpu.Barrier(num_arrivals=len(_IN_SLOT_BANDS), num_barriers=slots),)
  elif fp8:
    staging = (plgpu.SMEM((_FP8_STAGES, _STEP, d), F8,
                          transforms=(plgpu.TilingTransform((8, FP8_COLS)),
                                      plgpu.SwizzleTransform(FP8_COLS))),
               plgpu.Barrier(num_barriers=_FP8_STAGES))
    if shared_widening:  # stage_free: warpgroup 1 done reading a stage slot
      staging += (plgpu.Barrier(num_barriers=_FP8_STAGES),)
  k_scale = jnp.ones((1,), jnp.float32) if k_scale is None else (
      jnp.asarray(k_scale, jnp.float32).reshape(1))
  # Heads in N with float32 partials: the output tiles O^T [64 columns, heads] are staged and
  # written as they are (a transposed float32 store does not lower), o [T, splits, L, Np].
  cols_first = heads_n and out_dtype == jnp.float32
  # One staging buffer a warpgroup with value columns.
  stores, cols = sum(map(bool, value_cols)), max(value_cols)
  if cols_first:
    o_shape = (t, splits, kv_lora_rank, np_)
    o_staging = swizzled((stores, cols, tile_h), out_dtype, tile_h * 4)
  else:
    o_shape = (t, splits, np_, kv_lora_rank)
    o_staging = swizzled((stores, tile_h, cols), out_dtype)
  o_parts, lse_parts = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(o_shape, out_dtype),
                jax.ShapeDtypeStruct((t, splits, np_), jnp.float32)),
      scratch_types=(
          plgpu.RefUnion(
              (swizzled((2 * tile_h, d), F8, FP8_COLS) if e4m3_scores
               else swizzled((tile_h, d), q.dtype, sw), slot_type),
              (o_staging, plgpu.SMEM((tile_h,), jnp.float32)),
              # in_slot: the slots' bytes as e4m3 row bands, past a pad the size of the query
              # tile (both 1024-byte multiples: each starts where q_smem and kv_smem do)
              *([(plgpu.SMEM((tile_h, d), q.dtype),
                  plgpu.SMEM((slots, 2 * _STEP, d), F8,
                             transforms=(plgpu.TilingTransform((8, FP8_COLS)),
                                         plgpu.SwizzleTransform(FP8_COLS))))]
                if in_slot else [])),
          swizzled((tile_h, step_rows * pages), p_dtype, sw),
          plgpu.SMEM((tile_h,), jnp.float32),
          plgpu.Barrier(),  # q_bar (e4m3_scores: the interpreter's bf16 row only)
          # ready: the memory warpgroup's bulk copy or widening, and warpgroup 1's widening too
          # with shared_widening.
          plgpu.Barrier(num_arrivals=1 + shared_widening, num_barriers=slots),
          plgpu.Barrier(num_arrivals=_VALUE_WGS, num_barriers=slots),
          plgpu.Barrier(),
          plgpu.Barrier(),
          *staging,
      ),
      # Mosaic GPU makes the grid's last axis CUDA's x, the fastest in launch order: the head tiles
      # of a (token, split) run side by side and the second reads each page from L2 (H200, N=128:
      # 1.12x tokens fastest, which read every page from HBM twice: DRAM at 88% of its peak).
      grid=(t, splits, head_tiles),
      grid_names=("tokens", "splits", "heads"),
      num_threads=_VALUE_WGS + 1,
      thread_name="wg",
      # Row reductions of the WGMMA layout stay within a warp (shuffles), so the cross-warp
      # reduction scratch (2 KB by default) is not needed, and with 64 heads it would not fit;
      # heads in N reduce S^T over its rows, across the warpgroup's warps.
      compiler_params=mosaic_compiler_params(
          approx_math=True,
          reduction_scratch_bytes=REDUCTION_BYTES_PER_8_HEADS * tile_h // 8 if heads_n else 0,
          unsafe_no_auto_barriers=no_auto_barriers),
      interpret=interpret or None,
      kernel_name=(f"mosaic_latent_decode_{'fp8' if fp8 else 'bf16'}{'_half' if half_pages else ''}"
                   f"{'_shared' if shared_widening else ''}{'_register_a' if register_a else ''}"
                   f"{'_in_slot' if in_slot else ''}"
                   f"{'_lazy_rescale' if rescale_slack is not None and not heads_n else ''}"
                   f"{'_no_auto_barriers' if no_auto_barriers else ''}"
                   f"{'_wide_widening' if wide_widening else ''}"
                   f"{'_wide_keys' if wide_keys else ''}{'_wide_values' if wide_values else ''}"
                   f"{f'_e4m3_scores{e4m3_promote_cols}' if e4m3_scores else ''}"
                   f"{f'_heads_n{tile_h}' if heads_n else ''}"
                   f"{f'_pages{pages}' if pages > 1 else ''}"
                   f"{f'_ring{slots}' if register_a and slots != _REGISTER_A_STAGES else ''}"
                   f"_p{page}_s{splits}"),
  )(q, kv_cache, block_tables, seq_lens, k_scale, q_scales)

  if cols_first:  # the XLA merge reads them transposed
    o_parts = jnp.swapaxes(o_parts, 2, 3)
  if wide_values and (interpret or out_dtype != jnp.bfloat16):  # the value columns' order
    # (one transpose of o; the merge's input with splits): the kernel's lane store did it else
    o_parts = wide_value_order(o_parts, WIDE_VALUE_GROUP[tile_h], inverse=True)
  if splits == 1 and not fixed_order:
    o, lse = o_parts[:, 0], lse_parts[:, 0]
  else:
    o, lse = merge_splits(o_parts, lse_parts, dtype, fixed_order=fixed_order)
  return o[:, :n], lse[:, :n]
