"""Every decode backend against the float64 oracle; the Pallas ones run in interpret mode on
CPUs."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.extend
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from decode_contract import (FP8_SCALE, L, SCALE, DecodeContract, assert_decode_close,
                             assert_e4m3_split_is_exact, make_case)
from mla_jax import backends
from oracles import latent_decode_np
from pallas_kernels import e4m3_operands, mosaic_decode, mosaic_lanes
from pallas_kernels.common import (HEADS_N_TILES, RESCALE_SLACK, default_num_kv_splits,
                                   register_pool, softmax_step)
from pallas_kernels.latent_decode import latent_decode


class TestReferenceDecode(DecodeContract):
  backend = "reference"


class TestPallasTritonDecode(DecodeContract):
  backend = "pallas_triton"

  def test_default_splits(self):
    # vLLM's rule on the static bound (32768 // 512 = 64), capped at ~2 programs per SM.
    assert default_num_kv_splits(1, 1, 32768) == 64
    assert default_num_kv_splits(128, 1, 4096) == 4
    assert default_num_kv_splits(128, 2, 32768) == 2
    assert default_num_kv_splits(128, 4, 32768) == 1
    assert default_num_kv_splits(128, 1, 100) == 1

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "one row per query token"),
      (lambda a: {**a, "q": a["q"][..., :-16]}, "head dim"),
      (lambda a: {**a, "q": a["q"][..., :-16], "kv_cache": a["kv_cache"][..., :-16]},
       "powers of two"),
      (lambda a: {**a, "kv_lora_rank": 448}, "powers of two"),
      (lambda a: {**a, "kv_lora_rank": 576}, r"kv_lora_rank must be in \[1, 576\)"),
      (lambda a: {**a, "kv_cache": a["kv_cache"][:, :8]}, "multiple of 16"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "q dtype"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.int8)}, "cache dtype"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.uint32)}, "int32"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn)}, "needs k_scale"),
      (lambda a: {**a, "q": a["q"][..., :-48], "k_scale": 1.0,
                  "kv_cache": a["kv_cache"][..., :-48].astype(jnp.float8_e4m3fn)}, "pairs"),
      (lambda a: {**a, "k_scale": jnp.ones(2)}, "scalar"),
      (lambda a: {**a, "num_kv_splits": 0}, "num_kv_splits"),
      (lambda a: {**a, "block_h": 24}, "block_h"),
      (lambda a: {**a, "block_n": 32}, "block_n"),
      (lambda a: {**a, "num_warps": 3}, "num_warps"),
      (lambda a: {**a, "num_stages": 0}, "num_stages"),
      (lambda a: {**a, "num_kv_splits": 2, "split_tokens": 64}, "not both"),
      (lambda a: {**a, "split_tokens": 24}, "multiple of the kernel's step"),
  ])
  def test_bad_input_raises(self, change, message):
    q, cache, tables, lens = (jnp.asarray(a)
                              for a in make_case(50, n=16, page=16, req_lens=[20, 5]))
    args = dict(q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, kv_lora_rank=512)
    with pytest.raises(ValueError, match=message):
      latent_decode(**change(args), scale=0.1, interpret=True)

  def test_fp8_cache_every_value(self):
    # Every finite e4m3 byte, each at even and odd columns (a 255-long cycle over 576-wide rows):
    # the uint16-pair reading, the byte lanes and the column reorder are exact.
    q, cache, tables, lens = make_case(12, n=16, page=16, req_lens=[64, 37],
                                       cache_dtype=jnp.float8_e4m3fn)
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    pattern = np.resize(np.concatenate([codes, codes[:1]]), cache.size).reshape(cache.shape)
    cache = np.where(np.isnan(cache.astype(np.float32)), cache, pattern.view(cache.dtype))
    k_scale = 1 / 448  # the largest e4m3 value dequantizes to 1
    o, lse = latent_decode(q, cache, tables, lens, scale=SCALE, k_scale=k_scale, interpret=True)
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse,
                        *latent_decode_np(q.astype(np.float32), cache, tables, lens, SCALE, L,
                                          k_scale))

  def test_sub_page_steps(self):
    # block_n < page: several inner steps per page, starting mid-page.
    q, cache, tables, lens = make_case(70, n=32, page=64, req_lens=[150, 20, 0])
    o, lse = latent_decode(q, cache, tables, lens, scale=SCALE, block_n=16, num_kv_splits=3,
                           interpret=True)
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse,
                        *latent_decode_np(q.astype(np.float32), cache, tables, lens, SCALE, L))

  def test_splits_one_is_batch_independent(self):
    # One split: a row's bits do not depend on the other rows of the batch.
    q, cache, tables, lens = make_case(60, n=16, page=16, req_lens=[90, 40, 7])
    full = latent_decode(q, cache, tables, lens, scale=0.1, num_kv_splits=1, interpret=True)
    alone = latent_decode(q[1:2], cache, tables[1:2], lens[1:2], scale=0.1, num_kv_splits=1,
                          interpret=True)
    for a, b in zip(full, alone):
      np.testing.assert_array_equal(np.asarray(a[1:2]), np.asarray(b))


def _skip_unless_mosaic_takes(q, kv_cache):
  try:
    backends.get_backend("pallas_mosaic").check(cache_dtype=kv_cache.dtype,
                                                block_size=kv_cache.shape[1], num_heads=q.shape[1])
  except ValueError as e:
    pytest.skip(str(e))
  if q.dtype != jnp.bfloat16:
    pytest.skip(f"pallas_mosaic's decode kernel takes bfloat16 q only, got {q.dtype}")


_WHOLE_PAGE_CASES = [
    (100, 16, 1, 64, [37, 0, 64, 200]),  # one split: stage 1 writes the bf16 output itself
    (101, 32, 7, 64, [199, 3, 0, 48]),  # more splits than most rows have pages
    (102, 20, None, 64, [90, 17]),  # heads padded to a 64-row tile
    (103, 130, 3, 64, [150, 64]),  # 3 head tiles
    (104, 16, 2, 128, [300, 5, 128]),  # 2 bulk copies per page
]


def check_no_races(seed, n, cache_dtype, req_lens=(200, 1, 0), **knobs):
  """The Mosaic decode kernel under the interpreter's race detector (by default requests of 200,
  1 and 0 tokens): no race, and the numpy oracle's results."""
  report = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
  q, cache, tables, lens = make_case(seed, n=n, page=64, req_lens=list(req_lens),
                                     cache_dtype=cache_dtype)
  k_scale = FP8_SCALE if cache_dtype == jnp.float8_e4m3fn else None
  o, lse = mosaic_decode.latent_decode(q, cache, tables, lens, scale=SCALE, k_scale=k_scale,
                                       **knobs,
                                       interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(o)
  assert not report.get_races().races_found
  assert_decode_close(np.asarray(o.astype(jnp.float32)), lse, *latent_decode_np(
      q.astype(np.float32), cache, tables, lens, SCALE, L, k_scale or 1.0))


class TestPallasMosaicDecode(DecodeContract):
  """The Mosaic GPU kernel, in Mosaic GPU's interpreter on CPUs. Contract cases it cannot take
  (f16 or f32; pages not a multiple of 64) skip, naming why; the page-64 cases below cover what
  those test."""
  backend = "pallas_mosaic"

  def decode(self, q, kv_cache, *args, **kwargs):
    _skip_unless_mosaic_takes(q, kv_cache)
    return super().decode(q, kv_cache, *args, **kwargs)

  @pytest.mark.parametrize("seed,n,splits,page,req_lens", _WHOLE_PAGE_CASES)
  def test_bf16_whole_pages(self, seed, n, splits, page, req_lens):
    self.check(*make_case(seed, n=n, page=page, req_lens=req_lens), num_kv_splits=splits)

  def test_multi_token_rows_page_64(self):
    self.check(*make_case(31, n=16, page=64, req_lens=[161, 3], q_lens=[4, 4]), num_kv_splits=2)

  def test_bad_table_entries_page_64(self):
    self.check_bad_table_entries(page=64, req_lens=[200, 150])

  def test_backend_passes_auto_barriers(self, monkeypatch):
    # auto_barriers changes only the compiled form (the interpreter has no automatic barriers to
    # drop): the lowering cases and test_decode_gpu.py check it; here, that the backend passes it.
    config = mosaic_decode.MosaicDecodeConfig(auto_barriers=True)
    assert backend_passes(self.decode, monkeypatch, "auto_barriers", jnp.dtype(jnp.bfloat16),
                          config) == [True]
    with pytest.raises(ValueError, match="auto_barriers must be True or False"):
      mosaic_decode.MosaicDecodeConfig(auto_barriers=0)

  def test_splits_one_is_batch_independent(self):
    q, cache, tables, lens = make_case(61, n=16, page=64, req_lens=[90, 140, 7])
    run = lambda *a: mosaic_decode.latent_decode(*a, scale=0.1, num_kv_splits=1, interpret=True)
    for a, b in zip(run(q, cache, tables, lens), run(q[1:2], cache, tables[1:2], lens[1:2])):
      np.testing.assert_array_equal(np.asarray(a[1:2]), np.asarray(b))

  @pytest.mark.parametrize("cache_dtype,knobs", [
      (jnp.bfloat16, {}), (jnp.bfloat16, {"heads_in": "m"}),
      (jnp.float8_e4m3fn, {"fp8_pipeline": "half_pages"}),
      (jnp.float8_e4m3fn, {"fp8_pipeline": "shared_widening", "heads_in": "m"})])
  def test_no_races_in_the_interpreter(self, cache_dtype, knobs):
    # The interpreter's race detector sees plain loads and stores and bulk copies (the P and
    # rescale hand-off between the warpgroups, the output staged over the page memory, fp8's stage
    # ring and its widening into one or two slots), not the operand reads of wgmma. jax 0.11.2
    # reports it only through a private module. At 16 heads "serial" and "shared_widening" run
    # heads in N (the TestPallasMosaicDecodeHeadsN classes' race cases); "shared_widening" in M is
    # the fp8 default above 16 heads. bf16 in M: warpgroup 0 waits for P's buffer while S runs.
    check_no_races(62, 16, cache_dtype, num_kv_splits=2, **knobs)

  @pytest.mark.parametrize("batch,n,seq,splits,cache_dtype,knobs", [
      (128, 128, 8192, None, jnp.bfloat16, {}), (128, 16, 32768, None, jnp.bfloat16, {}),
      (4, 20, 4096, 1, jnp.bfloat16, {}),
      (128, 128, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "serial"}),
      (128, 16, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "serial"}),
      (128, 128, 4096, None, jnp.float8_e4m3fn, {"fp8_pipeline": "half_pages"}),
      (128, 16, 8192, 1, jnp.float8_e4m3fn, {"fp8_pipeline": "half_pages"}),
      (128, 128, 4096, None, jnp.float8_e4m3fn, {"fp8_pipeline": "shared_widening"}),
      (128, 16, 8192, 1, jnp.float8_e4m3fn, {"fp8_pipeline": "shared_widening"}),
      # in_slot (lane-level in-place widening): the timed shape, and 4 splits at 16 heads.
      (128, 128, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "in_slot"}),
      (128, 16, 8192, 4, jnp.float8_e4m3fn, {"fp8_pipeline": "in_slot"}),
      # rescale_slack (the consumers' lane-level skip of the rescale): bf16 at the timed shape
      # and several splits, the fp8 pipelines in M at 128 heads.
      *[(128, 128, 8192, splits, dtype, {"rescale_slack": RESCALE_SLACK, **knobs})
        for splits, dtype, knobs in ((None, jnp.bfloat16, {}), (4, jnp.bfloat16, {}),
                                     (None, jnp.float8_e4m3fn, {"fp8_pipeline": "half_pages"}),
                                     (None, jnp.float8_e4m3fn, {"fp8_pipeline": "in_slot"}))],
      # wide_widening's lane code: the default pipeline at the timed shape (one split) and 4 splits,
      # half_pages at 128 heads. "serial" with wide_widening at 128 heads traces the program of
      # plain "serial" above, and shared_widening in N at 16 heads (wide_widening, one split) that
      # of (128, 16, 8192, 1, shared_widening) above: equal jaxprs, so neither is listed again.
      *[(128, 128, 8192, splits, jnp.float8_e4m3fn, {"fp8_pipeline": pipeline,
                                                     "wide_widening": True})
        for pipeline, splits in (("shared_widening", 1), ("shared_widening", 4),
                                 ("half_pages", None))],
      # heads_in="n": a transposed float32 store does not lower (the partials are staged as they
      # are), so every output form: one split (bf16, transposed), several and fixed splits
      # (float32), at 16 and 32 heads, both caches.
      *[(32, n, 8192, splits, dtype, {"heads_in": "n", "fp8_pipeline": pipeline, **fixed})
        for n in (16, 32)
        for dtype, pipeline in ((jnp.bfloat16, "serial"), (jnp.float8_e4m3fn, "serial"),
                                (jnp.float8_e4m3fn, "shared_widening"),
                                (jnp.float8_e4m3fn, "register_a"))
        for splits, fixed in ((1, {}), (4, {}), (None, {"split_tokens": 2048}))],
      (128, 16, 8192, None, jnp.bfloat16, {"heads_in": "n"}),
      # register_a's f16 keys (e4m3_scores=False), its timed shape (one split) with 2-byte key
      # loads (wide_keys=False); only the lowerings (and the GPU) run its register A operands,
      # which the interpreter takes through shared memory.
      (128, 16, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a", "e4m3_scores": False,
                                                "wide_keys": False}),
      # Its wide_keys (lane-level 16-byte key loads): every output form, both head tiles.
      *[(batch, n, 8192, splits, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a",
                                                     "e4m3_scores": False, **fixed})
        for batch, n, splits, fixed in ((128, 16, None, {}), (32, 32, 4, {}),
                                        (32, 32, None, {"split_tokens": 2048}))],
      # register_a's wide_values=False (the shuffled relayout of V^T's fragments).
      (128, 16, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a",
                                                "wide_values": False}),
      # The default's wide_values (lane-level value loads, 16 bytes at 16 heads, 8 at 32) beside
      # the f16 keys: the timed shapes (one split) and float32 partials at 16 heads.
      *[(batch, n, 8192, splits, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a",
                                                     "e4m3_scores": False})
        for batch, n, splits in ((128, 32, None), (32, 16, 4))],
      # register_a's default e4m3_scores (fp8 wgmma from the e4m3 slot, q's two e4m3 parts
      # transposed as B): the timed shapes (one split), both head tiles. Its float32 partials and
      # fixed splits are the heads_in="n" cases above (register_a runs heads in N by default:
      # equal jaxprs).
      *[(128, n, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a"}) for n in (16, 32)],
      # Its other promotion chunks (the default is 192; 576: one accumulation) at the timed shapes.
      *[(128, n, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a",
                                                 "e4m3_promote_cols": cols})
        for n in (16, 32) for cols in (64, 128, 576)],
      # pages_per_step=2 (register_a's default: two ring slots a step, P^T [heads, 128]; a ring
      # of 4 by default): the timed shapes (one split), float32 partials and fixed splits, the
      # f16 keys, the shuffled value relayout and one accumulation (576); a ring of 5 at 16 heads.
      *[(batch, n, 8192, splits, jnp.float8_e4m3fn, {"pages_per_step": 2, **knobs})
        for batch, n, splits, knobs in (
            (128, 16, None, {}), (128, 32, None, {}), (32, 16, 4, {}),
            (32, 32, None, {"split_tokens": 2048}), (32, 16, None, {"split_tokens": 2048}),
            (128, 16, None, {"e4m3_scores": False}), (128, 16, None, {"wide_values": False}),
            (128, 32, None, {"e4m3_promote_cols": 576}), (128, 16, None, {"ring_slots": 5}),
            (32, 16, 4, {"ring_slots": 5}))],
      # One page a step, with rings of 4 and 5 (5 fits at 16 and 32 heads: 231,528 bytes at 32).
      *[(128, n, 8192, None, jnp.float8_e4m3fn, {"fp8_pipeline": "register_a",
                                                 "pages_per_step": 1, "ring_slots": ring})
        for n in (16, 32) for ring in (4, 5)],
      # auto_barriers=True, Pallas's barriers (the default False: bf16 only, fp8 keeps them).
      *[(batch, n, seq, splits, dtype, {"auto_barriers": True})
        for batch, n, seq, splits, dtype in ((128, 128, 8192, None, jnp.bfloat16),
                                             (32, 128, 8192, 4, jnp.bfloat16),
                                             (128, 16, 32768, None, jnp.bfloat16),
                                             (128, 128, 8192, None, jnp.float8_e4m3fn))]])
  def test_lowers_for_hopper(self, batch, n, seq, splits, cache_dtype, knobs):
    # Lowering for CUDA (it runs on this CPU) checks what the interpreter does not: wgmma operand
    # shapes and layouts, bulk-copy boxes, and that shared memory fits a Hopper block's 227 KB.
    q = jax.ShapeDtypeStruct((batch, n, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch * seq // 64, 64, 576), cache_dtype)
    tables = jax.ShapeDtypeStruct((batch, seq // 64), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
    traced = mosaic_decode.latent_decode.trace(q, cache, tables, lens, scale=SCALE,
                                               k_scale=k_scale, num_kv_splits=splits, **knobs)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("_no_auto_barriers" in text) == (not knobs.get("auto_barriers", False)
                                             and cache_dtype == jnp.bfloat16)

  def test_default_splits_fill_one_wave(self):
    # As many splits as one wave of one program a SM holds (132 on the H200, what the CPU
    # assumes): the timed shapes' picks (num_kv_splits_for's docstring), and vLLM's length cap
    # still applies. The Triton kernels' rule (about 2 programs a SM) beside.
    assert mosaic_decode.num_kv_splits_for(128, 128, 8192) == 1  # 256 programs
    assert mosaic_decode.num_kv_splits_for(128, 16, 8192) == 1
    assert mosaic_decode.num_kv_splits_for(64, 128, 8192) == 1
    assert mosaic_decode.num_kv_splits_for(32, 16, 8192) == 4
    assert mosaic_decode.num_kv_splits_for(20, 16, 8192) == 6  # not only powers of two
    assert mosaic_decode.num_kv_splits_for(1, 16, 32768) == 64
    assert mosaic_decode.num_kv_splits_for(3, 16, 320) == 1
    assert default_num_kv_splits(128, 1, 8192) == 4

  def test_register_split_fits_the_launch(self):
    # setmaxnreg.inc past the registers the block was launched with waits forever (a hang on the
    # H200, not an error), and the interpreter does not model registers. setmaxnreg takes
    # multiples of 8 from 24 to 256.
    for consumer, memory in mosaic_decode._REGS.values():
      assert 2 * consumer + memory <= register_pool(3) == 3 * 168
      assert all(r % 8 == 0 and 24 <= r <= 256 for r in (consumer, memory))

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "one row per query token"),
      (lambda a: {**a, "q": a["q"][..., :-64]}, "head dim"),
      (lambda a: {**a, "kv_lora_rank": 384}, "multiple of 256"),
      (lambda a: {**a, "kv_lora_rank": 576}, r"kv_lora_rank must be in \[1, 576\)"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "floating point"),
      (lambda a: {**a, "q": jnp.pad(a["q"], ((0, 0), (0, 0), (0, 64))),
                  "kv_cache": jnp.pad(a["kv_cache"], ((0, 0), (0, 0), (0, 64)))}, "at most 576"),
      (lambda a: {**a, "kv_cache": a["kv_cache"][:, :32]}, "multiple of 64"),
      (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "bfloat16"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float16)}, "float8_e4m3fn"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn)}, "needs k_scale"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn),
                  "k_scale": jnp.ones(2)}, "scalar"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "k_scale": 1.0}, "takes none"),
      (lambda a: {**a, "num_kv_splits": 0}, "num_kv_splits"),
      (lambda a: {**a, "num_kv_splits": 2, "split_tokens": 64}, "not both"),
      (lambda a: {**a, "split_tokens": 96}, "multiple of the kernel's step"),
      (lambda a: {**a, "fp8_pipeline": "quarter_pages"}, "fp8_pipeline must be None or one of"),
  ])
  def test_bad_input_raises(self, change, message):
    q, cache, tables, lens = (jnp.asarray(a)
                              for a in make_case(51, n=16, page=64, req_lens=[20, 5]))
    args = dict(q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, kv_lora_rank=512)
    with pytest.raises(ValueError, match=message):
      mosaic_decode.latent_decode(**change(args), scale=0.1, interpret=True)

  @pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
  def test_non_positive_scale_raises(self, scale):
    # The kernel takes a row's maximum score before scaling it (`common.softmax_step`).
    q, cache, tables, lens = (jnp.asarray(a)
                              for a in make_case(51, n=16, page=64, req_lens=[20, 5]))
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
      mosaic_decode.latent_decode(q, cache, tables, lens, kv_lora_rank=512, scale=scale,
                                  interpret=True)

  def test_more_tokens_than_the_grid_takes_raises(self):
    # Shapes only (65536 rows of queries would be 1.2 GB): the check runs while tracing.
    q, cache, tables, lens = (jnp.asarray(a)
                              for a in make_case(51, n=16, page=64, req_lens=[20, 5]))
    rows = lambda a: jax.ShapeDtypeStruct((mosaic_decode.MAX_GRID_TOKENS + 1,) + a.shape[1:],
                                          a.dtype)
    decode = lambda q, tables, lens: mosaic_decode.latent_decode(
        q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, kv_lora_rank=512, scale=0.1)
    with pytest.raises(ValueError, match="at most 65535 tokens"):
      jax.eval_shape(decode, rows(q), rows(tables), rows(lens))
    jax.eval_shape(decode, q, tables, lens)  # the same call at the real rows traces


