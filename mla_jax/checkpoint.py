"""Reading DeepSeek checkpoints: `config.json` plus safetensors shards, a few tensors at a time.

A checkpoint directory holds either `model.safetensors.index.json` (whose `weight_map` names the
shard of every tensor) or a single `model.safetensors`. Only the shards that hold the requested
tensors are opened, and only those tensors are read, so one layer of a 600 GB model loads alone.
Block-quantized fp8 weights (DeepSeek V3's e4m3 `weight` with a float32 `weight_scale_inv`, one
scale per 128x128 block) come back dequantized to float32.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import types
from typing import Iterable

import numpy as np

from mla_jax.modules import DeepseekV2MLAAttention
from mla_jax.quant import F8, block_grid, expand_block_scales, is_fp8
from mla_jax.weights import load_attention_weights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"


def import_safetensors() -> types.ModuleType:
  """The safetensors package: an optional dependency, only checkpoint files need it."""
  try:
    import safetensors
    import safetensors.numpy
  except ImportError as e:
    raise ImportError("checkpoint files need safetensors: pip install 'mla-jax[checkpoints]'"
                      ) from e
  return safetensors


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int] = (128, 128),
                          name: str = "weight") -> np.ndarray:
  """e4m3 `weight` [out, in] times its block scales [ceil(out/b0), ceil(in/b1)] -> float32.

  Scale (i, j) covers rows i*b0:(i+1)*b0 and columns j*b1:(j+1)*b1; the last blocks may be
  ragged. `name` (the weight's) goes into the errors.
  """
  if not is_fp8(weight.dtype) or weight.ndim != 2:
    raise ValueError(f"{name} has a {name}{SCALE_SUFFIX} but is {weight.dtype} of shape "
                     f"{weight.shape}; block scales apply to 2-D float8_e4m3fn weights")
  grid = block_grid(weight.shape, block)
  scale = np.asarray(scale_inv).astype(np.float32)
  if scale.shape != grid:
    raise ValueError(f"{name}{SCALE_SUFFIX} has shape {scale.shape}; weight {weight.shape} in "
                     f"{tuple(block)} blocks needs {grid}")
  if not np.all(np.isfinite(scale) & (scale > 0)):
    raise ValueError(f"{name}{SCALE_SUFFIX} holds non-finite or non-positive scales")
  return weight.astype(np.float32) * expand_block_scales(scale, block, weight.shape)


def _read_fp8(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """e4m3 tensors read at the offsets of the file's own header: safetensors' numpy framework has
  no float8 dtype to give them (it raises; safetensors issue #682)."""
  out = {}
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    for name in names:
      begin, end = header[name]["data_offsets"]
      f.seek(8 + size + begin)
      data = f.read(end - begin)
      if len(data) != end - begin:
        raise ValueError(f"{path}: tensor {name} is cut short ({len(data)} of {end - begin} bytes)")
      out[name] = np.frombuffer(data, F8).reshape(header[name]["shape"])
  return out


@contextlib.contextmanager
def _file_errors(path: pathlib.Path):
  """safetensors' own errors (truncated, empty, corrupt header) as a ValueError naming the file."""
  try:
    yield
  except (ValueError, ImportError):
    raise
  except Exception as e:
    raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from e


def _read_file(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """The tensors `names` of one safetensors file, as stored (numpy, ml_dtypes for bf16/fp8)."""
  if not path.is_file():
    raise ValueError(f"{path} (holding {names[0]}) does not exist")
  safetensors = import_safetensors()
  out, fp8 = {}, []
  with _file_errors(path), safetensors.safe_open(str(path), framework="numpy") as f:
    keys = set(f.keys())
    for name in names:
      if name not in keys:
        raise ValueError(f"tensor {name} is not in {path.name}, where the index puts it")
      dtype = f.get_slice(name).get_dtype()
      if dtype == "F8_E4M3":
        fp8.append(name)
      elif dtype.startswith("F8"):
        raise ValueError(f"tensor {name} is {dtype}; of the fp8 formats only F8_E4M3 is supported")
      else:
        out[name] = f.get_tensor(name)
  return out | (_read_fp8(path, fp8) if fp8 else {})


def _read_json(path: pathlib.Path) -> dict:
  """A JSON object file, or a ValueError naming the file and what is wrong with it."""
  try:
    value = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a {type(value).__name__}, expected a JSON object")
  return value


def _block_size(quant: dict, config: pathlib.Path) -> tuple[int, int]:
  block = quant.get("weight_block_size", (128, 128))
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise ValueError(f"{config}: quantization_config.weight_block_size is {block!r}, expected two "
                     f"positive integers")
  return tuple(block)


def _weight_map(path: pathlib.Path) -> dict[str, str]:
  """The index's tensor -> shard map, every shard a file name inside the checkpoint folder."""
  index = path / INDEX_FILE
  weight_map = _read_json(index).get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(f"{index} has no weight_map object (tensor name -> shard file)")
  root = path.resolve()
  for name, file in weight_map.items():
    if not isinstance(file, str) or not file:
      raise ValueError(f"{index}: weight_map[{name!r}] is {file!r}, expected a shard file name")
    if not (root / file).resolve().is_relative_to(root):
      raise ValueError(f"{index}: weight_map[{name!r}] = {file!r} leaves the checkpoint folder")
  return weight_map


class Checkpoint:
  """A checkpoint directory, read lazily: nothing but the index (or one file's names) at first."""

  def __init__(self, path):
    self.path = pathlib.Path(path)
    config = self.path / "config.json"
    if not config.is_file():
      raise ValueError(f"{config} not found: a checkpoint directory holds config.json and "
                       "safetensors")
    self.config = _read_json(config)
    quant = self.config.get("quantization_config") or {}
    if not isinstance(quant, dict):
      raise ValueError(f"{config}: quantization_config is {quant!r}, expected an object")
    if quant.get("quant_method", "fp8") != "fp8":
      raise ValueError(f"quantization {quant['quant_method']!r} is not supported; supported: fp8 "
                       f"with block scales")
    self.block_size = _block_size(quant, config)
    if (self.path / INDEX_FILE).is_file():
      self.weight_map: dict[str, str] = _weight_map(self.path)
    elif (self.path / SINGLE_FILE).is_file():
      safetensors = import_safetensors()
      with (_file_errors(self.path / SINGLE_FILE),
            safetensors.safe_open(str(self.path / SINGLE_FILE), framework="numpy") as f):
        self.weight_map = {name: SINGLE_FILE for name in f.keys()}
    else:
      raise ValueError(f"{self.path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")

  def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors `names` as stored, opening each shard that holds any of them once."""
    names = list(names)
    by_file = collections.defaultdict(list)
    for name in names:
      if name not in self.weight_map:
        raise ValueError(f"tensor {name} is not in the checkpoint {self.path}")
      by_file[self.weight_map[name]].append(name)
    out = {}
    for file, group in by_file.items():
      out |= _read_file(self.path / file, group)
    return {name: out[name] for name in names}

  def load(self, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors `names`, each fp8 one dequantized to float32 with its `_scale_inv`."""
    names = list(names)
    scales = [n + SCALE_SUFFIX for n in names if n + SCALE_SUFFIX in self.weight_map]
    raw = self.read(names + scales)
    out = {}
    for name in names:
      value = raw[name]
      if name + SCALE_SUFFIX in raw:
        value = dequantize_fp8_blocks(value, raw[name + SCALE_SUFFIX], self.block_size, name)
      elif is_fp8(value.dtype):
        raise ValueError(f"fp8 tensor {name} has no {name}{SCALE_SUFFIX} to dequantize it with")
      out[name] = value
    return out

  def tensors(self, prefix: str) -> dict[str, np.ndarray]:
    """Every tensor whose name starts with `prefix` (fp8 ones dequantized, scales consumed)."""
    return self.load(n for n in self.weight_map
                     if n.startswith(prefix) and not n.endswith(SCALE_SUFFIX))


def attention_prefix(layer: int) -> str:
  return f"model.layers.{layer}.self_attn."


def load_attention_layer(checkpoint: Checkpoint | str | pathlib.Path,
                         module: DeepseekV2MLAAttention, layer: int) -> None:
  """Fills `module` with layer `layer`'s attention (and V3.2 indexer) weights of a checkpoint."""
  ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
  prefix = attention_prefix(layer)
  load_attention_weights(module, ckpt.tensors(prefix), prefix)
