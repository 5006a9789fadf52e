"""Tasks: labels against a brute-force solver, and the structure each task promises."""

import inspect
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import data

from conftest import ROOT, docstring_lines, run_in_process, time_limit
from data import EOS, Cycles, decode, encode, get_task, parse_answer, render_answer
from model import GPT, GPTConfig, generate_inductive


@pytest.mark.parametrize("options", [{}, dict(n_blocks=4, block_len=2), dict(n_blocks=9, block_len=5)])
def test_toy_labels_equal_the_brute_force_solver(options):
    task = get_task("toy", **options)
    x, y = task.sample(64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, task.block_size)
    assert torch.equal(y, task.solve(x))


def test_toy_solver_refuses_a_pointer_that_does_not_point_back():
    # A sampler bug that points into its own block would make a chain loop forever.
    task = get_task("toy", n_blocks=3, block_len=2, vocab_size=10)
    with pytest.raises(ValueError, match="position 3 points at 3"):
        task.solve(torch.tensor([[9, 4, 1, 3, 2, 0]]))


def test_a_test_stuck_in_a_loop_fails_in_its_time_limit():
    # conftest.py holds every test to such a limit, so a mutant that loops fails, named.
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 1 s"), time_limit(1):
        while True:
            pass
    assert time.monotonic() - started < 5


def test_toy_worked_example_from_the_docstring():
    task = get_task("toy", n_blocks=4, block_len=2, vocab_size=10)
    x = torch.tensor([[9, 4, 1, 0, 3, 2, 4, 5]])
    assert task.solve(x).tolist() == [[-1, -1, 4, 9, 9, 4, 9, 4]]
    drawn, labels = task.sample(1, torch.Generator().manual_seed(766))  # what `python data.py` shows
    assert torch.equal(drawn, x) and labels.tolist() == task.solve(x).tolist()
    assert task.decode(x[0]) == "9 4 1 0 3 2 4 5"


