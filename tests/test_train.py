"""train.py and sample.py as a user runs them: a CPU smoke run, exact resume, and bad input."""

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import train
from data import EOS, decode, encode, get_task, parse_answer, render_answer
from model import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--n_embd", "32", "--n_head", "2",
        "--batch_size", "8", "--eval_samples", "16", "--no-progress", "--device", "cpu"]


def run_script(script, *args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


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
                    "--lr_decay_iters", "12"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    train.main(flags + ["--max_iters", "12", "--out_dir", str(straight)])
    train.main(flags + ["--max_iters", "4", "--out_dir", str(halves)])   # "killed" at step 4
    train.main(["--resume", "--max_iters", "12", "--out_dir", str(halves), "--no-progress"])
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
    evaluate, calls = train.evaluate, []

    def interrupted_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", interrupted_second_time)
    with pytest.raises(SystemExit):
        train.main(flags + ["--out_dir", str(killed)])
    monkeypatch.setattr(train, "evaluate", evaluate)
    assert torch.load(killed / "ckpt.pt", weights_only=False)["step"] == 4
    train.main(["--resume", "--out_dir", str(killed)])
    a = torch.load(straight / "ckpt.pt", weights_only=False)
    b = torch.load(killed / "ckpt.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    drop_time = lambda path: [{k: v for k, v in json.loads(line).items() if k != "train_time"}
                              for line in open(path / "metrics.jsonl")]
    assert drop_time(straight) == drop_time(killed)


def test_flags_typed_on_resume_override_the_saved_ones(tmp_path):
    run = ["--out_dir", str(tmp_path), "--no-progress"]
    train.main(TINY[:-2] + ["--max_iters", "2", "--eval_interval", "2", "--lr", "1e-3"] + run)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["args"]
    assert saved["device"] == saved["dtype"] == "auto"  # resolved again where the run resumes
    assert saved["min_lr"] is None and saved["lr_decay_iters"] is None
    args, *_ = train.parse_args(["--resume", "--lr", "2e-3", "--max_iters", "6"] + run)
    assert args.min_lr == pytest.approx(2e-4) and args.lr_decay_iters == 6
    train.main(["--resume", "--max_iters", "4", "--beta2", "0.9", "--weight_decay", "0.1"] + run)
    groups = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.9), (0.9, 0.9)]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_resume_continues_every_seed_of_a_multi_seed_run(tmp_path, capsys):
    train.main(TINY + ["--max_iters", "4", "--eval_interval", "2", "--seeds", "2",
                       "--out_dir", str(tmp_path)])
    os.remove(tmp_path / "seed_1338" / "ckpt.pt")  # as if killed before its first checkpoint
    capsys.readouterr()
    result = train.main(["--resume", "--max_iters", "6", "--out_dir", str(tmp_path)])
    assert capsys.readouterr().out.count("resuming at step 4") == 1  # seed 1338 started over
    for seed in ["seed_1337", "seed_1338"]:
        steps = [json.loads(line)["step"] for line in open(tmp_path / seed / "metrics.jsonl")]
        assert steps == [2, 4, 6], seed
    assert len(result["scores"]) == 2


def test_a_fresh_run_stopped_early_leaves_no_checkpoint_of_an_earlier_run(tmp_path, monkeypatch):
    flags = TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)]
    train.main(flags)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "evaluate", interrupt)
    with pytest.raises(SystemExit) as stopped:
        train.main(flags)
    assert stopped.value.code == 130 and not (tmp_path / "ckpt.pt").exists()