def backend_passes(decode, monkeypatch, field, cache_dtype, config=None):
  """What one call of the backend's `decode` hands the Mosaic kernel as `field` (with `config` as
  the backend's MOSAIC_DECODE_CONFIG where given): [value], or a KeyError if it passes none."""
  seen = []

  def latent_decode(*args, **kwargs):
    seen.append(kwargs[field])
    return None, None

  monkeypatch.setattr(mosaic_decode, "latent_decode", latent_decode)
  if config is not None:
    monkeypatch.setattr(backends, "MOSAIC_DECODE_CONFIG", config)
  q, cache, tables, lens = make_case(112, n=16, page=64, req_lens=[5], cache_dtype=cache_dtype)
  decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(tables), jnp.asarray(lens),
         k_scale=FP8_SCALE if cache_dtype == jnp.float8_e4m3fn else None)
  return seen


class _MosaicDecodeKnob(DecodeContract):
  """The contract through the backend's MOSAIC_DECODE_CONFIG with one field, `knob`, set to
  `value` (and the fields of `others`); where the field changes one cache dtype's program only
  (`mosaic_decode.DTYPE_KNOBS`), cases of the other skip."""
  backend = "pallas_mosaic"
  knob: str
  value: str
  others: dict = {}

  @pytest.fixture(autouse=True)
  def _config(self, monkeypatch):
    monkeypatch.setattr(backends, "MOSAIC_DECODE_CONFIG",
                        mosaic_decode.MosaicDecodeConfig(**{self.knob: self.value}, **self.others))

  def decode(self, q, kv_cache, *args, **kwargs):
    dtype = mosaic_decode.DTYPE_KNOBS.get(self.knob)
    if dtype is not None and kv_cache.dtype != dtype:
      pytest.skip(f"{self.knob} only changes {dtype.name} caches")
    _skip_unless_mosaic_takes(q, kv_cache)
    return super().decode(q, kv_cache, *args, **kwargs)

  def test_backend_passes_the_knob(self, monkeypatch):
    # Without this the cases would also pass on the default config.
    dtype = mosaic_decode.DTYPE_KNOBS.get(self.knob, jnp.dtype(jnp.bfloat16))
    assert backend_passes(self.decode, monkeypatch, self.knob, dtype) == [self.value]


