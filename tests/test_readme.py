"""The README's two commands stay true: CI runs its test command, the demo runs."""

import pathlib

from mla_jax import demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
  return [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
          if line.startswith("    python3.12 ")]


def test_readme_has_a_demo_and_a_test_command():
  demo_cmd, test_cmd = readme_commands()
  assert demo_cmd.endswith("-m mla_jax.demo")
  assert "pytest" in test_cmd


def test_ci_runs_the_readme_test_command():
  ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
  assert ci_lines[-1] == readme_commands()[1]


def test_demo_runs_and_matches_the_unabsorbed_math(capsys):
  demo.main(["--prompts", "5", "19", "--steps", "2", "--backend", "reference"])
  out = capsys.readouterr().out
  assert "backend: reference" in out
  error = float(out.strip().splitlines()[-1].split()[-1])
  assert error < 1e-5
