"""Every lesson notebook runs top to bottom at the smoke scale (tiny runs, seconds on a CPU)."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

LESSONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(LESSONS, "*.ipynb"))),
                         ids=os.path.basename)
def test_lesson_executes_at_smoke_scale(path, monkeypatch):
    monkeypatch.setenv("NANOCHACAL_SCALE", "smoke")  # the kernel inherits this environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": LESSONS}}).execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.get("output_type") == "error"]
    assert not errors
