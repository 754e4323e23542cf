import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_jax.backends import get_backend
from pallas_kernels import mosaic_prefill
from pallas_kernels.mla_prefill import mla_prefill
from prefill_contract import DK, DV, ROPE, SCALE, PrefillContract, assert_close, cumulative
from oracles import varlen_attention_np

# The Mosaic kernel's per-item knobs (on by default from 64 heads, session 14; the contract's
# cases have fewer), all on and all off.
_KNOBS_ON = dict(prefetch_q=True, first_step_unmasked=True, diagonal_half=True)
_KNOBS_OFF = dict(prefetch_q=False, first_step_unmasked=False, diagonal_half=False)


class TestReferencePrefill(PrefillContract):
  backend = "reference"


def test_reference_hides_later_positions_of_a_request_exactly():
  # Keys 20 and 21 of the first request hold NaN and inf: its rows 0..19 do not see them, and its
  # later rows (20..36, in the same query block) do.
  rng = np.random.default_rng(8)
  cu = cumulative([37, 11])
  q, k = (rng.standard_normal((48, 2, DK)) for _ in range(2))
  v = rng.standard_normal((48, 2, DV))
  ref_o, ref_lse = varlen_attention_np(q, k, v, cu, cu, SCALE, True)  # before the poison
  k[20], v[20], k[21], v[21] = np.nan, np.nan, np.inf, np.inf
  o, lse = get_backend("reference").prefill(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                            jnp.asarray(cu), jnp.asarray(cu), scale=SCALE,
                                            causal=True, max_seqlen_q=37)
  hidden = np.r_[0:20, 37:48]
  assert_close(o[hidden], ref_o[hidden], jnp.float32)
  assert_close(lse[hidden], ref_lse[hidden], jnp.float32)
  assert np.isnan(np.asarray(o[20:37])).all()


class TestPallasTritonPrefill(PrefillContract):
  backend = "pallas_triton"


class TestPallasPrefillSmallBlocks(PrefillContract):
  """The kernel itself with 16-row blocks, so that the test lengths span several query and key
  blocks (unmasked, diagonal and ragged-tail key blocks, partial query blocks)."""

  def prefill(self, *args, **kwargs):
    return mla_prefill(*args, **kwargs, block_q=16, block_k=16, interpret=True)


