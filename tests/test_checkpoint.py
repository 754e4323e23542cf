"""Checkpoint reading: sharded and single-file safetensors, lazy shard access, fp8 block scales."""

import json
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import checkpoint, quant
from mla_jax.checkpoint import Checkpoint, dequantize_fp8_blocks, load_attention_layer
from mla_jax.config import MLAConfig
from mla_jax.modules import DeepseekV2MLAAttention
from mla_jax.quant import quantize_fp8_blocks
from mla_jax.tiny_checkpoint import write_tiny_checkpoint

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

ATTN = "model.layers.1.self_attn."


@pytest.fixture(scope="module", params=["v3", "v3.2"])
def tiny(request, tmp_path_factory):
  """(directory, float32 originals) of a tiny checkpoint, written once per variant."""
  path = tmp_path_factory.mktemp(request.param)
  return path, write_tiny_checkpoint(path, request.param)


@pytest.fixture
def tiny_copy(tiny, tmp_path):
  """A copy of the checkpoint that a test may damage."""
  shutil.copytree(tiny[0], tmp_path / "ckpt")
  return tmp_path / "ckpt"


def attention_layer(config):
  return DeepseekV2MLAAttention(MLAConfig.from_hf(config), backend="reference", dtype=jnp.float32,
                                param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def dequantize_by_blocks(w8, scale, block=128):
  """fp8 * scale, block by block: an independent spelling of the block-scale rule."""
  out = np.zeros(w8.shape, np.float32)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
      out[rows, cols] = w8[rows, cols].astype(np.float32) * scale[i, j]
  return out


def test_attention_layer_loads_dequantized(tiny):
  path, originals = tiny
  ckpt = Checkpoint(path)
  layer = attention_layer(ckpt.config)
  load_attention_layer(ckpt, layer, 1)
  raw = ckpt.read([ATTN + "kv_b_proj.weight", ATTN + "kv_b_proj.weight_scale_inv"])
  kv_b = dequantize_by_blocks(*raw.values())
  np.testing.assert_array_equal(np.asarray(layer.kv_b_proj.kernel[...]).T, kv_b)
  # the absorbed weights come from the loaded kv_b_proj, not from the random init
  np.testing.assert_array_equal(np.asarray(layer.mla_attn.W_UK_T[...])[0],
                                kv_b[:layer.config.qk_nope_head_dim])
  np.testing.assert_array_equal(np.asarray(layer.kv_a_layernorm.scale[...]),
                                originals[ATTN + "kv_a_layernorm.weight"])
  if layer.config.has_indexer:
    np.testing.assert_array_equal(np.asarray(layer.indexer.k_norm.bias[...]),
                                  originals[ATTN + "indexer.k_norm.bias"])
    np.testing.assert_allclose(np.asarray(layer.indexer.wk.kernel[...]).T,
                               originals[ATTN + "indexer.wk.weight"], rtol=2**-4, atol=1e-3)


def test_dequantized_weights_are_fp8_times_block_scale_and_close_to_originals(tiny):
  path, originals = tiny
  ckpt = Checkpoint(path)
  scaled = [n[:-len("_scale_inv")] for n in ckpt.weight_map if n.endswith("_scale_inv")]
  assert len(scaled) >= 8 and any(n.endswith("mlp.down_proj.weight") for n in scaled)
  loaded = ckpt.load(scaled)
  for name in scaled:
    raw = ckpt.read([name, name + "_scale_inv"])
    w8, scale = raw[name], raw[name + "_scale_inv"]
    assert w8.dtype == quant.F8 and scale.dtype == np.float32
    np.testing.assert_array_equal(loaded[name], dequantize_by_blocks(w8, scale))
    # e4m3 keeps 3 mantissa bits (relative error <= 2**-4); subnormals step by 2**-9 of the scale
    full = np.kron(scale, np.ones((128, 128)))[:w8.shape[0], :w8.shape[1]]
    error = np.abs(loaded[name] - originals[name])
    assert (error <= 2**-4 * np.abs(originals[name]) + 2**-10 * full).all(), name


def test_ragged_blocks_are_exercised(tiny):
  ckpt = Checkpoint(tiny[0])
  raw = ckpt.read(["model.layers.0.mlp.gate_proj.weight",
                   "model.layers.0.mlp.gate_proj.weight_scale_inv"])
  w8, scale = raw.values()
  assert w8.shape == (288, 160) and scale.shape == (3, 2)  # last row and column blocks are partial


def test_only_the_shards_holding_the_layer_are_opened(tiny, monkeypatch):
  path, _ = tiny
  ckpt = Checkpoint(path)
  opened = []
  real = safetensors.safe_open
  monkeypatch.setattr(safetensors, "safe_open",
                      lambda f, *a, **k: opened.append(f) or real(f, *a, **k))
  ckpt.tensors(ATTN)
  expected = {str(path / f) for n, f in ckpt.weight_map.items() if n.startswith(ATTN)}
  assert set(opened) == expected and len(opened) == len(expected)  # each shard once
  assert len(expected) < len(set(ckpt.weight_map.values()))  # and not every shard


def test_single_file_checkpoint_reads_the_same(tiny, tmp_path):
  path, _ = tiny
  sharded = Checkpoint(path)
  single = tmp_path / "single"
  single.mkdir()
  shutil.copy(path / "config.json", single / "config.json")
  save_file(sharded.read(sharded.weight_map), str(single / "model.safetensors"))
  got, want = Checkpoint(single).tensors(ATTN), sharded.tensors(ATTN)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])


