import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests share oracles.py and the contract bases


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