@pytest.mark.parametrize("name", list(data.TASKS))
def test_data_py_shows_an_example_of_any_task_with_the_solvers_answer(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # boxes and text write their data_cache/ here
    shown = data.example_with_answer(name, seed=1)
    if name == "text":  # a window of the corpus, whose continuation is the answer
        assert shown.startswith("--- prompt")
    else:  # a prompt shows the right completion and no "model :" line of an empty answer
        assert "truth" in shown and "model" not in shown


def test_data_py_command_line(tmp_path):
    script = os.path.join(ROOT, "data.py")
    shown = subprocess.run([sys.executable, script, "lego", "--seed", "2"], capture_output=True,
                           text=True, cwd=tmp_path)  # once as the command it is
    assert shown.returncode == 0 and shown.stdout.startswith("sentence: [CLS]"), shown.stderr
    assert run_in_process(data.main, "data.py", "lego", "--seed", "2").stdout == shown.stdout
    docstrings = run_in_process(data.main, "data.py").stdout.splitlines()  # no task: the docstrings' worked examples
    assert docstrings[:4] == ["block  0 values  : [9, 4]",  # PointerChains' table, row by row
                              "block  1 pointers: [1, 0]  truth [4, 9]",
                              "block  2 pointers: [3, 2]  truth [9, 4]",
                              "block  3 pointers: [4, 5]  truth [9, 4]"]
    assert not docstrings[4].startswith("block")  # four blocks, no more
    rows = ("prompt", "none", "full", "inductive")  # Cycles' example: a prompt, then each format
    shown = dict(line.split(None, 1) for line in docstring_lines(Cycles)
                 if line.startswith(tuple(f"    {row} " for row in rows)))
    prompt = shown["prompt"]
    assert docstrings[-3:] == [f"{prompt}  |  {shown['none']}", f"{prompt}  |  {shown['full']}",
                               f"{prompt} :  |  {shown['inductive'].removeprefix(': ')}"]
    for wrong, named in ((["legos"], "invalid choice: 'legos'"),
                         (["toy", "--seed", "-1"], "--seed -1 must lie in"),
                         (["--seed", "3"], "--seed 3 picks an example of a TASK"),  # not ignored
                         (["--seed", "0"], "--seed 0 picks an example of a TASK"),  # 0 too
                         (["toy", "extra"], "unrecognized arguments: extra")):
        refused = run_in_process(data.main, "data.py", *wrong)
        assert refused.returncode == 2 and refused.stdout == "", wrong
        assert refused.stderr.startswith("data.py: error: ") and named in refused.stderr, wrong
        assert len(refused.stderr.splitlines()) == 1, refused.stderr  # no usage line above it


def test_toy_blocks_permute_the_previous_block_positions():
    task = get_task("toy")
    x, y = task.sample(32, torch.Generator().manual_seed(1))
    k = task.block_len
    for b in range(1, task.n_blocks):
        pointers = x[:, b * k:(b + 1) * k].sort(dim=1).values
        assert torch.equal(pointers, torch.arange((b - 1) * k, b * k).expand(32, k))
    assert (y[:, :k] == -1).all() and (y[:, k:] >= 0).all()
    assert x.max() < task.vocab_size
    values = task.sample(1024, torch.Generator().manual_seed(2))[0][:, :k]
    assert set(values.flatten().tolist()) == set(range(task.vocab_size))  # every value is drawn


def test_toy_chain_depth_is_the_block_number():
    task = get_task("toy")
    x, _ = task.sample(2, torch.Generator().manual_seed(0))
    depth = task.chain_depth(x)
    assert depth.shape == x.shape
    assert depth[0, :8].eq(0).all() and depth[0, 8:16].eq(1).all() and depth[0, -1] == 15


def test_toy_sampling_is_deterministic_given_a_generator():
    task = get_task("toy")
    a = task.sample(4, torch.Generator().manual_seed(5))
    b = task.sample(4, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unknown_task_names_the_flag():
    with pytest.raises(ValueError, match="--task"):
        get_task("chess")


@pytest.mark.parametrize("options, flag", [(dict(n_blocks=1), "--n_blocks"),
                                           (dict(block_len=0), "--block_len")])
def test_toy_sizes_out_of_range_name_their_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        get_task("toy", **options)


def test_toy_smallest_sizes_allowed_build():
    task = get_task("toy", n_blocks=2, block_len=1)
    x, y = task.sample(3, torch.Generator().manual_seed(0))
    assert x.shape == (3, 2) and torch.equal(y, task.solve(x))


def test_a_flag_s_help_states_its_task_s_own_default():
    # "(16)" at the end of a flag's help is a promise about the task constructor's default
    stated = 0
    for name in data.TASKS:
        task_class = data.task_class(name)
        defaults = inspect.signature(task_class.__init__).parameters
        for flag, spec in task_class.flags.items():
            said = re.search(r"\(([\w.]+)(;[^()]*)?\)$", spec.get("help", ""))  # "(0.5; why)" too
            if said and defaults[flag].default is not None:
                assert str(defaults[flag].default) == said.group(1), (name, flag)
                stated += 1
    assert stated >= 10


def test_toy_example_reads_a_typed_prompt_and_names_what_is_wrong():
    task = get_task("toy", n_blocks=4, block_len=4)
    x, n_prompt = task.example(None, prompt="5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10")
    assert x.shape == (1, 16) and n_prompt == 4
    fresh, n_prompt = task.example(torch.Generator().manual_seed(0))  # a test sequence, drawn
    drawn, labels = task.sample(1, torch.Generator().manual_seed(0), split="test")
    assert torch.equal(fresh, drawn) and n_prompt == 4 and torch.equal(task.solve(fresh), labels)
    # Too short; not token ids (three ways); a pointer past the block before (twice), then below
    # it; a value that is no token id (the vocabulary is 0..15).
    for bad in ["1 2 3", "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 x", "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 ²",
                "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 " + "9" * 23, "5 9 1 0 9 2 1 0 7 5 6 4 8 9 11 10",
                "5 9 1 0 3 2 1 4 7 5 6 4 8 9 11 10", "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 5",
                "16 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10"]:
        with pytest.raises(ValueError, match="--prompt"):
            task.example(None, prompt=bad)
    for prompt in [None, "5 9 1 0 3 2 1 0 7 5 6 4 8 9 11 10"]:  # a typed prompt is no way around it
        with pytest.raises(ValueError, match="--length"):
            task.example(None, prompt=prompt, length=30)


def test_toy_describe_shows_every_block_its_truth_and_the_model_s_hits():
    task = get_task("toy", n_blocks=3, block_len=2)
    x = torch.tensor([5, 9, 1, 0, 3, 2])  # block 1 reads [9, 5]; block 2 reads block 1: [5, 9]
    y = task.solve(x[None])[0]
    predictions = y.clone()
    predictions[4] = 0
    assert task.describe(x, y, predictions).splitlines() == [
        "block  0 values  : [5, 9]",
        "block  1 pointers: [1, 0]  truth [9, 5]  model [9, 5] (2/2)",
        "block  2 pointers: [3, 2]  truth [5, 9]  model [0, 9] (1/2)"]
    assert task.describe(x, predictions=predictions).splitlines()[2].endswith("model [0, 9] (?/2)")


@pytest.mark.parametrize("scratchpad", ["none", "inductive"])
def test_a_task_s_answers_are_greedy(scratchpad):
    # sample.py and evaluate() write answers with task.generate: the argmax at every step
    task = get_task("cycles", cycle_n=3, scratchpad=scratchpad)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=1,
                          n_embd=16, n_head=2, attn="standard"))
    x, _ = task.sample(4, torch.Generator().manual_seed(0), split="test")
    prompts = torch.tensor(task.prompts(x))
    room = task.block_size - prompts.size(1)
    greedy = (generate_inductive(model, prompts, room, data.CYCLE_START, data.CYCLE_SEP,
                                 temperature=0, stop_token=task.stop_token)
              if scratchpad == "inductive" else
              model.generate(prompts, room, temperature=0, stop_token=task.stop_token))
    assert torch.equal(task.generate(model, prompts, room), greedy)