def rewrite(path, name, value=None):
  """Replaces tensor `name` in its shard (or, value None, removes it from shard and index)."""
  index = json.loads((path / checkpoint.INDEX_FILE).read_text())
  file = index["weight_map"][name]
  ckpt = Checkpoint(path)
  tensors = ckpt.read([n for n, f in ckpt.weight_map.items() if f == file])
  if value is None:
    del tensors[name], index["weight_map"][name]
    (path / checkpoint.INDEX_FILE).write_text(json.dumps(index))
  else:
    tensors[name] = value
  save_file(tensors, str(path / file))


def load_layer(path):
  ckpt = Checkpoint(path)
  load_attention_layer(ckpt, attention_layer(ckpt.config), 1)


def expect_error(path, match):
  with pytest.raises(ValueError, match=match):
    load_layer(path)


@pytest.mark.parametrize("name", ["kv_a_layernorm.weight", "o_proj.weight"])
def test_wrong_shape_names_the_tensor(tiny_copy, name):
  w = Checkpoint(tiny_copy).load([ATTN + name])[ATTN + name]
  if w.ndim == 1:
    rewrite(tiny_copy, ATTN + name, w[:-1])
  else:  # a consistently quantized weight of the wrong shape
    w8, scale = quantize_fp8_blocks(w[:, :-3])
    rewrite(tiny_copy, ATTN + name, w8)
    rewrite(tiny_copy, ATTN + name + "_scale_inv", scale)
  expect_error(tiny_copy, f"{ATTN}{name}.*shape")


def test_missing_tensor_names_the_tensor(tiny_copy):
  rewrite(tiny_copy, ATTN + "kv_b_proj.weight_scale_inv")
  rewrite(tiny_copy, ATTN + "kv_b_proj.weight")
  expect_error(tiny_copy, f"missing.*{ATTN}kv_b_proj.weight")


def test_tensor_absent_from_its_indexed_shard_is_named(tiny_copy):
  index = json.loads((tiny_copy / checkpoint.INDEX_FILE).read_text())
  rewrite(tiny_copy, ATTN + "q_a_layernorm.weight")
  index["weight_map"][ATTN + "q_a_layernorm.weight"] = index["weight_map"][ATTN + "q_b_proj.weight"]
  (tiny_copy / checkpoint.INDEX_FILE).write_text(json.dumps(index))
  expect_error(tiny_copy, f"{ATTN}q_a_layernorm.weight is not in model-")


