"""What goes wrong, as a user meets it: a bad command is refused at start with one line and no
traceback; a fault in the middle of a run (a full disk, a wrecked model, a second run on the same
directory) costs one line and loses nothing that was saved."""

import errno
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from conftest import ROOT, TINY, assert_one_line, command


class OpensAFileWhenUnpickled:
    """Put in a pickle, unpickling it creates `path`: how a file from elsewhere could run code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished toy run of 2 steps (ckpt.pt, metrics.jsonl)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """Finished one-step runs of lego and parity, for sample.py."""
    out = tmp_path_factory.mktemp("others")
    small = ["--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--eval_samples", "4", "--max_iters", "1",
             "--eval_interval", "1", "--no-progress", "--device", "cpu"]
    train.main(["--task", "lego", "--bidirectional", "--n_vars", "4", *small, "--out_dir", str(out / "lego")])
    train.main(["--task", "parity", "--max_train_length", "6", "--max_test_length", "9", "--length_samples", "2",
                *small, "--out_dir", str(out / "parity")])
    return {name: out / name for name in ("lego", "parity")}


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run, to damage."""
    return shutil.copytree(trained, tmp_path / "run")


def damage(run, how):
    """Damage the checkpoint in `run` as named; returns a file that must never appear."""
    path, marker = run / "ckpt.pt", run.parent / "code ran"
    good = path.read_bytes()
    checkpoint = torch.load(path, weights_only=True)
    first = next(iter(checkpoint["model"]))
    if how == "truncated":
        path.write_bytes(good[:len(good) // 2])
    elif how == "random bytes":
        path.write_bytes(bytes(range(256)) * 40)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    elif how == "code":  # a pickle that would run code: never unpickled
        torch.save({**checkpoint, "extra": OpensAFileWhenUnpickled(str(marker))}, path)
    elif how == "missing weight":
        del checkpoint["model"][first]
    elif how == "wrong shape":
        checkpoint["model"][first] = torch.zeros(3, 3)
    elif how == "config not a mapping":
        checkpoint["config"] = [1, 2, 3]
    if how in ("missing weight", "wrong shape", "config not a mapping"):
        torch.save(checkpoint, path)
    return marker


# Each refused at start: a non-zero exit, one line on stderr and no traceback, nothing written.
# {run} is a copy of a trained toy run (with its checkpoint damaged as named), {lego} and {parity}
# runs of those tasks, {tmp} a scratch folder.
BAD_COMMANDS = [
    # unknown choices
    ("train.py", "--attn flash", None), ("train.py", "--task chess", None), ("train.py", "--device tpu", None),
    ("train.py", "--task cycles --scratchpad dfs", None),
    # numbers out of range
    ("train.py", "--gamma 1.0", None), ("train.py", "--gamma -0.1", None), ("train.py", "--lr nan", None),
    ("train.py", "--lr 1e39", None), ("train.py", "--dropout 1.5", None), ("train.py", "--batch_size 0", None),
    ("train.py", "--max_iters 0", None), ("train.py", "--eval_interval 0", None), ("train.py", "--seed -1", None),
    ("train.py", "--n_layer 0", None), ("train.py", "--task toy --n_blocks 1", None),
    ("train.py", "--task parity --p_one 1.5", None), ("train.py", "--task lego --bidirectional --n_vars 30", None),
    ("train.py", "--task cycles --cycle_n 1", None), ("train.py", "--stop_at_acc 95", None),
    ("train.py", "--task boxes --boxes_version advanced --n_boxes 4 --n_filled 4", None),
    # contradictory flags
    ("train.py", "--n_embd 30 --n_head 4", None), ("train.py", "--attn standard,chacal", None),
    ("train.py", "--attn dilated --chunk 1", None), ("train.py", "--attn dilated --bidirectional", None),
    ("train.py", "--task lego --n_vars 4", None),  # lego's labels need --bidirectional
    ("train.py", "--task boxes --n_train 8 --n_test 4 --bidirectional", None),  # writing answers needs causal
    ("train.py", "--task cycles --scratchpad inductive --attn dilated", None),  # no group masks
    ("train.py", "--attn lego_v0 --mimic_iters 5", None),  # mimicking fits heads lego_v0 has not
    # missing files
    ("train.py", "--task text --data {tmp}/no/such.txt", None), ("train.py", "--resume --out_dir {tmp}/no/run", None),
    ("train.py", "--init_from {tmp}/no/run", None), ("train.py", "--out_dir {run}/ckpt.pt", None),
    ("train.py", "--task text --data {tmp}", None),  # a directory
    ("sample.py", "--out_dir {tmp}/no/run", None), ("data.py", "chess", None),
    # broken and foreign checkpoints
    *[("train.py", "--resume --out_dir {run}", how)
      for how in ("truncated", "random bytes", "empty", "foreign", "code")],
    *[("sample.py", "--out_dir {run}", how) for how in ("truncated", "foreign", "code")],
    # a resume that would continue these weights as another model or task
    ("train.py", "--resume --out_dir {run} --n_embd 64", None),
    ("train.py", "--resume --out_dir {run} --attn standard", None),
    ("train.py", "--resume --out_dir {run} --task parity", None),
    ("train.py", "--resume --out_dir {run} --n_blocks 5", None),
    ("train.py", "--init_from {run} --n_embd 64", None),  # weights of another shape
    # a prompt the run's task cannot read
    ("sample.py", "--out_dir {run} --prompt '0 1 2 3 9'", None), ("sample.py", "--out_dir {run} --prompt x", None),
    ("sample.py", "--out_dir {run} --prompt '" + " 1" * 40 + "'", None),  # longer than the model reads
    ("sample.py", "--out_dir {run} --length 30", None),  # toy sequences have one length
    ("sample.py", "--out_dir {lego} --prompt '[CLS] a = + 1 , [SEP]'", None),  # one clause, for a model of 4
    ("sample.py", "--out_dir {parity} --prompt ''", None),
]


@pytest.mark.parametrize("script, line, broken", BAD_COMMANDS, ids=[f"{s} {l} {b or ''}" for s, l, b in BAD_COMMANDS])
def test_a_bad_command_is_refused_in_one_line(script, line, broken, run, others, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a task built before its refusal would leave its data here
    marker = damage(run, broken) if broken else None
    saved = (run / "ckpt.pt").read_bytes()
    typed = shlex.split(line.format(run=run, tmp=tmp_path, **others))
    before = ["--device", "cpu"] if script != "data.py" else []  # the row's own flags come last, and win
    if script == "train.py":  # should it be accepted after all: one quick step, no bar
        before += ["--no-progress"] + ([] if "--resume" in typed else [
            "--max_iters", "1", "--eval_interval", "1", "--eval_samples", "2", "--out_dir", str(tmp_path / "out")])
    assert_one_line(command(script, *before, *typed))
    assert not (tmp_path / "out" / "ckpt.pt").exists() and (run / "ckpt.pt").read_bytes() == saved
    assert not (marker and marker.exists())


@pytest.mark.parametrize("how", ["missing weight", "wrong shape", "config not a mapping"])
@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_fault_2_a_checkpoint_that_loads_but_does_not_fit_is_one_line(how, script, run):
    damage(run, how)
    saved = (run / "ckpt.pt").read_bytes()
    argv = ["--resume", "--max_iters", "4", "--no-progress"] if script == "train.py" else ["--device", "cpu"]
    assert_one_line(command(script, *argv, "--out_dir", run))
    assert (run / "ckpt.pt").read_bytes() == saved


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writing", ["checkpoint", "metrics"])
def test_fault_1_a_full_disk_is_one_line_and_the_earlier_files_survive(writing, run, monkeypatch):
    before = {name: (run / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    if writing == "checkpoint":
        monkeypatch.setattr(torch, "save", full_disk)
    else:  # any file opened for writing whose name starts with "metrics"
        real_open = open

        def opened(file, mode="r", *args, **kwargs):
            if os.path.basename(str(file)).startswith("metrics") and set(mode) & set("wax"):
                full_disk()
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr("builtins.open", opened)
        monkeypatch.setattr(io, "open", opened)
    assert_one_line(command("train.py", "--resume", "--max_iters", "4", "--no-progress", "--out_dir", run))
    monkeypatch.undo()
    assert (run / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    if writing == "checkpoint":
        assert (run / "ckpt.pt").read_bytes() == before["ckpt.pt"]
    # nothing lost: the run goes on from what it saved
    assert train.main(["--resume", "--max_iters", "4", "--no-progress", "--out_dir", str(run)])["final"]["step"] == 4


@pytest.mark.parametrize("how", ["tokens out of range", "cut columns", "not tensors", "code"])
def test_faults_3_and_4_a_broken_boxes_cache_is_one_line_naming_it(how, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = ["--task", "boxes", "--boxes_version", "advanced", "--n_boxes", "3", "--n_filled", "2", "--n_objects", "4",
             "--max_ops", "2", "--n_train", "16", "--n_test", "4", "--n_embd", "16", "--n_head", "2",
             "--batch_size", "4", "--max_iters", "1", "--eval_interval", "1", "--eval_samples", "2",
             "--no-progress", "--device", "cpu"]
    train.main(flags + ["--out_dir", "first"])
    (cache,) = (tmp_path / "data_cache").iterdir()
    rows = torch.load(cache, weights_only=True)
    if how == "tokens out of range":
        rows["train"][0, 3] = 250  # the vocabulary has 132 words
    elif how == "cut columns":
        rows = {split: r[:, :5].clone() for split, r in rows.items()}
    elif how == "not tensors":
        rows = {split: r.tolist() for split, r in rows.items()}
    else:
        rows["extra"] = OpensAFileWhenUnpickled(str(tmp_path / "code ran"))
    torch.save(rows, cache)
    error = assert_one_line(command("train.py", *flags, "--out_dir", "second"))
    assert cache.name in error and "nan" not in error and "--lr" not in error
    assert not (tmp_path / "code ran").exists() and not (tmp_path / "second" / "ckpt.pt").exists()


def test_the_nan_guard_stops_a_diverging_run_and_keeps_the_last_good_checkpoint(tmp_path):
    flags = TINY + ["--warmup_iters", "5", "--gamma", "0.999", "--grad_clip", "0", "--eval_interval", "10"]
    train.main(flags + ["--max_iters", "10", "--out_dir", str(tmp_path)])
    before = {name: (tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    assert_one_line(command("train.py", "--resume", "--lr", "1e6", "--max_iters", "40", "--no-progress",
                            "--out_dir", tmp_path))
    assert {name: (tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")} == before


def test_fault_5_a_resume_at_a_wrecking_rate_keeps_the_best_evaluations_weights(tmp_path):
    train.main(TINY + ["--max_iters", "20", "--eval_interval", "5", "--out_dir", str(tmp_path)])
    good = torch.load(tmp_path / "best.pt", weights_only=True)
    code, _, err = command("train.py", "--resume", "--lr", "50", "--warmup_iters", "0", "--max_iters", "60",
                           "--no-progress", "--out_dir", tmp_path)
    assert code == 0 or len(err.strip().splitlines()) == 1, err  # finished, or stopped in one line
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    best = min(records, key=lambda record: record["eval_loss"])
    assert code != 0 or records[-1]["eval_loss"] > 2 * best["eval_loss"]  # the rate did wreck the model
    kept = torch.load(tmp_path / "best.pt", weights_only=True)
    assert kept["step"] == best["step"] <= 20  # the weights of the good part of the run, kept
    assert all(torch.equal(tensor, kept["model"][name]) for name, tensor in good["model"].items())


def test_fault_6_a_second_run_on_a_held_out_dir_is_refused_in_one_line(tmp_path):
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--max_iters", "100000",
                              "--eval_interval", "5", "--out_dir", str(tmp_path)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ckpt.pt").exists():  # it is training, and has saved
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.05)
        for second in (TINY + ["--max_iters", "2", "--out_dir", tmp_path],
                       ["--resume", "--max_iters", "100001", "--out_dir", tmp_path]):
            assert_one_line(command("train.py", *second, "--no-progress"))
        assert first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step = torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"]  # a kill -9 leaves no lock behind
    resumed = train.main(["--resume", "--max_iters", str(step + 2), "--no-progress", "--out_dir", str(tmp_path)])
    assert resumed["final"]["step"] == step + 2
