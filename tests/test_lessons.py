"""The lessons: every notebook runs top to bottom at the smoke scale (tiny runs, seconds on a
CPU), and their helper module, lessons/common.py, trains many runs as one would one by one."""

import collections
import concurrent.futures
import glob
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import train
from conftest import ROOT, needs_posix_signals

LESSONS = os.path.join(ROOT, "lessons")
sys.path.insert(0, LESSONS)
import common  # noqa: E402

TINY = ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--n_embd", "32", "--n_head", "2",
        "--batch_size", "8", "--eval_samples", "16", "--no-progress", "--device", "cpu"]


def execute(path, scale, monkeypatch, first_cell=None):
    """The lesson at `path` run top to bottom at NANOCHACAL_SCALE=scale, `first_cell` (code) run
    before its own cells; returns the executed notebook."""
    monkeypatch.setenv("NANOCHACAL_SCALE", scale)  # the kernel inherits this environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    if first_cell is not None:
        notebook.cells.insert(0, nbformat.v4.new_code_cell(first_cell))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": LESSONS}}).execute()
    return notebook


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(LESSONS, "*.ipynb"))),
                         ids=os.path.basename)
def test_lesson_executes_at_smoke_scale(path, monkeypatch):
    notebook = execute(path, "smoke", monkeypatch)
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.get("output_type") == "error"]
    assert not errors
    # The last cell is the claims cell: a verdict per claim, then the time the lesson took.
    claims_cell = [cell for cell in notebook.cells if cell.cell_type == "code"][-1]
    printed = "".join(output.get("text", "") for output in claims_cell.get("outputs", []))
    *verdicts, blank, took = printed.splitlines()
    assert verdicts and all(line[:2] in ("✓ ", "✗ ", "· ") for line in verdicts), verdicts
    assert blank == "" and took.startswith("lesson time: "), took


# Run first in a lesson at the gpu scale: its first plan of runs goes through train.py's checks
# (on the CPU, into a scratch folder), and the lesson stops there, having trained nothing.
CHECK_THE_PLAN = """
import contextlib, functools, io, common, data, train
# Every run folder a lesson names is under OUT: in the scratch folder, train.py's start-up check
# makes them there (lesson 04's tasks too, built through train.parse_args), never in out/gpu.
common.OUT = {scratch!r} + "/out"
# A few boxes examples are enough to check flags (the gpu scale's full sets take a minute to
# draw), and they are never cached: under the full sets' names they would stand in for them.
boxes_generate = data.Boxes._generate
data.Boxes.__init__ = functools.partialmethod(data.Boxes.__init__, cache_dir=None)
data.Boxes._generate = lambda self, n, *rest: boxes_generate(self, min(n, 8), *rest)
class PlanChecked(Exception):
    pass
class PlanRefused(Exception):
    pass
def check_plan(argvs, jobs=1, resume_saved=False):
    for argv in argvs:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                train.parse_args(list(argv) + ["--device", "cpu"])
        except SystemExit:
            raise PlanRefused(" ".join(argv) + ": " + said.getvalue().strip().splitlines()[-1]) from None
    raise PlanChecked(f"{{len(argvs)}} runs checked")
common.train_many = check_plan
"""


def stopped_at_the_plan_check(path, first_cell, monkeypatch):
    """The lesson run at the gpu scale after first_cell, which must stop it with PlanChecked
    (its plan passed train.py's checks); returns PlanChecked's message."""
    with pytest.raises(CellExecutionError) as stopped:
        execute(path, "gpu", monkeypatch, first_cell)
    assert stopped.value.ename == "PlanChecked", f"{stopped.value.ename}: {stopped.value.evalue}"
    return str(stopped.value.evalue)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(LESSONS, "*.ipynb"))),
                         ids=os.path.basename)
def test_lesson_plans_valid_runs_at_gpu_scale(path, tmp_path, monkeypatch):
    # The paper's sizes are never trained here; the flags of the first runs each lesson plans
    # at that scale must at least pass train.py's checks, as a reader with a GPU would run them.
    stopped_at_the_plan_check(path, CHECK_THE_PLAN.format(scratch=str(tmp_path)), monkeypatch)