@pytest.mark.parametrize("bad", ["grid", "nan", "inf", "zero", "negative"])
def test_bad_scale_names_the_tensor(tiny_copy, bad):
  name = ATTN + "kv_b_proj.weight_scale_inv"
  scale = Checkpoint(tiny_copy).read([name])[name].copy()
  if bad == "grid":
    scale = np.concatenate([scale, scale], axis=1)
  else:
    scale[-1, 0] = {"nan": np.nan, "inf": np.inf, "zero": 0.0, "negative": -1.0}[bad]
  rewrite(tiny_copy, name, scale)
  expect_error(tiny_copy,
               "kv_b_proj.weight_scale_inv.*" + ("shape" if bad == "grid" else "non-positive"))


def test_fp8_weight_without_scale_is_refused(tiny_copy):
  rewrite(tiny_copy, ATTN + "o_proj.weight_scale_inv")
  expect_error(tiny_copy, f"fp8 tensor {ATTN}o_proj.weight has no")


def test_scale_on_an_unquantized_tensor_is_refused():
  with pytest.raises(ValueError,
                     match="kv_a_layernorm.weight has a kv_a_layernorm.weight_scale_inv"):
    dequantize_fp8_blocks(np.ones((4,), np.float32), np.ones((1,), np.float32),
                          name="kv_a_layernorm.weight")


def test_directory_without_weights_is_refused(tmp_path):
  with pytest.raises(ValueError, match="config.json"):
    Checkpoint(tmp_path)
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="neither"):
    Checkpoint(tmp_path)


def test_missing_safetensors_gives_an_install_hint(tiny, monkeypatch):
  monkeypatch.setitem(sys.modules, "safetensors", None)
  with pytest.raises(ImportError, match=r"mla-jax\[checkpoints\]"):
    Checkpoint(tiny[0]).tensors(ATTN)


@pytest.mark.parametrize("entry", ["../elsewhere/model.safetensors", "/tmp/model.safetensors",
                                   "sub/../../model.safetensors"])
def test_index_entries_leaving_the_folder_are_refused(tiny_copy, entry):
  index = json.loads((tiny_copy / checkpoint.INDEX_FILE).read_text())
  index["weight_map"][ATTN + "o_proj.weight"] = entry
  (tiny_copy / checkpoint.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(ValueError, match=f"{ATTN}o_proj.weight.*leaves the checkpoint folder"):
    Checkpoint(tiny_copy)


def shard_of(path, name):
  return path / json.loads((path / checkpoint.INDEX_FILE).read_text())["weight_map"][name]


def truncate(path):
  shard = shard_of(path, ATTN + "o_proj.weight")
  shard.write_bytes(shard.read_bytes()[:-100])
  return shard.name, "not a readable safetensors file"


def empty(path):
  shard_of(path, ATTN + "o_proj.weight").write_bytes(b"")
  return shard_of(path, ATTN + "o_proj.weight").name, "not a readable safetensors file"


def corrupt_header(path):
  shard = shard_of(path, ATTN + "o_proj.weight")
  data = bytearray(shard.read_bytes())
  data[8:12] = b"]]]]"
  shard.write_bytes(bytes(data))
  return shard.name, "not a readable safetensors file"


def bad_index_json(path):
  (path / checkpoint.INDEX_FILE).write_text('{"weight_map": {')
  return checkpoint.INDEX_FILE, "not valid JSON"


def bad_config_json(path):
  (path / "config.json").write_text("{'vocab_size': 1}")
  return "config.json", "not valid JSON"


def no_weight_map(path):
  (path / checkpoint.INDEX_FILE).write_text('{"metadata": {}}')
  return checkpoint.INDEX_FILE, "no weight_map"


def zero_block(path):
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"]["weight_block_size"] = [128, 0]
  (path / "config.json").write_text(json.dumps(config))
  return "config.json", "weight_block_size"


@pytest.mark.parametrize("damage", [truncate, empty, corrupt_header, bad_index_json,
                                    bad_config_json, no_weight_map, zero_block])
def test_file_level_failures_name_the_file_and_the_problem(tiny_copy, damage):
  file, problem = damage(tiny_copy)
  with pytest.raises(ValueError, match=f"{file}.*{problem}"):
    load_layer(tiny_copy)