class TestPallasMosaicDecodeHalfPages(_MosaicDecodeKnob):
  """The Mosaic kernel's fp8_pipeline="half_pages" (two 32-row bf16 slots, 32-token consumer
  steps) through the backend's MOSAIC_DECODE_CONFIG, at the contract's fp8 head counts (16 and
  128): the rows a half page can cut (lengths ending in either half or on its edge, a half with no
  row that counts), bad table entries. bf16 caches ignore the pipeline (TestPallasMosaicDecode)."""
  knob, value = "fp8_pipeline", "half_pages"
  # The fp8 default with heads in M (TestPallasMosaicDecode's fp8 cases): the half-page cases
  # below take the contract's fp8 head counts (16 and 128) and splits, with lengths that cut half
  # pages.
  test_fp8_cache = None

  @pytest.mark.parametrize("seed,n,splits", [(110, 16, 3), (111, 128, None)])
  def test_fp8_half_page_edges(self, seed, n, splits):
    case = make_case(seed, n=n, page=64, req_lens=[32, 33, 95, 1, 64, 0, 161, 31],
                     cache_dtype=jnp.float8_e4m3fn)
    self.check(*case, k_scale=FP8_SCALE, num_kv_splits=splits)

  def test_fp8_bad_table_entries(self):
    self.check_bad_table_entries(page=64, req_lens=[200, 150], cache_dtype=jnp.float8_e4m3fn)


class TestPallasMosaicDecodeSerialFp8(TestPallasMosaicDecodeHalfPages):
  """The other fp8 pipeline, "serial" (one 64-row bf16 slot; the SWEEP's alternative), on the same
  cases."""
  value = "serial"
  # At 16 heads "serial" runs heads in N: TestPallasMosaicDecodeHeadsN's programs (its bad-table
  # case is this one, seed 40); heads in M at 128 here.
  test_fp8_bad_table_entries = None

  @pytest.mark.parametrize("seed,n,splits", [(111, 128, None)])
  def test_fp8_half_page_edges(self, seed, n, splits):
    super().test_fp8_half_page_edges(seed, n, splits)


class TestPallasMosaicDecodeSharedWidening(TestPallasMosaicDecodeHalfPages):
  """fp8_pipeline="shared_widening" (half pages, warpgroup 1 widening its value columns of the
  half-page after next, the memory warpgroup the rest) on the same cases: every half-page's
  columns come from two warpgroups, and the stage ring is refilled only once both are done."""
  value = "shared_widening"
  # At 16 heads it runs heads in N, the programs of TestPallasMosaicDecodeHeadsNSharedWidening (the
  # same bad-table case, seed 40); the contract's fp8 case and the half-page edges at 128 (heads
  # in M, the fp8 default there before wide_widening) stay.
  test_fp8_bad_table_entries = None

  @pytest.mark.parametrize("seed,n,page,splits,k_scale", [(12, 128, 64, 2, FP8_SCALE)])
  def test_fp8_cache(self, seed, n, page, splits, k_scale):
    DecodeContract.test_fp8_cache(self, seed, n, page, splits, k_scale)  # the parent skips it

  @pytest.mark.parametrize("seed,n,splits", [(111, 128, None)])
  def test_fp8_half_page_edges(self, seed, n, splits):
    super().test_fp8_half_page_edges(seed, n, splits)


class TestPallasMosaicDecodeInSlot(TestPallasMosaicDecodeHalfPages):
  """fp8_pipeline="in_slot" (each page's e4m3 bands land inside the bf16 slot they are widened
  into; bf16's 64-token consumer steps), heads in M: pages cut anywhere (rows past the length and
  behind bad table entries zeroed as they are widened) at 128 heads, bad table entries and a
  contract fp8 case (NaN in every unused slot, shuffled tables, 4 splits: splits with no, one and
  several pages, the memory warpgroup's refill order and its last waits) at 16. The interpreter
  widens through Pallas arrays from the bands' places; the lane-level form lowers
  (test_lowers_for_hopper) and compiles without spills (ptxas, RESULTS.md). No race-detector
  case: the detector refuses any read of a `RefUnion` through another member than the last
  write's, which the slots' e4m3 view does by design (mosaic_sparse's "in_place" the same)."""
  value = "in_slot"

  @pytest.mark.parametrize("seed,n,page,splits,k_scale", [(10, 16, 64, 4, FP8_SCALE)])
  def test_fp8_cache(self, seed, n, page, splits, k_scale):
    DecodeContract.test_fp8_cache(self, seed, n, page, splits, k_scale)  # the parent skips it

  @pytest.mark.parametrize("seed,n,splits", [(111, 128, None)])
  def test_fp8_half_page_edges(self, seed, n, splits):
    super().test_fp8_half_page_edges(seed, n, splits)

  def test_bit_identical_to_serial(self):
    # "serial" widens the same pages from a stage of their own into one slot and its consumers
    # run the same 64-token steps: the same bits (the GPU's lane-level form: test_decode_gpu.py).
    q, cache, tables, lens = make_case(53, n=128, page=64, req_lens=[200, 64, 1, 0],
                                       cache_dtype=jnp.float8_e4m3fn)
    run = lambda pipeline: mosaic_decode.latent_decode(
        q, cache, tables, lens, scale=SCALE, k_scale=FP8_SCALE, heads_in="m", num_kv_splits=2,
        fp8_pipeline=pipeline, interpret=True)
    for a, b in zip(run("in_slot"), run("serial")):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_gpu_form_without_wide_widening_raises(self):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        52, n=16, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="in_slot\" widens in place in lane-level code only"):
      mosaic_decode.latent_decode(q, cache, tables, lens, scale=0.1, k_scale=1.0,
                                  fp8_pipeline="in_slot", wide_widening=False)


