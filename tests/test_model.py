"""The small decoder: checkpoint loading, greedy generation batched and alone, full-forward
logits."""

import dataclasses
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.checkpoint import Checkpoint
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.model import DecoderConfig, DeepseekForCausalLM, forward, generate
from mla_jax.modules import jitted_step
from mla_jax.tiny_checkpoint import tiny_config, write_tiny_checkpoint

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(2, 15)), [9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW_TOKENS = 10
# One pool shape for every run, so batched and single-prompt runs share compiled steps.
POOL = dict(block_size=32, num_blocks=8)


@pytest.fixture(scope="module", params=["v3", "v3.2"])
def tiny(request, tmp_path_factory):
  """(checkpoint directory, float32 model) per variant; V3.2 keeps top-8, shorter than most
  windows here, so the sparse path runs."""
  path = tmp_path_factory.mktemp(request.param)
  write_tiny_checkpoint(path, request.param, index_topk=8)
  return path, DeepseekForCausalLM.from_checkpoint(path, backend="reference", dtype=jnp.float32)


@pytest.fixture(scope="module")
def batched(tiny):
  return generate(tiny[1], PROMPTS, NEW_TOKENS, return_logits=True, **POOL)


def test_from_checkpoint_fills_every_parameter(tiny):
  path, model = tiny
  ckpt = Checkpoint(path)
  assert model.config.attention.has_indexer == ("index_topk" in ckpt.config)
  want = ckpt.load(["model.embed_tokens.weight", "lm_head.weight",
                    "model.layers.1.mlp.down_proj.weight",
                    "model.layers.0.post_attention_layernorm.weight"])
  layer = model.layers[1]
  np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding[...]),
                                want["model.embed_tokens.weight"])
  np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]).T, want["lm_head.weight"])
  np.testing.assert_array_equal(np.asarray(layer.mlp.down_proj.kernel[...]).T,
                                want["model.layers.1.mlp.down_proj.weight"])
  np.testing.assert_array_equal(np.asarray(model.layers[0].post_attention_layernorm.scale[...]),
                                want["model.layers.0.post_attention_layernorm.weight"])


def test_batched_greedy_equals_each_prompt_alone(tiny, batched):
  tokens, _ = batched
  assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS)
  for prompt, got in zip(PROMPTS, tokens):
    assert generate(tiny[1], [prompt], NEW_TOKENS, **POOL) == [got]


