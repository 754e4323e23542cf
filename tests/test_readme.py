"""The README stays true: CI runs its test command, the demo runs, the version check in front of
both commands names the user's mistake, and its code blocks (and the notebooks) run as written,
importing from `mla_jax` itself."""

import ast
import json
import os
import pathlib
import re
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
  assert test_cmd.endswith('-m pytest -q -m "not gpu" -n 2 --dist loadfile')
  assert "${PYTHON:-python3}" in demo_cmd and "python3.12" not in demo_cmd.split("&&", 1)[1]


def test_ci_runs_the_readme_test_command_without_a_shim():
  ci = (ROOT / ".ci" / "run").read_text()
  assert readme_commands()[1] in [line.strip() for line in ci.splitlines()]
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
  old.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c '
                 '"import sys; sys.version_info = (3, 11, 7); exec(sys.argv[1])" "$2"\n')
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


def readme_python_blocks():
  return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


def test_readme_code_blocks_run_as_written(tmp_path):
  """All blocks in order, one script, in a fresh directory, on two CPU devices (for the sharding
  block)."""
  blocks = readme_python_blocks()
  assert len(blocks) >= 5
  script = tmp_path / "readme.py"
  script.write_text("\n".join(blocks) + '\nprint("README blocks ran")\n')
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().endswith("README blocks ran")


def mla_jax_imports(code):
  """(module, name) of every import of mla_jax in `code` (IPython magics skipped)."""
  lines = [line for line in code.splitlines() if not line.lstrip().startswith("%")]
  tree = ast.parse("\n".join(lines))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "mla_jax":
      found += [(node.module, alias.name) for alias in node.names]
    elif isinstance(node, ast.Import):
      found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "mla_jax"]
  return found


def test_readme_and_notebooks_import_from_the_package_itself():
  import mla_jax
  sources = {"README.md": "\n".join(readme_python_blocks())}
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    cells = json.loads(nb.read_text())["cells"]
    sources[nb.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  for source, code in sources.items():
    imports = mla_jax_imports(code)
    assert imports, source
    for module, name in imports:
      assert module == "mla_jax", f"{source} imports from {module}"
      assert name is None or name in mla_jax.__all__, f"{source}: {name} is not in mla_jax.__all__"


def test_public_api_names_exist_and_are_exactly_all():
  import mla_jax
  namespace = {}
  exec("from mla_jax import *", namespace)
  assert set(namespace) - {"__builtins__"} == set(mla_jax.__all__)
  for name in ["MLAConfig", "DeepseekV2MLAAttention", "LatentCache", "DSACache", "build_metadata",
               "jitted_step", "Checkpoint", "load_attention_layer", "DeepseekForCausalLM",
               "generate", "backends", "sharding"]:
    assert name in mla_jax.__all__