@pytest.mark.parametrize("name, typed, flag", [("lego", dict(prompt="a = + 1 ,"), "--prompt"),
                                               ("lego", dict(length=30), "--length"),
                                               ("parity", dict(length=0), "--length"),
                                               ("cycles", dict(length=30), "--length")])
def test_example_refuses_what_its_task_cannot_read_naming_the_flag(name, typed, flag):
    # sample.py hands --prompt and --length to Task.example, and prints its ValueError as one line.
    with pytest.raises(ValueError, match=f"^{flag}"):
        get_task(name).example(torch.Generator().manual_seed(0), **typed)


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


@pytest.mark.parametrize("name, options", [("toy", {}), ("lego", {}), ("lego", dict(group="s3")),
                                           ("cycles", dict(cycle_n=3, scratchpad="full")),
                                           ("parity", {}), ("tomita3", {}),
                                           ("boxes", dict(n_train=8, n_test=8, cache_dir=None))])
def test_encode_inverts_decode_and_names_a_word_outside_the_vocabulary(name, options):
    task = get_task(name, **options)
    x, _ = task.sample(4, torch.Generator().manual_seed(0), split="test")
    for row in x:
        kept = row[row != 0] if name == "boxes" else row  # boxes rows end in padding, left out
        assert torch.equal(task.encode(task.decode(row)), kept)
    with pytest.raises(ValueError, match="'zebra' is not"):
        task.encode(task.decode(x[0]) + " zebra")


@pytest.mark.parametrize("name, options", [("toy", {}), ("parity", {}), ("tomita3", {}),
                                           ("cycles", dict(cycle_n=3, test_cycle_n=5, scratchpad="inductive")),
                                           ("boxes", dict(n_train=64, n_test=8, cache_dir=None))])
def test_train_length_is_the_longest_training_row(name, options):
    # train.py sizes a step's memory by it: it must be reached, and never passed, in training
    task = get_task(name, **options)
    widths = [task.sample(16, torch.Generator().manual_seed(seed))[0].size(1) for seed in range(60)]
    assert max(widths) == task.train_length <= task.block_size
    if name in ("parity", "tomita3", "cycles"):  # they test on longer rows than they train on
        assert task.train_length < task.block_size


def test_cycles_encode_refuses_the_padding_that_decode_leaves_out():
    task = get_task("cycles", cycle_n=3)
    with pytest.raises(ValueError, match="'<pad>' is not a word"):
        task.encode("v1 <pad> > v2")


def test_evaluate_counts_whole_sequences_and_depths():
    task = get_task("toy", n_blocks=4, block_len=4)

    def evaluate(model):
        return task.evaluate(model, n_samples=8, batch_size=8,
                             generator=torch.Generator().manual_seed(0))

    perfect = evaluate(Oracle(task.vocab_size))
    assert perfect["eval_acc"] == 1 and perfect["eval_whole_sequences"] == 1
    flawed = evaluate(Oracle(task.vocab_size, wrong_rows=[0, 3]))  # 2 of 8 rows, 1 token each
    assert flawed["eval_whole_sequences"] == 6 / 8
    assert flawed["eval_acc_by_depth"] == {"1": 1.0, "2": 1.0, "3": 30 / 32}


class Lookup(torch.nn.Module):
    """Stands in for a model: fixed random logits per token id, and the model's loss, the mean
    cross-entropy over the targets that are not -1."""

    def __init__(self, vocab_size):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = 3 * torch.randn(vocab_size, vocab_size, generator=generator)

    def forward(self, x, y):
        logits = self.table[x]
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                         ignore_index=-1)


