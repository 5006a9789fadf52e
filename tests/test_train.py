"""train.py and sample.py as a user runs them: a CPU smoke run, an exact resume (also after
kill -9), micro-batches, the schedule, and every attention with every task."""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from attention import ATTENTIONS
from conftest import ROOT, TINY, assert_one_line, command, needs_posix_signals
from data import get_task


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "ckpt.pt"), weights_only=True)["model"]


def untimed(run_dir):
    """metrics.jsonl, without the seconds that differ from run to run."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "train_time"} for line in f]


def assert_same_run(a, b):
    assert all(torch.equal(tensor, weights(b)[name]) for name, tensor in weights(a).items())
    assert untimed(a) == untimed(b)


def test_smoke_run_writes_metrics_and_checkpoint(tmp_path):
    summary = train.main(TINY + ["--max_iters", "5", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [2, 4, 5]  # the last steps are evaluated too
    assert set(lines[-1]["eval_acc_by_depth"]) == {"1", "2", "3"} and 0 <= lines[-1]["eval_acc"] <= 1
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert checkpoint["step"] == 5 and checkpoint["config"]["attn"] == "chacal"
    assert summary["final"] == lines[-1]


def test_resume_continues_a_run_exactly_and_leaves_a_finished_one_as_it_is(tmp_path):
    # Dropout draws from the restored RNG state and the decay ends at the saved --max_iters, so
    # the two runs agree to the last bit; metrics.jsonl is rewritten from the checkpoint.
    flags = TINY + ["--attn", "standard,chacal", "--n_layer", "2", "--dropout", "0.1", "--eval_interval", "4",
                    "--warmup_iters", "2", "--lr_decay_iters", "12"]
    train.main(flags + ["--max_iters", "12", "--out_dir", str(tmp_path / "straight")])
    train.main(flags + ["--max_iters", "4", "--out_dir", str(tmp_path / "halves")])
    (tmp_path / "halves" / "metrics.jsonl").unlink()
    resumed = train.main(["--resume", "--max_iters", "12", "--no-progress", "--out_dir", str(tmp_path / "halves")])
    assert_same_run(tmp_path / "straight", tmp_path / "halves")
    assert [m["step"] for m in resumed["metrics"]] == [4, 8, 12]
    saved = [(tmp_path / "halves" / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")]
    again = train.main(["--resume", "--no-progress", "--out_dir", str(tmp_path / "halves")])  # finished
    assert again["final"]["step"] == 12
    assert [(tmp_path / "halves" / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")] == saved


@needs_posix_signals
def test_kill_9_then_resume_reproduces_an_uninterrupted_run(tmp_path):
    flags = TINY + ["--attn", "standard,chacal", "--n_layer", "2", "--dropout", "0.1", "--max_iters", "60",
                    "--eval_interval", "5"]
    train.main(flags + ["--out_dir", str(tmp_path / "straight")])
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *flags, "--out_dir", str(killed)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (killed / "metrics.jsonl").exists() or len((killed / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    train.main(["--resume", "--out_dir", str(killed), "--no-progress"])
    assert_same_run(tmp_path / "straight", killed)


def test_a_resumed_run_takes_typed_training_flags(tmp_path):
    run = ["--out_dir", str(tmp_path), "--no-progress"]
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--lr", "1e-3"] + run)
    resumed = train.main(["--resume", "--max_iters", "4", "--lr", "2e-3", "--warmup_iters", "0"] + run)
    assert [m["step"] for m in resumed["metrics"]] == [2, 4]
    # step 4 took lr(3) of a cosine from 2e-3 to 2e-4 (lr / 10) ending at --max_iters 4
    assert resumed["metrics"][-1]["lr"] == pytest.approx(2e-4 + 1.8e-3 * (1 + math.cos(math.pi * 3 / 4)) / 2)


def test_learning_rate_warms_up_then_follows_a_cosine_to_min_lr():
    args = argparse.Namespace(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lr = lambda step: train.learning_rate(step, args)
    assert lr(0) == pytest.approx(0.1) and lr(4) == pytest.approx(0.5) and lr(9) == pytest.approx(1)
    assert lr(10) == pytest.approx(1.0) and lr(60) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr(35) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)


def test_records_hold_the_mean_training_loss_of_their_interval(tmp_path, monkeypatch):
    losses, forward = [], train.GPT.forward

    def recorded(model, *args, **kwargs):
        logits, loss = forward(model, *args, **kwargs)
        if model.training:
            losses.append(loss.item())
        return logits, loss

    monkeypatch.setattr(train.GPT, "forward", recorded)
    run = train.main(TINY + ["--max_iters", "12", "--eval_interval", "6", "--out_dir", str(tmp_path)])
    means = [sum(losses[:6]) / 6, sum(losses[6:]) / 6]
    assert [m["train_loss"] for m in run["metrics"]] == pytest.approx(means, rel=1e-5)


@pytest.mark.parametrize("flags", [
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4"],
    ["--task", "cycles", "--cycle_n", "3", "--scratchpad", "inductive", "--attn", "standard"],  # positions, groups
    ["--task", "boxes", "--boxes_version", "advanced", "--n_boxes", "4", "--n_filled", "2", "--n_objects", "5",
     "--max_ops", "6", "--n_train", "64", "--n_test", "8", "--attn", "standard"],  # rows that end early
    ["--task", "lego", "--bidirectional", "--n_vars", "4"],  # every token reads every other
])
def test_a_run_in_micro_batches_trains_as_the_whole_batches_do(flags, tmp_path, monkeypatch):
    # The same steps in float32, summed in another order: equal to float32's precision.
    monkeypatch.chdir(tmp_path)  # boxes writes its data_cache/ here
    runs = [train.main(flags + ["--n_embd", "16", "--n_head", "2", "--batch_size", "6", "--max_iters", "6",
                                "--eval_interval", "3", "--eval_samples", "8", "--no-progress", "--device", "cpu",
                                "--micro_batches", n, "--out_dir", n]) for n in ("1", "3")]
    for whole, parts in zip(*(run["metrics"] for run in runs)):
        assert parts["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)
        assert parts["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-4)


def test_evaluation_draws_from_its_own_stream(tmp_path):
    # How much is evaluated leaves training unchanged: the weights after 4 steps are the same.
    for n in ("8", "16"):
        train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--eval_samples", n,
                           "--out_dir", str(tmp_path / n)])
    assert all(torch.equal(tensor, weights(tmp_path / "16")[name]) for name, tensor in weights(tmp_path / "8").items())


PARITY = ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none", "--n_embd", "16",
          "--n_head", "2", "--batch_size", "8", "--eval_samples", "16", "--max_train_length", "6",
          "--max_test_length", "9", "--length_samples", "5", "--no-progress", "--device", "cpu"]


def test_stop_at_acc_ends_at_the_first_evaluation_that_reaches_it_and_stays_stopped(tmp_path):
    flags = PARITY + ["--max_iters", "12", "--lr", "1e-2", "--warmup_iters", "0", "--eval_interval", "2"]
    full = train.main(flags + ["--out_dir", str(tmp_path / "full")])
    assert list(full["final"]["length_acc"]) == ["7", "8", "9"]  # every unseen length, scored at the end
    threshold = max(m["eval_acc"] for m in full["metrics"][:-1])
    first = next(m for m in full["metrics"] if m["eval_acc"] >= threshold)
    stop = flags + ["--out_dir", str(tmp_path / "stop"), "--stop_at_acc", str(threshold)]
    metrics = train.main(stop)["metrics"]
    assert [m["eval_acc"] for m in metrics] == [m["eval_acc"] for m in full["metrics"] if m["step"] <= first["step"]]
    assert train.main(stop + ["--resume"])["metrics"] == metrics  # stopped: nothing left to do
    assert train.main(stop + ["--resume", "--stop_at_acc", "1"])["metrics"][-1]["step"] > first["step"]


def test_a_mimicking_run_mimics_once_and_records_its_loss(tmp_path):
    flags = ["--task", "lego", "--bidirectional", "--n_vars", "4", "--n_layer", "2", "--n_embd", "16", "--n_head", "2",
             "--batch_size", "4", "--eval_samples", "8", "--mimic_iters", "3", "--eval_interval", "2",
             "--no-progress", "--device", "cpu", "--out_dir", str(tmp_path)]
    first = train.main(flags + ["--max_iters", "2"])
    assert len(first["metrics"][0]["mimic_loss"]) == 2  # its first and last loss
    resumed = train.main(["--resume", "--max_iters", "6", "--out_dir", str(tmp_path), "--no-progress"])
    assert ["mimic_loss" in m for m in resumed["metrics"]] == [True, False, False]


def test_init_from_a_run_with_chacal_at_gamma_0_trains_as_standard_attention(tmp_path):
    flags = TINY + ["--attn", "standard"]
    train.main(flags + ["--max_iters", "4", "--eval_interval", "4", "--out_dir", str(tmp_path / "pre")])
    start = ["--init_from", str(tmp_path / "pre"), "--seed", "7", "--max_iters", "1", "--eval_interval", "1"]
    loss = lambda *typed: train.main(flags + list(typed))["final"]["train_loss"]
    standard = loss(*start, "--out_dir", str(tmp_path / "standard"))
    chacal = loss(*start, "--attn", "chacal", "--gamma", "0", "--out_dir", str(tmp_path / "chacal"))
    fresh = loss("--seed", "7", "--max_iters", "1", "--eval_interval", "1", "--out_dir", str(tmp_path / "fresh"))
    assert chacal == pytest.approx(standard, abs=1e-5) and abs(fresh - standard) > 1e-3
    resumed = train.main(["--resume", "--max_iters", "2", "--no-progress", "--out_dir", str(tmp_path / "chacal")])
    assert [m["step"] for m in resumed["metrics"]] == [1, 2]  # it continues as any run does


@pytest.mark.parametrize("model", [[], ["--share_weights"], ["--attn", "lego_v0"]])  # the last two: no cache
def test_sample_writes_the_same_answers_with_and_without_the_cache(model, tmp_path):
    train.main(TINY + model + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    outputs = [command("sample.py", "--out_dir", tmp_path, "--seed", "3", "--device", "cpu", cache)
               for cache in ("--cache", "--no-cache")]
    assert all(code == 0 for code, _, _ in outputs), outputs
    answers = [out.splitlines()[:-1] for _, out, _ in outputs]  # all but the speed line
    assert len(answers[0]) > 2 and answers[0] == answers[1]


def test_sample_reads_a_typed_prompt_as_its_task_reads_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # boxes writes its data_cache/ here
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", "toy"])
    prompt = "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10"
    code, out, err = command("sample.py", "--out_dir", "toy", "--device", "cpu", "--prompt", prompt)
    assert code == 0 and "accuracy" in out, err  # values, then 3 blocks of pointers, scored by the solver
    train.main(["--task", "boxes", "--n_train", "16", "--n_test", "4", "--n_embd", "16", "--n_head", "2",
                "--batch_size", "4", "--max_iters", "1", "--eval_interval", "1", "--eval_samples", "2",
                "--no-progress", "--device", "cpu", "--out_dir", "boxes"])
    prompt = "The cup is in Box B, there is nothing in Box A. Move the contents of Box B to Box A."
    code, out, err = command("sample.py", "--out_dir", "boxes", "--device", "cpu", "--prompt", prompt)
    assert code == 0 and "Box A contains the cup, Box B is empty." in out, err  # the simulator's answer


# The attention x task grid as a user meets it: a step of training, then sample.py.
GRID = {"toy": dict(n_blocks=3, block_len=2), "parity": dict(max_train_length=4, max_test_length=6, length_samples=2),
        "lego": dict(n_vars=3), "cycles": dict(cycle_n=2, scratchpad="inductive"),
        "text": dict(context=8, data="corpus.txt"),
        "boxes": dict(boxes_version="advanced", n_boxes=3, n_filled=2, n_objects=4, max_ops=2, n_train=8, n_test=4),
        "box_clauses": dict(n_boxes=4, n_objects=4, max_ops=4, n_train=8, n_test=4)}


@pytest.mark.parametrize("task", list(GRID))
def test_every_attention_trains_and_samples_every_task_or_is_refused_in_one_line(task, tmp_path, monkeypatch):
    """What a task needs (task.needs) that an attention does not support (its class's supports)
    is refused at start in one line; every other pairing trains a step, then samples."""
    monkeypatch.chdir(tmp_path)  # boxes writes its data_cache/ here
    (tmp_path / "corpus.txt").write_text("the key is in box a; move a into c. " * 20)
    needs = get_task(task, **GRID[task]).needs
    options = [word for k, v in GRID[task].items() for word in (f"--{k}", str(v))]
    options += ["--bidirectional"] if "bidirectional" in needs else []
    for attn in [*ATTENTIONS, "standard,chacal"]:
        flags = options + (f"--task {task} --attn {attn} --n_layer {attn.count(',') + 1} --n_embd 8 --n_head 2 "
                           f"--batch_size 2 --max_iters 1 --eval_interval 1 --eval_samples 2 --no-progress "
                           f"--device cpu --out_dir {attn}").split()
        supports = set.intersection(*(set(ATTENTIONS[a].supports) for a in attn.split(",")))
        result = command("train.py", *flags)
        if needs & {"bidirectional", "groups"} - supports:
            assert_one_line(result)
            continue
        assert result[0] == 0, (attn, result[2])
        code, out, err = command("sample.py", "--out_dir", attn, "--device", "cpu")
        assert code == 0 and out, (attn, err)
