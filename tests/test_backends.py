"""Backend table: selection (name, env var, platform), capability checks, immutability."""

import dataclasses

import jax.numpy as jnp
import pytest

from mla_jax import backends
from mla_jax.backends import BACKENDS, ENV_VAR, default_backend_name, get_backend
from mla_jax.cache import DSMLACache, IndexerKCache, LatentCache


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
  monkeypatch.delenv(ENV_VAR, raising=False)


def test_env_var_name():
  assert ENV_VAR == "MLA_JAX_BACKEND"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_get_by_name(name):
  be = get_backend(name)
  assert be is BACKENDS[name] and be.name == name
  for fn in (be.decode, be.prefill, be.write_cache, be.gather_cache):
    assert callable(fn)


def test_reference_is_registered():
  assert "reference" in BACKENDS and BACKENDS["reference"].name == "reference"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_get_by_env_var(monkeypatch, name):
  monkeypatch.setenv(ENV_VAR, name)
  assert get_backend().name == name
  assert get_backend(None).name == name


def test_explicit_name_beats_env_var(monkeypatch):
  monkeypatch.setenv(ENV_VAR, "no_such_backend")
  assert get_backend("reference").name == "reference"


def test_platform_default():
  assert default_backend_name("cpu") == "reference"
  assert default_backend_name("tpu") == "reference"
  assert default_backend_name("gpu") == "pallas"


def test_no_name_no_env_uses_platform(monkeypatch):
  monkeypatch.setattr(backends.jax, "default_backend", lambda: "cpu")
  assert get_backend().name == "reference"
  monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
  assert get_backend().name == "pallas"


def record_kernel_calls(monkeypatch, op, hopper):
  """Replaces op in pallas_mosaic and pallas_triton by recorders and fakes the device; returns the
  list the calls land in, as (backend name, keyword arguments)."""
  called = []

  def recorder(name):
    def run(x, *args, **kwargs):
      called.append((name, kwargs))
      return x
    return dataclasses.replace(BACKENDS[name], **{op: run})

  monkeypatch.setattr(backends, "PALLAS_MOSAIC", recorder("pallas_mosaic"))
  monkeypatch.setattr(backends, "PALLAS_TRITON", recorder("pallas_triton"))
  monkeypatch.setattr(backends, "_on_hopper", lambda: hopper)
  return called


@pytest.mark.parametrize("tokens,dtype,dv,hopper,want", [
    (1024, jnp.bfloat16, 128, True, "pallas_mosaic"),
    (1023, jnp.bfloat16, 128, True, "pallas_triton"),  # below the smallest size measured
    (4096, jnp.float16, 128, True, "pallas_triton"),  # a dtype the Mosaic kernel does not take
    (4096, jnp.bfloat16, 256, True, "pallas_triton"),  # Dv > Dk: not a Mosaic shape
    (4096, jnp.bfloat16, 128, False, "pallas_triton"),  # not a Hopper GPU
])
def test_pallas_prefill_takes_the_faster_kernel(monkeypatch, tokens, dtype, dv, hopper, want):
  called = record_kernel_calls(monkeypatch, "prefill", hopper)
  q = jnp.zeros((tokens, 1, 192), dtype)
  v = jnp.zeros((tokens, 1, dv), dtype)
  cu = jnp.array([0, tokens], jnp.int32)
  get_backend("pallas").prefill(q, q, v, cu, cu, scale=1.0, causal=True, max_seqlen_q=tokens)
  assert [(name, kw["max_seqlen_q"]) for name, kw in called] == [(want, tokens)]


Q_RANK_2 = jnp.zeros((2048, 576), jnp.bfloat16)  # [T, D]: no head axis
ROWS = jnp.zeros((2048, 2), jnp.int32)
CU = jnp.array([0, 2048], jnp.int32)