def test_eval_loss_and_accuracy_are_means_over_every_scored_token_of_all_batches():
    # Batches of 3, 1 and 5 rows with 12, 8 and 5 scored tokens: each batch's mean loss weighs
    # as many tokens as it scored, so the whole is one cross-entropy over all of them at once.
    generator = torch.Generator().manual_seed(1)
    batches = []
    for rows, scored in [(3, 4), (1, 8), (5, 1)]:
        x, y = (torch.randint(0, 4, (rows, 8), generator=generator) for _ in range(2))
        batches.append((x, y.index_fill(1, torch.arange(8 - scored), -1)))
    model = Lookup(4)
    scores = data.score_batches(model, batches, torch.zeros_like, lambda x: {})
    logits = torch.cat([model.table[x].flatten(0, 1) for x, _ in batches])
    targets = torch.cat([y.flatten() for _, y in batches])
    expected = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1)
    assert scores["eval_loss"] == pytest.approx(expected.item(), rel=1e-6)
    hits = (logits.argmax(dim=-1) == targets).sum().item()
    assert hits > 0 and scores["eval_acc"] == pytest.approx(hits / 25)


def test_evaluate_scores_every_sample_asked_for(monkeypatch):
    task, sizes = get_task("toy", n_blocks=4, block_len=4), []
    sample = task.sample
    monkeypatch.setattr(task, "sample", lambda n, generator, split: sizes.append((n, split))
                        or sample(n, generator, split))
    task.evaluate(Oracle(task.vocab_size), n_samples=20, batch_size=8,
                  generator=torch.Generator().manual_seed(0))
    assert sizes == [(8, "test"), (8, "test"), (4, "test")]
    # A regular language: every training length, the samples spread evenly, n_samples in all.
    parity = get_task("parity", max_train_length=6, max_test_length=9)
    batches = list(parity.evaluation_batches(20, 2, torch.Generator().manual_seed(0)))
    sizes = [(x.size(0), x.size(1)) for x, _ in batches]
    assert sorted({length for _, length in sizes}) == [1, 2, 3, 4, 5, 6]
    assert sum(size for size, _ in sizes) == 20 and max(size for size, _ in sizes) == 2
    per_length = [sum(size for size, l in sizes if l == length) for length in range(1, 7)]
    assert max(per_length) - min(per_length) <= 1


class AnswerWriter(torch.nn.Module):
    """Stands in for a model in generate(): writes each test row's true answer, with Box A's
    contents changed (emptied, or given a cup) in the rows it is told to spoil."""

    def __init__(self, task, spoiled_rows=()):
        super().__init__()
        self.config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size)
        self.rows, self.spoiled = task.rows["test"].long(), set(spoiled_rows)

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


def test_answers_by_generation_are_scored_against_the_simulator(tmp_path, monkeypatch):
    task = get_task("boxes", n_train=8, n_test=12, cache_dir=str(tmp_path))
    monkeypatch.setattr(data.Task, "evaluate", lambda *args, **kwargs: {})  # the answers alone

    def evaluate(model):
        metrics = task.evaluate(model, n_samples=10, batch_size=4, generator=None)
        return {k: v for k, v in metrics.items() if "exact" in k or "box" in k}

    perfect = evaluate(AnswerWriter(task))
    assert perfect["eval_exact_match"] == 1 and perfect["eval_box_acc"] == 1
    spoiled = evaluate(AnswerWriter(task, spoiled_rows=[0, 5]))  # one box of seven wrong in each
    assert spoiled["eval_exact_match"] == 8 / 10 and spoiled["eval_box_acc"] == 68 / 70
    assert 0 < min(spoiled["eval_box_acc_by_depth"].values()) < 1


def test_write_whole_gives_each_writer_of_a_file_its_own_temporary(tmp_path):
    """Two runs that build the same cache file at once (a lesson's parallel runs) must not write
    into one temporary file; a failed write leaves the file as it was and nothing beside it."""
    path = str(tmp_path / "cache.pt")

    def slow_writer(temporary):
        with open(temporary, "w") as file:
            file.write("first, ")
            file.flush()
            data.write_whole(path, lambda other: open(other, "w").write("second"))  # meanwhile
            file.write("whole")

    data.write_whole(path, slow_writer)
    assert open(path).read() == "first, whole"

    def failing_writer(temporary):
        open(temporary, "w").write("half")
        raise RuntimeError("the disk is full")

    with pytest.raises(RuntimeError):
        data.write_whole(path, failing_writer)
    assert open(path).read() == "first, whole" and [p.name for p in tmp_path.iterdir()] == ["cache.pt"]