BAD_FLAGS = [
    (["--attn", "flash"], "--attn"),
    (["--task", "chess"], "--task"),
    (["--gamma", "1.0"], "--gamma"),
    (["--gamma", "-0.1"], "--gamma"),
    (["--block_size", "64"], "--block_size"),
    (["--attn", "standard,chacal"], "--attn"),
    (["--resume", "--out_dir", "no/such/run"], "--resume"),
    (["--attn", "dilated", "--chunk", "1"], "--chunk"),
    (["--n_layer", "auto"], "--share_weights"),
    (["--n_layer", "0"], "--n_layer"),
    (["--p_one", "0.3"], "--p_one"),
    (["--task", "parity", "--p_one", "1.5"], "--p_one"),
    (["--task", "parity", "--n_blocks", "4"], "--n_blocks"),
    (["--attn", "dilated", "--bidirectional"], "--bidirectional"),
    (["--task", "boxes", "--bidirectional"], "--bidirectional"),
    (["--share_weights", "--n_layer", "4", "--min_train_layers", "6"], "--min_train_layers"),
    (["--mimic_iters", "5", "--n_head", "1"], "--mimic_iters"),
    (["--task", "lego", "--attn", "lego_v0", "--bidirectional", "--mimic_iters", "3"], "--mimic_iters"),
    (["--n_vars", "6"], "--n_vars"),
    (["--seeds", "2", "--jobs", "3"], "--jobs"),
    (["--task", "lego", "--n_vars", "30"], "--n_vars"),
    (["--n_embd", "0"], "--n_embd"),
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
    (["--resume", "--seeds", "2", "--out_dir", "no/such/runs"], "--resume"),
]


def test_the_script_prints_one_line_for_bad_input():
    result = run_script("train.py", "--gamma", "1.0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("train.py: error: --gamma 1.0 is outside [0, 1); the paper "
                                     "uses 0.9")  # the README's example, word for word


@pytest.mark.parametrize("flags, named", BAD_FLAGS)
def test_bad_flags_fail_at_start_with_one_line_naming_the_flag(flags, named, capsys):
    # In-process, as `python train.py` calls main(): any exception but argparse's exit fails here.
    with pytest.raises(SystemExit) as stopped:
        train.main(flags)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("train.py: error:") and named in error[0]


