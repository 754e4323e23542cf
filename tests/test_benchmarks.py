"""The benchmark modules' entry points: `python -m benchmarks.<name> --help` from the repository
root, a help text for every option, and a clear exit on a machine without a GPU."""

import argparse
import importlib
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_every_benchmark_is_listed():
  assert MODULES == ["benchmarks.bench_decode", "benchmarks.bench_generate", "benchmarks.bench_prefill",
                     "benchmarks.bench_sparse", "benchmarks.bench_tp"]


@pytest.mark.parametrize("module", MODULES)
def test_help_runs_as_a_module_from_the_repository_root(module):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith(f"usage: python -m {module} ")
  assert "needs" not in done.stderr  # --help answers before looking for a GPU


@pytest.mark.parametrize("module", MODULES)
def test_help_describes_every_option_and_the_whole_module(module, capsys, monkeypatch):
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exit_info:
    mod.main(["--help"])
  assert exit_info.value.code == 0
  assert mod.__doc__.strip() in capsys.readouterr().out  # the whole docstring, not its first line
  parsers = []
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                      lambda self, argv=None: parsers.append(self) or sys.exit(0))
  with pytest.raises(SystemExit):
    mod.main([])
  (parser,) = parsers
  assert len(parser._actions) > 3
  for action in parser._actions:
    assert action.help and len(action.help) > 5, f"{module}: {action.option_strings} has no help"


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a GPU is visible")
@pytest.mark.parametrize("module", MODULES)
def test_without_a_gpu_it_says_so_and_exits(module):
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exit_info:
    mod.main(["--quick"] if "--quick" in mod.__doc__ else [])
  message = str(exit_info.value.code)
  assert f"python -m {module} needs" in message and "CUDA GPU" in message, message