def test_request_longer_than_max_seqlen_q_is_still_covered():
  rng = np.random.default_rng(7)
  cu = cumulative([50, 21])
  q, k = (jnp.asarray(rng.standard_normal((71, 2, DK)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((71, 2, DV)), jnp.float32)
  o, lse = mla_prefill(q, k, v, jnp.asarray(cu), jnp.asarray(cu), scale=SCALE, causal=True,
                       max_seqlen_q=16, block_q=16, block_k=16, interpret=True)
  ref_o, ref_lse = varlen_attention_np(q, k, v, cu, cu, SCALE, True)
  assert_close(o, ref_o, jnp.float32)
  assert_close(lse, ref_lse, jnp.float32)


@pytest.mark.parametrize("change, message", [
    (dict(k=jnp.zeros((8, 2, 96))), "Dk"),
    (dict(v=jnp.zeros((8, 2, 96))), "Dv"),
    (dict(q=jnp.zeros((8, 2, DK), jnp.float16)), "dtype"),
    (dict(cu_seqlens_q=jnp.array([0.0, 8.0])), "int32"),
    (dict(cu_seqlens_k=jnp.array([0, 4, 8], jnp.int32)), "differ in length"),
    (dict(block_q=48), "block_q"),
])
def test_bad_arguments_raise(change, message):
  args = dict(q=jnp.zeros((8, 2, DK)), k=jnp.zeros((8, 2, DK)), v=jnp.zeros((8, 2, DV)),
              cu_seqlens_q=jnp.array([0, 8], jnp.int32), cu_seqlens_k=jnp.array([0, 8], jnp.int32))
  args.update(change)
  call = functools.partial(mla_prefill, scale=SCALE, causal=True, max_seqlen_q=8, interpret=True)
  with pytest.raises(ValueError, match=message):
    call(**args)


class TestPallasMosaicPrefill(PrefillContract):
  """The Mosaic GPU kernel, in Mosaic GPU's interpreter on CPUs. Contract cases of a dtype it does
  not take (f32) skip, naming why; the cases below cover lengths of several blocks."""
  backend = "pallas_mosaic"

  def prefill(self, q, *args, **kwargs):
    if q.dtype.name not in mosaic_prefill.DTYPES:
      pytest.skip(f"pallas_mosaic's prefill kernel takes {mosaic_prefill.DTYPES} only, "
                  f"got {q.dtype}")
    return super().prefill(q, *args, **kwargs)

  # Requests starting off a multiple of 8 rows (bulk-copy boxes start aligned), of several 64-key
  # steps and 128-row blocks, a tile past the end of the arrays; persistent: 3 programs walk the
  # queue (each takes several items); else more blocks than max_seqlen_q gives programs.
  @pytest.mark.parametrize("causal", [True, False])
  @pytest.mark.parametrize("persistent, max_seqlen_q", [(True, None), (False, None), (False, 64)])
  def test_multi_block(self, causal, persistent, max_seqlen_q):
    rng = np.random.default_rng(11 + causal)
    len_q, len_k = [200, 70, 0, 130], [260, 70, 5, 130]
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    q = jnp.asarray(2 * rng.standard_normal((int(cu_q[-1]) + 3, 2, DK)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((int(cu_k[-1]) + 1, 2, DK)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((int(cu_k[-1]) + 1, 2, DV)), jnp.bfloat16)
    o, lse = mosaic_prefill.mla_prefill(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), scale=SCALE,
                                        causal=causal, max_seqlen_q=max_seqlen_q or max(len_q),
                                        persistent=persistent, num_programs=3, interpret=True)
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, causal)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, causal)
    assert_close(f32(o), ref_o, jnp.bfloat16, magnitude)
    assert_close(lse, ref_lse, jnp.bfloat16)
    assert ((f32(o[int(cu_q[-1]):]) == 0).all()
            and (np.asarray(lse[int(cu_q[-1]):]) == -np.inf).all())

  @pytest.mark.parametrize("causal", [True, False])
  def test_work_queue_lists_every_block_once_heaviest_first(self, causal):
    # Requests of 300 (starting at row 0), 0, 7 (at row 300: 4 rows off 8-aligned, 1 block) and
    # 250 (at 307, 3 rows off: 2 blocks) query rows.
    len_q, len_k = [300, 0, 7, 250], [300, 16, 500, 250]
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    queue = np.asarray(mosaic_prefill._work_queue(jnp.asarray(cu_q), jnp.asarray(cu_k), 560,
                                                  causal, direct=False))
    count = queue[0, 0]
    blocks = [tuple(b) for b in queue[:, 1:count + 1].T]
    assert sorted(blocks) == [(0, 0), (0, 1), (0, 2), (2, 0), (3, 0), (3, 1)]
    def keys(r, b):  # keys the block reads: its last row's, after the k_lead rows in front
      if not causal:
        return len_k[r] + cu_k[r] % 8
      rows = min((b + 1) * 128 - cu_q[r] % 8, len_q[r])  # request-local, up to the block's end
      return min(rows + len_k[r] - len_q[r], len_k[r]) + cu_k[r] % 8
    work = [keys(r, b) for r, b in blocks]
    assert work == sorted(work, reverse=True)

  # One request (no output gather): (a) starting off row 0 and 8-aligned, ending before the
  # arrays' end; (b) ending just before a 128-row block that holds only padding rows (140 rows: a
  # block's box there would reach back over the request). The rows around it hold NaN queries,
  # keys and values, which reach none of its rows, and the rows after it give 0, -inf.
  @pytest.mark.parametrize("causal", [True, False])
  @pytest.mark.parametrize("cu_q, tq", [([13, 213], 250), ([0, 125], 140)])
  def test_one_request_writes_its_rows_in_place(self, causal, cu_q, tq):
    rng = np.random.default_rng(14 + causal)
    cu_q, cu_k = np.array(cu_q, np.int32), np.array([5, 290], np.int32)
    q = 2 * rng.standard_normal((tq, 2, DK))
    k, v = rng.standard_normal((300, 2, DK)), rng.standard_normal((300, 2, DV))
    for x, (lo, hi) in ((q, cu_q), (k, cu_k), (v, cu_k)):
      x[:lo], x[hi:] = np.nan, np.inf
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o, lse = mosaic_prefill.mla_prefill(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), scale=SCALE,
                                        causal=causal, max_seqlen_q=200, num_programs=3,
                                        interpret=True)
    rows, tail = slice(cu_q[0], cu_q[1]), cu_q[1]
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, causal)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, causal)
    assert_close(f32(o)[rows], ref_o[rows], jnp.bfloat16, magnitude[rows])
    assert_close(np.asarray(lse)[rows], ref_lse[rows], jnp.bfloat16)
    assert (f32(o[tail:]) == 0).all() and (np.asarray(lse[tail:]) == -np.inf).all()

  # split: the keys in the split form (two boxes a key step into one barrier). knobs: one program
  # walks all three items, tiles whole and row by row (intra_overlap, the default: each step's
  # P V issued in the next step, its V slot released there, the ring running on across items);
  # the steps in order, and with turns (ping-pong), one program; the split form in one program
  # (a query tile's two copies on one barrier, reused by every item). The per-item knobs (the
  # default from 64 heads; prefetch_q: the memory warpgroup copying each item's queries over the
  # tile the last one's S read, the output through its own staging while the next item reads the
  # new queries; first_step_unmasked; diagonal_half) all on in one program, joined and split;
  # prefetch_q alone, and with the steps in order; diagonal_half alone.
  @pytest.mark.parametrize("split, knobs", [
      (False, {}), (True, {}), (False, dict(num_programs=1)),
      (False, dict(num_programs=1, intra_overlap=False)),
      (False, dict(num_programs=1, ping_pong=True, intra_overlap=False)),
      (True, dict(num_programs=1)),
      (False, dict(_KNOBS_ON, num_programs=1)), (True, dict(_KNOBS_ON, num_programs=1)),
      (False, dict(_KNOBS_OFF, num_programs=1, prefetch_q=True)),
      (False, dict(num_programs=1, prefetch_q=True, intra_overlap=False)),
      (False, dict(_KNOBS_OFF, num_programs=1, diagonal_half=True)),
  ], ids=["joined", "split", "one_program", "in_order", "ping_pong", "split_one_program",
          "knobs_on", "knobs_on_split", "prefetch_q_alone", "prefetch_q_in_order",
          "diagonal_half_alone"])
  def test_no_races_in_the_interpreter(self, split, knobs):
    # The race detector sees plain loads and stores and bulk copies (each warpgroup's P, the K/V
    # ring refills, the output staging), not the operand reads of wgmma. jax 0.11.2 reports it
    # only through a private module.
    report = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    rng = np.random.default_rng(12)
    cu_q, cu_k = cumulative([150, 3]), cumulative([170, 3])
    q = jnp.asarray(rng.standard_normal((160, 1, DK)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((174, 1, DK)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((174, 1, DV)), jnp.bfloat16)
    keys = (k[..., :DK - ROPE], dict(k_pe=k[:, 0, DK - ROPE:])) if split else (k, {})
    o, lse = mosaic_prefill.mla_prefill(q, keys[0], v, jnp.asarray(cu_q), jnp.asarray(cu_k),
                                        scale=SCALE, causal=True, max_seqlen_q=64, **keys[1],
                                        **knobs,
                                        interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not report.get_races().races_found
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, True)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, True)
    assert_close(f32(o), ref_o, jnp.bfloat16, magnitude)
    assert_close(lse, ref_lse, jnp.bfloat16)

  @pytest.mark.parametrize("tokens,n,requests,causal,knobs", [
      (16384, 128, 1, True, {}), (16384, 16, 4, False, {}), (45, 3, 2, True, {}),
      # The variants the H200 sweep timed: 64-key steps with 4 stages, the overlap and in order.
      (4096, 64, 2, True, dict(block_k=64, num_stages=4)),
      (4096, 64, 2, True, dict(block_k=64, num_stages=4, intra_overlap=False)),
      # Each grid where it is not the default (the queue up to 8192 rows at 128 heads, below 4096
      # at 16); the queue in L2 sections (2 heads of 128 at 16K keys, 8 at 4096 keys) and without.
      (16384, 128, 1, True, dict(persistent=True)), (1024, 16, 1, True, dict(persistent=False)),
      (4096, 128, 4, True, dict(persistent=True, l2_section_bytes=None)),
      # A batch's tiles written in place, the edge tiles row by row: the queue (8 x 1024) and the
      # grid (4 x 4096).
      (8192, 128, 8, True, {}), (16384, 128, 4, True, {}),
      # The ping-pong schedule (the default before intra_overlap): 16K on the grid, one
      # 4096-token request on the queue.
      (16384, 128, 1, True, dict(ping_pong=True, intra_overlap=False)),
      (4096, 128, 1, True, dict(ping_pong=True, intra_overlap=False)),
      # The per-item knobs (prefetch_q, first_step_unmasked, diagonal_half) run in the 128-head
      # cases above (the default from 64 heads); each alone on the queue (8 x 1024) and the grid
      # (16K); all three at 16 heads (non-causal: ragged ends halved); prefetch_q with ping-pong's
      # steps and with 64-key steps (4 stages still fit).
      *[(tokens, 128, requests, True, dict(_KNOBS_OFF, **{knob: True}))
        for knob in ("prefetch_q", "first_step_unmasked", "diagonal_half")
        for tokens, requests in ((8192, 8), (16384, 1))],
      (8192, 128, 8, True, dict(prefetch_q=True, ping_pong=True, intra_overlap=False)),
      (8192, 128, 8, True, dict(prefetch_q=True, block_k=64)),
      (8192, 128, 8, True, _KNOBS_OFF), (16384, 16, 4, False, _KNOBS_ON),
  ])
  def test_lowers_for_hopper(self, tokens, n, requests, causal, knobs):
    # Lowering for CUDA (it runs on this CPU) checks what the interpreter does not: wgmma operand
    # shapes and layouts, bulk-copy boxes (8-aligned starts), and the 227 KB shared-memory bound.
    q = jax.ShapeDtypeStruct((tokens, n, DK), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((tokens, n, DV), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((requests + 1,), jnp.int32)
    traced = mosaic_prefill.mla_prefill.trace(q, q, v, cu, cu, scale=SCALE, causal=causal,
                                              max_seqlen_q=tokens // requests, **knobs)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()

  # The split form (k_pe apart: a Dv-wide box of the head's keys and a shared rope box a step) as
  # the layer's prefill calls it: a context chunk (non-causal, 4 x 2048 query rows over 16384
  # keys: the grid), one request's queue (the 2048-row window of `--context 4 2048 16384`), the
  # new tokens (causal, 4 requests, the queue in sections), and 64-key steps with 4 stages; 8 x 1024
  # new tokens with output tiles in place and stores waited for until read.
  @pytest.mark.parametrize("tokens,keys,n,requests,causal,knobs", [
      (8192, 16384, 128, 4, False, dict(persistent=False)), (2048, 8192, 128, 1, False, {}),
      (8192, 8192, 128, 4, True, {}),
      (4096, 4096, 64, 2, True, dict(block_k=64, num_stages=4, intra_overlap=False)),
      (8192, 8192, 128, 8, True, {}), (8192, 8192, 128, 8, True, _KNOBS_OFF),
  ])
  def test_split_keys_lower_for_hopper(self, tokens, keys, n, requests, causal, knobs):
    q = jax.ShapeDtypeStruct((tokens, n, DK), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((keys, n, DK - ROPE), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((keys, n, DV), jnp.bfloat16)
    k_pe = jax.ShapeDtypeStruct((keys, ROPE), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((requests + 1,), jnp.int32)
    traced = mosaic_prefill.mla_prefill.trace(q, k, v, cu, cu, scale=SCALE, causal=causal,
                                              max_seqlen_q=tokens // requests, k_pe=k_pe, **knobs)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "_kpe" in text

  # What the kernel counts (`_smem_bytes`, which picks the ring's depth and refuses what does not
  # fit) against Mosaic GPU's own count (with its bound at 0 its error names the bytes): 128-key
  # steps (2 stages, 214,136 bytes; the keys joined and split) and 64-key steps (4 stages,
  # 214,216); prefetch_q's output staging and barriers (230,520 and 230,600).
  @pytest.mark.parametrize("block_k, split, prefetch_q", [
      (128, False, False), (128, True, False), (64, False, False), (128, False, True),
      (128, True, True), (64, False, True)])
  def test_shared_memory_count_is_mosaic_gpus(self, block_k, split, prefetch_q, monkeypatch):
    tokens, n, requests = 8192, 128, 8
    q = jax.ShapeDtypeStruct((tokens, n, DK), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((tokens, n, DV if split else DK), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((tokens, n, DV), jnp.bfloat16)
    k_pe = dict(k_pe=jax.ShapeDtypeStruct((tokens, ROPE), jnp.bfloat16)) if split else {}
    cu = jax.ShapeDtypeStruct((requests + 1,), jnp.int32)
    stages = mosaic_prefill._stages_for(DK, DV, block_k, prefetch_q)
    counted = mosaic_prefill._smem_bytes(DK, DV, block_k, stages, prefetch_q)
    assert stages >= 2 and counted <= 227 * 1024
    jax.clear_caches()  # a lowering cached by another test would not be checked again
    monkeypatch.setattr(mosaic_gpu_core, "_SMEM_SIZE_BOUND", 0)
    traced = mosaic_prefill.mla_prefill.trace(q, k, v, cu, cu, scale=SCALE, causal=True,
                                              max_seqlen_q=tokens // requests, block_k=block_k,
                                              prefetch_q=prefetch_q, **k_pe)
    with pytest.raises(ValueError, match=f"smem_bytes={counted} "):
      traced.lower(lowering_platforms=("cuda",))

  @pytest.mark.parametrize("change, message", [
      (dict(q=jnp.zeros((8, 2, DK), jnp.float32)), "dtype"),
      (dict(q=jnp.zeros((8,), jnp.bfloat16)), r"\[T, N, D\]"),  # before the knobs read its heads
      (dict(k=jnp.zeros((8, 2, 96), jnp.bfloat16)), "Dk"),
      (dict(q=jnp.zeros((8, 2, 160), jnp.bfloat16), k=jnp.zeros((8, 2, 160), jnp.bfloat16)),
       "multiples of 64"),
      (dict(v=jnp.zeros((8, 2, 320), jnp.bfloat16)), "at most 256"),
      (dict(q=jnp.zeros((8, 2, 512), jnp.bfloat16), k=jnp.zeros((8, 2, 512), jnp.bfloat16)),
       "shared memory"),
      (dict(block_k=96), "block_k must be 64 or 128"),
      (dict(num_stages=3), r"num_stages must be in \[2, 2\]"),  # 128-key steps: 2 fit
      (dict(num_programs=0), "num_programs must be an int >= 1"),
      (dict(persistent="yes"), "persistent must be a bool or None"),
      (dict(l2_section_bytes=0), "l2_section_bytes must be an int >= 1"),
      (dict(intra_overlap=1), "intra_overlap must be a bool"),
      (dict(ping_pong=True), "ping_pong=True needs intra_overlap=False"),
      (dict(prefetch_q=1), "prefetch_q must be a bool"),
      (dict(first_step_unmasked=1), "first_step_unmasked must be a bool"),
      (dict(first_step_unmasked=True, intra_overlap=False), "first_step_unmasked is intra_overlap"),
      (dict(diagonal_half=1), "diagonal_half must be a bool"),
      (dict(diagonal_half=True, block_k=64), "needs intra_overlap=True and block_k=128"),
      (dict(diagonal_half=True, intra_overlap=False), "needs intra_overlap=True and block_k=128"),
      # Dk 256, Dv 64: 2 stages of 128-key steps fit, not with prefetch_q's staging.
      (dict(q=jnp.zeros((8, 2, 256), jnp.bfloat16), k=jnp.zeros((8, 2, 256), jnp.bfloat16),
            v=jnp.zeros((8, 2, 64), jnp.bfloat16), prefetch_q=True),
       "prefetch_q: 2 stages of 128-key K/V blocks and the output staging do not fit"),
      (dict(cu_seqlens_q=jnp.array([0.0, 8.0])), "int32"),
      (dict(cu_seqlens_k=jnp.array([0, 4, 8], jnp.int32)), "differ in length"),
      # Split keys whose own columns are not Dv: the query tile is split at Dv.
      (dict(q=jnp.zeros((8, 2, 256), jnp.bfloat16), k=jnp.zeros((8, 2, 192), jnp.bfloat16),
            k_pe=jnp.zeros((8, ROPE), jnp.bfloat16)), r"k must hold Dv \(128\) columns"),
  ])
  def test_bad_arguments_raise(self, change, message):
    args = dict(q=jnp.zeros((8, 2, DK), jnp.bfloat16), k=jnp.zeros((8, 2, DK), jnp.bfloat16),
                v=jnp.zeros((8, 2, DV), jnp.bfloat16), cu_seqlens_q=jnp.array([0, 8], jnp.int32),
                cu_seqlens_k=jnp.array([0, 8], jnp.int32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
      mosaic_prefill.mla_prefill(**args, scale=SCALE, causal=True, max_seqlen_q=8, interpret=True)

  def test_knobs_default_leaves_prefetch_q_off_where_its_staging_does_not_fit(self):
    # Dk 256, Dv 64 at 64 heads, where the per-item knobs' default is on: prefetch_q's staging
    # does not fit there (test_bad_arguments_raise), so the default runs without it, not raises.
    q = jax.ShapeDtypeStruct((256, 64, 256), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((256, 64, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    traced = mosaic_prefill.mla_prefill.trace(q, q, v, cu, cu, scale=SCALE, causal=True,
                                              max_seqlen_q=128)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "_first_unmasked" in text and "_prefetch_q" not in text


class TestPallasMosaicPrefillItemVariants:
  """How a batch's items end, in the interpreter, on the queue (3 programs, each taking several
  items) and the grid: tiles of one request's rows written whole, each request's first and last
  tiles row by row (their lse through slots, `_final_lse`). Interpreter outputs start as NaN, so
  the no-NaN checks also show that every row was written: whole or row by row."""

  @pytest.fixture(autouse=True, params=[dict(persistent=True), dict(persistent=False)],
                  ids=["queue", "grid"])
  def knobs(self, request):
    self.knobs = request.param

  def prefill(self, q, *args, **kwargs):
    return mosaic_prefill.mla_prefill(q, *args, **kwargs, **self.knobs, num_programs=3,
                                      interpret=True)

  # Requests over several tiles, off 8-aligned rows (first tiles row by row), ending inside a tile
  # (last tiles row by row) or on one's edge (written in place); the last request's last tile (the
  # first of a block) moved back at the arrays' end over 48 of its own earlier rows, which see
  # fewer keys than the block's unmasked first step gives (causal; its keys start 8-aligned and
  # outnumber its queries by 10): they must not be stored from there. NaN queries in the
  # padding rows, which only the extra request reads.
  @pytest.mark.parametrize("causal", [True, False])
  def test_tiles_whole_and_row_by_row(self, causal):
    rng = np.random.default_rng(21 + causal)
    len_q, len_k = [128, 64, 3, 135], [128, 101, 3, 145]
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    q = 2 * rng.standard_normal((int(cu_q[-1]) + 5, 2, DK))
    q[cu_q[-1]:] = np.nan
    q = jnp.asarray(q, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((int(cu_k[-1]), 2, DK)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((int(cu_k[-1]), 2, DV)), jnp.bfloat16)
    o, lse = self.prefill(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), scale=SCALE,
                          causal=causal, max_seqlen_q=max(len_q))
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, causal)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, causal)
    rows = slice(0, int(cu_q[-1]))
    assert_close(f32(o)[rows], ref_o[rows], jnp.bfloat16, magnitude[rows])
    assert_close(np.asarray(lse)[rows], ref_lse[rows], jnp.bfloat16)
    assert ((f32(o[int(cu_q[-1]):]) == 0).all()
            and (np.asarray(lse[int(cu_q[-1]):]) == -np.inf).all())


class TestPallasMosaicPrefillL2Sections(PrefillContract):
  """The contract on the persistent queue walked in L2 sections (`l2_section_bytes`), in the
  interpreter: a budget of two heads' K/V, so 16 heads run in 8 sections and 4 in 2 (items of a
  later section must land on its own heads), 3 programs each taking several items."""

  def prefill(self, q, k, v, *args, **kwargs):
    if q.dtype.name not in mosaic_prefill.DTYPES:
      pytest.skip(f"pallas_mosaic's prefill kernel takes {mosaic_prefill.DTYPES} only, "
                  f"got {q.dtype}")
    # The kernel pads k to whole boxes of block_k (128) keys: a head's K/V is that many rows.
    rows = mosaic_prefill._pad_rows(k, mosaic_prefill.DEFAULT.block_k).shape[0]
    budget = 2 * rows * (DK + DV) * k.dtype.itemsize
    return mosaic_prefill.mla_prefill(q, k, v, *args, **kwargs, persistent=True, num_programs=3,
                                      l2_section_bytes=budget, interpret=True)

  # The contract's cases that the kernel takes (bf16) and that hold more than one section.
  @pytest.mark.parametrize("case", ["causal_bf16_n16", "noncausal_bf16_n16",
                                    "causal_bf16_n4_all_padding"])
  def test_matches_oracle(self, case, rng):
    super().test_matches_oracle(case, rng)

  # The split form over 8 sections. The packed case's 2 heads and the poisoned requests' 1 fit the
  # budget in one section: the walk of TestPallasMosaicPrefill's queue (all heads one section).
  test_a_poisoned_request_leaves_the_others_exact = None

  @pytest.mark.parametrize("case", ["noncausal_bf16_n16"])
  def test_split_keys_match_oracle_and_joined_keys(self, case, rng):
    super().test_split_keys_match_oracle_and_joined_keys(case, rng)

  @pytest.mark.parametrize("heads, head_kv_bytes, budget, want", [
      (128, 16384 * 640, 32 << 20, 2),  # 16K keys: 10.5 MB a head, 3 fit, 2 divide 128
      (128, 4096 * 640, 32 << 20, 8),  # 4096 keys: 12 fit
      (6, 100, 400, 3),  # 4 fit, 3 divide 6
      (16, 100, 99, 1),  # not one head fits: one a section
      (16, 100, 10**6, 16),  # all heads
  ])
  def test_section_heads(self, heads, head_kv_bytes, budget, want):
    assert mosaic_prefill._section_heads(heads, head_kv_bytes, budget) == want


class _NarrowedMosaicPrefillKnobs(PrefillContract):
  """The contract through `mla_prefill` with `knobs`, in the interpreter, on the queue (3
  programs, each taking several items), narrowed for the suite's time to the two cases that
  reach every path of the step loop: the packed requests (causal_bf16_n2_packed) and the
  poisoned requests in the split form. The split keys' bits and the argument checks run no code
  a schedule changes."""
  test_split_keys_match_oracle_and_joined_keys = None
  test_bad_split_keys_raise = None
  knobs: dict = {}

  def prefill(self, q, *args, **kwargs):
    return mosaic_prefill.mla_prefill(q, *args, **kwargs, **self.knobs, num_programs=3,
                                      interpret=True)

  @pytest.mark.parametrize("case", ["causal_bf16_n2_packed"])
  def test_matches_oracle(self, case, rng):
    super().test_matches_oracle(case, rng)

  @pytest.mark.parametrize("len_q, len_k, split", [([150, 100, 5], [150, 100, 5], True)])
  def test_a_poisoned_request_leaves_the_others_exact(self, rng, len_q, len_k, split):
    super().test_a_poisoned_request_leaves_the_others_exact(rng, len_q, len_k, split)


class TestPallasMosaicPrefillPingPong(_NarrowedMosaicPrefillKnobs):
  """The contract on the ping-pong schedule (`ping_pong=True, intra_overlap=False`: each step's
  P V before the next step's scores, the two compute warpgroups taking turns on the tensor cores
  through a barrier), in the interpreter, on the queue (3 programs, each taking several items),
  narrowed to two cases for the suite's time that reach every path of its step loop: the packed
  requests (1, 7, 128, 0 and 300 tokens: unmasked steps, a request off 8-aligned rows whose V
  slot is cleaned, items of one step) and the poisoned requests in the split form (NaN, inf in
  the neighbours' rows, a 5-row request at the arrays' end whose box moves back). The steps in
  order without turns: the race test above. The rest of the contract (split keys' bits, argument
  checks) runs no code the schedule changes."""
  knobs = dict(ping_pong=True, intra_overlap=False)


class TestPallasMosaicPrefillKnobsOn(_NarrowedMosaicPrefillKnobs):
  """The contract with the three per-item knobs on (the default from 64 heads; the contract's
  cases have fewer), narrowed as the ping-pong class is: `prefetch_q` (each item's query tiles
  copied by the memory warpgroup once the previous item's last S read them; the output through
  a staging tile of its own) on 3 programs taking several items each, so tiles are refilled
  across items; `first_step_unmasked` and `diagonal_half` on the packed requests' steps (see the
  two classes below); the race detector: `test_no_races_in_the_interpreter[knobs_on*]`."""
  knobs = _KNOBS_ON

  @pytest.mark.parametrize("case", ["causal_bf16_n2_packed", "noncausal_bf16_n16"])
  def test_matches_oracle(self, case, rng):
    super().test_matches_oracle(case, rng)


class TestPallasMosaicPrefillPrefetchQ64(_NarrowedMosaicPrefillKnobs):
  """The contract with `prefetch_q` on 64-key steps and a ring of 4 (not a default; the other two
  knobs need 128-key steps): the memory warpgroup's copy of the next item's
  step 0 no longer waits on a slot of this item's last steps, so only the release after the last
  S keeps the next queries from landing over a tile a later step still reads."""
  knobs = dict(prefetch_q=True, block_k=64, num_stages=4)  # 64-key steps: the others off
  test_a_poisoned_request_leaves_the_others_exact = None


class TestPallasMosaicPrefillFirstStepUnmasked(_NarrowedMosaicPrefillKnobs):
  """The same two contract cases with `first_step_unmasked` (step 0 masked only where it needs
  it): the packed requests hold every kind of step 0, unmasked (the 300-row request's second and
  third blocks), masked for keys before the request (the 7-row request, off 8-aligned keys) and
  for the diagonal (one-step blocks: no step all their rows see); the poisoned requests' boxes
  hold a neighbour's NaN and inf where a step 0 is masked. The other two knobs off."""
  knobs = dict(_KNOBS_OFF, first_step_unmasked=True)


class TestPallasMosaicPrefillDiagonalHalf(_NarrowedMosaicPrefillKnobs):
  """The same two contract cases with `diagonal_half` (a warpgroup's last step on 64 keys where
  its rows see no more of it): the packed requests halve the last step of the 128-row
  request's block and of the 300-row request's blocks for warpgroup 0 (the diagonal), after
  other steps and as an item's only step; the 7-row request's off-aligned keys and the 1-row
  request's box (other requests' keys masked in the halved step); the poisoned requests put NaN
  and inf in the halved box's other rows. Non-causal: the 16-head cases, whose ragged last
  steps of at most 64 keys are halved for both warpgroups. The other two knobs off."""
  knobs = dict(_KNOBS_OFF, diagonal_half=True)

  @pytest.mark.parametrize("case", ["causal_bf16_n2_packed", "noncausal_bf16_n16"])
  def test_matches_oracle(self, case, rng):
    super().test_matches_oracle(case, rng)