# Lesson 06 then fine-tunes with --init_from the checkpoint of its first plan's standard run,
# which train.py reads while checking the flags: so that plan is trained first, one step each at
# the gpu scale's model sizes, and the second is checked against those checkpoints.
TRAIN_ONE_STEP_THEN_CHECK = CHECK_THE_PLAN + """
trained = []
def one_step_then_check(argvs, jobs=1, resume_saved=False):
    if trained:
        check_plan(argvs)
    runs = []
    for k, argv in enumerate(argvs):
        argv = list(argv)
        argv[argv.index("--out_dir") + 1] = {scratch!r} + f"/trained{{k}}"
        runs.append(train.main(argv + ["--max_iters", "1", "--eval_interval", "1", "--eval_samples", "1",
                                       "--batch_size", "1", "--device", "cpu"]))
    trained.append(runs)
    return runs
common.train_many = one_step_then_check
"""


def test_lesson_06_fine_tunes_at_gpu_scale_pass_train_py_checks_from_its_scratch_runs(tmp_path, monkeypatch):
    checked = stopped_at_the_plan_check(os.path.join(LESSONS, "06_language_modelling.ipynb"),
                                        TRAIN_ONE_STEP_THEN_CHECK.format(scratch=str(tmp_path)), monkeypatch)
    assert "2 runs checked" in checked  # the fine-tunes, not the scratch runs
    assert len(glob.glob(str(tmp_path / "trained*" / "ckpt.pt"))) == 3