def test_step_by_step_logits_equal_one_full_forward(tiny, batched):
  tokens, logits = batched
  full = forward(tiny[1], [p + t[:-1] for p, t in zip(PROMPTS, tokens)])
  for prompt, got, ref in zip(PROMPTS, logits, full):
    # position len(prompt) - 1 predicts the first new token, and so on
    np.testing.assert_allclose(got, ref[len(prompt) - 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(-1), ref[len(prompt) - 1:].argmax(-1))


def test_jitted_step_forwards_the_models_logit_rows(tiny):
  model = tiny[1]
  md, layout = build_metadata([RequestState(0, 5, [0])], max_blocks_per_seq=1, **POOL)
  tokens = jnp.asarray(layout.pack([np.array([5, 6, 7, 8, 9], np.int32)]))
  rows = jnp.asarray([4, 2], jnp.int32)
  caches = model.allocate_caches(POOL["num_blocks"], POOL["block_size"])
  want, _ = model(tokens, caches, md, logit_rows=rows)
  got, _ = jitted_step(model)(tokens, model.allocate_caches(POOL["num_blocks"], POOL["block_size"]),
                              md, logit_rows=rows)
  assert got.shape == (2, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_stop_token_ends_only_its_request(tiny, batched):
  tokens, _ = batched
  stop = tokens[0][2]
  stopped = generate(tiny[1], PROMPTS, NEW_TOKENS, stop_token_id=stop, **POOL)
  for full, got in zip(tokens, stopped):
    end = full.index(stop) + 1 if stop in full else len(full)
    assert got == full[:end]
  assert len(stopped[0]) == tokens[0].index(stop) + 1 <= 3


def test_progress_bar_without_tqdm(tiny, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tqdm", None)
  generate(tiny[1], PROMPTS[:1], 3, progress=True, **POOL)
  err = capsys.readouterr().err
  assert "generate [" in err and "3/3" in err


def test_fp8_ds_mla_cache_generates_close_to_a_float32_cache():
  """V3.2's packed fp8 latent cache (kv_lora_rank a multiple of its 128-wide tiles)."""
  config = DecoderConfig.from_hf(tiny_config("v3.2", index_topk=8) | {"kv_lora_rank": 128})
  model = DeepseekForCausalLM(config, backend="reference", dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  prompts = [PROMPTS[1], PROMPTS[3]]  # longer than top-k: the sparse path reads the cache
  _, exact = generate(model, prompts, 4, return_logits=True, **POOL)
  tokens, fp8 = generate(model, prompts, 4, return_logits=True, cache_dtype="fp8_ds_mla", **POOL)
  assert [len(t) for t in tokens] == [4, 4]
  for e, f in zip(exact, fp8):
    # The prefill step's logits (later steps may already be fed different tokens): e4m3 keeps
    # 3 mantissa bits, a few percent per cached value, through two layers and the LM head.
    assert np.linalg.norm(f[0] - e[0]) / np.linalg.norm(e[0]) < 0.1


def test_mixture_of_experts_configs_are_refused():
  config = tiny_config("v3") | {"first_k_dense_replace": 1}
  with pytest.raises(ValueError, match="mixture-of-experts"):
    DecoderConfig.from_hf(config)


def test_bad_generate_arguments(tiny):
  with pytest.raises(ValueError, match="non-empty"):
    generate(tiny[1], [[]], 4)
  with pytest.raises(ValueError, match="pool of 1 blocks"):
    generate(tiny[1], PROMPTS, 4, block_size=32, num_blocks=1)
  with pytest.raises(ValueError, match="caches"):
    tiny[1](jnp.zeros(8, jnp.int32), (), None)


@pytest.mark.parametrize("prompts, match", [
    ([[5, 6], [7, 320, 8]], "prompt 1, position 1: token id 320 is outside the vocabulary"),
    ([[5, -1]], "prompt 0, position 1: token id -1 is outside"),
    ([[5, 6.0]], "prompt 0, position 1: token id 6.0 is not an integer"),
    ([[5, True]], "prompt 0, position 1: token id True is not an integer"),
    ([np.array([5.0, 6.0])], "prompt 0 has dtype float64"),
    ([[5], []], "prompt 1 must be a non-empty"),
    ([], "non-empty list of prompts"),
    ("abc", "non-empty list of prompts"),
])
def test_bad_token_ids_are_refused_by_generate_and_forward(tiny, prompts, match):
  with pytest.raises(ValueError, match=match):
    generate(tiny[1], prompts, 2, **POOL)
  with pytest.raises(ValueError, match=match.replace("prompt", "sequence")):
    forward(tiny[1], prompts)


def test_numpy_integer_prompts_are_accepted(tiny):
  want = generate(tiny[1], [PROMPTS[0]], 3, **POOL)
  assert generate(tiny[1], [np.array(PROMPTS[0], np.int64)], np.int32(3), **POOL) == want
  assert generate(tiny[1], [[np.uint16(t) for t in PROMPTS[0]]], 3, **POOL) == want


def test_prompts_past_max_position_embeddings_are_refused(tiny):
  short = dataclasses.replace(tiny[1].config, attention=tiny[1].config.attention.replace(
      max_position_embeddings=12))
  model = DeepseekForCausalLM(short, backend="reference", dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="prompt 0 needs 13 positions .10 tokens, 4 new.*=12"):
    generate(model, [list(range(10))], 4)
  with pytest.raises(ValueError, match="sequence 1 needs 13 positions"):
    forward(model, [[1], list(range(13))])
  with pytest.raises(ValueError, match="tokens must be integer ids"):
    model(jnp.zeros(8, jnp.float32), model.allocate_caches(1, 8), None)


def test_a_bad_tensor_in_a_later_layer_leaves_the_whole_model_unchanged(tiny, tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(tiny[0], path)
  name = "model.layers.1.mlp.down_proj.weight"
  ckpt = Checkpoint(path)
  file = ckpt.weight_map[name]
  tensors = ckpt.read([n for n, f in ckpt.weight_map.items() if f == file])
  tensors[name + "_scale_inv"] = np.full_like(tensors[name + "_scale_inv"], np.nan)
  save_file(tensors, str(path / file))
  model = DeepseekForCausalLM(tiny[1].config, backend="reference", dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(3))
  before = jax.tree.map(np.asarray, nnx.state(model))
  with pytest.raises(ValueError, match="down_proj.weight_scale_inv"):
    model.load_checkpoint(Checkpoint(path))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)


def test_batch_invariant_reaches_every_layers_decode(tiny):
  path, model = tiny
  inv = DeepseekForCausalLM.from_checkpoint(path, backend="reference", dtype=jnp.float32,
                                            batch_invariant=True)
  assert ([layer.self_attn.mla_attn.batch_invariant for layer in inv.layers]
          == [True] * len(inv.layers))
  assert not any(layer.self_attn.mla_attn.batch_invariant for layer in model.layers)
