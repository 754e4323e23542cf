"""The notebooks run top to bottom (on whatever this machine is) and are stored without outputs."""

import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat")


def test_both_notebooks_are_there():
  assert [p.name for p in NOTEBOOKS] == ["quickstart.ipynb", "sparse_attention.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_cleared(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_without_error(path, tmp_path, monkeypatch):
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  # A kernel spec of this very interpreter, found first through JUPYTER_PATH: a "python3" spec
  # elsewhere on the machine could start another Python without this environment's packages.
  spec = tmp_path / "kernels" / "mla-jax-test"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "mla-jax tests", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  # The checkout's mla_jax, also where it is not installed.
  monkeypatch.setenv("PYTHONPATH",
                     os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="mla-jax-test", timeout=300,
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()  # raises CellExecutionError at the first failing cell
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
