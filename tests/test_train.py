"""train.py and sample.py as a user runs them: a CPU smoke run, exact resume, and bad input."""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import sample
import train
from attention import ATTENTIONS
from conftest import (ROOT, OpensAFileWhenUnpickled, assert_tokens_per_second_possible,
                      needs_posix_signals, run_in_process)
from data import TASKS, PointerChains, get_task

TINY = ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--n_embd", "32", "--n_head", "2",
        "--batch_size", "8", "--eval_samples", "16", "--no-progress", "--device", "cpu"]


def run_script(script, *args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def run_sample(*args):
    """sample.py's main(args) in this process, as run_script("sample.py", *args) would report it."""
    return run_in_process(sample.main, "sample.py", *args)


def interrupt_the_second_evaluation(monkeypatch):
    """PointerChains.evaluate raises KeyboardInterrupt at its second call, as a Ctrl-C would."""
    evaluate, calls = PointerChains.evaluate, []
    def interrupted_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(PointerChains, "evaluate", interrupted_second_time)


def test_smoke_run_writes_metrics_and_checkpoint(tmp_path):
    summary = train.main(TINY + ["--max_iters", "6", "--eval_interval", "3", "--out_dir", str(tmp_path)])
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [3, 6]
    assert set(lines[-1]["eval_acc_by_depth"]) == {"1", "2", "3"}
    assert 0 <= lines[-1]["eval_acc"] <= 1 and lines[-1]["eval_loss"] > 0
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert checkpoint["step"] == 6 and checkpoint["config"]["attn"] == "chacal"
    assert summary["final"] == lines[-1]


def test_resume_continues_a_run_exactly(tmp_path):
    flags = TINY + ["--attn", "standard,chacal", "--n_layer", "2", "--eval_interval", "4",
                    "--warmup_iters", "2", "--lr_decay_iters", "12"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    train.main(flags + ["--max_iters", "12", "--out_dir", str(straight)])
    first = train.main(flags + ["--max_iters", "4", "--out_dir", str(halves)])   # "killed" at step 4
    resumed = train.main(["--resume", "--max_iters", "12", "--out_dir", str(halves), "--no-progress"])
    # The summary tells the checkpoint's training seconds from those this command added.
    assert first["resumed_train_time"] == 0.0
    assert first["final"]["train_time"] > 0
    assert resumed["resumed_train_time"] == pytest.approx(first["final"]["train_time"], abs=1e-3)
    a = torch.load(straight / "ckpt.pt", weights_only=False)
    b = torch.load(halves / "ckpt.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    metrics_a = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    metrics_b = [json.loads(line) for line in open(halves / "metrics.jsonl")]
    drop_time = lambda ms: [{k: v for k, v in m.items() if k != "train_time"} for m in ms]
    assert drop_time(metrics_a) == drop_time(metrics_b)


def test_resume_after_an_interrupt_continues_exactly(tmp_path, monkeypatch):
    # Ctrl-C during the evaluation at step 8, so the checkpoint holds step 4; then nothing but
    # --resume. Dropout draws from the restored RNG state, and the decay ends at the saved
    # --max_iters, so the two runs must agree to the last bit.
    flags = TINY + ["--attn", "standard,chacal", "--n_layer", "2", "--dropout", "0.1",
                    "--max_iters", "12", "--eval_interval", "4"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train.main(flags + ["--out_dir", str(straight)])
    interrupt_the_second_evaluation(monkeypatch)
    with pytest.raises(SystemExit):
        train.main(flags + ["--out_dir", str(killed)])
    monkeypatch.undo()
    assert torch.load(killed / "ckpt.pt", weights_only=False)["step"] == 4
    train.main(["--resume", "--out_dir", str(killed)])
    a = torch.load(straight / "ckpt.pt", weights_only=False)
    b = torch.load(killed / "ckpt.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    drop_time = lambda path: [{k: v for k, v in json.loads(line).items() if k != "train_time"}
                              for line in open(path / "metrics.jsonl")]
    assert drop_time(straight) == drop_time(killed)


def test_resume_takes_a_model_setting_added_since_the_checkpoint_at_its_default(tmp_path):
    flags = ["--attn", "standard", "--n_embd", "16", "--n_head", "2", "--n_blocks", "3",
             "--block_len", "3", "--batch_size", "4", "--max_iters", "2", "--eval_interval", "2",
             "--eval_samples", "8", "--no-progress", "--device", "cpu", "--out_dir", str(tmp_path)]
    train.main(flags)
    path = tmp_path / "ckpt.pt"
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["config"]["weight_init"]  # as a checkpoint written before the flag existed
    torch.save(checkpoint, path)
    resumed = train.main(flags + ["--resume", "--max_iters", "4"])
    assert resumed["final"]["step"] == 4


def test_resume_writes_where_it_read_even_from_a_copied_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --resume alone continues ./out, whatever out_dir it was saved with
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", "first"])
    os.rename("first", "out")
    train.main(["--resume", "--max_iters", "4", "--no-progress"])
    assert torch.load("out/ckpt.pt", weights_only=False)["step"] == 4 and not os.path.exists("first")


def test_flags_typed_on_resume_override_the_saved_ones(tmp_path):
    run = ["--out_dir", str(tmp_path), "--no-progress"]
    train.main(TINY[:-2] + ["--max_iters", "2", "--eval_interval", "2", "--lr", "1e-3"] + run)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["args"]
    assert saved["device"] == saved["dtype"] == "auto"  # resolved again where the run resumes
    assert saved["min_lr"] is None and saved["lr_decay_iters"] is None
    args, *_ = train.parse_args(["--resume", "--lr", "2e-3", "--max_iters", "6"] + run)
    assert args.min_lr == pytest.approx(2e-4) and args.lr_decay_iters == 6
    assert train.parse_args(["--resume", "--max_iters=7"] + run)[0].max_iters == 7  # the = form
    with pytest.raises(SystemExit):  # another model cannot continue these weights
        train.parse_args(["--resume", "--n_embd", "64"] + run)
    train.main(["--resume", "--max_iters", "4", "--beta2", "0.9", "--weight_decay", "0.1"] + run)
    groups = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.9), (0.9, 0.9)]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_a_fresh_run_stopped_before_its_first_checkpoint_leaves_the_earlier_run(tmp_path,
                                                                                monkeypatch):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    before = [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PointerChains, "evaluate", interrupt)
    with pytest.raises(SystemExit, match="nothing was saved"):
        train.main(flags)
    assert [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")] == before
    monkeypatch.setattr(train, "set_up", interrupt)  # Ctrl-C before the first step
    with pytest.raises(SystemExit, match="^interrupted before training began; no checkpoint was "
                                         "written, and any earlier run in out_dir is as it was$"):
        train.main(flags)
    assert [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")] == before
    monkeypatch.undo()
    assert train.main(["--resume", "--max_iters", "4", "--out_dir", str(tmp_path),
                       "--no-progress"])["final"]["step"] == 4


BAD_FLAGS = [
    (["--attn", "flash"], "--attn"),
    (["--task", "chess"], "--task"),
    (["--gamma", "1.0"], "--gamma"),
    (["--gamma", "-0.1"], "--gamma"),
    (["--block_size", "64"], "--block_size"),
    (["--attn", "standard,chacal"], "--attn"),
    (["--resume", "--out_dir", "no/such/run"], "--resume"),
    (["--attn", "dilated", "--chunk", "1"], "--chunk"),
    (["--chunk", "3"], "--chunk"),  # chacal: no chunk to size
    (["--init_from", "no/such/run"], "--init_from"),  # a path, not a model name: no download
    (["--n_layer", "auto"], "--share_weights"),
    (["--n_layer", "0"], "--n_layer"),
    (["--p_one", "0.3"], "--p_one"),
    (["--task", "parity", "--p_one", "1.5"], "--p_one"),
    (["--task", "parity", "--n_blocks", "4"], "--n_blocks"),
    (["--attn", "dilated", "--bidirectional"], "--bidirectional"),
    (["--task", "boxes", "--bidirectional"], "--bidirectional"),
    (["--task", "lego"], "--bidirectional is missing: task lego"),  # labels before their causes
    (["--task", "boxes", "--share_weights"], "--n_layer auto"),  # adaptive depth, written answer
    (["--task", "cycles", "--share_weights", "--n_layer", "auto"], "--n_layer auto"),
    (["--share_weights", "--n_layer", "4", "--min_train_layers", "6"], "--min_train_layers"),
    (["--mimic_iters", "5", "--n_head", "1"], "--mimic_iters"),
    (["--task", "lego", "--attn", "lego_v0", "--bidirectional", "--mimic_iters", "3"], "--mimic_iters"),
    (["--n_vars", "6"], "--n_vars"),
    (["--task", "lego", "--n_vars", "30"], "--n_vars"),
    (["--n_embd", "0"], "--n_embd"),
    (["--max_iters", "0"], "--max_iters"),
    (["--batch_size", "0"], "--batch_size"),
    (["--beta2", "1.0"], "--beta2"),
    (["--lr", "1e-3", "--min_lr", "1e-2"], "--min_lr"),
    (["--n_embd", "-16", "--n_head", "2"], "--n_embd"),
    (["--dropout", "1.5"], "--dropout"),
    (["--beta1", "2"], "--beta1"),
    (["--eval_samples", "0"], "--eval_samples"),
    (["--lr", "0"], "--lr"),
    (["--warmup_iters", "-1"], "--warmup_iters"),
    (["--mimic_iters", "-1"], "--mimic_iters"),
    (["--length_samples", "0"], "--length_samples"),
    (["--min_lr", "-1"], "--min_lr"),
    (["--grad_clip", "-1"], "--grad_clip"),
    (["--block_size", "0"], "--block_size"),
    (["--task", "boxes", "--n_train", "0"], "--n_train"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "1e39"], "--lr"),  # finite in Python, infinite in float32
    (["--weight_decay", "nan"], "--weight_decay"),
    (["--grad_clip", "nan"], "--grad_clip"),
    (["--seed", "100000000000000000000000"], "--seed"),
    (["--seed", "1e23"], "--seed"),
    (["--warmup_iters", "100", "--lr_decay_iters", "50"], "--lr_decay_iters"),
    (["--block_size", "100000000"], "--block_size"),
    (["--batch_size", "100000000"], "--batch_size"),  # terabytes of activations
    (["--micro_batches", "0"], "--micro_batches"),
    (["--batch_size", "4", "--micro_batches", "8"], "--micro_batches"),
    (["--task", "parity", "--share_weights", "--n_layer", "4", "--min_train_layers", "2",
      "--micro_batches", "2"], "--micro_batches"),
    (["--out_dir", ""], "--out_dir"),
    (["--stop_at_acc", "0"], "--stop_at_acc"),
    (["--stop_at_acc", "95"], "--stop_at_acc"),
    (["--stop_at_acc", "always"], "--stop_at_acc"),
    (["--out_dir", "x" * 300], "--out_dir"),
]


def test_help_opens_with_the_docstring_and_gives_each_default_once():
    parser = train.build_parser()
    assert parser.description == train.__doc__.strip().split("\n")[0]
    # Each flag's entry: its line of options (two spaces in), then its help, indented further.
    entries = {}
    for line in parser.format_help().split("options:")[1].splitlines()[1:]:
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = ""
        entries[flag] += " " + line.strip()
    for action in parser._actions[1:]:  # after -h
        said = re.findall(r"\(default: ([^)]*)\)", entries[action.option_strings[0]])
        assert said == ([] if action.default is None else [str(action.default)]), action.dest
    assert parser.parse_args([]).progress  # a bar unless --no-progress


def test_the_script_prints_one_line_for_bad_input():
    result = run_script("train.py", "--gamma", "1.0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("train.py: error: --gamma 1.0 is outside [0, 1); the paper "
                                     "uses 0.9")  # the README's example, word for word


@pytest.mark.parametrize("flags, named", BAD_FLAGS)
def test_bad_flags_fail_at_start_with_one_line_naming_the_flag(flags, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a task built before the check would leave its data here
    # In-process, as `python train.py` calls main(): any exception but argparse's exit fails here.
    with pytest.raises(SystemExit) as stopped:
        train.main(flags)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("train.py: error:") and named in error[0]


@pytest.mark.parametrize("model", [[], ["--share_weights"], ["--attn", "lego_v0"]])  # the last two
def test_sample_script_runs_a_checkpoint_with_and_without_cache(tmp_path, model):  # cannot cache
    train.main(TINY + model + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    started = time.perf_counter()
    cached = run_sample("--out_dir", str(tmp_path), "--seed", "3")
    if not model:
        assert_tokens_per_second_possible(cached.stdout, time.perf_counter() - started)
    uncached = run_sample("--out_dir", str(tmp_path), "--seed", "3", "--no-cache")
    assert cached.returncode == 0 and uncached.returncode == 0, cached.stderr + uncached.stderr
    # The cache where the model keeps one; LEGO attention and adaptive depth keep none, and read
    # the whole sequence in one pass (as evaluation does) whether or not the cache is asked for.
    assert ("(with the cache)" if not model else "read in one pass") in cached.stdout
    assert ("(no cache" if not model else "read in one pass") in uncached.stdout
    answers = lambda out: [line for line in out.splitlines() if "model" in line]
    assert answers(cached.stdout) and answers(cached.stdout) == answers(uncached.stdout)


def test_sample_accuracy_counts_the_scored_positions_only(tmp_path, monkeypatch, capsys):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    task = PointerChains(n_blocks=4, block_len=4)
    def right_where_scored(model, x, n_prompt, use_cache=True):  # block 0 (unscored): a wrong 0
        return task.solve(x.cpu()).clamp(min=0), 1.0
    monkeypatch.setattr(sample, "read_token_by_token", right_where_scored)
    sample.main(["--out_dir", str(tmp_path), "--device", "cpu"])
    assert "accuracy 100.00%" in capsys.readouterr().out


def test_sample_reads_an_adaptive_depth_model_as_evaluation_does(tmp_path, monkeypatch):
    # Adaptive depth runs a shorter input through fewer layers: read token by token, each
    # position would be predicted by a shallower model than the one training evaluated.
    train.main(TINY + ["--share_weights", "--max_iters", "4", "--eval_interval", "4",
                       "--out_dir", str(tmp_path)])
    read_by_sample, calls = sample.read_token_by_token, []
    def recorded(model, x, n_prompt, use_cache=True):
        predictions, seconds = read_by_sample(model, x, n_prompt, use_cache)
        calls.append((model, x, predictions))
        return predictions, seconds
    monkeypatch.setattr(sample, "read_token_by_token", recorded)
    sample.main(["--out_dir", str(tmp_path), "--device", "cpu", "--seed", "3"])
    model, x, predictions = calls[0]
    with torch.no_grad():
        whole = model(x)[0]
        by_prefix = torch.cat([model(x[:, :t + 1])[0][:, -1:] for t in range(x.size(1))], dim=1)
    assert torch.equal(predictions, whole.argmax(dim=-1))
    assert not torch.allclose(by_prefix, whole)  # what reading token by token would have shown


def test_sample_names_the_run_when_its_own_example_does_not_fit(tmp_path, capsys):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    checkpoint["args"]["n_blocks"] = 5  # as if edited: the task now writes 20 tokens, not 16
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        sample.main(["--out_dir", str(tmp_path), "--device", "cpu"])
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("sample.py: error: the run's test example: 20 tokens"), error  # no flag typed


def test_sample_script_takes_a_prompt_and_rejects_a_bad_one(tmp_path):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    prompt = "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10"  # values, then 3 blocks of pointers
    result = run_sample("--out_dir", str(tmp_path), "--prompt", prompt)
    assert result.returncode == 0, result.stderr
    assert "block  3" in result.stdout
    for bad_prompt in ("1 2 3", prompt.replace("11", "x")):  # too short; not a token id
        bad = run_script("sample.py", "--out_dir", str(tmp_path), "--prompt", bad_prompt)
        assert bad.returncode == 2 and "--prompt" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("flags, shown", [
    (["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
      "--max_train_length", "6", "--max_test_length", "9", "--length_samples", "2"], "length 30"),
    (["--task", "lego", "--n_vars", "4", "--bidirectional", "--attn", "standard"], "truth   :"),
])
def test_sample_script_reads_a_regular_language_or_lego_in_one_pass(tmp_path, flags, shown):
    train.main(flags + ["--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--max_iters", "2",
                        "--eval_interval", "2", "--eval_samples", "8", "--no-progress",
                        "--device", "cpu", "--out_dir", str(tmp_path)])
    length = ["--length", "30"] if "parity" in flags else []  # past the training lengths
    result = run_sample("--out_dir", str(tmp_path), *length)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout and "tokens/s" not in result.stdout  # one pass: nothing decoded


# Each task at a size that trains a step in milliseconds (the regular languages share one).
GRID_SIZES = {"toy": "--n_blocks 3 --block_len 2", "lego": "--n_vars 3 --bidirectional",
              "boxes": "--boxes_version advanced --n_boxes 3 --n_filled 2 --n_objects 4 --max_ops 2 "
                       "--n_train 8 --n_test 4",
              "cycles": "--cycle_n 2", "text": "--context 8 --data corpus.txt"}
REGULAR_SIZE = "--max_train_length 4 --max_test_length 6 --length_samples 2"


@pytest.mark.parametrize("task", list(TASKS))
def test_every_attention_trains_and_samples_every_task_or_is_refused_in_one_line(task, tmp_path,
                                                                                  monkeypatch):
    """The task-by-attention grid as a user meets it, a stack of two included: a step of training,
    then sample.py with and without the cache. The one pairing that cannot work, a bidirectional
    task with Sliding-Dilated-Attention (it only looks back), is refused at start."""
    monkeypatch.chdir(tmp_path)  # boxes writes its data_cache/ here
    (tmp_path / "corpus.txt").write_text("the key is in box a; move a into c. " * 20)
    for attn in [*ATTENTIONS, "standard,chacal"]:
        flags = (f"--task {task} {GRID_SIZES.get(task, REGULAR_SIZE)} --attn {attn} "
                 f"--n_layer {attn.count(',') + 1} --n_embd 8 --n_head 2 --batch_size 2 "
                 f"--max_iters 1 --eval_interval 1 --eval_samples 2 --no-progress --device cpu "
                 f"--out_dir {attn}").split()
        trained = run_in_process(train.main, "train.py", *flags)
        if task == "lego" and attn == "dilated":
            assert trained.returncode == 2 and trained.stderr.count("\n") == 1, trained.stderr
            assert trained.stderr.startswith("train.py: error: --bidirectional")
            continue
        assert trained.returncode == 0 and "done:" in trained.stdout, (attn, trained.stderr)
        for cache in ("--cache", "--no-cache"):
            sampled = run_sample("--out_dir", attn, "--device", "cpu", cache)
            assert sampled.returncode == 0 and f"{task}, " in sampled.stdout, (attn, sampled.stderr)


def test_learning_rate_warms_up_then_follows_a_cosine_to_min_lr(tmp_path):
    args = argparse.Namespace(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lr = lambda step: train.learning_rate(step, args)
    assert lr(0) == pytest.approx(0.1) and lr(4) == pytest.approx(0.5) and lr(9) == pytest.approx(1)
    assert lr(10) == pytest.approx(1.0)               # the top of the cosine
    assert lr(60) == pytest.approx(0.55)              # halfway: (lr + min_lr) / 2
    assert lr(35) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)  # then min_lr
    # A run's records: the rate of the step just taken, min_lr = lr / 10 and the decay ending at
    # max_iters by default: step 2 took lr(1) = 0.01, step 4 lr(3) = 0.001 + 0.009 / 2.
    run = train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--lr", "0.01",
                             "--warmup_iters", "2", "--out_dir", str(tmp_path)])
    assert [m["lr"] for m in run["metrics"]] == pytest.approx([0.01, 0.0055])
    # Both parameter groups (decayed and not) take the rate, not only the first.
    groups = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]["param_groups"]
    assert len(groups) == 2 and [g["lr"] for g in groups] == pytest.approx([0.0055, 0.0055])


def test_resuming_a_finished_run_takes_no_step_and_changes_nothing(tmp_path):
    train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    saved = [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")]
    again = train.main(["--resume", "--no-progress", "--out_dir", str(tmp_path)])
    assert again["final"]["step"] == 4
    assert [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")] == saved


def test_boxes_run_trains_and_answers_a_typed_prompt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes data cache goes to ./data_cache
    summary = train.main(["--task", "boxes", "--n_train", "64", "--n_test", "16", "--n_layer", "2",
                          "--attn", "standard,chacal", "--n_embd", "32", "--n_head", "2",
                          "--batch_size", "4", "--max_iters", "2", "--eval_interval", "2",
                          "--eval_samples", "8", "--no-progress", "--device", "cpu",
                          "--out_dir", "run"])
    assert os.path.exists("data_cache") and 0 <= summary["final"]["eval_acc"] <= 1
    prompt = "The cup is in Box B, there is nothing in Box A. Move the contents of Box B to Box A."
    result = run_sample("--out_dir", "run", "--prompt", prompt)
    assert result.returncode == 0, result.stderr
    assert "truth : Box A contains the cup, Box B is empty." in result.stdout
    assert "exact match:" in result.stdout and "boxes right" in result.stdout and "/2\n" in result.stdout
    bad = run_sample("--out_dir", "run", "--prompt", "Juggle Box A.")
    assert bad.returncode == 2 and "--prompt" in bad.stderr and "Traceback" not in bad.stderr
    # LEGO attention cannot decode against a cache: its answers are written by recomputing the
    # prefix. (Adaptive depth, which cannot either, is refused for tasks that write an answer.)
    for model in (["--attn", "lego_v0"],):
        run = train.main(["--task", "boxes", "--n_train", "64", "--n_test", "16", *model,
                          "--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--max_iters", "1",
                          "--eval_interval", "1", "--eval_samples", "2", "--no-progress",
                          "--device", "cpu", "--out_dir", "nocache"])
        assert 0 <= run["final"]["eval_exact_match"] <= 1


def test_regular_language_run_scores_every_unseen_length(tmp_path):
    flags = ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
             "--n_embd", "16", "--n_head", "2", "--batch_size", "8", "--max_iters", "4",
             "--eval_interval", "2", "--eval_samples", "16", "--max_train_length", "6",
             "--max_test_length", "9", "--length_samples", "5", "--no-progress", "--device", "cpu"]
    summary = train.main(flags + ["--out_dir", str(tmp_path)])
    final = summary["final"]
    assert list(final["length_acc"]) == ["7", "8", "9"]
    assert all(acc in {0, 0.2, 0.4, 0.6, 0.8, 1} for acc in final["length_acc"].values())
    assert final["length_score"] == pytest.approx(sum(final["length_acc"].values()) / 3)
    assert set(final["eval_acc_by_depth"]) <= {str(n) for n in range(1, 7)}  # depth = length
    assert "length score" in summary["line"]


def test_stop_at_acc_ends_at_the_first_evaluation_that_reaches_it_and_stays_stopped(tmp_path):
    flags = ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
             "--n_embd", "16", "--n_head", "2", "--batch_size", "8", "--max_iters", "12",
             "--lr", "1e-2", "--warmup_iters", "0", "--eval_interval", "2", "--eval_samples", "16",
             "--max_train_length", "6", "--max_test_length", "9", "--length_samples", "5",
             "--no-progress", "--device", "cpu"]
    full = train.main(flags + ["--out_dir", str(tmp_path / "full")])["metrics"]
    threshold = max(m["eval_acc"] for m in full[:-1])  # reached before the end, by this seed
    assert threshold > 0
    first = next(m for m in full if m["eval_acc"] >= threshold)
    stop = flags + ["--out_dir", str(tmp_path / "stop"), "--stop_at_acc", str(threshold)]
    summary = train.main(stop)
    metrics = summary["metrics"]
    assert [m["step"] for m in metrics] == [m["step"] for m in full if m["step"] <= first["step"]]
    assert [m["eval_acc"] for m in metrics] == [m["eval_acc"] for m in full[:len(metrics)]]
    assert metrics[-1]["stopped_early"] and list(metrics[-1]["length_acc"]) == ["7", "8", "9"]
    assert f"{first['step']} steps (stopped" in summary["line"]
    assert train.main(stop + ["--resume"])["metrics"] == metrics  # stopped, so nothing to do
    resumed = train.main(stop + ["--resume", "--stop_at_acc", "1"])  # a higher bar: on it goes
    assert resumed["metrics"][-1]["step"] > first["step"]


def test_a_stopped_run_goes_on_to_max_iters_when_resumed_with_stop_at_acc_never(tmp_path, capsys):
    flags = TINY + ["--max_iters", "6", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    stopped = train.main(flags + ["--stop_at_acc", "1e-9"])  # any accuracy above 0 reaches it
    assert stopped["final"]["stopped_early"] and stopped["final"]["step"] == 2
    assert "(stopped: accuracy >= 1e-07%)" in stopped["line"]  # the bar as typed, not "0%"
    capsys.readouterr()
    assert train.main(flags + ["--resume"])["final"]["step"] == 2  # the saved bar still holds
    assert ("nothing left to train in " + str(tmp_path) + ": it stopped at step 2 with accuracy"
            in capsys.readouterr().out)  # and says so, with the flag that would go on
    unset = train.main(flags + ["--resume", "--stop_at_acc", "never", "--max_iters", "2"])
    assert unset["final"]["step"] == 2 and "2 steps (stopped) in" in unset["line"]  # no bar left
    resumed = train.main(flags + ["--resume", "--stop_at_acc", "never", "--max_iters", "6"])
    assert [m["step"] for m in resumed["metrics"]] == [2, 4, 6]
    assert "6 steps in" in resumed["line"] and "(stopped" not in resumed["line"]


def test_a_finished_run_resumed_says_it_has_nothing_left_to_train(tmp_path, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    capsys.readouterr()
    resumed = train.main(flags + ["--resume", "--lr", "0.01"])  # a new --lr would act on nothing
    assert resumed["final"]["step"] == 2
    assert (f"nothing left to train in {tmp_path}: it is at --max_iters 2 already; give more "
            f"steps to train on") in capsys.readouterr().out


def test_a_run_shorter_than_its_warmup_says_it_never_reaches_lr(tmp_path, capsys):
    warm = TINY + ["--max_iters", "4", "--eval_interval", "4", "--lr", "1e-3", "--out_dir", str(tmp_path)]
    train.main(warm + ["--warmup_iters", "8"])
    assert ("note: --max_iters 4 ends inside --warmup_iters 8: the learning rate climbs to "
            "0.0005, never --lr 0.001, and never decays" in capsys.readouterr().out)
    train.main(warm + ["--warmup_iters", "4"])  # its last step is at --lr: no note
    assert "note:" not in capsys.readouterr().out


def test_a_run_that_reaches_stop_at_acc_at_its_last_step_is_not_called_stopped_early(tmp_path):
    run = train.main(TINY + ["--stop_at_acc", "1e-9", "--max_iters", "2", "--eval_interval", "2",
                             "--out_dir", str(tmp_path)])
    assert run["final"]["eval_acc"] > 0 and "stopped_early" not in run["final"]
    assert "(stopped" not in run["line"]


def test_regular_languages_change_the_defaults_but_never_a_typed_flag():
    args, *_ = train.parse_args(["--task", "parity", "--lr", "2e-3"])
    assert (args.n_embd, args.batch_size, args.max_iters) == (64, 64, 5000)
    assert args.lr == 2e-3 and args.min_lr == 2e-4 and args.lr_decay_iters == 5000
    toy, *_ = train.parse_args([])
    assert (toy.n_embd, toy.batch_size, toy.lr, toy.max_iters) == (128, 32, 3e-3, 1000)


@pytest.mark.parametrize("flags, norm", [
    ([], "pre"), (["--share_weights", "--n_layer", "3"], "pre"),
    (["--share_weights"], "post"), (["--share_weights", "--norm", "pre"], "pre"),
    (["--norm", "post"], "post"),
])
def test_norm_defaults_to_post_only_with_adaptive_depth(flags, norm):
    _, _, config, _ = train.parse_args(flags + ["--attn", "dilated", "--task", "parity"])
    assert config.norm == norm


# Nothing lost, nothing silent: a diverging run, interrupted writes, and broken files.

def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    flags = TINY + ["--warmup_iters", "5", "--gamma", "0.999", "--grad_clip", "0",
                    "--eval_interval", "10", "--out_dir", str(tmp_path)]
    train.main(flags + ["--max_iters", "10"])
    good = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    with pytest.raises(SystemExit) as stopped:
        train.main(["--resume", "--lr", "1e6", "--max_iters", "40"] + flags[-2:] + ["--no-progress"])
    message = str(stopped.value.code)
    assert "loss became nan" in message and "untouched" in message and "--lr" in message
    assert len(message.splitlines()) == 1
    kept = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert kept["step"] == 10 and all(torch.equal(good["model"][k], v) for k, v in kept["model"].items())
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [10]


def test_a_diverging_run_stops_within_ten_steps_not_at_its_next_evaluation(tmp_path):
    with pytest.raises(SystemExit, match="loss became nan by step 10;"):
        train.main(TINY + ["--gamma", "0.999", "--grad_clip", "0", "--lr", "1e6", "--warmup_iters", "1",
                           "--eval_interval", "100", "--max_iters", "100", "--out_dir", str(tmp_path)])
    assert not (tmp_path / "ckpt.pt").exists()


def test_weights_that_break_while_the_loss_is_still_finite_are_named_as_such(tmp_path, monkeypatch):
    # The loss of a step is computed before its update, so an update that breaks a weight shows
    # in the weights first: the message must not report a finite loss as the cause.
    step, calls = torch.optim.AdamW.step, []
    def breaking(optimizer, *args, **kwargs):
        step(optimizer, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("inf"))
    monkeypatch.setattr(torch.optim.AdamW, "step", breaking)
    with pytest.raises(SystemExit, match="a weight became inf or nan by step 2;"):
        train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    assert not (tmp_path / "ckpt.pt").exists()


@pytest.mark.parametrize("flags", [
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4"],
    ["--task", "boxes", "--boxes_version", "advanced", "--n_boxes", "4", "--n_filled", "2",
     "--n_objects", "5", "--max_ops", "6", "--n_train", "64", "--n_test", "8", "--attn", "standard"],
    ["--task", "cycles", "--cycle_n", "3", "--scratchpad", "inductive", "--attn", "standard"],
    ["--task", "cycles", "--cycle_n", "3", "--scratchpad", "full", "--attn", "dilated"],
    ["--task", "lego", "--bidirectional"],  # parts are not cut: every token reads every other
    ["--task", "parity", "--share_weights", "--n_layer", "auto"],  # not cut: depth grows with length
])
def test_micro_batches_give_the_gradient_of_the_whole_batch(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # boxes writes its dataset here
    args, task, config, _ = train.parse_args(flags + ["--n_embd", "16", "--n_head", "2",
                                                      "--micro_batches", "3", "--no-progress"])
    torch.manual_seed(0)
    model = train.GPT(config).double()
    x, y = task.sample(7, torch.Generator().manual_seed(1))
    layout = task.layout(x)

    def gradients(parts):
        model.zero_grad()
        for x_part, y_part, layout_part, share in parts:
            (model(x_part, y_part, **layout_part)[1] * share).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole = gradients([(x, y, layout, 1.0)])
    split = list(train.split_batch(x, y, layout, 3, cut=model.can_cache()))
    assert len(split) == 3 and sum(len(part[0]) for part in split) == 7
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in zip(whole, gradients(split)))
    widths = [part[0].size(1) for part in split]
    assert widths == sorted(widths)
    if model.can_cache() and (y[:, -1] == -1).any():  # rows that end early: their part is cut
        assert widths[0] < x.size(1)


def test_split_batch_skips_parts_with_nothing_scored_and_keeps_an_unscored_batch_whole():
    # A part with no scored token has the mean loss 0 / 0 = nan, and nan * 0 is still nan: it
    # must be left out, not weighted by its zero share. A batch with nothing scored at all is one
    # part, as without --micro_batches.
    x, y = get_task("toy").sample(6, torch.Generator().manual_seed(1))
    y[:2] = -1
    parts = list(train.split_batch(x, y, {}, 3, cut=True))
    assert [len(part[0]) for part in parts] == [2, 2] and [part[3] for part in parts] == [0.5, 0.5]
    y[:] = -1
    (part,) = train.split_batch(x, y, {}, 3, cut=True)
    assert part[0] is x and part[3] == 1.0


def test_micro_batches_of_a_bidirectional_model_are_not_cut(tmp_path, monkeypatch):
    # Every token of a bidirectional model reads the columns after its last scored one, so
    # train_loop must ask split_batch for whole rows (the gradient test above shows why).
    asked, split_batch = [], train.split_batch
    monkeypatch.setattr(train, "split_batch",
                        lambda *a, cut: asked.append(cut) or split_batch(*a, cut=cut))
    train.main(["--task", "lego", "--bidirectional", "--attn", "standard", "--n_embd", "16",
                "--n_head", "2", "--batch_size", "6", "--max_iters", "2", "--eval_interval", "2",
                "--eval_samples", "8", "--micro_batches", "3", "--no-progress", "--device", "cpu",
                "--out_dir", str(tmp_path)])
    assert asked == [False, False]


def test_a_run_in_micro_batches_trains_as_the_whole_batches_do(tmp_path):
    # The same steps in float32, summed in another order: equal to float32's precision
    runs = [train.main(TINY + ["--max_iters", "20", "--eval_interval", "10", "--micro_batches", n,
                               "--out_dir", str(tmp_path / n)]) for n in ("1", "3")]
    for whole, parts in zip(*(run["metrics"] for run in runs)):
        assert parts["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)
        assert parts["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-4)


@pytest.mark.parametrize("attn", ["standard", "chacal", "dilated", "lego_v1"])
def test_training_bytes_bounds_what_autograd_keeps_from_below(attn):
    # The activations of a training step, counted independently: every tensor autograd saves
    # for the backward pass, once per storage, the weights left out.
    config = train.GPTConfig(block_size=48, vocab_size=40, n_layer=3, n_head=4, n_embd=32,
                             attn=attn, causal=attn != "lego_v1")
    torch.manual_seed(0)
    model, saved = train.GPT(config), {}
    x = torch.randint(0, 40, (5, 48))
    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, x)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = sum(n for pointer, n in saved.items() if pointer not in weights)
    model_bytes, bound = train.training_bytes(config, 48, 5, "float32")
    assert model_bytes == 16 * model.num_params()
    assert bound <= kept
    assert train.training_bytes(config, 48, 5, "bfloat16") == (model_bytes, bound // 2)
    if attn == "standard":  # and close to it, so that the check refuses what cannot fit
        assert kept < 1.1 * bound


def test_a_run_too_large_for_memory_fails_at_start_naming_its_length_flags(tmp_path, capsys, monkeypatch):
    (tmp_path / "words.txt").write_text("the cat sat on the mat. " * 2000)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**18}  # a machine of 1 GiB
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    error = one_error_line(capsys, ["--task", "text", "--data", str(tmp_path / "words.txt"),
                                    "--context", "4000", "--out_dir", str(tmp_path / "run")])
    assert "32 sequences (--batch_size / --micro_batches) of up to 4000 tokens" in error
    assert "--context 4000)" in error
    assert not (tmp_path / "run").exists()
    # sized by the rows it trains on: parity tests up to 6,000 symbols, but trains on up to 40
    train.parse_args(["--task", "parity", "--max_test_length", "6000", "--out_dir", str(tmp_path / "p")])
    # resuming, the task's flags are the saved ones, and the model cannot shrink
    monkeypatch.undo()
    text = ["--task", "text", "--data", str(tmp_path / "words.txt"), "--context", "64"]
    train.main(text + ["--max_iters", "2", "--eval_interval", "2", "--eval_samples", "8",
                       "--no-progress", "--out_dir", str(tmp_path / "small")])
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    error = one_error_line(capsys, ["--resume", "--out_dir", str(tmp_path / "small"),
                                    "--batch_size", "100000", "--max_iters", "4"])
    assert "--context 64)" in error and "start a new --out_dir with a smaller model" in error


def test_check_memory_refuses_past_half_for_the_model_and_three_quarters_in_all(tmp_path, monkeypatch):
    # The bounds themselves, on a machine of 1 GiB: equal passes, one byte more is refused.
    args, task, config, _ = train.parse_args(TINY + ["--batch_size", "5", "--micro_batches", "2",
                                                     "--out_dir", str(tmp_path)])
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**18}
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    asked, gib = [], 2**30
    for model_bytes, activation_bytes, refusal in [
            (gib // 2, 0, None), (gib // 2 + 1, 0, "more than half"),
            (gib // 2, gib // 4, None), (gib // 2, gib // 4 + 1, "more than three quarters")]:
        monkeypatch.setattr(train, "training_bytes", lambda *given, sizes=(model_bytes, activation_bytes):
                            asked.append(given[1:]) or sizes)
        if refusal is None:
            train.check_memory(args, task, config)
        else:
            with pytest.raises(ValueError, match=refusal):
                train.check_memory(args, task, config)
    assert asked[0] == (task.train_length, 3, "float32")  # a part of 5 rows in 2 holds 3
    monkeypatch.setattr(train, "training_bytes", lambda *given: (gib, 0))
    with pytest.raises(ValueError) as refused:
        train.check_memory(args, task, config)
    assert str(refused.value).endswith("lower --n_embd or --n_layer, or the task's sizes (its "
                                       f"{config.block_size}-token sequences, its vocabulary of "
                                       f"{config.vocab_size})")
    args.block_size = 64  # typed: the model's length is the flag's, not the task's
    with pytest.raises(ValueError) as refused:
        train.check_memory(args, task, config)
    assert str(refused.value).endswith("lower --block_size, --n_embd or --n_layer")


def test_stochastic_depth_trains_in_one_part(tmp_path):
    # --micro_batches 1 (the default) is one part: one depth is drawn for the step.
    args, _, config, _ = train.parse_args(["--task", "parity", "--share_weights", "--n_layer", "4",
                                           "--min_train_layers", "2", "--out_dir", str(tmp_path)])
    assert args.micro_batches == 1 and config.min_train_layers == 2


def test_numbers_at_the_edge_of_what_is_allowed_pass(monkeypatch):
    args, *_ = train.parse_args(["--max_iters", "1", "--eval_interval", "1", "--batch_size", "2",
                                 "--micro_batches", "2", "--eval_samples", "1", "--lr_decay_iters",
                                 "1", "--warmup_iters", "0", "--stop_at_acc", "1", "--device",
                                 "cpu"])
    assert args.dtype == "float32"  # --dtype auto, on a CPU
    args.block_size, args.lr, args.batch_size, args.micro_batches = 1, 3.4028234663852886e38, 1, 1
    train.check_numbers(args)  # float32's largest rate is still finite in the optimizer
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert train.parse_args(["--device", "cpu"])[0].dtype == "float32"  # bfloat16: CUDA's only


def test_seed_device_and_memory_helpers_at_their_edges(monkeypatch):
    for seed in (0, 2**63 - 1):  # the ends of [0, 2^63), the range its message gives
        train.check_seed(seed)
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=f"--seed {bad} must lie in"):
            train.check_seed(bad)
    for cuda in (False, True):  # a machine without a GPU, then one with CUDA
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
        assert train.pick_device("auto") == ("cuda" if cuda else "cpu")
        assert train.pick_device("cpu") == "cpu"
        for name in ("cuda", "mps")[cuda:]:
            with pytest.raises(ValueError, match=f"--device {name}: not available here"):
                train.pick_device(name)
    assert train.pick_device("cuda") == "cuda"
    synchronized = []
    for device in ("cpu", "cuda", "mps"):
        monkeypatch.setattr(getattr(torch, device), "synchronize",
                            lambda d=device: synchronized.append(d))
    for device in ("cpu", "cuda", "mps"):
        train.synchronize(device)
    assert synchronized == ["cuda", "mps"]  # a CPU runs each op to its end: nothing to wait for
    assert train.out_of_memory(RuntimeError("MPS backend out of memory"))
    assert not train.out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory."), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")])
def test_running_out_of_memory_in_training_is_one_line_naming_what_was_kept(tmp_path, monkeypatch, error):
    forward, calls = train.GPT.forward, []
    def runs_out_at_step_5(model, *args, **kwargs):
        calls.append(model.training)
        if sum(calls) == 5:
            raise error
        return forward(model, *args, **kwargs)
    monkeypatch.setattr(train.GPT, "forward", runs_out_at_step_5)
    with pytest.raises(SystemExit) as stopped:
        train.main(TINY + ["--max_iters", "6", "--eval_interval", "3", "--out_dir", str(tmp_path)])
    message = str(stopped.value.code)
    assert message.startswith("train.py: error: cpu ran out of memory training on --batch_size 8")
    assert "ckpt.pt holds step 3: add --resume and a higher --micro_batches" in message
    assert len(message.splitlines()) == 1
    # evaluation runs whole batches: more parts would not help there
    calls.clear()
    def runs_out_evaluating_at_step_6(model, *args, **kwargs):
        calls.append(model.training)
        if sum(calls) == 6 * 2 and not model.training:  # 6 steps of 2 parts each
            raise error
        return forward(model, *args, **kwargs)
    monkeypatch.setattr(train.GPT, "forward", runs_out_evaluating_at_step_6)
    with pytest.raises(SystemExit) as stopped:
        train.main(TINY + ["--max_iters", "6", "--eval_interval", "3", "--micro_batches", "2",
                           "--out_dir", str(tmp_path / "evaluating")])
    message = str(stopped.value.code)
    assert "ran out of memory evaluating whole batches of --batch_size 8" in message
    assert "ckpt.pt holds step 3: add --resume and a lower --batch_size" in message
    calls.clear()
    monkeypatch.setattr(train.GPT, "forward", runs_out_at_step_5)
    with pytest.raises(SystemExit) as stopped:  # before the first checkpoint
        train.main(TINY + ["--max_iters", "6", "--out_dir", str(tmp_path / "first")])
    assert str(stopped.value.code).endswith("; nothing was saved")
    monkeypatch.setattr(train.GPT, "forward", lambda *args, **kwargs: 1 / 0)  # other errors: as they are
    with pytest.raises(ZeroDivisionError):
        train.main(TINY + ["--max_iters", "6", "--out_dir", str(tmp_path / "other")])


def test_records_hold_the_mean_training_loss_of_their_interval(tmp_path, monkeypatch):
    losses, forward = [], train.GPT.forward
    def recorded(model, *args, **kwargs):
        logits, loss = forward(model, *args, **kwargs)
        if model.training:
            losses.append(loss.item())
        return logits, loss
    monkeypatch.setattr(train.GPT, "forward", recorded)
    run = train.main(TINY + ["--max_iters", "24", "--eval_interval", "12", "--out_dir", str(tmp_path)])
    assert [m["train_loss"] for m in run["metrics"]] == pytest.approx(
        [sum(losses[:12]) / 12, sum(losses[12:]) / 12], rel=1e-5)


def one_error_line(capsys, argv):
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train.main(argv)
    error = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(error) == 1 and error[0].startswith("train.py: error:")
    return error[0]


def test_init_from_checks_the_model_it_takes_in_against_the_task(tmp_path, capsys):
    # --init_from brings the saved model's heads, direction and depth: the checks a typed flag
    # gets at start apply to them too, not a traceback at the first evaluation or mimicking step.
    toy = ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--n_embd", "16",
           "--batch_size", "4", "--eval_samples", "8", "--max_iters", "1", "--eval_interval", "1",
           "--no-progress", "--device", "cpu"]  # 16 tokens, as the 9 words and 7 names below
    room = ["--block_size", "32"]  # for the cycles rows
    for name, flags in {"bert": ["--attn", "standard", "--n_head", "2", "--bidirectional"],
                        "adaptive": ["--attn", "dilated", "--n_head", "2", "--share_weights",
                                     "--pos", "none"],
                        "one_head": ["--n_head", "1"]}.items():
        train.main(toy + room + flags + ["--out_dir", str(tmp_path / name)])
    cycles = toy[6:] + ["--task", "cycles", "--cycle_n", "2", "--cycle_names", "7", "--n_head",
                        "2", "--out_dir", str(tmp_path / "next")]
    error = one_error_line(capsys, cycles + ["--attn", "standard",
                                             "--init_from", str(tmp_path / "bert")])
    assert "--bidirectional (the model of --init_from" in error and "generating" in error
    error = one_error_line(capsys, cycles + ["--attn", "dilated", "--pos", "none",
                                             "--init_from", str(tmp_path / "adaptive")])
    assert "--n_layer auto (the model of --init_from" in error
    error = one_error_line(capsys, toy + ["--mimic_iters", "2", "--out_dir", str(tmp_path / "m"),
                                          "--init_from", str(tmp_path / "one_head")])
    assert "--mimic_iters (the model of --init_from" in error and "--n_head 2" in error
    lego = toy[6:] + ["--task", "lego", "--n_vars", "4", "--n_head", "2"]
    train.main(lego + ["--bidirectional", "--out_dir", str(tmp_path / "lego")])
    saved = torch.load(tmp_path / "lego" / "ckpt.pt", weights_only=False)
    saved["config"]["causal"] = True  # a causal model of LEGO's tokens, as an older version saved
    torch.save(saved, tmp_path / "lego" / "ckpt.pt")
    error = one_error_line(capsys, lego + ["--init_from", str(tmp_path / "lego"),
                                           "--out_dir", str(tmp_path / "lego_next")])
    assert "--bidirectional is missing (the model of --init_from" in error
    saved["args"]["bidirectional"] = False
    torch.save(saved, tmp_path / "lego" / "ckpt.pt")
    error = one_error_line(capsys, ["--resume", "--out_dir", str(tmp_path / "lego")])
    assert "--bidirectional is missing" in error and "start a new --out_dir" in error


def test_init_from_an_adaptive_model_refuses_a_fixed_n_layer_by_name(tmp_path, capsys):
    lego = ["--task", "lego", "--bidirectional", "--share_weights", "--n_embd", "16", "--n_head",
            "2", "--batch_size", "4", "--eval_samples", "8", "--no-progress", "--device", "cpu"]
    train.main(lego + ["--n_layer", "auto", "--max_iters", "1", "--eval_interval", "1",
                       "--out_dir", str(tmp_path / "a")])
    for n_layer in ("1", "3"):  # 1 is the placeholder an adaptive config holds: not a match
        with pytest.raises(SystemExit):
            train.parse_args(lego + ["--n_layer", n_layer, "--init_from", str(tmp_path / "a"),
                                     "--out_dir", str(tmp_path / "b")])
        err = capsys.readouterr().err
        assert "its model has --n_layer auto, where this run needs a fixed --n_layer" in err, err


def test_init_from_takes_adaptive_depth_and_any_length_as_typed_again(tmp_path):
    # A model of adaptive depth and no positions is what `--share_weights --n_layer auto --pos
    # none` asks for, whatever block_size it was saved with.
    parity = ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
              "--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--eval_samples", "8",
              "--max_train_length", "6", "--max_test_length", "8", "--length_samples", "2",
              "--no-progress", "--device", "cpu"]
    train.main(parity + ["--max_iters", "1", "--eval_interval", "1",
                         "--out_dir", str(tmp_path / "a")])
    _, task, config, _ = train.parse_args(parity + [
        "--max_train_length", "12", "--max_test_length", "14",  # the last typed value counts
        "--n_layer", "auto", "--init_from", str(tmp_path / "a"), "--out_dir", str(tmp_path / "b")])
    assert config.adaptive_depth and config.block_size == task.block_size > 8


def test_resume_takes_a_gamma_that_the_model_does_not_use(tmp_path, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags + ["--attn", "standard"])
    train.main(flags + ["--resume", "--gamma", "0.5", "--max_iters", "4"])  # standard: no γ
    train.main(TINY + ["--attn", "chacal", "--max_iters", "2", "--eval_interval", "2",
                       "--out_dir", str(tmp_path / "chacal")])
    error = one_error_line(capsys, TINY + ["--resume", "--gamma", "0.5", "--max_iters", "4",
                                           "--out_dir", str(tmp_path / "chacal")])
    assert "different model (--gamma)" in error


@pytest.mark.parametrize("typed, named", [
    (["--n_layer", "auto"], "(--n_layer)"),           # not the norm and adaptive depth it implies
    (["--n_layer", "auto", "--norm", "post"], "(--n_layer, --norm)"),
    (["--n_blocks", "5"], "(--n_blocks)"),            # the task's flag, not block_size
    (["--n_blocks", "5", "--n_embd", "48"], "(--n_blocks, --n_embd)"),  # each behind its field
])
def test_resume_names_the_typed_flags_that_change_the_model(tmp_path, capsys, typed, named):
    flags = TINY + ["--attn", "standard", "--share_weights", "--n_layer", "2", "--max_iters", "2",
                    "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    error = one_error_line(capsys, TINY + ["--resume", "--out_dir", str(tmp_path)] + typed)
    assert f"has a different model {named}; drop those flags" in error


CYCLES = ["--task", "cycles", "--cycle_n", "2", "--n_embd", "16", "--n_head", "2", "--batch_size", "4",
          "--eval_samples", "4", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("run, typed, named", [
    (CYCLES, ["--cycle_n", "3"], "(--cycle_n)"),                     # it changes block_size only
    (TINY + ["--attn", "standard"], ["--bidirectional"], "(--bidirectional)"),  # not "causal"
])
def test_resume_names_the_flag_behind_a_field_of_another_name(tmp_path, capsys, run, typed, named):
    flags = run + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    error = one_error_line(capsys, flags + ["--resume"] + typed)
    assert f"has a different model {named}; drop those flags" in error, error


def test_resume_refuses_a_new_seed_or_mimicking_it_could_not_apply(tmp_path, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    assert train.main(flags + ["--resume", "--seed", "1337", "--max_iters", "4"])["final"]["step"] == 4
    for typed in (["--seed", "5"], ["--mimic_iters", "3"]):
        error = one_error_line(capsys, flags + ["--resume", "--max_iters", "6"] + typed)
        assert error.startswith(f"train.py: error: {typed[0]}: the run in {tmp_path}"), error


@pytest.mark.parametrize("source, target, what", [
    ("dilated", "chacal", "has no place for weights of that model"),
    ("chacal", "dilated", "needs weights that model lacks"),
])
def test_init_from_says_which_weights_do_not_fit_and_the_source_attn(tmp_path, capsys, source, target, what):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--attn", source, "--out_dir", str(tmp_path / "source")])
    error = one_error_line(capsys, flags + ["--attn", target, "--init_from", str(tmp_path / "source"),
                                            "--out_dir", str(tmp_path / "target")])
    assert f"--attn {target} {what} (" in error and error.endswith(f"has --attn {source}"), error


def test_init_from_names_the_flags_behind_a_model_it_cannot_become(tmp_path, capsys):
    # e.g. a typed --bidirectional would otherwise train the causal model it loaded, silently
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--out_dir", str(tmp_path / "source")])
    start = flags + ["--init_from", str(tmp_path / "source"), "--out_dir", str(tmp_path / "target")]
    for typed, have, need in ((["--bidirectional"], "no --bidirectional", "--bidirectional"),
                              (["--n_layer", "auto"], "a fixed --n_layer", "--n_layer auto"),
                              (["--share_weights"], "no --share_weights", "--share_weights")):
        error = one_error_line(capsys, start + typed)
        assert error.endswith(f"--init_from {tmp_path / 'source'}: its model has {have}, where this run "
                              f"needs {need}; drop the flag, or start from other weights"), error


def test_init_from_names_the_task_flags_behind_a_vocabulary_it_does_not_have(tmp_path, capsys):
    # No flag sets the vocabulary or the positions: the task's do, so the error names those.
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--out_dir", str(tmp_path / "source")])
    start = ["--init_from", str(tmp_path / "source"), "--out_dir", str(tmp_path / "target")]
    assert flags[2:6] == ["--n_blocks", "4", "--block_len", "4"]  # TINY's sizes, left out below
    error = one_error_line(capsys, flags[:2] + flags[6:] + start)  # the toy task's default sizes
    assert error.endswith(f"--init_from {tmp_path / 'source'}: its model has a vocabulary of 16 "
                          f"tokens (trained with --task toy --n_blocks 4 --block_len 4), where this "
                          f"run's task needs a vocabulary of 128 tokens; give the task the flags "
                          f"those weights were trained with, or start from other weights"), error
    error = one_error_line(capsys, flags[:4] + ["--block_len", "2"] + flags[6:] + start)
    assert "its model has a vocabulary of 16 tokens" in error and "needs a vocabulary of 8" in error


def test_init_from_a_file_an_empty_value_or_an_adaptive_model_for_a_writer(tmp_path, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--out_dir", str(tmp_path / "source")])
    error = one_error_line(capsys, flags + ["--init_from", str(tmp_path / "source" / "ckpt.pt")])
    assert error.endswith(f"a file; give the run directory that holds ckpt.pt ({tmp_path / 'source'})")
    error = one_error_line(capsys, flags + ["--init_from", ""])  # an empty shell variable, say
    assert error.endswith("--init_from is empty: give a run directory or a GPT-2 name, or drop it")
    train.main(flags + ["--share_weights", "--pos", "none", "--out_dir", str(tmp_path / "adaptive")])
    # a toy model of 16 token ids, adaptive depth, read by cycles of 7 names (16 ids too)
    error = one_error_line(capsys, ["--task", "cycles", "--cycle_n", "2", "--cycle_names", "7", "--init_from",
                                    str(tmp_path / "adaptive"), "--out_dir", str(tmp_path / "cycles")])
    assert "adaptive depth would run" in error and error.endswith("start from a model of fixed depth")


def test_resume_refuses_fewer_steps_than_the_run_has_taken(tmp_path, capsys):
    flags = TINY + ["--max_iters", "4", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    assert train.main(flags + ["--resume"])["final"]["step"] == 4  # a finished run, taken as it is
    error = one_error_line(capsys, flags + ["--resume", "--max_iters", "2"])
    assert error.endswith(f"--max_iters 2: the run in {tmp_path} is at step 4 already; give more "
                          f"steps to go on, or drop --resume to start again")


def test_too_big_a_model_names_the_sizes_behind_it(capsys):
    error = one_error_line(capsys, TINY + ["--n_embd", "65536", "--n_head", "1", "--n_layer", "64"])
    assert "GiB to train" in error and error.endswith("lower --n_embd or --n_layer, or the task's "
                                                      "sizes (its 16-token sequences, its vocabulary of 16)")


def test_init_from_a_shared_model_of_fixed_depth_for_a_task_that_writes(tmp_path):
    cycles = ["--task", "cycles", "--cycle_n", "2", "--attn", "standard", "--n_embd", "16",
              "--n_head", "2", "--batch_size", "4", "--eval_samples", "4", "--no-progress",
              "--device", "cpu", "--max_iters", "1", "--eval_interval", "1"]
    train.main(cycles + ["--share_weights", "--n_layer", "2", "--out_dir", str(tmp_path / "a")])
    # --share_weights alone would mean --n_layer auto for a fresh model; this one has depth 2
    _, _, config, _ = train.parse_args(cycles + ["--share_weights", "--init_from", str(tmp_path / "a"),
                                                 "--out_dir", str(tmp_path / "b")])
    assert config.n_layer == 2 and config.share_weights and not config.adaptive_depth


def test_out_dir_and_init_from_expand_a_leading_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    flags = TINY + ["--max_iters", "1", "--eval_interval", "1"]
    train.main(flags + ["--out_dir", "~/a"])
    assert (tmp_path / "a" / "ckpt.pt").exists()
    args, *_ = train.parse_args(flags + ["--init_from", "~/a", "--out_dir", "~/b"])
    assert args.init_from == str(tmp_path / "a") and args.out_dir == str(tmp_path / "b")


def test_deferring_a_ctrl_c_puts_back_the_handler_it_found():
    def ours(*_):
        pass
    found = signal.signal(signal.SIGINT, ours)
    try:
        with train.interrupts_deferred():
            assert signal.getsignal(signal.SIGINT) is not ours
        assert signal.getsignal(signal.SIGINT) is ours
    finally:
        signal.signal(signal.SIGINT, found)


def test_a_checkpoint_with_just_the_parts_asked_for_loads(tmp_path):
    torch.save({"model": {}, "config": {}, "args": {}, "step": 0}, tmp_path / "ckpt.pt")
    assert train.load_checkpoint(str(tmp_path), needs=())["step"] == 0


@needs_posix_signals
def test_a_ctrl_c_while_a_checkpoint_is_saved_takes_effect_after_it(tmp_path, monkeypatch):
    save = torch.save

    def save_then_ctrl_c(checkpoint, path):
        save(checkpoint, path)
        os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C would, before ckpt.pt is replaced

    monkeypatch.setattr(train.torch, "save", save_then_ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    assert f"{tmp_path}/ckpt.pt holds step 2" in str(stopped.value)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_rewrites_metrics_jsonl_from_the_checkpoint(tmp_path):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    saved = train.main(flags)["metrics"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "left by": "an earlier run"}\n')  # as many lines
    train.main(flags + ["--resume"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == saved


def test_a_resumed_run_started_from_init_from_is_named_as_itself(tmp_path, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2"]
    train.main(flags + ["--out_dir", str(tmp_path / "pre")])
    train.main(flags + ["--init_from", str(tmp_path / "pre"), "--out_dir", str(tmp_path / "run")])
    error = one_error_line(capsys, flags + ["--resume", "--out_dir", str(tmp_path / "run"),
                                            "--n_embd", "16"])
    assert f"--resume: the run in {tmp_path / 'run'}: its model has --n_embd 32, where this run needs --n_embd 16" in error
    # The command that started it, with --resume, continues it (lesson 06's fine-tunes resume so);
    # other weights to start from are refused, as the run no longer starts
    train.main(flags + ["--max_iters", "3", "--init_from", str(tmp_path / "pre"), "--resume",
                        "--out_dir", str(tmp_path / "run")])
    assert train.load_checkpoint(str(tmp_path / "run"))["step"] == 3
    error = one_error_line(capsys, flags + ["--resume", "--out_dir", str(tmp_path / "run"),
                                            "--init_from", str(tmp_path / "run")])
    assert error.startswith(f"train.py: error: --init_from: the run in {tmp_path / 'run'} continues "
                            f"from its own checkpoint; drop --init_from")


def test_a_kill_while_metrics_are_written_loses_no_earlier_line(tmp_path, monkeypatch):
    flags = TINY + ["--max_iters", "4", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    before = (tmp_path / "metrics.jsonl").read_text()
    dumps = json.dumps

    def killed_midway(record):
        if record["step"] == 2:
            raise KeyboardInterrupt  # as a kill would, at the file's first line
        return dumps(record)

    monkeypatch.setattr(train.json, "dumps", killed_midway)
    with pytest.raises(SystemExit):
        train.main(["--resume", "--max_iters", "6"] + flags[-2:])
    assert (tmp_path / "metrics.jsonl").read_text() == before
    monkeypatch.undo()
    (tmp_path / "metrics.jsonl").unlink()  # even without it, the checkpoint holds the history
    summary = train.main(["--resume", "--max_iters", "6", "--no-progress"] + flags[-2:])
    assert [m["step"] for m in summary["metrics"]] == [2, 4, 6]
    # Killed between the checkpoint and the metrics file of the last step: a resume writes it.
    (tmp_path / "metrics.jsonl").write_text(before)
    train.main(["--resume", "--no-progress"] + flags[-2:])  # finished: nothing left to train
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]


def test_a_kill_while_the_checkpoint_is_written_leaves_the_last_one_whole(tmp_path, monkeypatch):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    before = (tmp_path / "metrics.jsonl").read_text()

    def half_written(checkpoint, path):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(SystemExit, match="ckpt.pt holds step 2:"):  # not the step 4 it was saving
        train.main(["--resume", "--max_iters", "4"] + flags[-2:])
    monkeypatch.undo()
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 2
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_set_up_restores_a_run_and_keeps_evaluation_apart_from_training(tmp_path, monkeypatch):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    args, _, config, checkpoint = train.parse_args(["--resume", "--out_dir", str(tmp_path)])
    _, _, (data_rng, eval_rng), state = train.set_up(args, config, checkpoint)
    assert state["train_time"] == checkpoint["train_time"] > 0 and state["step"] == 2
    assert not torch.equal(data_rng.get_state(), eval_rng.get_state())  # test batches are others
    # Evaluation draws from its own stream: how much of it there is leaves training unchanged.
    runs = [train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--eval_samples", n,
                               "--out_dir", str(tmp_path / n)]) for n in ("8", "16")]
    weights = [torch.load(tmp_path / n / "ckpt.pt", weights_only=True)["model"] for n in ("8", "16")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # Gradient clipping at --grad_clip, once a step; none at 0.
    norms = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, norm: norms.append(norm))
    train.main(TINY + ["--max_iters", "3", "--eval_interval", "3", "--grad_clip", "0.5",
                       "--out_dir", str(tmp_path / "clip")])
    train.main(TINY + ["--max_iters", "3", "--eval_interval", "3", "--grad_clip", "0",
                       "--out_dir", str(tmp_path / "no_clip")])
    assert norms == [0.5, 0.5, 0.5] and runs[0]["final"]["step"] == 4


def test_init_from_a_run_takes_the_typed_attention_gamma_and_dropout(tmp_path):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path / "a")])
    _, _, config, _ = train.parse_args(TINY + ["--init_from", str(tmp_path / "a"), "--attn", "standard",
                                               "--gamma", "0.5", "--dropout", "0.1",
                                               "--out_dir", str(tmp_path / "b")])
    assert (config.attn, config.gamma, config.dropout) == ("standard", 0.5, 0.1)


def test_the_summary_line_counts_exactly_99_percent_as_reached(tmp_path):
    argv = TINY + ["--max_iters", "2", "--eval_interval", "1", "--out_dir", str(tmp_path)]
    run = train.main(argv)
    args, _, config, _ = train.parse_args(argv)
    metrics = [dict(m, eval_acc=acc) for m, acc in zip(run["metrics"], (0.98, 0.99))]
    assert "accuracy >= 99% at step 2 " in train.summarize(args, config, 1, metrics)["line"]


def test_resuming_a_mimicking_run_does_not_mimic_again(tmp_path, capsys):
    flags = ["--task", "lego", "--bidirectional", "--n_vars", "4", "--n_layer", "2", "--n_embd", "16",
             "--n_head", "2", "--batch_size", "4", "--eval_samples", "8", "--mimic_iters", "3",
             "--eval_interval", "2", "--no-progress", "--device", "cpu", "--out_dir", str(tmp_path)]
    train.main(flags + ["--max_iters", "4"])
    assert "mimicking:" in capsys.readouterr().out
    run = train.main(["--resume", "--max_iters", "6", "--out_dir", str(tmp_path), "--no-progress"])
    assert "mimicking:" not in capsys.readouterr().out
    assert ["mimic_loss" in m for m in run["metrics"]] == [True, False, False]  # the first record


def test_mimicking_reads_the_training_stream_and_records_its_first_and_last_loss(tmp_path, capsys,
                                                                               monkeypatch):
    real_mimic, batches_seen, losses = train.mimic, [], []
    def recorded(model, batches, *rest):
        batches_seen.extend(batches)
        losses.extend(real_mimic(model, iter(batches_seen), *rest))
        return losses
    monkeypatch.setattr(train, "mimic", recorded)
    flags = ["--task", "lego", "--bidirectional", "--n_vars", "4", "--n_embd", "16", "--n_head",
             "2", "--batch_size", "4", "--eval_samples", "8", "--mimic_iters", "3", "--max_iters",
             "2", "--eval_interval", "2", "--no-progress", "--device", "cpu", "--seed", "7"]
    run = train.main(flags + ["--out_dir", str(tmp_path)])
    assert capsys.readouterr().err == ""  # --no-progress: no bar while mimicking either
    task, stream = get_task("lego", n_vars=4), torch.Generator().manual_seed(7)  # --seed's
    assert all(torch.equal(batch, task.sample(4, stream)[0]) for batch in batches_seen)
    assert len(losses) == 3 and run["metrics"][0]["mimic_loss"] == [losses[0], losses[-1]]


def test_a_float32_run_computes_in_float32(tmp_path, monkeypatch):
    # --dtype float32 (auto, on a CPU) runs without autocast: logits in float32 throughout.
    forward, dtypes = train.GPT.forward, set()
    def recorded(model, *args, **kwargs):
        logits, loss = forward(model, *args, **kwargs)
        dtypes.add(logits.dtype)
        return logits, loss
    monkeypatch.setattr(train.GPT, "forward", recorded)
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    assert dtypes == {torch.float32}


@needs_posix_signals
def test_kill_9_then_resume_reproduces_an_uninterrupted_run(tmp_path):
    flags = TINY + ["--attn", "standard,chacal", "--n_layer", "2", "--dropout", "0.1",
                    "--max_iters", "400", "--eval_interval", "20"]
    train.main(flags + ["--out_dir", str(tmp_path / "straight")])
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *flags,
                                "--out_dir", str(killed)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (killed / "metrics.jsonl").exists() or len((killed / "metrics.jsonl").read_text()
                                                         .splitlines()) < 3:
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    train.main(["--resume", "--out_dir", str(killed), "--no-progress"])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(killed / "ckpt.pt", weights_only=True)
    assert all(torch.equal(tensor, b["model"][name]) for name, tensor in a["model"].items())
    untimed = lambda path: [{k: v for k, v in json.loads(line).items() if k != "train_time"}
                            for line in open(path / "metrics.jsonl")]
    assert untimed(tmp_path / "straight") == untimed(killed)


BROKEN_CHECKPOINTS = {
    "truncated": lambda good: good[:len(good) // 2],
    "random bytes": lambda good: bytes(range(256)) * 40,
    "empty": lambda good: b"",
}


@pytest.mark.parametrize("broken", list(BROKEN_CHECKPOINTS) + ["foreign", "no rng state"])
def test_a_broken_checkpoint_is_one_line_for_resume_and_sample(tmp_path, broken, capsys):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)
    path = tmp_path / "ckpt.pt"
    if broken == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    elif broken == "no rng state":  # a model sample.py can read, but not a run to resume
        checkpoint = torch.load(path, weights_only=True)
        del checkpoint["rng"]
        torch.save(checkpoint, path)
    else:
        path.write_bytes(BROKEN_CHECKPOINTS[broken](path.read_bytes()))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(["--resume", "--out_dir", str(tmp_path)])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(path) in error[0] and "delete it" in error[0]
    assert "weights_only" not in error[0]
    if broken == "no rng state":
        return
    result = run_sample("--out_dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(path) in result.stderr


def test_resume_refuses_another_task_and_sample_refuses_a_huge_seed(tmp_path, capsys):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        train.main(["--resume", "--task", "parity", "--out_dir", str(tmp_path)])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--task parity" in error[0] and "toy" in error[0]
    for seed in ("100000000000000000000000", "1e23"):
        result = run_sample("--out_dir", str(tmp_path), "--seed", seed)
        assert result.returncode == 2 and "--seed" in result.stderr and "Traceback" not in result.stderr


def test_an_out_dir_that_cannot_hold_a_run_is_named_at_start(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for out_dir in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
        with pytest.raises(SystemExit):
            train.main(TINY + ["--out_dir", str(out_dir)])
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and "--out_dir" in error[0] and "another directory" in error[0]


def test_a_checkpoint_unpickles_nothing_but_tensors_numbers_and_strings(tmp_path):
    marker = tmp_path / "ran"
    parts = {part: {} for part in ("model", "config", "args", "optimizer", "metrics", "rng")}
    torch.save({**parts, "step": 1, "extra": OpensAFileWhenUnpickled(str(marker))},
               tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="is not a checkpoint of this train.py"):
        train.load_checkpoint(str(tmp_path))
    assert not marker.exists()


def test_a_damaged_boxes_cache_is_named_with_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags = ["--task", "boxes", "--n_train", "16", "--n_test", "4", "--n_embd", "16", "--n_head",
             "2", "--batch_size", "4", "--max_iters", "1", "--eval_interval", "1",
             "--eval_samples", "2", "--no-progress", "--device", "cpu", "--out_dir", "run"]
    train.main(flags)
    cache = next((tmp_path / "data_cache").iterdir())
    good = cache.read_bytes()
    for damage in (lambda: cache.write_bytes(good[:100]),  # cut short: torch.load fails
                   lambda: torch.save({"train": torch.zeros(5), "test": torch.zeros(5)}, cache)):  # no rows
        damage()
        capsys.readouterr()
        with pytest.raises(SystemExit):
            train.main(flags)
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and cache.name in error[0] and "delete it" in error[0], error


def test_a_run_whose_max_iters_is_no_multiple_of_eval_interval_still_ends_evaluated(tmp_path):
    # The last steps after the last regular evaluation must still be evaluated and saved.
    run = train.main(TINY + ["--max_iters", "5", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    assert [m["step"] for m in run["metrics"]] == [2, 4, 5] and run["final"]["step"] == 5
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 5


def test_weights_broken_by_the_last_step_are_never_saved(tmp_path, monkeypatch):
    # A step's loss is measured before its update: weights that update made infinite must still
    # stop the run before they replace a checkpoint.
    step = torch.optim.AdamW.step
    def breaking_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(math.inf)
        return result
    monkeypatch.setattr(torch.optim.AdamW, "step", breaking_step)
    with pytest.raises(SystemExit, match="untouched"):
        train.main(TINY + ["--max_iters", "1", "--eval_interval", "1", "--out_dir", str(tmp_path)])
    assert not (tmp_path / "ckpt.pt").exists()


def test_resume_replaces_a_longer_metrics_file_left_by_an_earlier_run(tmp_path, monkeypatch):
    # A fresh run killed between its first checkpoint and its metrics file leaves the earlier
    # run's longer file behind; resuming must not report that run's history as this one's.
    train.main(TINY + ["--max_iters", "6", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    def killed(out_dir, metrics):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "write_metrics", killed)
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--seed", "5", "--out_dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="holds step 2"):
        train.main(flags)
    monkeypatch.undo()
    summary = train.main(["--resume", "--no-progress", "--out_dir", str(tmp_path)])
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == summary["metrics"] and [m["step"] for m in lines] == [2]


def test_an_interrupted_fresh_run_names_the_step_its_checkpoint_holds(tmp_path, monkeypatch):
    # Ctrl-C after the checkpoint of step 2 must say it holds step 2, not that nothing was saved.
    interrupt_the_second_evaluation(monkeypatch)
    with pytest.raises(SystemExit, match="ckpt.pt holds step 2: add --resume"):
        train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--out_dir", str(tmp_path)])


def test_init_from_a_bidirectional_run_keeps_it_bidirectional_typed_or_not(tmp_path):
    # Only a typed --bidirectional that contradicts the saved model is an error; agreeing with
    # it, or leaving it out, takes the saved (bidirectional) model.
    lego = ["--task", "lego", "--n_vars", "4", "--attn", "standard", "--n_embd", "16", "--n_head",
            "2", "--batch_size", "4", "--eval_samples", "8", "--no-progress", "--device", "cpu"]
    train.main(lego + ["--bidirectional", "--max_iters", "1", "--eval_interval", "1",
                       "--out_dir", str(tmp_path / "pre")])
    for typed in (["--bidirectional"], []):
        _, _, config, _ = train.parse_args(lego + typed + ["--init_from", str(tmp_path / "pre"),
                                                           "--out_dir", str(tmp_path / "next")])
        assert config.causal is False


def test_init_from_a_run_with_a_longer_block_size_keeps_it(tmp_path):
    # A saved model that accepts longer sequences than the task needs can still start a run.
    train.main(TINY + ["--block_size", "32", "--max_iters", "1", "--eval_interval", "1",
                       "--out_dir", str(tmp_path / "pre")])
    _, _, config, _ = train.parse_args(TINY + ["--init_from", str(tmp_path / "pre"),
                                               "--out_dir", str(tmp_path / "next")])
    assert config.block_size == 32


def test_init_from_a_missing_nested_path_tries_no_download(tmp_path, monkeypatch, capsys):
    # A path with several slashes names a directory, never a hub model: nothing is fetched.
    def no_download(name):
        raise AssertionError(f"tried to download {name}")
    monkeypatch.setattr(train.GPT, "from_pretrained", no_download)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train.parse_args(TINY + ["--init_from", "runs/old/run1"])
    assert "no ckpt.pt there" in capsys.readouterr().err


def test_init_from_a_name_with_one_slash_is_a_hub_model(tmp_path, monkeypatch, capsys):
    # "org/name" that is no directory here is what the Hugging Face hub calls a model.
    asked = []
    def offline(name):
        asked.append(name)
        raise OSError("offline")
    monkeypatch.setattr(train.GPT, "from_pretrained", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train.parse_args(TINY + ["--init_from", "openai-community/gpt2"])
    assert asked == ["openai-community/gpt2"]
    assert "not a run directory, nor a GPT-2 that transformers can load (offline)" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--lr", "1e-3", "--min_lr", "1e-3"],
                                   ["--warmup_iters", "10", "--lr_decay_iters", "10"]])
def test_a_constant_rate_or_a_decay_ending_with_the_warmup_is_accepted(flags, tmp_path):
    # The limits of check_numbers are inclusive: min_lr = lr and lr_decay_iters = warmup_iters.
    args, *_ = train.parse_args(TINY + flags + ["--out_dir", str(tmp_path)])
    assert args.min_lr <= args.lr and args.lr_decay_iters >= args.warmup_iters


@pytest.mark.parametrize("flags, named", [(["--eval_interval", "0"], "--eval_interval"),
                                          (["--lr_decay_iters", "0", "--warmup_iters", "0"],
                                           "--lr_decay_iters")])
def test_zero_counts_are_refused_with_one_line(flags, named, capsys, tmp_path):
    # A zero evaluation interval would divide by zero at the first step.
    with pytest.raises(SystemExit) as stopped:
        train.main(TINY + flags + ["--max_iters", "2", "--out_dir", str(tmp_path)])
    error = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(error) == 1 and named in error[0]


def test_resume_of_a_model_without_positions_takes_another_block_size(tmp_path):
    # Without learned positions block_size bounds nothing the model learned: not a new model.
    flags = ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
             "--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--max_iters", "1",
             "--eval_interval", "1", "--eval_samples", "4", "--max_train_length", "6",
             "--max_test_length", "9", "--length_samples", "2", "--no-progress", "--device", "cpu",
             "--out_dir", str(tmp_path)]
    train.main(flags)
    _, _, config, _ = train.parse_args(["--resume", "--block_size", "64", "--out_dir", str(tmp_path)])
    assert config.block_size == 64


def test_train_time_leaves_out_the_time_spent_evaluating(tmp_path, monkeypatch):
    # Every evaluation "takes" 100 s on a shifted clock; none of it may count as training time.
    shift, perf_counter, evaluate = [0.0], time.perf_counter, PointerChains.evaluate
    def slow_evaluate(*args, **kwargs):
        shift[0] += 100
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(train.time, "perf_counter", lambda: perf_counter() + shift[0])
    monkeypatch.setattr(PointerChains, "evaluate", slow_evaluate)
    run = train.main(TINY + ["--max_iters", "6", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    assert all(m["train_time"] < 100 for m in run["metrics"])


def test_a_run_that_never_reaches_stop_at_acc_is_not_called_stopped(tmp_path):
    # The summary says "stopped" only when the bar was reached, not whenever one was set.
    run = train.main(TINY + ["--stop_at_acc", "1", "--max_iters", "2", "--eval_interval", "2",
                             "--out_dir", str(tmp_path)])
    assert run["final"]["eval_acc"] < 1 and run["final"]["step"] == 2
    assert "stopped" not in run["line"] and "2 steps in" in run["line"]


def test_sample_reads_a_bidirectional_model_in_one_pass(tmp_path, capsys):
    # A bidirectional model sees the whole sequence in training: read by prefixes, its answers
    # would come from inputs it never saw.
    train.main(TINY + ["--bidirectional", "--attn", "standard", "--max_iters", "2",
                       "--eval_interval", "2", "--out_dir", str(tmp_path)])
    capsys.readouterr()
    sample.main(["--out_dir", str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "16 tokens read in one pass" in out and "tokens/s" not in out


def test_a_reader_that_stops_early_ends_train_py_quietly(tmp_path):
    # `python train.py | head -1`: the next line train.py prints finds no reader. It must end
    # as Unix tools do, with no BrokenPipeError traceback, its last checkpoint whole. (200 steps:
    # so many lines that the run cannot end before the reader goes.)
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *TINY,
                                "--max_iters", "200", "--eval_interval", "2", "--out_dir",
                                str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().startswith("toy: ")
    process.stdout.close()  # as head does after its line
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1 and stderr == "", stderr
    assert 2 <= train.load_checkpoint(str(tmp_path))["step"] < 200  # stopped, not finished


def test_run_command_turns_a_ctrl_c_into_its_one_line():
    # sample.py and bench.py end a Ctrl-C with their own line through run_command.
    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as stop:
        train.run_command(interrupted, "interrupted; nothing is lost")
    assert stop.value.code == "interrupted; nothing is lost"


@needs_posix_signals
@pytest.mark.parametrize("script", ["train.py", "sample.py", "bench.py", "data.py"])
def test_a_ctrl_c_while_torch_loads_stops_a_script_without_a_traceback(script, tmp_path):
    # A stand-in torch that gets a Ctrl-C as it loads: the script stops at once and says nothing,
    # killed by SIGINT as a Unix tool is. Started with Ctrl-C ignored (as a shell script starts its
    # background jobs), it goes on ignoring it, until the stand-in ends it with its own line.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nraise SystemExit('torch loaded')\n")
    paths = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    command = dict(args=[sys.executable, os.path.join(ROOT, script)], cwd=tmp_path, capture_output=True,
                   text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    stopped = subprocess.run(**command)
    assert stopped.returncode == -signal.SIGINT and stopped.stderr == "", stopped.stderr
    ignored = subprocess.run(**command, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert ignored.returncode == 1 and ignored.stderr == "torch loaded\n", ignored.stderr


@needs_posix_signals
def test_a_ctrl_c_once_training_runs_ends_train_py_with_its_one_line(tmp_path):
    # Past the imports, run_command gives a Ctrl-C back to Python: one line, not a silent kill.
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *TINY,
                                "--max_iters", "100000", "--out_dir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("toy: ")
    process.send_signal(signal.SIGINT)
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1 and stderr.startswith("interrupted") \
        and len(stderr.splitlines()) == 1, stderr