def test_runs_in_parallel_processes_equal_the_same_runs_one_after_another(tmp_path):
    # Each spawned worker gets one CPU thread; so does the sequential reference, so that both
    # sum in the same order and must agree to the last digit.
    flags = TINY + ["--max_iters", "6", "--eval_interval", "3"]
    argvs = [flags + ["--seed", str(seed), "--out_dir", str(tmp_path / "parallel" / str(seed))]
             for seed in (0, 1)]
    parallel = common.train_many(argvs, jobs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_by_one = common.train_many([argv[:-1] + [str(tmp_path / f"seq{i}")]
                                       for i, argv in enumerate(argvs)])
    finally:
        torch.set_num_threads(threads)
    def untimed(runs):
        return [[{k: v for k, v in m.items() if k != "train_time"} for m in r["metrics"]]
                for r in runs]
    assert untimed(parallel) == untimed(one_by_one)
    assert parallel[0]["final"]["eval_loss"] != parallel[1]["final"]["eval_loss"]  # two seeds
    assert "step 6:" in (tmp_path / "parallel" / "0" / "log.txt").read_text()


def test_a_worker_trains_on_its_share_of_threads_without_a_progress_bar(tmp_path, monkeypatch):
    seen = {}
    def fake_main(argv):
        seen.update(argv=argv, threads=torch.get_num_threads())
        print("what the run prints")
        return {"line": "done"}
    monkeypatch.setattr(train, "main", fake_main)
    threads = torch.get_num_threads()
    try:
        share = threads + 1  # unlike the count it had, on any machine
        assert common.main_logged(TINY[:2], str(tmp_path / "run" / "log.txt"), share) == {"line": "done"}
    finally:
        torch.set_num_threads(threads)
    assert seen == {"argv": TINY[:2] + ["--no-progress"], "threads": share}
    assert (tmp_path / "run" / "log.txt").read_text() == "what the run prints\n"  # not the notebook


def test_train_many_takes_saved_runs_as_they_are_only_when_asked(tmp_path, capsys, monkeypatch):
    flags = TINY + ["--max_iters", "4", "--eval_interval", "2"]
    finished = flags + ["--out_dir", str(tmp_path / "finished")]
    stopped = flags + ["--out_dir", str(tmp_path / "stopped")]
    first = train.main(finished)
    schedule = train.learning_rate
    def interrupt_at_step_3(step, args):  # Ctrl-C after the checkpoint of step 2
        if step == 3:
            raise KeyboardInterrupt
        return schedule(step, args)
    monkeypatch.setattr(train, "learning_rate", interrupt_at_step_3)
    with pytest.raises(SystemExit, match="holds step 2"):
        train.main(stopped)
    monkeypatch.setattr(train, "learning_rate", schedule)
    saved = json.loads((tmp_path / "stopped" / "metrics.jsonl").read_text())
    again, resumed = common.train_many([finished, stopped], resume_saved=True)
    assert again["final"] == first["final"]  # train_time included: it did not train again
    assert [m["step"] for m in resumed["metrics"]] == [2, 4] and resumed["metrics"][0] == saved
    capsys.readouterr()
    common.train_many([finished], resume_saved=False)  # every run starts over
    assert "holds an earlier run" in capsys.readouterr().out


def test_a_saved_run_with_other_settings_is_refused_not_taken(tmp_path):
    out = ["--out_dir", str(tmp_path / "run")]
    fresh = TINY + ["--max_iters", "2", "--eval_interval", "2"] + out
    assert common.reuse_if_saved(fresh) == fresh  # nothing saved yet: a fresh run, no --resume
    train.main(fresh)
    assert common.reuse_if_saved(fresh)[-1] == "--resume"
    with pytest.raises(SystemExit, match=r"--n_embd 32 \(now 64\).*delete that directory"):
        common.reuse_if_saved([*TINY, "--max_iters", "2", "--eval_interval", "2", *out, "--n_embd", "64"])
    with pytest.raises(SystemExit, match=r"--max_iters 2 \(now 1000\)"):  # a flag no longer typed
        common.reuse_if_saved(TINY + ["--eval_interval", "2"] + out)
    for flag, value in (("--seed", "1"), ("--lr", "0.01"), ("--attn", "standard")):
        with pytest.raises(SystemExit, match=flag):
            common.reuse_if_saved(TINY + ["--max_iters", "2", "--eval_interval", "2", flag, value] + out)
    # A task's own defaults (parity sets its lr and more) are part of the same settings.
    parity = ["--task", "parity", "--attn", "dilated", "--share_weights", "--max_iters", "2",
              "--eval_interval", "2", "--n_embd", "16", "--n_head", "2", "--batch_size", "4",
              "--eval_samples", "8", "--length_samples", "2", "--max_test_length", "44",
              "--no-progress", "--device", "cpu", "--out_dir", str(tmp_path / "parity")]
    train.main(parity)
    assert common.reuse_if_saved(parity)[-1] == "--resume"
    with pytest.raises(ValueError, match="more than one run writes to"):
        common.train_many([TINY + out, TINY + out])
    with pytest.raises(ValueError, match="more than one run writes to"):  # one folder, two names
        common.train_many([TINY + out, TINY + [out[0], out[1] + "/"]])


@pytest.mark.parametrize("reuse, reused", [(None, False), ("0", False), ("1", True)])
def test_saved_runs_are_taken_only_under_nanochacal_reuse_1(reuse, reused):
    # A lesson retrains every run unless the reader asks, with NANOCHACAL_REUSE=1, to take the
    # runs saved in out/ as they are; its first line says which.
    env = {k: v for k, v in os.environ.items() if k != "NANOCHACAL_REUSE"}
    env.update({"NANOCHACAL_REUSE": reuse} if reuse is not None else {})
    said = subprocess.run([sys.executable, "-c", "import common; print(common.REUSE, common.describe_setup())"],
                          cwd=LESSONS, env=env, capture_output=True, text=True, check=True).stdout
    assert said.startswith(f"{reused} scale ") and ("reusing saved runs" in said) == reused


def test_blind_guess_is_the_expected_share_of_block_0_s_most_repeated_value():
    # Every label is the value at some position of block 0, so betting on block 0's most
    # repeated value scores its count / block_len. Its expectation, exactly, over every block 0
    # of 3 values drawn from 6 (2 blocks of 3: a vocabulary of 6 positions):
    exact = sum(max(collections.Counter(block).values())
                for block in itertools.product(range(6), repeat=3)) / (6**3 * 3)
    assert exact == pytest.approx(0.4907, abs=1e-4)
    measured = common.blind_guess({"task": "toy", "n_blocks": 2, "block_len": 3})  # 4096 samples
    assert measured == pytest.approx(exact, abs=0.015)  # 5 standard errors


def test_trained_model_is_the_run_s_saved_model_ready_to_read(tmp_path):
    summary = train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    model = common.trained_model(summary)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    assert not model.training and all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_steps_to_is_the_first_evaluation_at_or_above_the_threshold():
    run = {"metrics": [{"step": 1, "eval_acc": 0.5, "eval_acc_by_depth": {"3": 0.2}},
                       {"step": 2, "eval_acc": 1.0, "eval_acc_by_depth": {"3": 0.9}},
                       {"step": 3, "eval_acc": 1.0, "eval_acc_by_depth": {"3": 1.0}}]}
    assert common.steps_to(run, 1.0) == 2 and common.steps_to(run, 0.5) == 1
    assert common.steps_to(run, 0.9, "eval_acc_by_depth", depth=3) == 2
    assert common.steps_to(run, 1.0, "eval_acc_by_depth", depth=3) == 3
    assert common.steps_to(run, 1.01) is None
    run["final"] = {"step": 3}
    assert common.steps_to_text(run, 0.9, "eval_acc_by_depth", depth=3) == "2"
    assert common.steps_to_text(run, 1.01) == "never within 3"


def test_only_the_runs_taken_as_saved_are_named_beside_the_lesson_time():
    argvs = [["--out_dir", "a"], ["--out_dir", "b", "--resume"], ["--out_dir", "c", "--resume"]]
    # c was saved unfinished at 30 s and trained 45 s more here: only its 30 s are Lesson 1's.
    runs = [{"final": {"train_time": total}, "resumed_train_time": saved}
            for total, saved in ((600.0, 0.0), (90.0, 90.0), (75.0, 30.0))]
    assert common.taken_as_saved(argvs, runs, "Lesson 1", 2) == (
        "; 2 runs taken as Lesson 1 saved them (their 2.0 min of training, 2 at a time, is not in this time)")
    assert common.taken_as_saved([argvs[0]], runs[:1], "Lesson 1", 2) == ""


def test_a_failed_parallel_run_names_its_log_and_cancels_the_runs_not_started(tmp_path, capsys):
    # The pool hands a few runs to its workers ahead of time, and those cannot be called back;
    # runs of a second each make sure the failure is seen long before the last ones come up.
    runs = [("bad", ["--eval_interval", "0"])] + [(f"queued{i}", []) for i in range(8)]
    argvs = [TINY + ["--max_iters", "150", "--out_dir", str(tmp_path / name)] + extra
             for name, extra in runs]
    with pytest.raises(SystemExit, match="bad"):
        common.train_many(argvs, jobs=2)
    assert "the others never start" in capsys.readouterr().out  # said before waiting on them
    assert "--eval_interval" in (tmp_path / "bad" / "log.txt").read_text()
    assert not (tmp_path / "queued7").exists()


@needs_posix_signals
def test_a_killed_parallel_run_is_named_as_killed(tmp_path, capsys):
    # A worker killed from outside (the kernel's out-of-memory killer, say) leaves no error
    # behind, only a broken pool: the message must say what most likely happened, and name the
    # runs in progress, not the third, which never started.
    argvs = [TINY + ["--max_iters", "1000000", "--out_dir", str(tmp_path / f"run{k}")]
             for k in range(3)]
    raised = []
    def train_both():
        try:
            common.train_many(argvs, jobs=2)
        except SystemExit as error:
            raised.append(str(error))
    caller = threading.Thread(target=train_both)
    caller.start()
    deadline = time.time() + 120
    while not all((tmp_path / f"run{k}" / "log.txt").exists() for k in range(2)):
        assert time.time() < deadline, "the workers never started"
        time.sleep(0.1)
    for worker in multiprocessing.active_children():
        os.kill(worker.pid, signal.SIGKILL)
    caller.join(timeout=120)
    assert raised and "died without an error" in raised[0] and "fewer at a time" in raised[0]
    assert all(str(tmp_path / f"run{k}" / "log.txt") in raised[0] for k in range(2))  # both named
    assert "run2" not in raised[0]
    assert "the runs in progress finish first" not in capsys.readouterr().out  # none is left


def test_the_gpu_scale_of_the_shared_toy_runs_passes_train_py_checks(tmp_path):
    # The paper's sizes are never trained on a CPU; their flags must at least be valid.
    script = ("import common, train\n"
              "assert common.TOY_TABLE['layers'] == [1, 2, 3, 4, 5] and len(common.TOY_TABLE['seeds']) == 4\n"
              "for attn, L in [('chacal', 1)] + [('standard', L) for L in common.TOY_TABLE['layers']]:\n"
              f"    train.parse_args(common.toy_table_flags(attn, L, 0) + ['--device', 'cpu', '--out_dir', {str(tmp_path)!r}])\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=LESSONS, capture_output=True, text=True,
                            env={**os.environ, "NANOCHACAL_SCALE": "gpu"}, timeout=120)
    assert result.returncode == 0, result.stderr


def test_parallel_workers_share_the_cores_among_the_runs_there_are(tmp_path, monkeypatch):
    # Fewer runs than jobs: each run gets the cores the idle jobs leave, not a jobs-th of them.
    threads = []
    class Inline:  # a pool that records each worker's thread count instead of spawning it
        def __init__(self, jobs, mp_context):
            pass
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
        def submit(self, fn, argv, log, n_threads):
            threads.append(n_threads)
            future = concurrent.futures.Future()
            future.set_result({"line": "done"})
            return future
    monkeypatch.setattr(common, "CORES", 8)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Inline)
    argvs = [TINY + ["--out_dir", str(tmp_path / name)] for name in ("a", "b")]
    assert common.train_many(argvs, jobs=4) == [{"line": "done"}] * 2
    assert threads == [4, 4]


