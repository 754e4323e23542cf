"""The README's two commands stay true: CI runs its test command, the demo runs, the version
check in front of both names the user's mistake."""

import os
import pathlib
import stat
import subprocess
import sys

from mla_jax import demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
  """The indented command lines of the README's "Run it" section."""
  section = (ROOT / "README.md").read_text().split("\n## Run it\n")[1].split("\n## ")[0]
  return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_has_a_demo_and_a_test_command():
  demo_cmd, test_cmd = readme_commands()
  assert demo_cmd.endswith("-m mla_jax.demo")
  assert test_cmd.endswith('-m pytest -q -m "not gpu"')
  assert "${PYTHON:-python3}" in demo_cmd and "python3.12" not in demo_cmd.split("&&", 1)[1]


def test_ci_runs_the_readme_test_command_without_a_shim():
  ci = (ROOT / ".ci" / "run").read_text()
  assert readme_commands()[1] in ci.splitlines()
  assert "ln -s" not in ci and "PATH=" not in ci


def version_check():
  check = readme_commands()[0].split(" && ")[0]
  assert check == readme_commands()[1].split(" && ")[0]
  return check


def run_check(python):
  return subprocess.run(["bash", "-c", version_check()], env={**os.environ, "PYTHON": python},
                        capture_output=True, text=True, timeout=60)


def test_version_check_passes_on_this_python():
  done = run_check(sys.executable)
  assert done.returncode == 0 and not done.stderr, done.stderr


def test_version_check_names_the_problem_on_an_older_python(tmp_path):
  # A Python that reports 3.11, as python3 does on pyenv machines where 3.12 is not the default.
  old = tmp_path / "python3"
  old.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; sys.version_info = (3, 11, 7); '
                 'exec(sys.argv[1])" "$2"\n')
  old.chmod(old.stat().st_mode | stat.S_IEXEC)
  done = run_check(str(old))
  assert done.returncode == 1
  assert done.stderr.strip() == "mla-jax needs Python >= 3.12, not 3.11: set PYTHON to one"


def test_demo_runs_and_matches_the_unabsorbed_math(capsys):
  demo.main(["--prompts", "5", "19", "--steps", "2", "--backend", "reference"])
  out = capsys.readouterr().out
  assert "backend: reference" in out
  assert " prefill   24 tokens in   32 rows (decode 0 + prefill 32, power-of-two buckets)" in out
  error = float(out.strip().splitlines()[-1].split()[-1])
  assert error < 1e-5