class _IntArith:
  """Mosaic GPU's arith ops on Python ints: runs lane-level address code for one lane at a time."""

  class CmpIPredicate:
    slt = "slt"

  constant = staticmethod(lambda _type, v: v)
  addi = staticmethod(lambda a, b: a + b)
  muli = staticmethod(lambda a, b: a * b)
  remui = staticmethod(lambda a, b: a % b)
  divui = staticmethod(lambda a, b: a // b)
  xori = staticmethod(lambda a, b: a ^ b)
  select = staticmethod(lambda c, a, b: a if c else b)
  cmpi = staticmethod(lambda pred, a, b: a < b)


def test_in_slot_widening_reads_every_byte_before_it_is_overwritten(monkeypatch):
  # The GPU's in-place widening (`_wide_widen_rows(..., in_slot=True)`), which neither the
  # interpreter nor its race detector can check: its own lane-level address code, run lane by lane
  # on ints, recording each lane's 16-byte loads (slot bytes as e4m3 bands), 16-byte stores (the
  # same bytes as bf16 rows) and warp barriers in program order. Checked: every bf16 byte stored
  # once, every staged e4m3 byte loaded once (`_IN_SLOT_BANDS`' places), each stored unit from
  # the right row, band and columns; no warp stores where another warp loads or stores; a lane
  # stores over bytes its warp loaded only after they were loaded and a warp barrier since.
  lane = {"tid": 0}
  events = {}  # tid -> [(kind, byte offset or None, load id)]

  class Scalar:
    def __init__(self, v):
      self.registers = np.asarray(v)

  def inline_mgpu(**_):
    def wrap(body):
      def run(stage_slot, dst, first, valid):
        for tid in range(128):
          lane["tid"] = tid
          events[tid] = []
          body(None, stage_slot, dst, Scalar(first), Scalar(valid))
      return run
    return wrap

  def wide_load(_ref, base, offset):
    events[lane["tid"]].append(("load", base + offset, len(events[lane["tid"]])))
    return len(events[lane["tid"]]) - 1

  def wide_store(_ref, words, _convert, offsets):
    for h, (base, offset) in enumerate(offsets):
      events[lane["tid"]].append(("store", base + offset, (words, h)))

  class Utils:
    warp_barrier = staticmethod(lambda: events[lane["tid"]].append(("barrier", None, None)))

  class Plgpu:
    def __getattr__(self, name):
      return inline_mgpu if name == "inline_mgpu" else getattr(plgpu, name)

  class Ir:
    class IntegerType:
      get_signless = staticmethod(lambda bits: bits)

  for module in (mosaic_decode, mosaic_lanes):
    monkeypatch.setattr(module, "arith", _IntArith)
    monkeypatch.setattr(module, "ir", Ir)
  monkeypatch.setattr(mosaic_decode, "plgpu", Plgpu())
  monkeypatch.setattr(mosaic_decode, "mgpu_utils", Utils)
  monkeypatch.setattr(mosaic_decode, "wide_load", wide_load)
  monkeypatch.setattr(mosaic_decode, "wide_store", wide_store)
  monkeypatch.setattr(mosaic_decode, "warpgroup_thread", lambda: (
      lane["tid"], lane["tid"] % 32, lane["tid"] // 32))
  d = 576
  shaped = lambda *shape: type("Ref", (), {"shape": shape})()
  mosaic_decode._wide_widen_rows(shaped(128, d), shaped(64, d), 0, 64, range(d // 64),
                                 in_slot=True)

  # The layouts' one definition (`mosaic_lanes.swizzled_unit_offset`), inverted.
  e4m3_at = {mosaic_lanes.swizzled_unit_offset(r, u, d, 64): (r, u)
             for r in range(128) for u in range(d // 16)}
  bf16_at = {mosaic_lanes.swizzled_unit_offset(r, u, 2 * d, 128): (r, u)
             for r in range(64) for u in range(2 * d // 16)}
  kinds = {tuple(kind for kind, _, _ in ev) for ev in events.values()}
  assert len(kinds) == 1  # no lane diverges: event k is the same instruction in every lane
  loads, stores = {}, {}  # byte offset of a 16-byte unit -> (tid, event index)
  for tid, ev in events.items():
    for k, (kind, offset, what) in enumerate(ev):
      if kind == "load":
        assert offset not in loads and offset in e4m3_at
        loads[offset] = (tid, k)
      elif kind == "store":
        assert offset not in stores and offset in bf16_at
        stores[offset] = (tid, k)
        row, unit = bf16_at[offset]
        load_id, h = what
        src_row, src_unit = e4m3_at[ev[load_id][1]]
        assert src_row // 8 == mosaic_decode._IN_SLOT_BANDS[row // 8] and src_row % 8 == row % 8
        assert 8 * unit == 16 * src_unit + 8 * h  # the unit's 16 values, 8 a bf16 unit
  assert len(stores) == 64 * 2 * d // 16  # every bf16 byte of the slot
  staged = {8 * band + r for band in mosaic_decode._IN_SLOT_BANDS for r in range(8)}
  assert {e4m3_at[o][0] for o in loads} == staged and len(loads) == 64 * d // 16
  for offset, (tid, k) in stores.items():  # 16-byte units, aligned, on both sides
    if offset in loads:
      loader, j = loads[offset]
      assert loader // 32 == tid // 32, (tid, loader)  # no cross-warp overwrite
      between = [kind for kind, _, _ in events[tid][j + 1:k]]
      assert j < k and (loader == tid or "barrier" in between), (tid, loader, j, k)


class TestPallasMosaicDecodeWideWidening(_MosaicDecodeKnob):
  """wide_widening=False (the widening pipelines widen e4m3 tiles into the bf16 slots through
  Pallas arrays, not the default's lane-level code; fp8_pipeline=None then takes
  "shared_widening" with heads in M) through the backend's MOSAIC_DECODE_CONFIG. The interpreter
  runs the Pallas-level widening either way (it runs no lane code), so these check the knob's
  plumbing and rules and which programs it changes; the CUDA lowerings
  (TestPallasMosaicDecode.test_lowers_for_hopper) build the lane code and the -m gpu tests
  (tests/test_decode_gpu.py) run it, bit-identical to wide_widening=False."""
  knob, value = "wide_widening", False
  # The interpreter's program is the default's but for the pipeline: the contract's other cases
  # would repeat TestPallasMosaicDecode's. Its fp8 case at 128 heads (shared_widening in M) stays.
  test_bf16 = None
  test_other_dtypes = None
  test_multi_token_rows = None
  test_batch_invariant = None
  test_bad_backend_input_raises = None
  test_bad_table_entries_inside_length_are_masked = None

  @pytest.mark.parametrize("seed,n,page,splits,k_scale", [(12, 128, 64, 2, FP8_SCALE)])
  def test_fp8_cache(self, seed, n, page, splits, k_scale):
    super().test_fp8_cache(seed, n, page, splits, k_scale)

  @staticmethod
  def jaxpr(n, cache_dtype, **knobs):
    """The GPU program at B=32 and n heads, 128 pages of 64 a row, as text."""
    args = (jax.ShapeDtypeStruct((32, n, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((32 * 128, 64, 576), cache_dtype),
            jax.ShapeDtypeStruct((32, 128), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.int32))
    k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
    return str(mosaic_decode.latent_decode.trace(*args, scale=SCALE, k_scale=k_scale,
                                                 **knobs).jaxpr)

  @pytest.mark.parametrize("value", [1, None, "yes"])
  def test_knob_must_be_a_bool(self, value):
    with pytest.raises(ValueError, match="wide_widening must be True or False"):
      mosaic_decode.MosaicDecodeConfig(wide_widening=value)

  def test_on_by_default(self):
    assert mosaic_decode.CONFIG.wide_widening is True

  @pytest.mark.parametrize("heads_in,wide,want", [
      ("m", True, "in_slot"), ("m", False, "shared_widening"), ("n", True, "register_a"),
      ("n", False, "register_a")])
  def test_it_picks_the_heads_in_m_pipeline(self, heads_in, wide, want):
    # in_slot only with the lane-level widening (it has no Pallas-level form on the GPU; session
    # 29: 1.18x half_pages), shared_widening with the Pallas-level one (session 18: 1.07-1.21x
    # half_pages').
    assert mosaic_decode.default_fp8_pipeline(heads_in, wide) == want

  @pytest.mark.parametrize("n,knobs", [(128, {}), (16, {"heads_in": "n"})])
  def test_bf16_cache_ignores_it(self, n, knobs):
    assert (self.jaxpr(n, jnp.bfloat16, wide_widening=True, **knobs)
            == self.jaxpr(n, jnp.bfloat16, **knobs))

  def test_register_a_ignores_it(self):
    # It widens nothing (the consumers convert their tiles in registers).
    assert (self.jaxpr(16, jnp.float8_e4m3fn, fp8_pipeline="register_a", wide_widening=True)
            == self.jaxpr(16, jnp.float8_e4m3fn, fp8_pipeline="register_a"))

  @pytest.mark.parametrize("n,knobs", [
      (128, {}), (128, {"fp8_pipeline": "half_pages"}), (128, {"fp8_pipeline": "serial"}),
      (16, {"fp8_pipeline": "shared_widening", "heads_in": "n"})])
  def test_it_changes_the_widening_programs(self, n, knobs):
    # (rescale_slack off: its lane-level skip is inline Mosaic GPU code too)
    on, off, default = (self.jaxpr(n, jnp.float8_e4m3fn, rescale_slack=None, **extra, **knobs)
                        for extra in ({"wide_widening": True}, {"wide_widening": False}, {}))
    assert on == default != off
    assert "inline_mgpu" in on and "inline_mgpu" not in off

  def test_unit_factor_is_bf16_two_to_the_bias(self):
    # The lane code's multiply with the scale 1: bf16(2^120) in both halves.
    bits = int(np.array(2.0 ** mosaic_lanes.WIDE_BIAS, np.float32).view(np.uint32)) >> 16
    assert mosaic_lanes.WIDE_UNIT_FACTOR == bits << 16 | bits


class TestPallasMosaicDecodeHeadsN(_MosaicDecodeKnob):
  """heads_in="n" (N <= 32 heads as wgmma's N: S^T = K Q^T, O^T = V^T P^T; fp8 caches through
  fp8_pipeline "serial") through the backend's MOSAIC_DECODE_CONFIG: the contract's page-64 fp8
  cases of at most 32 heads, and 8, 16, 20 and 32 heads (padded to 16 or 32) with one split (bf16
  output stored transposed) and several (float32 partials written [T, splits, L, Np]), lengths
  cutting pages, bad table entries."""
  knob, value, others = "heads_in", "n", {"fp8_pipeline": "serial"}
  fp8_only = False  # a subclass that changes only the fp8 pipeline skips the bf16 cases
  # bf16 takes heads in N by default up to 32 heads: the contract's bf16 cases (and the
  # batch-invariant mode's fixed splits) are TestPallasMosaicDecode's, the same programs on the
  # same inputs.
  test_bf16 = None
  test_batch_invariant = None

  def decode(self, q, kv_cache, *args, **kwargs):
    if q.shape[1] > HEADS_N_TILES[-1]:
      pytest.skip(f"heads_in=\"n\" takes at most {HEADS_N_TILES[-1]} heads")
    if self.fp8_only and kv_cache.dtype != jnp.float8_e4m3fn:
      pytest.skip("fp8_pipeline only changes fp8 caches")
    return super().decode(q, kv_cache, *args, **kwargs)

  @pytest.mark.parametrize("seed,n,splits,cache_dtype", [
      (120, 16, 1, jnp.bfloat16), (121, 32, 3, jnp.bfloat16), (122, 20, 2, jnp.bfloat16),
      (123, 8, 1, jnp.bfloat16), (124, 16, 1, jnp.float8_e4m3fn),
      (125, 32, 4, jnp.float8_e4m3fn)])
  def test_heads_n(self, seed, n, splits, cache_dtype):
    case = make_case(seed, n=n, page=64, req_lens=[1, 161, 0, 64, 95, 300],
                     cache_dtype=cache_dtype)
    self.check(*case, num_kv_splits=splits,
               k_scale=FP8_SCALE if cache_dtype == jnp.float8_e4m3fn else None)

  @pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn])  # bf16: TestPallasMosaicDecode's
  def test_bad_table_entries_page_64(self, cache_dtype):
    self.check_bad_table_entries(page=64, req_lens=[200, 150], cache_dtype=cache_dtype)

  @pytest.mark.parametrize("n,cache_dtype", [(16, jnp.bfloat16), (32, jnp.float8_e4m3fn),
                                             (16, jnp.float8_e4m3fn)])
  def test_no_races_in_the_interpreter(self, n, cache_dtype):
    # The transposed P hand-off, the softmax's cross-warp reductions and both output stagings
    # (bf16 transposed with one split, float32 as it is with two) under the race detector.
    if self.fp8_only and cache_dtype != jnp.float8_e4m3fn:
      pytest.skip("fp8_pipeline only changes fp8 caches")
    for splits in (1, 2):
      check_no_races(126, n, cache_dtype, num_kv_splits=splits, heads_in="n",
                     fp8_pipeline=self.others["fp8_pipeline"])

  @pytest.mark.parametrize("n,cache_dtype,pipeline,want", [
      # Timed (session 12): "n" 1.04-1.10x at 16 heads (bf16), 1.00-1.04x (fp8 shared_widening).
      (16, jnp.bfloat16, "shared_widening", "n"), (8, jnp.bfloat16, "shared_widening", "n"),
      (16, jnp.float8_e4m3fn, "shared_widening", "n"), (16, jnp.float8_e4m3fn, "serial", "n"),
      (16, jnp.float8_e4m3fn, "half_pages", "m"),  # its 32-token steps cannot be S^T's rows
      # bf16 up to 32 heads (session 13: 1.01-1.05x at 32).
      (20, jnp.bfloat16, None, "n"), (32, jnp.bfloat16, None, "n"),
      # fp8 up to 32 heads (session 14, 32 heads: "serial" 1.27x in N).
      (32, jnp.float8_e4m3fn, "serial", "n"), (32, jnp.float8_e4m3fn, "half_pages", "m"),
      # The default pipeline (None): "register_a" in N (session 13: 1.23-1.27x at 16 heads;
      # session 14: 1.45x "m" with "shared_widening" at 32).
      (16, jnp.float8_e4m3fn, None, "n"), (32, jnp.float8_e4m3fn, None, "n")])
  def test_default_heads_in(self, n, cache_dtype, pipeline, want):
    # heads_in=None (the default) traces the program of `default_heads_in`'s pick, another than
    # the other one's.
    q = jax.ShapeDtypeStruct((32, n, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((32 * 128, 64, 576), cache_dtype)
    tables = jax.ShapeDtypeStruct((32, 128), jnp.int32)
    lens = jax.ShapeDtypeStruct((32,), jnp.int32)
    k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
    assert mosaic_decode.default_heads_in(n, cache_dtype == jnp.float8_e4m3fn, pipeline) == want
    jaxpr = lambda **knobs: str(mosaic_decode.latent_decode.trace(
        q, cache, tables, lens, scale=SCALE, k_scale=k_scale, fp8_pipeline=pipeline,
        **knobs).jaxpr)
    assert jaxpr() == jaxpr(heads_in=want)
    if cache_dtype == jnp.bfloat16 or pipeline != "half_pages":
      assert jaxpr() != jaxpr(heads_in="m" if want == "n" else "n")

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": jnp.zeros((2, 33, 576), jnp.bfloat16)}, "at most 32 heads"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn), "k_scale": 1.0,
                  "fp8_pipeline": "half_pages"}, "takes fp8_pipeline serial or shared_widening"),
      (lambda a: {**a, "heads_in": "k"}, "heads_in must be None or one of"),
  ])
  def test_bad_input_raises(self, change, message):
    q, cache, tables, lens = (jnp.asarray(a)
                              for a in make_case(127, n=16, page=64, req_lens=[20, 5]))
    args = dict(q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, heads_in="n")
    with pytest.raises(ValueError, match=message):
      mosaic_decode.latent_decode(**change(args), scale=0.1, interpret=True)


class TestPallasMosaicDecodeHeadsNSharedWidening(TestPallasMosaicDecodeHeadsN):
  """heads_in="n" with fp8_pipeline="shared_widening" (64-token steps into one bf16 slot:
  warpgroup 1 widens its value columns of page i + 1 right after its P V of page i, the memory
  warpgroup the other tiles; ready takes both, a stage slot is refilled once both read it): the
  fp8 cases of the same tests."""
  others = {"fp8_pipeline": "shared_widening"}
  fp8_only = True
  # Narrowed for the suite's time: the parent's rule and bad-input cases trace the same code.
  test_default_heads_in = None
  test_bad_input_raises = None

  @pytest.mark.parametrize("n,cache_dtype", [(16, jnp.float8_e4m3fn)])
  def test_no_races_in_the_interpreter(self, n, cache_dtype):
    super().test_no_races_in_the_interpreter(n, cache_dtype)


class TestPallasMosaicDecodeHeadsNRegisterA(TestPallasMosaicDecodeHeadsN):
  """heads_in="n" with fp8_pipeline="register_a" (no bf16 slot: e4m3 pages in a ring of 4 slots;
  by default, e4m3_scores, S^T by fp8 wgmma from the slot itself and q's two exact e4m3 parts as
  B, combined as hi + 2^-4 lo; warpgroup 1 converting its V^T tiles to f16 as wgmma's A operand,
  P^T f16; tail rows zeroed in the e4m3 slot by a bitwise AND and their scores masked by a
  select): the fp8 cases of the same tests, q past f16's range and far below e4m3's. The
  interpreter form hands the converted tiles to wgmma through shared memory (it takes no register
  A) and sums fp8 products in float32, so these check the loads, transposed views, conversions,
  the split and masking; the CUDA lowering (`test_lowers_for_hopper`) and the -m gpu tests check
  the register form and Hopper's fp8 accumulation."""
  others = {"fp8_pipeline": "register_a"}
  fp8_only = True
  test_default_heads_in = None  # the parent's rule; its own below
  # The fp8 default at 16 heads: the contract's fp8 case there (seed 10) is TestPallasMosaicDecode's
  # (the same program and inputs); the others take more than 32 heads or 16-token pages.
  test_fp8_cache = None

  @pytest.mark.parametrize("n,cache_dtype", [(16, jnp.float8_e4m3fn)])
  def test_no_races_in_the_interpreter(self, n, cache_dtype):
    super().test_no_races_in_the_interpreter(n, cache_dtype)

  @pytest.mark.parametrize("n,want", [(16, "n"), (20, "n"), (32, "n")])
  def test_register_a_defaults_to_heads_n(self, n, want):
    # It has no "m" form: heads_in=None runs "n" at every head count "n" takes.
    assert mosaic_decode.default_heads_in(n, True, "register_a") == want

  @pytest.mark.parametrize("n,heads_in,want", [(16, None, "register_a"), (32, "n", "register_a"),
                                                (32, None, "register_a"),
                                                (32, "m", "in_slot"),
                                                (128, None, "in_slot")])
  def test_default_fp8_pipeline(self, n, heads_in, want):
    # fp8_pipeline=None traces the program of the pipeline its heads_in takes.
    q = jax.ShapeDtypeStruct((32, n, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((32 * 128, 64, 576), jnp.float8_e4m3fn)
    tables = jax.ShapeDtypeStruct((32, 128), jnp.int32)
    lens = jax.ShapeDtypeStruct((32,), jnp.int32)
    jaxpr = lambda pipeline: str(mosaic_decode.latent_decode.trace(
        q, cache, tables, lens, scale=SCALE, k_scale=jnp.float32(FP8_SCALE), heads_in=heads_in,
        fp8_pipeline=pipeline).jaxpr)
    assert mosaic_decode.CONFIG.fp8_pipeline is None
    assert jaxpr(None) == jaxpr(want)

  def test_queries_past_f16_range(self):
    # The products take q as f16: a token past 65504 (bf16 reaches 3.4e38) runs scaled down by a
    # power of two and scaled back in its score scale; unscaled, its scores overflow to inf.
    q, cache, tables, lens = make_case(129, n=16, page=64, req_lens=[150, 64, 7],
                                       cache_dtype=jnp.float8_e4m3fn)
    q = q.copy()
    q[0] *= 4096
    q[0, 3, 10], q[2, 0, 500] = 1e5, -3e5
    self.check(q, cache, tables, lens, k_scale=FP8_SCALE, num_kv_splits=1)

  def test_queries_far_below_e4m3_range(self):
    # A token of tiny magnitudes runs scaled up by a power of two (its largest to [128, 256));
    # unscaled, its hi parts would flush to e4m3 zeros.
    q, cache, tables, lens = make_case(131, n=16, page=64, req_lens=[150, 64, 7],
                                       cache_dtype=jnp.float8_e4m3fn)
    q = q.copy()
    q[0] *= 2.0 ** -30
    q[1] *= 2.0 ** 12
    self.check(q, cache, tables, lens, k_scale=FP8_SCALE, num_kv_splits=1)

  def test_e4m3_split_is_exact(self):
    assert_e4m3_split_is_exact()

  @pytest.mark.parametrize("cols,n,splits", [(64, 16, 1), (576, 32, 2), (128, 16, 1)])
  def test_promote_cols(self, cols, n, splits):
    # The other promotion chunks (the class's cases run the default, 192; 576 is one
    # accumulation, 128 is 4 x 128 + 64); the interpreter sums exactly: each meets the contract.
    q, cache, tables, lens = make_case(132, n=n, page=64, req_lens=[1, 161, 0, 95, 300],
                                       cache_dtype=jnp.float8_e4m3fn)
    o, lse = mosaic_decode.latent_decode(
        *(jnp.asarray(a) for a in (q, cache, tables, lens)), scale=SCALE, kv_lora_rank=L,
        k_scale=FP8_SCALE, num_kv_splits=splits, heads_in="n", fp8_pipeline="register_a",
        e4m3_scores=True, e4m3_promote_cols=cols, interpret=True)
    ref_o, ref_lse = latent_decode_np(q.astype(np.float32), cache, tables, lens, SCALE, L,
                                      FP8_SCALE)
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse, ref_o, ref_lse)

  def test_promote_cols_change_the_program(self):
    q = jax.ShapeDtypeStruct((32, 16, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((32 * 128, 64, 576), jnp.float8_e4m3fn)
    tables = jax.ShapeDtypeStruct((32, 128), jnp.int32)
    lens = jax.ShapeDtypeStruct((32,), jnp.int32)
    jaxpr = lambda **knobs: str(mosaic_decode.latent_decode.trace(
        q, cache, tables, lens, scale=SCALE, k_scale=jnp.float32(FP8_SCALE), e4m3_scores=True,
        **knobs).jaxpr)
    assert mosaic_decode.CONFIG.e4m3_promote_cols == 192
    programs = [jaxpr(e4m3_promote_cols=cols) for cols in mosaic_decode.E4M3_PROMOTE_COLS]
    assert jaxpr() == programs[2] and len(set(programs)) == len(programs)

  def test_backend_passes_the_promote_cols(self, monkeypatch):
    config = mosaic_decode.MosaicDecodeConfig(e4m3_scores=True, e4m3_promote_cols=576,
                                              **self.others)
    assert backend_passes(self.decode, monkeypatch, "e4m3_promote_cols", jnp.float8_e4m3fn,
                          config) == [576]

  @pytest.mark.parametrize("value", [0, 32, 100, 640, None])
  def test_promote_cols_must_be_a_listed_width(self, value):
    with pytest.raises(ValueError, match="e4m3_promote_cols must be one of"):
      mosaic_decode.MosaicDecodeConfig(e4m3_promote_cols=value)

  @pytest.mark.parametrize("knobs,message", [
      ({"fp8_pipeline": "serial"}, "e4m3_scores takes fp8_pipeline=\"register_a\""),
      ({"fp8_pipeline": "shared_widening"}, "e4m3_scores takes fp8_pipeline=\"register_a\""),
      ({"fp8_pipeline": "register_a", "wide_keys": True}, "wide_keys loads the keys"),
      ({"fp8_pipeline": None, "wide_keys": True}, "wide_keys loads the keys"),
  ])
  def test_e4m3_scores_bad_input_raises(self, knobs, message):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        128, n=16, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=message):
      mosaic_decode.latent_decode(q, cache, tables, lens, k_scale=FP8_SCALE, scale=0.1,
                                  heads_in="n", e4m3_scores=True, interpret=True, **knobs)

  def test_f16_queries_are_exact_powers_of_two(self):
    q = np.random.default_rng(130).standard_normal((4, 16, 576)).astype(jnp.bfloat16)
    q[1] *= 2.0 ** 20
    q[1, 0, 0] = 5 * 2.0 ** 20  # its largest in [2^22, 2^23): 2^8 brings it below 2^15
    q[3, 5, 7] = 65536.0
    q16, back = mosaic_decode._f16_queries(jnp.asarray(q))
    assert q16.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(back), [1, 2.0 ** 8, 1, 4])
    np.testing.assert_array_equal(np.asarray(q16, np.float32) * np.asarray(back)[:, None, None],
                                  q.astype(np.float32))

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "heads_in": "m"}, "register_a\" takes heads_in=\"n\""),
      (lambda a: {**a, "heads_in": None, "q": jnp.zeros((2, 33, 576), jnp.bfloat16)},
       "at most 32 heads"),
  ])
  def test_register_a_bad_input_raises(self, change, message):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        128, n=16, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    args = dict(q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, k_scale=FP8_SCALE,
                fp8_pipeline="register_a")
    with pytest.raises(ValueError, match=message):
      mosaic_decode.latent_decode(**change(args), scale=0.1, interpret=True)


class _RegisterAOffKnob(TestPallasMosaicDecodeHeadsNRegisterA):
  """register_a with one of its default-on loads (`knob`) off: the parent's fp8 cases run it. The
  parent's cases that read no fp8 cache or check the same code with or without the knob (the
  pipeline rules, the q scaling, the shared-memory accesses the race detector sees: the knobs
  change values and orders, not accesses) are not repeated."""
  others = {"fp8_pipeline": "register_a", "heads_in": "n"}
  test_register_a_defaults_to_heads_n = None
  test_default_fp8_pipeline = None
  test_f16_queries_are_exact_powers_of_two = None
  test_register_a_bad_input_raises = None
  test_bad_input_raises = None
  test_no_races_in_the_interpreter = None
  # The default's e4m3 split, promotion and errors (the knobs leave them as they are).
  test_queries_far_below_e4m3_range = None
  test_e4m3_split_is_exact = None
  test_promote_cols = None
  test_promote_cols_change_the_program = None
  test_backend_passes_the_promote_cols = None
  test_promote_cols_must_be_a_listed_width = None
  test_e4m3_scores_bad_input_raises = None
  beside: dict = {}  # other knobs the knob needs to mean anything (in `others` too)

  def jaxpr(self, cache_dtype, n=16, **knobs):
    """The GPU program at B=32 (N=16 unless told), 128 pages of 64 a row, as text."""
    args = (jax.ShapeDtypeStruct((32, n, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((32 * 128, 64, 576), cache_dtype),
            jax.ShapeDtypeStruct((32, 128), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.int32))
    k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
    return str(mosaic_decode.latent_decode.trace(*args, scale=SCALE, heads_in="n", k_scale=k_scale,
                                                 **self.beside, **knobs).jaxpr)

  def test_bf16_cache_ignores_it(self):
    on, off, default = (self.jaxpr(jnp.bfloat16, **knobs) for knobs in (
        {self.knob: True}, {self.knob: False}, {}))
    assert on == off == default

  def test_on_by_default(self):
    # None (on with register_a): the default config's program is the one with it.
    assert getattr(mosaic_decode.CONFIG, self.knob) is None
    on, off, default = (self.jaxpr(jnp.float8_e4m3fn, **knobs) for knobs in (
        {self.knob: True}, {self.knob: False}, {}))
    assert on == default != off

  @pytest.mark.parametrize("value", [1, "yes"])
  def test_knob_must_be_a_bool_or_none(self, value):
    with pytest.raises(ValueError, match=f"{self.knob} must be None, True or False"):
      mosaic_decode.MosaicDecodeConfig(**{self.knob: value})

  @pytest.mark.parametrize("pipeline", ["serial", "shared_widening"])
  def test_knob_takes_register_a_only(self, pipeline):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        128, n=16, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=f"{self.knob} takes fp8_pipeline=\"register_a\""):
      mosaic_decode.latent_decode(q, cache, tables, lens, k_scale=FP8_SCALE, scale=0.1,
                                  heads_in="n", fp8_pipeline=pipeline, **{self.knob: True},
                                  **self.beside, interpret=True)


class TestPallasMosaicDecodeRegisterANarrowKeys(_RegisterAOffKnob):
  """register_a with wide_keys=False: the key fragments loaded 2 bytes at a time in the WGMMA
  layout and q's columns in their own order (with the f16 keys, e4m3_scores=False), against their
  default wide_keys (q's columns permuted per 64-column tile, `wide_key_order`; the key fragments
  loaded 16 bytes a row on the GPU, permuted after a plain load in the interpreter), which
  TestPallasMosaicDecodeRegisterAF16Scores runs: the fp8 cases of the heads_in="n" tests (16 and
  32 heads, one split and several, lengths cutting pages, bad table entries: the tail rows masked
  in the e4m3 slot the loads read) and the f16 queries past f16's range (scaled, then permuted).
  Either side's permutation alone fails that class's; the lane code itself runs only on the GPU
  (tests/test_decode_gpu.py)."""
  knob, value = "wide_keys", False
  beside = {"e4m3_scores": False}
  others = {**_RegisterAOffKnob.others, **beside}

  def test_wide_key_order_is_the_fragments(self):
    # Lane q (lane % 4) of the WGMMA A fragment holds a row's columns 8j + 2q + e (register j,
    # half e); wide_keys gives them bytes 16q + 2j + e of the row's 64-column tile: lane q's
    # 16-byte unit in register order. Per tile, over the 9 tiles of a 576-column row.
    order = np.asarray(mosaic_decode.wide_key_order(jnp.arange(576)))
    for tile in range(9):
      for q in range(4):
        fragment = [64 * tile + 8 * j + 2 * q + e for j in range(8) for e in range(2)]
        np.testing.assert_array_equal(order[fragment], 64 * tile + 16 * q + np.arange(16))
    assert sorted(order) == list(range(576))



class TestPallasMosaicDecodeRegisterANarrowValues(_RegisterAOffKnob):
  """register_a with wide_values=False: V^T's fragments in the WGMMA layout, relaid by shuffles,
  and o's columns in their own order, against the default's wide_values (the O^T tiles' rows are
  the value columns in `wide_value_order`: V^T's fragments loaded 16 bytes a token row on the GPU,
  permuted after a plain load in the interpreter; o's columns put back after the call), which the
  parent runs: the fp8 cases of the heads_in="n" tests (16 and 32 heads, one split and several:
  the put-back before the merge, lengths cutting pages, bad table entries: the tail rows masked in
  the e4m3 slot the loads read) and the f16 queries past f16's range. A missing put-back fails the
  parent's; the lane code itself runs only on the GPU (tests/test_decode_gpu.py,
  tests/test_register_a_probe.py)."""
  knob, value = "wide_values", False

  @pytest.mark.parametrize("group", [8, 4])
  def test_wide_value_order_is_the_fragments(self, group):
    # Thread (warp w, lane l) holds rows 16w + l/4 + 8h of every V^T tile c (the WGMMA A
    # fragment's rows; tile c is output columns 64c ..); wide_value_order gives them the 16 value
    # columns of unit u = 8w + l/4 (a token row's 16 bytes), tile c's in the bytes that a pass of
    # `group` tiles loads: 2c + h, or with 8-byte passes rotated by 8 bytes where u / 2 is odd.
    order = np.asarray(e4m3_operands.wide_value_order(jnp.arange(512), group))
    for w in range(4):
      for r in range(8):
        unit = 8 * w + r
        held = [order[64 * c + 16 * w + r + 8 * h] for c in range(8) for h in range(2)]
        rotate = 8 * ((unit // 2) % 2) if group == 4 else 0
        np.testing.assert_array_equal(held, 16 * unit + (np.arange(16) ^ rotate))
        for first in range(0, 8, group):  # a pass's tiles: one aligned run of 2 group bytes
          bytes_ = np.asarray(held[2 * first:2 * (first + group)]) - 16 * unit
          assert bytes_[0] % (2 * group) == 0
          np.testing.assert_array_equal(bytes_, bytes_[0] + np.arange(2 * group))
    assert sorted(order) == list(range(512))
    x = jnp.arange(3 * 512).reshape(3, 512)
    np.testing.assert_array_equal(e4m3_operands.wide_value_order(
        e4m3_operands.wide_value_order(x, group), group, inverse=True), x)

  def test_wide_values_other_lora_raises(self):
    # A 256-column latent: 8 bytes a thread's rows, not a 16-byte unit.
    q = jax.ShapeDtypeStruct((2, 16, 320), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4, 64, 320), jnp.float8_e4m3fn)
    tables = jax.ShapeDtypeStruct((2, 2), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match="wide_values takes kv_lora_rank 512"):
      mosaic_decode.latent_decode.trace(q, cache, tables, lens, scale=0.1, kv_lora_rank=256,
                                        k_scale=jnp.float32(FP8_SCALE), wide_values=True)


class TestPallasMosaicDecodeRegisterAF16Scores(_RegisterAOffKnob):
  """register_a with e4m3_scores=False: warpgroup 0 converts the keys' e4m3 tiles to f16 as
  wgmma's register A operand (16-byte loads, wide_keys) beside f16 queries (`_f16_queries`, each
  token scaled by a power of two), against the default's fp8 wgmma from the slot, which the
  parent runs: the fp8 cases of the heads_in="n" tests (16 and 32 heads, one split and several,
  lengths cutting pages, bad table entries: the tail rows masked in the e4m3 slot the loads
  read), the f16 queries past f16's range, and the race detector (the key loads are plain loads
  it sees)."""
  knob, value = "e4m3_scores", False

  @pytest.mark.parametrize("n,cache_dtype", [(16, jnp.float8_e4m3fn)])
  def test_no_races_in_the_interpreter(self, n, cache_dtype):
    check_no_races(126, n, cache_dtype, num_kv_splits=2, heads_in="n", fp8_pipeline="register_a",
                   e4m3_scores=False)


class TestPallasMosaicDecodePagesPerStep(_RegisterAOffKnob):
  """register_a's pages a consumer step. By default two (the parent's cases run them): a consumer
  step over two pages, each in its own ring slot with its own barriers (both pages' S^T, one
  cross-warp row max and one P^T hand-off for 128 tokens, both pages' V^T P^T in one step; a
  page's slot released once both consumers are done with it). The parent's fp8 cases run one page
  a step here (16 and 32 heads, one split and several, lengths cutting pages, bad table entries,
  NaN past every length); below, two pages a step with rings of 4 and 5: the race detector (an
  odd count's last step: a slot no copy filled, zeroed before it is read; rows long enough for
  the ring to wrap, so that with 5 slots a slot serves either page of a step in turn), odd page
  ranges of splits and fixed splits, the f16 keys, and the knobs' rules."""
  knob, value = "pages_per_step", 1
  test_on_by_default = None  # a bool knob's; its own below
  test_knob_must_be_a_bool_or_none = None

  @pytest.mark.parametrize("n,ring,req_lens,splits", [
      (16, 5, (200, 1, 0), 2), (16, 4, (200, 1, 0), 2), (32, 4, (200, 1, 0), 2),
      # 15 and 5 pages in one split, 15 in three (5 each): rings that wrap, odd counts.
      (16, 5, (900, 300, 0), 1), (16, 4, (900, 300, 0), 1), (16, 5, (900, 1), 3),
      (32, 4, (900, 300, 0), 1)])
  def test_no_races_in_the_interpreter(self, n, ring, req_lens, splits):
    check_no_races(126, n, jnp.float8_e4m3fn, req_lens, num_kv_splits=splits, heads_in="n",
                   fp8_pipeline="register_a", pages_per_step=2, ring_slots=ring)

  @pytest.mark.parametrize("seed,n,knobs,req_lens,ring", [
      (seed, n, knobs, req_lens, ring) for seed, n, knobs, req_lens in (
          (140, 16, {"num_kv_splits": 3}, None), (141, 32, {"num_kv_splits": 2}, None),
          (142, 16, {"split_tokens": 192}, None), (143, 32, {"split_tokens": 128}, None),
          (144, 16, {"num_kv_splits": 1, "e4m3_scores": False}, None),
          # 16, 18, 11 and 1 pages (the ring wraps; tails of 40, 2 and 60 rows), in one split
          # and in three.
          (145, 16, {"num_kv_splits": 1}, [1000, 1090, 700, 5]),
          (146, 16, {"num_kv_splits": 3}, [1000, 1090, 700, 5]),
          (147, 32, {"num_kv_splits": 1}, [1000, 1090, 700, 5]))
      for ring in mosaic_decode.RING_SLOTS if ring <= mosaic_decode._MAX_RING_SLOTS[n, 2]])
  def test_odd_page_ranges(self, seed, n, knobs, req_lens, ring):
    # Lengths cutting pages and NaN past every length (make_case), in splits whose page ranges
    # are odd (3 splits of 5 pages: 2, 2, 1; fixed splits of 3 pages) or even; by default 1 to 5
    # pages a row.
    q, cache, tables, lens = make_case(seed, n=n, page=64, cache_dtype=jnp.float8_e4m3fn,
                                       req_lens=req_lens or [64, 65, 128, 191, 257, 320, 3])
    o, lse = mosaic_decode.latent_decode(
        *(jnp.asarray(a) for a in (q, cache, tables, lens)), scale=SCALE, kv_lora_rank=L,
        k_scale=FP8_SCALE, fp8_pipeline="register_a", pages_per_step=2, ring_slots=ring,
        interpret=True, **knobs)
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse, *latent_decode_np(
        q.astype(np.float32), cache, tables, lens, SCALE, L, FP8_SCALE))

  @pytest.mark.parametrize("n", [16, 32])
  def test_two_by_default(self, n):
    assert mosaic_decode.CONFIG.pages_per_step is None
    one, two, default = (self.jaxpr(jnp.float8_e4m3fn, n=n, **knobs) for knobs in (
        {self.knob: 1}, {self.knob: 2}, {}))
    assert two == default != one

  def test_bf16_cache_ignores_it(self):
    assert (self.jaxpr(jnp.bfloat16, **{self.knob: 2}) == self.jaxpr(jnp.bfloat16, ring_slots=5)
            == self.jaxpr(jnp.bfloat16))

  @pytest.mark.parametrize("value", [0, 3, True, 2.0])
  def test_knob_must_be_one_or_two(self, value):
    with pytest.raises(ValueError, match=r"pages_per_step must be None or one of \(1, 2\)"):
      mosaic_decode.MosaicDecodeConfig(pages_per_step=value)

  @pytest.mark.parametrize("pipeline", ["serial", "shared_widening"])
  @pytest.mark.parametrize("knobs,message", [
      ({"pages_per_step": 2}, "pages_per_step=2 takes heads_in=\"n\" with fp8_pipeline="
                              "\"register_a\""),
      ({"ring_slots": 4}, "ring_slots takes fp8_pipeline=\"register_a\"")])
  def test_knob_takes_register_a_only(self, pipeline, knobs, message):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        128, n=16, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=message):
      mosaic_decode.latent_decode(q, cache, tables, lens, k_scale=FP8_SCALE, scale=0.1,
                                  heads_in="n", fp8_pipeline=pipeline, interpret=True, **knobs)

  @pytest.mark.parametrize("value", [3, 6, True, 5.0, "4"])
  def test_ring_slots_must_be_listed(self, value):
    with pytest.raises(ValueError, match=r"ring_slots must be None or one of \(4, 5\)"):
      mosaic_decode.MosaicDecodeConfig(ring_slots=value)

  def test_default_ring(self):
    # None: 4 slots, with one page a step or two (5 at 16 heads timed slower with two).
    assert mosaic_decode.CONFIG.ring_slots is None
    fp8 = lambda **knobs: self.jaxpr(jnp.float8_e4m3fn, **knobs)
    assert fp8() == fp8(ring_slots=4) != fp8(ring_slots=5)
    assert fp8(pages_per_step=1) == fp8(pages_per_step=1, ring_slots=4) != fp8(
        pages_per_step=1, ring_slots=5)
    assert fp8(n=32) == fp8(n=32, ring_slots=4)

  def test_ring_that_does_not_fit_raises(self):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(
        128, n=32, page=64, req_lens=[20, 5], cache_dtype=jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="ring_slots=5 does not fit in shared memory at 32 heads "
                                         "a tile with pages_per_step=2"):
      mosaic_decode.latent_decode(q, cache, tables, lens, k_scale=FP8_SCALE, scale=0.1,
                                  fp8_pipeline="register_a", pages_per_step=2, ring_slots=5,
                                  interpret=True)

  def test_lowers_for_hopper_refuses_the_ring_past_max(self, monkeypatch):
    # _MAX_RING_SLOTS is the most that fit: one more slot each, Mosaic GPU's own count of shared
    # memory refuses the CUDA lowering (227 KB a block).
    q = jax.ShapeDtypeStruct((128, 32, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((128 * 128, 64, 576), jnp.float8_e4m3fn)
    tables = jax.ShapeDtypeStruct((128, 128), jnp.int32)
    lens = jax.ShapeDtypeStruct((128,), jnp.int32)
    monkeypatch.setattr(mosaic_decode, "_MAX_RING_SLOTS", {(32, 2): 5})
    traced = mosaic_decode.latent_decode.trace(q, cache, tables, lens, scale=SCALE,
                                               k_scale=jnp.float32(FP8_SCALE), pages_per_step=2,
                                               ring_slots=5)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
      traced.lower(lowering_platforms=("cuda",))

  def test_backend_passes_the_ring(self, monkeypatch):
    config = mosaic_decode.MosaicDecodeConfig(pages_per_step=2, ring_slots=5, **self.others)
    assert backend_passes(self.decode, monkeypatch, "ring_slots", jnp.float8_e4m3fn,
                          config) == [5]


# Pallas calls in a jaxpr (Mosaic GPU's `plgpu.kernel` shows as a custom_vmap_call around one).
_KERNELS = ("pallas_call", "custom_vmap_call")


def _leaf_eqns(jaxpr):
  """A jaxpr's equations with nested jaxprs opened, a Pallas call kept whole."""
  for eqn in jaxpr.eqns:
    subs = () if eqn.primitive.name in _KERNELS else jax.extend.core.jaxprs_in_params(eqn.params)
    subs = list(subs)
    if not subs:
      yield eqn
    for sub in subs:
      yield from _leaf_eqns(sub)


def _stage1_splits(jaxpr):
  """The split count of every Pallas call in a jaxpr: dimension 1 of its first output."""
  return [e.outvars[0].aval.shape[1] for e in _leaf_eqns(jaxpr) if e.primitive.name in _KERNELS]


def test_read_only_ref_keeps_transforms_and_is_never_written():
  # The lane code's GMEM inputs: jax >= 0.12.1 refuses a kernel that writes an input passed as an
  # array unless the RefType says write=False (CI's second environment); 0.11.2's has no field.
  transforms = (plgpu.SwizzleTransform(128),)
  ref_type = mosaic_lanes.read_only_ref(transforms)
  assert isinstance(ref_type, plgpu.RefType) and ref_type.transforms == transforms
  assert getattr(ref_type, "write", False) is False
  assert getattr(ref_type, "read", True) is True


@pytest.mark.parametrize("kernel", [latent_decode, mosaic_decode.latent_decode])
def test_fixed_split_count_ignores_the_batch(kernel):
  # split_tokens: the grid's split count is the static length bound over the split size (8192 /
  # 2048) whatever the batch. Without it the count follows the batch (the probe can tell).
  def splits(batch, **kwargs):
    q = jax.ShapeDtypeStruct((batch, 16, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch * 128, 64, 576), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((batch, 128), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return set(_stage1_splits(kernel.trace(q, cache, tables, lens, scale=SCALE,
                                           **kwargs).jaxpr.jaxpr))
  assert [splits(b, split_tokens=2048) for b in (1, 3, 128)] == [{4}] * 3
  assert len({frozenset(splits(b)) for b in (1, 3, 128)}) > 1


@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_default_call_is_one_kernel(heads, cache_dtype):
  # The benchmark's shapes (B=128, S=8192: one split): the default call is the Mosaic kernel and
  # nothing that touches q or o besides free reshapes. Session 26 (benchmarks/RESULTS.md) found
  # the fp8 call at 16 heads spending 9% of its time in five XLA kernels around the kernel (q's
  # e4m3 split before it, wide_values' transpose after it); the kernel does both now.
  q = jax.ShapeDtypeStruct((128, heads, 576), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((128 * 128, 64, 576), cache_dtype)
  tables = jax.ShapeDtypeStruct((128, 128), jnp.int32)
  lens = jax.ShapeDtypeStruct((128,), jnp.int32)
  k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
  eqns = list(_leaf_eqns(mosaic_decode.latent_decode.trace(
      q, cache, tables, lens, scale=SCALE, k_scale=k_scale).jaxpr.jaxpr))
  assert [e.primitive.name in _KERNELS for e in eqns].count(True) == 1
  # Scalars and the [T] per-token scale-backs of 1 (constants), and the output's squeezes.
  heavy = [(e.primitive.name, e.outvars[0].aval.shape) for e in eqns
           if e.primitive.name not in _KERNELS + ("reshape", "squeeze")
           and np.prod(e.outvars[0].aval.shape) > 128]
  assert heavy == []


def test_softmax_partial_sums_are_the_running_sums():
  # Heads in N carry l as per-key partial sums (`run_scores`' partial_sums), summed over the keys
  # once after the last step: the same m and P each step as the per-step sums, and the same l up
  # to float32 rounding, with masked keys, a fully masked step and a rising row max.
  rng = np.random.default_rng(3)
  steps = [rng.normal(0, 4, (64, 16)).astype(np.float32) + 3 * i for i in range(5)]
  steps[1][:, 5] = -np.inf  # one head sees no key in a step
  steps[2][40:] = -np.inf  # a tail
  steps[3][:] = -np.inf  # a step with no key
  m = jnp.full((16,), -1e30, jnp.float32)
  m2, l, partial = m, jnp.zeros((16,), jnp.float32), jnp.zeros((64, 16), jnp.float32)
  for s in map(jnp.asarray, steps):
    m, alpha, p, l = softmax_step(s, m, l, heads_axis=1)
    m2, alpha2, p2, partial = softmax_step(s, m2, partial, heads_axis=1)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(alpha2, alpha)
    np.testing.assert_array_equal(p2, p)
  np.testing.assert_allclose(partial.sum(axis=0), l, rtol=2e-6)
  assert bool((l > 1).all())


def test_softmax_slack_moves_the_max_only_past_it():
  # rescale_slack's online softmax (`softmax_step(slack=)`): a row's m moves only to a step max
  # above m + slack, so alpha is exactly 1 on the other steps (what the GPU's lazy rescale skips)
  # and P stays <= 2^slack; run over the steps as the kernels do, o / l and m + log2 l are the
  # exact softmax's. slack=0 is the plain running max, bit for bit. Rows rising by 3 a step move
  # every third step, rows rising by 20 every step, falling rows never; masked keys, a fully
  # masked step and a row that sees nothing.
  rng = np.random.default_rng(5)
  rise = np.repeat([0.0, 3.0, 20.0, -6.0], 16)[:, None].astype(np.float32)
  steps = [rng.normal(0, 2, (64, 64)).astype(np.float32) + rise * i for i in range(7)]
  values = [rng.normal(0, 1, (64, 8)).astype(np.float32) for _ in steps]
  steps[1][:, 50:] = -np.inf
  steps[4][:] = -np.inf
  for s in steps:
    s[63] = -np.inf

  def run(slack):
    m, l = jnp.full((64,), -1e30, jnp.float32), jnp.zeros((64,), jnp.float32)
    o, kept = jnp.zeros((64, 8), jnp.float32), []
    for s, v in zip(steps, values):
      m_new, alpha, p, l = softmax_step(jnp.asarray(s), m, l, slack=slack)
      assert float(p.max()) <= 2.0 ** (slack or 0)
      kept.append(np.asarray(m_new == m))
      np.testing.assert_array_equal(np.asarray(alpha)[kept[-1]], 1.0)
      o, m = o * alpha[:, None] + p @ v, m_new
    return np.asarray(o), np.asarray(l), np.asarray(m), np.stack(kept)

  s_all, v_all = np.concatenate(steps, 1).astype(np.float64), np.concatenate(values)
  seen = np.isfinite(s_all).any(1)
  w = np.exp2(s_all[seen] - s_all[seen].max(1, keepdims=True))
  for slack in (0.0, RESCALE_SLACK):
    o, l, m, kept = run(slack)
    np.testing.assert_allclose(o[seen] / l[seen, None], (w @ v_all) / w.sum(1, keepdims=True),
                               rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(m[seen] + np.log2(l[seen]),
                               np.log2(np.exp2(s_all[seen]).sum(1)), rtol=1e-6)
    assert l[63] == 0
  exact, lazy = run(0.0), run(None)
  for a, b in zip(exact[:3], lazy[:3]):
    np.testing.assert_array_equal(a, b)
  kept = run(RESCALE_SLACK)[3]
  assert kept[1:, 48:63].all() and kept[1:, :16].all() and not kept[1:, 32:48].all()
  assert not kept[1:, 16:32].all() and kept[1:, 16:32].any()


@pytest.mark.parametrize("heads_axis", [0, 1])
@pytest.mark.parametrize("per_row", [False, True])
def test_softmax_scale_inside_the_exponent(heads_axis, per_row):
  # `softmax_step(scale=)`: raw scores (masked keys -inf), scaled inside exp2's argument with the
  # maximum taken before scaling, give the step of the pre-scaled scores (to float32 rounding: one
  # FFMA an element against a multiply then a subtract), with or without a slack, for one scale
  # or one a row (heads along heads_axis), partial sums too; a masked row keeps its m.
  rng = np.random.default_rng(7)
  shape = (64, 48) if heads_axis == 0 else (48, 64)
  s = rng.normal(0, 30, shape).astype(np.float32)
  s[(slice(None), slice(40, None)) if heads_axis == 0 else (slice(40, None), slice(None))] = -np.inf
  s[(3, slice(None)) if heads_axis == 0 else (slice(None), 3)] = -np.inf
  scale = (rng.uniform(0.01, 0.2, 64).astype(np.float32) if per_row
           else np.float32(0.0721))
  along = (lambda x: x[:, None]) if heads_axis == 0 else (lambda x: x[None, :])
  scaled = s * (along(scale) if per_row else scale)
  m = rng.normal(0, 3, 64).astype(np.float32)
  m[5] = -1e30
  for slack in (None, RESCALE_SLACK):
    for l in (jnp.ones((64,), jnp.float32), jnp.ones(shape, jnp.float32)):
      want = softmax_step(jnp.asarray(scaled), jnp.asarray(m), l, heads_axis, slack)
      got = softmax_step(jnp.asarray(s), jnp.asarray(m), l, heads_axis, slack,
                         scale=jnp.asarray(scale))
      for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-30)
      assert float(got[0][3]) == m[3] and float(got[2].max()) <= 2.0 ** (slack or 0)


class TestPallasMosaicDecodeRescaleSlack:
  """rescale_slack at the kernel level (interpreter): the softmax's slack in both consumers'
  steps, over rows whose scores rise page by page along a direction of the keys (each head's
  slope its own: maxima that move far past the slack, where a max left behind overflows P, some
  within it, some never), bf16 and fp8 (half_pages and in_slot) heads in M, against the float64
  oracle; slack 0 bit for bit the default. The GPU's lane-level skip: lowering
  (test_lowers_for_hopper) and test_decode_gpu.py."""

  def ramp_case(self, seed, rise=30.0):
    """make_case's bf16 inputs at 128 heads (one 300-token row: 5 pages), the keys of token pos
    plus pos / 64 * rise / (scale log2 e) along a unit direction u: head h's scores rise by
    rise * (q_h . u) log2 units a page (|q_h . u| ~ 1). Float32 values, NaN where unused."""
    q, cache, tables, lens = make_case(seed, n=128, page=64, req_lens=[300, 130, 0])
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(L + 64).astype(np.float32)
    u /= np.linalg.norm(u)
    values = cache.astype(np.float32)
    for row, length in enumerate(lens):
      for pos in range(length):
        values[tables[row, pos // 64], pos % 64] += pos / 64 * rise / (SCALE * np.log2(np.e)) * u
    return q, values, tables, lens

  @pytest.mark.parametrize("cache_dtype,pipeline", [(jnp.bfloat16, None),
                                                    (jnp.float8_e4m3fn, "half_pages"),
                                                    (jnp.float8_e4m3fn, "in_slot")])
  def test_matches_oracle(self, cache_dtype, pipeline):
    fp8 = cache_dtype == jnp.float8_e4m3fn
    q, values, tables, lens = self.ramp_case(81)
    k_scale = 0.5 if fp8 else None  # the ramp's largest values (~170) within e4m3's 448
    cache = (values / (k_scale or 1)).astype(ml_dtypes.float8_e4m3fn if fp8 else jnp.bfloat16)
    o, lse = mosaic_decode.latent_decode(q, cache, tables, lens, scale=SCALE, k_scale=k_scale,
                                         heads_in="m", num_kv_splits=1, fp8_pipeline=pipeline,
                                         rescale_slack=RESCALE_SLACK, interpret=True)
    dequantized = cache.astype(np.float32) * (k_scale or 1)
    ref_o, ref_lse = latent_decode_np(q, dequantized, tables, lens, SCALE, L)
    assert_decode_close(o, lse, ref_o, ref_lse)

  def test_slack_zero_is_the_default_bit_for_bit(self):
    q, values, tables, lens = self.ramp_case(82)
    cache = values.astype(jnp.bfloat16)
    run = lambda slack: mosaic_decode.latent_decode(q, cache, tables, lens, scale=SCALE,
                                                    heads_in="m", rescale_slack=slack,
                                                    interpret=True)
    for a, b in zip(run(0.0), run(None)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_backend_passes_it_on(self, monkeypatch):
    seen = []
    monkeypatch.setattr(backends, "MOSAIC_DECODE_CONFIG",
                        mosaic_decode.MosaicDecodeConfig(rescale_slack=RESCALE_SLACK))
    monkeypatch.setattr(mosaic_decode, "latent_decode",
                        lambda *a, **kw: seen.append(kw["rescale_slack"]) or (None, None))
    backends._mosaic_decode(None, None, None, None, scale=SCALE)
    assert seen == [RESCALE_SLACK]

  @pytest.mark.parametrize("slack", [-1.0, float("inf"), float("nan"), "8", True])
  def test_bad_slack(self, slack):
    with pytest.raises(ValueError, match="rescale_slack must be None or a finite float >= 0"):
      mosaic_decode.MosaicDecodeConfig(rescale_slack=slack)
