"""Every lesson runs top to bottom at the smoke scale (tiny runs, seconds on a CPU) and ends
with its claims cell: a verdict per claim, then the time the lesson took. And lessons/common.py
trains runs in parallel as one would one by one."""

import concurrent.futures
import functools
import glob
import os
import sys

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from conftest import ROOT, TINY

LESSONS = os.path.join(ROOT, "lessons")
PATHS = sorted(glob.glob(os.path.join(LESSONS, "*.ipynb")))
SMOKE = dict(os.environ, NANOCHACAL_SCALE="smoke", MPLBACKEND="Agg", OMP_NUM_THREADS="1")


def execute_in_turn(paths):
    """Each notebook top to bottom at the smoke scale, one after another: {path: notebook or error}."""
    done = {}
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        try:
            NotebookClient(notebook, timeout=300, kernel_name="python3",
                           resources={"metadata": {"path": LESSONS}}).execute(env=SMOKE)
            done[path] = notebook
        except Exception as error:  # the notebook's own test reports it
            done[path] = error
    return done


@functools.cache
def executions():
    """Two notebooks at a time, each kernel on one thread: a smoke run is mostly Python. Lessons 0
    and 1 share their standard runs (whichever runs first trains them), so they run in turn."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    groups = [PATHS[:2]] + [[path] for path in reversed(PATHS[2:])]  # the later lessons, longer, first
    futures = {tuple(group): pool.submit(execute_in_turn, group) for group in groups}
    return {path: future for group, future in futures.items() for path in group}


@pytest.mark.parametrize("path", PATHS, ids=os.path.basename)
def test_lesson_executes_at_smoke_scale(path):
    notebook = executions()[path].result()[path]
    if isinstance(notebook, Exception):
        raise notebook
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    assert not [output for output in outputs if output.get("output_type") == "error"]
    claims = [cell for cell in notebook.cells if cell.cell_type == "code"][-1]
    *verdicts, blank, took = "".join(output.get("text", "") for output in claims.get("outputs", [])).splitlines()
    assert verdicts and all(line[:2] in ("✓ ", "✗ ", "· ") for line in verdicts), verdicts
    assert blank == "" and took.startswith("lesson time: "), took


def test_runs_in_parallel_processes_equal_the_same_runs_one_after_another(tmp_path):
    # lessons/common.py's train_many: each spawned worker gets one CPU thread here, and so does
    # the sequential reference, so that both sum in the same order and agree to the last digit.
    sys.path.insert(0, LESSONS)
    import common
    flags = TINY + ["--max_iters", "4", "--eval_interval", "2"]
    argvs = [flags + ["--seed", str(seed), "--out_dir", str(tmp_path / "parallel" / str(seed))] for seed in (0, 1)]
    parallel = common.train_many(argvs, jobs=2, resume_saved=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_by_one = common.train_many([argv[:-1] + [str(tmp_path / f"one{i}")] for i, argv in enumerate(argvs)],
                                       resume_saved=False)
    finally:
        torch.set_num_threads(threads)
    untimed = lambda runs: [[{k: v for k, v in m.items() if k != "train_time"} for m in r["metrics"]] for r in runs]
    assert untimed(parallel) == untimed(one_by_one)
    assert parallel[0]["final"]["eval_loss"] != parallel[1]["final"]["eval_loss"]  # two seeds