def test_a_saved_run_is_reused_whatever_its_progress_bar_place_or_newer_flags(tmp_path):
    # Neither the bar, nor a moved directory, nor a setting added since the run was saved makes
    # it another run.
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--out_dir", str(tmp_path / "run")])
    without_bar = [f for f in flags if f != "--no-progress"]
    assert common.reuse_if_saved(without_bar + ["--out_dir", str(tmp_path / "run")])[-1] == "--resume"
    os.rename(tmp_path / "run", tmp_path / "moved")
    assert common.reuse_if_saved(flags + ["--out_dir", str(tmp_path / "moved")])[-1] == "--resume"
    path = tmp_path / "moved" / "ckpt.pt"
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["args"]["weight_init"]  # as a run saved before the flag existed
    torch.save(checkpoint, path)
    assert common.reuse_if_saved(flags + ["--out_dir", str(tmp_path / "moved")])[-1] == "--resume"


def test_run_flags_stay_whole_in_a_clone_whose_path_has_a_space(tmp_path):
    clone = tmp_path / "my lessons"  # a copy: a link would be resolved by the working directory
    (clone / "lessons").mkdir(parents=True)
    root = os.path.dirname(LESSONS)
    for name in ("attention.py", "data.py", "model.py", "train.py", "lessons/common.py"):
        shutil.copy(os.path.join(root, name), clone / name)
    script = ("import common, train; flags = common.toy_table_flags('chacal', 1, 0); "
              "print(train.build_parser().parse_args(flags).out_dir)")
    result = subprocess.run([sys.executable, "-c", script], cwd=clone / "lessons", capture_output=True,
                            text=True, env={**os.environ, "NANOCHACAL_SCALE": "smoke",
                                            "PYTHONPATH": str(clone)})
    assert result.returncode == 0, result.stderr
    assert os.path.realpath(clone / "lessons" / result.stdout.strip()) == str(
        clone / "out" / "smoke" / "toy" / "chacal_L1_seed0")