@pytest.mark.parametrize("model", [[], ["--share_weights"], ["--attn", "lego_v0"]])  # the last two
def test_sample_script_runs_a_checkpoint_with_and_without_cache(tmp_path, model):  # cannot cache
    train.main(TINY + model + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    cached = run_script("sample.py", "--out_dir", str(tmp_path), "--seed", "3")
    uncached = run_script("sample.py", "--out_dir", str(tmp_path), "--seed", "3", "--no_cache")
    assert cached.returncode == 0 and uncached.returncode == 0, cached.stderr + uncached.stderr
    assert "tokens/s" in cached.stdout
    answers = lambda out: [line for line in out.splitlines() if "model" in line]
    assert answers(cached.stdout) and answers(cached.stdout) == answers(uncached.stdout)


def test_sample_script_takes_a_prompt_and_rejects_a_bad_one(tmp_path):
    train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--out_dir", str(tmp_path)])
    prompt = "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10"  # values, then 3 blocks of pointers
    result = run_script("sample.py", "--out_dir", str(tmp_path), "--prompt", prompt)
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
    result = run_script("sample.py", "--out_dir", str(tmp_path), *length)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout and "read in one forward pass" in result.stdout


def test_bench_measures_every_section_at_a_tiny_size():
    import bench
    size = dict(n_embd=16, n_head=2)
    (t_std, _), (t_cha, _) = bench.bench_core(16, 32, 2, 8, torch.float32, "cpu", repeats=1)
    step = bench.bench_model_step("chacal", 16, 32, size, torch.float32, "cpu", repeats=1)
    tokens_per_s = bench.bench_decode("chacal", True, 8, 2, size, torch.float32, "cpu")
    assert t_std > 0 and t_cha > 0 and step[0] > 0 and tokens_per_s > 0
    lego = dict(causal=False, broadcast_ids=(0, 1))
    heads = dict(n_embd=32, n_head=4)  # four pathways of one head each cost less than 4 heads' q, k, v
    counts = {attn: bench.count_step(attn, 16, 32, heads, **lego) for attn in ["standard", "lego_v0", "lego_v1"]}
    # v0 learns no queries and keys; v1 is standard attention plus the pathways
    assert counts["lego_v0"][1] < counts["standard"][1] < counts["lego_v1"][1]
    assert counts["lego_v0"][0] < counts["lego_v1"][0] and counts["standard"][0] < counts["lego_v1"][0]
    # Softmax attention's FLOPs are counted (a fused kernel would count 0): at a fixed number of
    # tokens, a longer sequence costs more in QKᵀ and AV and the same in every other layer.
    assert bench.count_step("standard", 32, 32, heads, **lego)[0] > counts["standard"][0]


def test_boxes_run_trains_and_answers_a_typed_prompt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes data cache goes to ./data_cache
    summary = train.main(["--task", "boxes", "--n_train", "64", "--n_test", "16", "--n_layer", "2",
                          "--attn", "standard,chacal", "--n_embd", "32", "--n_head", "2",
                          "--batch_size", "4", "--max_iters", "2", "--eval_interval", "2",
                          "--eval_samples", "8", "--no-progress", "--device", "cpu",
                          "--out_dir", "run"])
    assert os.path.exists("data_cache") and 0 <= summary["final"]["eval_acc"] <= 1
    prompt = "The cup is in Box B, there is nothing in Box A. Move the contents of Box B to Box A."
    result = run_script("sample.py", "--out_dir", "run", "--prompt", prompt, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "truth : Box A contains the cup, Box B is empty." in result.stdout
    assert "exact match:" in result.stdout and "boxes right" in result.stdout and "/2;" in result.stdout
    bad = run_script("sample.py", "--out_dir", "run", "--prompt", "Juggle Box A.", cwd=tmp_path)
    assert bad.returncode == 2 and "--prompt" in bad.stderr and "Traceback" not in bad.stderr
    # Adaptive depth and LEGO attention cannot decode against a cache: their answers are written
    # by recomputing the prefix.
    for model in (["--attn", "standard", "--share_weights"], ["--attn", "lego_v0"]):
        run = train.main(["--task", "boxes", "--n_train", "64", "--n_test", "16", *model,
                          "--n_embd", "16", "--n_head", "2", "--batch_size", "4", "--max_iters", "1",
                          "--eval_interval", "1", "--eval_samples", "2", "--no-progress",
                          "--device", "cpu", "--out_dir", "nocache"])
        assert 0 <= run["final"]["eval_exact_match"] <= 1


class Oracle(torch.nn.Module):
    """Stands in for a model: logits that put all mass on the target, except where told."""

    def __init__(self, vocab_size, wrong_rows=()):
        super().__init__()
        self.vocab_size, self.wrong_rows = vocab_size, set(wrong_rows)

    def forward(self, x, y):
        logits = torch.nn.functional.one_hot(y.clamp(min=0), self.vocab_size).float()
        for row in self.wrong_rows:  # one wrong answer at the last scored position of the row
            last = (y[row] != -1).nonzero()[-1, 0]
            logits[row, last] = torch.roll(logits[row, last], 1)
        return logits, torch.tensor(0.0)


def test_evaluate_counts_whole_sequences_and_depths():
    task = get_task("toy", n_blocks=4, block_len=4)

    def evaluate(model):
        return train.evaluate(model, task, n_samples=8, batch_size=8,
                              generator=torch.Generator().manual_seed(0), device="cpu",
                              autocast=contextlib.nullcontext())

    perfect = evaluate(Oracle(task.vocab_size))
    assert perfect["eval_acc"] == 1 and perfect["eval_whole_sequences"] == 1
    flawed = evaluate(Oracle(task.vocab_size, wrong_rows=[0, 3]))  # 2 of 8 rows, 1 token each
    assert flawed["eval_whole_sequences"] == 6 / 8
    assert flawed["eval_acc_by_depth"] == {"1": 1.0, "2": 1.0, "3": 30 / 32}


def test_evaluate_scores_every_sample_asked_for(monkeypatch):
    task, sizes = get_task("toy", n_blocks=4, block_len=4), []
    sample = task.sample
    monkeypatch.setattr(task, "sample", lambda n, generator: sizes.append(n) or sample(n, generator))
    train.evaluate(Oracle(task.vocab_size), task, n_samples=20, batch_size=8,
                   generator=torch.Generator().manual_seed(0), device="cpu",
                   autocast=contextlib.nullcontext())
    assert sizes == [8, 8, 4]
    # A regular language: every training length, the samples spread evenly, n_samples in all.
    parity = get_task("parity", max_train_length=6, max_test_length=9)
    batches = train.evaluation_batches(parity, n_samples=20, batch_size=2)
    assert sorted({length for _, length in batches}) == [1, 2, 3, 4, 5, 6]
    assert sum(size for size, _ in batches) == 20 and max(size for size, _ in batches) == 2
    per_length = [sum(size for size, l in batches if l == length) for length in range(1, 7)]
    assert max(per_length) - min(per_length) <= 1


class AnswerWriter(torch.nn.Module):
    """Stands in for a model in generate(): writes each test row's true answer, with Box A's
    contents changed (emptied, or given a cup) in the rows it is told to spoil."""

    def __init__(self, task, spoiled_rows=()):
        super().__init__()
        self.config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size)
        self.rows, self.spoiled = task.rows.long(), set(spoiled_rows)

    def can_cache(self):
        return True

    def generate(self, idx, max_new_tokens, temperature, stop_token, prompt_lengths, use_cache=True):
        out = torch.zeros(idx.size(0), int(prompt_lengths.max()) + max_new_tokens, dtype=torch.long)
        for r, length in enumerate(prompt_lengths.tolist()):
            row = next(i for i in range(len(self.rows))
                       if torch.equal(self.rows[i, :length], idx[r, :length]))
            answer = self.rows[row, length:].tolist()
            answer = answer[:answer.index(EOS) + 1]
            if row in self.spoiled:
                boxes = parse_answer(decode(answer[:-1]))
                boxes["A"] = set() if boxes["A"] else {"cup"}
                answer = encode(render_answer(boxes)) + [EOS]
            out[r, :length], out[r, length:length + len(answer)] = idx[r, :length], torch.tensor(answer)
        return out


def test_answers_by_generation_are_scored_against_the_simulator(tmp_path):
    task = get_task("boxes", n_train=8, n_test=12, split="test", cache_dir=str(tmp_path))

    def evaluate(model):
        return train.evaluate_answers(model, task, n_examples=10, batch_size=4, device="cpu",
                                      autocast=contextlib.nullcontext())

    perfect = evaluate(AnswerWriter(task))
    assert perfect["eval_exact_match"] == 1 and perfect["eval_box_acc"] == 1
    spoiled = evaluate(AnswerWriter(task, spoiled_rows=[0, 5]))  # one box of seven wrong in each
    assert spoiled["eval_exact_match"] == 8 / 10 and spoiled["eval_box_acc"] == 68 / 70
    assert 0 < min(spoiled["eval_box_acc_by_depth"].values()) < 1


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
    assert "lengths 7..9" in summary["line"]


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


def test_seeds_flag_trains_each_seed_and_reports_max_and_avg(tmp_path):
    result = train.main(TINY + ["--max_iters", "2", "--eval_interval", "2", "--seeds", "2",
                                "--out_dir", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["seed_1337", "seed_1338", "seeds.json"]
    assert result["max"] == max(result["scores"]) and len(result["scores"]) == 2
    assert result["scores"] == [run["final"]["eval_acc"] for run in result["runs"]]
    assert "Max" in result["line"] and "Avg" in result["line"]


def test_runs_in_parallel_processes_equal_the_same_runs_one_after_another(tmp_path):
    # Each spawned worker gets one CPU thread; so does the sequential reference, so that both
    # sum in the same order and must agree to the last digit.
    flags = TINY + ["--max_iters", "6", "--eval_interval", "3"]
    argvs = [flags + ["--seed", str(seed), "--out_dir", str(tmp_path / "parallel" / str(seed))]
             for seed in (0, 1)]
    parallel = train.train_many(argvs, jobs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_by_one = train.train_many([argv[:-1] + [str(tmp_path / f"seq{i}")]
                                       for i, argv in enumerate(argvs)])
    finally:
        torch.set_num_threads(threads)
    def untimed(runs):
        return [[{k: v for k, v in m.items() if k != "train_time"} for m in r["metrics"]]
                for r in runs]
    assert untimed(parallel) == untimed(one_by_one)
    assert parallel[0]["final"]["eval_loss"] != parallel[1]["final"]["eval_loss"]  # two seeds
    assert "step 6:" in (tmp_path / "parallel" / "0" / "log.txt").read_text()


def test_train_many_takes_saved_runs_as_they_are_only_when_asked(tmp_path, capsys):
    flags = TINY + ["--max_iters", "4", "--eval_interval", "2"]
    finished = flags + ["--out_dir", str(tmp_path / "finished")]
    stopped = flags + ["--out_dir", str(tmp_path / "stopped")]
    first = train.main(finished)
    train.main(stopped + ["--max_iters", "2"])  # the last of a repeated flag wins
    saved = json.loads((tmp_path / "stopped" / "metrics.jsonl").read_text())
    again, resumed = train.train_many([finished, stopped], resume_saved=True)
    assert again["final"] == first["final"]  # train_time included: it did not train again
    assert [m["step"] for m in resumed["metrics"]] == [2, 4] and resumed["metrics"][0] == saved
    capsys.readouterr()
    train.train_many([finished])  # by default every run starts over
    assert "of an earlier run removed" in capsys.readouterr().out


def test_a_failed_parallel_run_names_its_log_and_cancels_the_runs_not_started(tmp_path):
    # The pool hands a few runs to its workers ahead of time, and those cannot be called back;
    # runs of a second each make sure the failure is seen long before the last ones come up.
    runs = [("bad", ["--eval_interval", "0"])] + [(f"queued{i}", []) for i in range(8)]
    argvs = [TINY + ["--max_iters", "150", "--out_dir", str(tmp_path / name)] + extra
             for name, extra in runs]
    with pytest.raises(SystemExit, match="bad"):
        train.train_many(argvs, jobs=2)
    assert "--eval_interval" in (tmp_path / "bad" / "log.txt").read_text()
    assert not (tmp_path / "queued7").exists()


def test_a_killed_parallel_run_is_named_as_killed(tmp_path):
    # A worker killed from outside (the kernel's out-of-memory killer, say) leaves no error
    # behind, only a broken pool: the message must say what most likely happened.
    argvs = [TINY + ["--max_iters", "1000000", "--out_dir", str(tmp_path / f"run{k}")]
             for k in range(2)]
    raised = []
    def train_both():
        try:
            train.train_many(argvs, jobs=2)
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
    assert raised and "died without an error" in raised[0] and "--jobs" in raised[0]


@pytest.mark.parametrize("causal", [False, True])  # a causal map is 0 on the future: no NaN from log 0
def test_mimicking_lowers_the_mimicking_loss(causal):
    torch.manual_seed(0)
    task = get_task("lego", n_vars=4)  # unlabelled LEGO sentences, as in the paper
    config = train.GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=2,
                             n_head=2, n_embd=32, attn="standard", causal=causal)
    model = train.GPT(config)
    args = train.build_parser().parse_args(["--mimic_iters", "40", "--lr", "3e-3", "--no-progress",
                                            "--batch_size", "16"])
    x, _ = task.sample(16, torch.Generator().manual_seed(1))
    before = train.mimicking_loss(model, x).item()
    train.mimic(model, task, args, torch.Generator().manual_seed(0), "cpu", contextlib.nullcontext())
    assert train.mimicking_loss(model, x).item() < 0.5 * before
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_mimicking_targets_follow_their_definitions():
    tokens = torch.tensor([[5, 7, 5, 9, 7, 5]])
    manipulation, association = train.mimicking_targets(tokens, causal=False)
    raw = torch.zeros(6, 6)
    for i in range(6):
        for j in range(6):
            raw[i, j] = {0: 4, 1: 2, 2: 1}.get(abs(i - j), 0)
    expected = (raw + 1e-3) / (raw + 1e-3).sum(dim=1, keepdim=True)
    torch.testing.assert_close(manipulation[0], expected)
    equal = torch.tensor([[float(a == b and i != j) for j, b in enumerate(tokens[0])]
                          for i, a in enumerate(tokens[0])])
    torch.testing.assert_close(association[0], (equal + 1e-3) / (equal + 1e-3).sum(1, keepdim=True))
    _, causal_association = train.mimicking_targets(tokens, causal=True)
    assert (causal_association[0].triu(1) == 0).all()