@pytest.mark.parametrize("op,call,message", [
    ("decode", lambda be: be.decode(Q_RANK_2, LatentCache.allocate(4, 64), ROWS, ROWS[:, 0],
                                    scale=1.0, kv_lora_rank=512), "want q"),
    ("sparse_attention", lambda be: be.sparse_attention(
        Q_RANK_2, DSMLACache.allocate(2, 64, 512, 64), ROWS, scale=1.0, kv_lora_rank=512),
     "want q"),
    ("prefill", lambda be: be.prefill(
        Q_RANK_2[:, :192], jnp.zeros((2048, 1, 192), jnp.bfloat16),
        jnp.zeros((2048, 1, 128), jnp.bfloat16), CU, CU, scale=1.0, causal=True,
        max_seqlen_q=2048), r"must be \[T, N, D\]"),
])
def test_pallas_checks_before_it_picks_a_kernel(monkeypatch, op, call, message):
  # The choice reads q's shape (q of rank 2 was an IndexError there): the contract's ValueError
  # comes first, and no kernel is called.
  called = record_kernel_calls(monkeypatch, op, hopper=True)
  with pytest.raises(ValueError, match=message):
    call(get_backend("pallas"))
  assert not called


@pytest.mark.parametrize("via_env", [False, True])
def test_unknown_name_lists_supported(monkeypatch, via_env):
  if via_env:
    monkeypatch.setenv(ENV_VAR, "flashmla_cuda")
  with pytest.raises(ValueError, match="flashmla_cuda") as err:
    get_backend(None if via_env else "flashmla_cuda")
  for name in BACKENDS:
    assert name in str(err.value)


RESTRICTED = dataclasses.replace(BACKENDS["reference"], name="restricted",
                                 cache_dtypes=frozenset({"bfloat16", "float8_e4m3fn"}),
                                 block_size_multiple=16, max_heads=64)


def test_check_accepts_supported():
  RESTRICTED.check(cache_dtype=jnp.bfloat16, block_size=64, num_heads=64)
  RESTRICTED.check(cache_dtype="float8_e4m3fn", block_size=16, num_heads=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_dtype=jnp.float32), "float32"),
    (dict(cache_dtype="float16"), "bfloat16"),  # the message names what is supported
    (dict(block_size=8), "multiple of 16"),
    (dict(block_size=24), "24"),
    (dict(num_heads=65), "at most 64"),
    (dict(num_heads=128), "128"),
])
def test_check_rejects_unsupported(kwargs, match):
  args = dict(cache_dtype=jnp.bfloat16, block_size=64, num_heads=64)
  with pytest.raises(ValueError, match=match):
    RESTRICTED.check(**{**args, **kwargs})


def test_reference_check_accepts_all_cache_dtypes():
  for dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
    BACKENDS["reference"].check(cache_dtype=dtype, block_size=1, num_heads=128)
  with pytest.raises(ValueError):
    BACKENDS["reference"].check(cache_dtype="int8", block_size=1, num_heads=128)


def test_backends_table_is_immutable():
  with pytest.raises(TypeError):
    BACKENDS["mine"] = RESTRICTED
  with pytest.raises(TypeError):
    del BACKENDS["reference"]
  assert "mine" not in BACKENDS
  with pytest.raises(dataclasses.FrozenInstanceError):
    BACKENDS["reference"].max_heads = 1


@pytest.mark.parametrize("heads,cache_dtype,page,hopper,want", [
    (128, jnp.bfloat16, 64, True, "pallas_mosaic"),
    (64, jnp.bfloat16, 128, True, "pallas_mosaic"),
    (32, jnp.bfloat16, 64, True, "pallas_mosaic"),
    (16, jnp.bfloat16, 64, True, "pallas_mosaic"),  # session 12: 1.17x Triton at B=128
    (8, jnp.bfloat16, 64, True, "pallas_triton"),  # below 16 heads: not measured
    (128, jnp.float8_e4m3fn, 64, True, "pallas_mosaic"),  # fp8: measured 1.21x Triton at N=128
    (16, jnp.float8_e4m3fn, 64, True, "pallas_mosaic"),  # register_a: 1.27x at N=16 (session 13)
    (8, jnp.float8_e4m3fn, 64, True, "pallas_triton"),  # below 16 heads: not measured
    (128, jnp.bfloat16, 32, True, "pallas_triton"),  # pages of less than one 64-row step
    (128, jnp.bfloat16, 64, False, "pallas_triton"),  # not a Hopper GPU
])
def test_pallas_decode_takes_the_faster_kernel(monkeypatch, heads, cache_dtype, page, hopper, want):
  called = record_kernel_calls(monkeypatch, "decode", hopper)
  q = jnp.zeros((2, heads, 576), jnp.bfloat16)
  cache = LatentCache(jnp.zeros((4, page, 576), cache_dtype), jnp.float32(1.0))
  get_backend("pallas").decode(q, cache, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32),
                               scale=1.0, kv_lora_rank=512, num_kv_splits=3, batch_invariant=True)
  assert [(name, kw["kv_lora_rank"], kw["num_kv_splits"], kw["batch_invariant"])
          for name, kw in called] == [(want, 512, 3, True)]


