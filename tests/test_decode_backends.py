"""Every decode backend against the float64 oracle; the Pallas one runs in interpret mode on CPUs."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from decode_contract import L, SCALE, DecodeContract, assert_decode_close, make_case
from oracles import latent_decode_np
from pallas_kernels.latent_decode import default_num_kv_splits, latent_decode


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
      (lambda a: {**a, "kv_cache": a["kv_cache"][:, :8]}, "multiple of 16"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "q dtype"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.int8)}, "cache dtype"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.uint32)}, "int32"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn)}, "needs k_scale"),
      (lambda a: {**a, "k_scale": jnp.ones(2)}, "scalar"),
      (lambda a: {**a, "num_kv_splits": 0}, "num_kv_splits"),
      (lambda a: {**a, "block_h": 24}, "block_h"),
      (lambda a: {**a, "block_n": 32}, "block_n"),
      (lambda a: {**a, "num_warps": 3}, "num_warps"),
      (lambda a: {**a, "num_stages": 0}, "num_stages"),
  ])
  def test_bad_input_raises(self, change, message):
    q, cache, tables, lens = (jnp.asarray(a) for a in make_case(50, n=16, page=16, req_lens=[20, 5]))
    args = dict(q=q, kv_cache=cache, block_tables=tables, seq_lens=lens, kv_lora_rank=512)
    with pytest.raises(ValueError, match=message):
      latent_decode(**change(args), scale=0.1, interpret=True)

  def test_fp8_cache_past_int32_offsets_raises(self):
    q = jax.ShapeDtypeStruct((1, 16, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2 ** 16, 64, 576), jnp.float8_e4m3fn)
    ints = jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    with pytest.raises(ValueError, match="int32 offsets"):
      jax.eval_shape(functools.partial(latent_decode, scale=0.1, k_scale=1.0), q, cache, *ints)

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
