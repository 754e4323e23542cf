"""A tiny DeepSeek-shaped checkpoint with random weights, laid out as the Hugging Face ones are.

    python -m mla_jax.tiny_checkpoint OUT_DIR [--variant v3|v3.2] [--shards 2]

`config.json` carries the V3 (and V3.2 indexer) keys at small sizes; tensors use the exact HF
names, are spread over several `model-0000k-of-0000n.safetensors` files with
`model.safetensors.index.json`, and the 2-D projection weights are fp8 (e4m3) with one float32
`weight_scale_inv` per 128x128 block, as DeepSeek ships them. Sizes are not multiples of 128, so
the last blocks are ragged. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from mla_jax.checkpoint import INDEX_FILE, SCALE_SUFFIX, import_safetensors
from mla_jax.quant import quantize_fp8_blocks

BLOCK = (128, 128)


def tiny_config(variant: str = "v3", *, num_layers: int = 2, index_topk: int = 8) -> dict:
  """A V3 / V3.2 `config.json` at small sizes: every layer dense (first_k_dense_replace covers
  them all), since the small decoder has no experts."""
  if variant not in ("v3", "v3.2"):
    raise ValueError(f"unknown variant {variant!r}; known: v3, v3.2")
  config = {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
      "ep_size": 1, "first_k_dense_replace": num_layers, "hidden_act": "silu", "hidden_size": 160,
      "initializer_range": 0.02, "intermediate_size": 288, "kv_lora_rank": 64,
      "max_position_embeddings": 163840, "moe_intermediate_size": 64, "moe_layer_freq": 1,
      "n_group": 1, "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": True,
      "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": num_layers,
      "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "q_lora_rank": 96,
      "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": list(BLOCK)},
      "rms_norm_eps": 1e-06, "rope_theta": 10000,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                       "type": "yarn"},
      "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
      "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
      "transformers_version": "4.46.3", "use_cache": True, "v_head_dim": 32, "vocab_size": 320,
  }
  if variant == "v3.2":
    config |= {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
               "index_head_dim": 32, "index_n_heads": 4, "index_topk": index_topk}
  return config


def _shapes(c: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
  """HF name -> (shape, stored as block-quantized fp8), in the order HF writes them."""
  h, n = c["hidden_size"], c["num_attention_heads"]
  qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
  out = {"model.embed_tokens.weight": ((c["vocab_size"], h), False)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out |= {
        p + "input_layernorm.weight": ((h,), False),
        p + "self_attn.q_a_proj.weight": ((c["q_lora_rank"], h), True),
        p + "self_attn.q_a_layernorm.weight": ((c["q_lora_rank"],), False),
        p + "self_attn.q_b_proj.weight": ((n * qk, c["q_lora_rank"]), True),
        p + "self_attn.kv_a_proj_with_mqa.weight": (
            (c["kv_lora_rank"] + c["qk_rope_head_dim"], h), True),
        p + "self_attn.kv_a_layernorm.weight": ((c["kv_lora_rank"],), False),
        p + "self_attn.kv_b_proj.weight": ((n * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                            c["kv_lora_rank"]), True),
        p + "self_attn.o_proj.weight": ((h, n * c["v_head_dim"]), True),
    }
    if "index_topk" in c:  # V3.2: weights_proj stays unquantized, as in DeepSeek's release
      d = c["index_head_dim"]
      out |= {
          p + "self_attn.indexer.wq_b.weight": ((c["index_n_heads"] * d, c["q_lora_rank"]), True),
          p + "self_attn.indexer.wk.weight": ((d, h), True),
          p + "self_attn.indexer.k_norm.weight": ((d,), False),
          p + "self_attn.indexer.k_norm.bias": ((d,), False),
          p + "self_attn.indexer.weights_proj.weight": ((c["index_n_heads"], h), False),
      }
    out |= {
        p + "post_attention_layernorm.weight": ((h,), False),
        p + "mlp.gate_proj.weight": ((c["intermediate_size"], h), True),
        p + "mlp.up_proj.weight": ((c["intermediate_size"], h), True),
        p + "mlp.down_proj.weight": ((h, c["intermediate_size"]), True),
    }
  out |= {"model.norm.weight": ((h,), False), "lm_head.weight": ((c["vocab_size"], h), False)}
  return out


def write_tiny_checkpoint(path: str | pathlib.Path, variant: str = "v3", *, num_layers: int = 2,
                          index_topk: int = 8,
                          num_shards: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
  """Writes the checkpoint into directory `path`; returns every weight as float32, as it was
  before fp8 quantization (unquantized ones as stored, i.e. after bfloat16 rounding)."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  config = tiny_config(variant, num_layers=num_layers, index_topk=index_topk)
  rng = np.random.default_rng(seed)
  originals, stored = {}, {}
  for name, (shape, quantized) in _shapes(config).items():
    if len(shape) == 1:  # norm scales near 1, biases near 0
      w = (0.0 if name.endswith(".bias") else 1.0) + 0.1 * rng.standard_normal(shape)
    elif name == "model.embed_tokens.weight":
      w = rng.standard_normal(shape)
    else:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
      w = rng.standard_normal(shape) * shape[1] ** -0.5
    w = w.astype(np.float32)
    if quantized:
      stored[name], stored[name + SCALE_SUFFIX] = quantize_fp8_blocks(w, BLOCK)
      originals[name] = w
    else:
      stored[name] = w.astype(ml_dtypes.bfloat16)
      originals[name] = stored[name].astype(np.float32)
  _write_shards(path, stored, num_shards)
  (path / "config.json").write_text(json.dumps(config, indent=2))
  return originals


def _write_shards(path: pathlib.Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
  """Cuts the tensors (in order, each scale with its weight) into `num_shards` files of about
  equal bytes, as HF's sharding does, and writes the index."""
  save_file = import_safetensors().numpy.save_file
  names = list(tensors)
  total = sum(t.nbytes for t in tensors.values())
  shards, size = [[]], 0
  for name in names:
    if size >= total * len(shards) / num_shards and not name.endswith(SCALE_SUFFIX):
      shards.append([])
    shards[-1].append(name)
    size += tensors[name].nbytes
  if len(shards) != num_shards:
    raise ValueError(f"{len(names)} tensors do not cut into {num_shards} shards")
  weight_map = {}
  for k, group in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
    save_file({n: np.ascontiguousarray(tensors[n]) for n in group}, str(path / file),
              metadata={"format": "pt"})
    weight_map |= {n: file for n in group}
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (path / INDEX_FILE).write_text(json.dumps(index, indent=2))


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out_dir")
  parser.add_argument("--variant", choices=["v3", "v3.2"], default="v3")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--shards", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  write_tiny_checkpoint(args.out_dir, args.variant, num_layers=args.layers, num_shards=args.shards,
                        seed=args.seed)
  print(f"wrote a tiny DeepSeek-{args.variant.upper()} checkpoint to {args.out_dir}")


if __name__ == "__main__":
  main()