@pytest.mark.parametrize("tokens,heads,kind,hopper,want", [
    # Measured (RESULTS.md, "DSA sparse attention (pallas_mosaic)", v3), Mosaic vs Triton:
    (128, 128, "bf16", True, "pallas_mosaic"),  # 1.77x
    (128, 32, "bf16", True, "pallas_mosaic"),  # 1.19x
    (128, 16, "bf16", True, "pallas_mosaic"),  # 0.74x; session 11 (no pad and slice): 1.08x
    (129, 16, "bf16", True, "pallas_triton"),  # fewer than 32 heads past the 128 rows measured
    (4096, 64, "bf16", True, "pallas_mosaic"),  # 1.91x
    (4096, 16, "bf16", True, "pallas_triton"),  # 0.65x
    (128, 128, "fp8_ds_mla", True, "pallas_mosaic"),  # 1.54x
    (4096, 32, "fp8_ds_mla", True, "pallas_mosaic"),  # 1.30x
    (128, 16, "fp8_ds_mla", True, "pallas_mosaic"),  # 1.46x ("half_rows", v6; "serial" 0.93x)
    (128, 8, "fp8_ds_mla", True, "pallas_triton"),  # fewer than 16 heads: not measured
    (128, 24, "bf16", True, "pallas_mosaic"),  # between 16 and 32 heads, both faster there
    (128, 8, "bf16", True, "pallas_triton"),  # fewer than 16 heads: not measured
    (128, 128, "fp8", True, "pallas_triton"),  # a per-tensor fp8 cache: not a Mosaic layout
    (128, 128, "bf16", False, "pallas_triton"),  # not a Hopper GPU
])
def test_pallas_sparse_attention_takes_the_faster_kernel(monkeypatch, tokens, heads, kind, hopper,
                                                         want):
  called = record_kernel_calls(monkeypatch, "sparse_attention", hopper)
  q = jnp.zeros((tokens, heads, 576), jnp.bfloat16)
  if kind == "fp8_ds_mla":
    cache = DSMLACache.allocate(2, 64, 512, 64)
  else:
    dtype = jnp.bfloat16 if kind == "bf16" else jnp.float8_e4m3fn
    cache = LatentCache(jnp.zeros((2, 64, 576), dtype), jnp.float32(1.0))
  get_backend("pallas").sparse_attention(q, cache, jnp.zeros((tokens, 8), jnp.int32), scale=1.0,
                                         kv_lora_rank=512)
  assert [(name, kw["kv_lora_rank"]) for name, kw in called] == [(want, 512)]


@pytest.mark.parametrize("dtype,hopper,want", [
    (jnp.float8_e4m3fn, True, "pallas_mosaic"),  # e4m3 operands on Hopper: 1.8-2.5x
    (jnp.bfloat16, True, "pallas_triton"),  # operands the Mosaic kernel does not take
    (jnp.float8_e4m3fn, False, "pallas_triton"),  # not a Hopper GPU
])
@pytest.mark.parametrize("distinct", [True, False])
def test_pallas_indexer_takes_the_faster_kernel_and_passes_the_hint(monkeypatch, dtype, hopper,
                                                                   want, distinct):
  called = record_kernel_calls(monkeypatch, "indexer_logits", hopper)
  k_cache = IndexerKCache.allocate(2, 64, dtype=dtype)
  get_backend("pallas").indexer_logits(
      jnp.zeros((4, 64, 128), dtype), jnp.zeros((4, 64), jnp.float32), k_cache,
      jnp.zeros((4, 2), jnp.int32), jnp.ones((4,), jnp.int32), distinct_tables=distinct)
  assert called == [(want, {"distinct_tables": distinct})]
