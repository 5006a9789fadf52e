"""Tasks: labels against brute-force solvers written apart from the samplers, the promises of the
Task interface for every task, and evaluation's arithmetic. (Boxes, LEGO and cycles: their files.)"""

import collections
import inspect
import itertools
import math
import random
import re

import numpy as np
import pytest
import torch

import data
from conftest import command
from data import TASKS, get_task
from model import GPT, GPTConfig


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """20,000 bytes of random words: every 16-byte window occurs once, so solve() can find it."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 7))) for _ in range(2000)]
    text = " ".join(rng.choice(words) for _ in range(5000))
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_bytes(text.encode()[:20_000])
    return path


SMALL = {"toy": dict(n_blocks=4, block_len=2), "lego": dict(n_vars=4), "cycles": dict(cycle_n=3),
         "boxes": dict(boxes_version="advanced", n_boxes=3, n_filled=2, n_objects=4, max_ops=2,
                       n_train=8, n_test=4, cache_dir=None),
         "box_clauses": dict(n_boxes=4, n_objects=4, max_ops=4, n_train=8, n_test=4, cache_dir=None)}


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_keeps_the_promises_of_the_interface(name, corpus):
    task = get_task(name, **SMALL.get(name, dict(data=str(corpus), context=16) if name == "text" else {}))
    for split in ("train", "test"):
        x, y = task.sample(8, seeded(1), split=split)
        assert x.shape == y.shape and x.size(1) <= task.block_size and 0 <= x.min() <= x.max() < task.vocab_size
        assert x.dtype == y.dtype == torch.long and torch.equal(task.solve(x), y)
        assert task.chain_depth(x).shape == x.shape and isinstance(task.layout(x), dict)
        again = task.sample(8, seeded(1), split=split)  # a seeded run sees the same data
        assert torch.equal(again[0], x) and torch.equal(again[1], y)
        for row in x:
            kept = row[:int((row != 0).nonzero().max()) + 1] if name in ("boxes", "box_clauses", "cycles") else row
            assert torch.equal(task.encode(task.decode(row)), kept)  # padding aside
        assert isinstance(task.describe(x[0], y[0], predictions=y[0]), str)
    assert task.needs <= {"causal", "bidirectional", "groups", "generation"}


def test_data_py_prints_a_test_example_of_a_task_with_its_labels():
    code, out, err = command("data.py", "lego", "2")
    assert code == 0 and "[CLS]" in out, err


def test_toy_worked_example_and_structure():
    task = get_task("toy", n_blocks=4, block_len=2)
    x = torch.tensor([[9, 4, 1, 0, 3, 2, 4, 5]])  # the docstring's table
    assert task.solve(x).tolist() == [[-1, -1, 4, 9, 9, 4, 9, 4]]
    assert task.chain_depth(x)[0, 2:].tolist() == [1, 1, 2, 2, 3, 3]
    task = get_task("toy")
    x, y = task.sample(32, seeded(1))
    k = task.block_len
    for b in range(1, task.n_blocks):  # each block a permutation of the positions of the one before
        assert torch.equal(x[:, b * k:(b + 1) * k].sort(dim=1).values, torch.arange((b - 1) * k, b * k).expand(32, k))
    assert (y[:, :k] == -1).all() and (y[:, k:] >= 0).all()


# The twelve regular languages.

SEQUENCE_TASKS = ["even_pairs", "parity", "cycle_navigation", "modular_arithmetic"]
RECOGNITION_TASKS = ["d2", "d3", "d4", "d12", "tomita3", "tomita4", "tomita5", "tomita6"]


def all_strings(task, length):
    """Every string of input symbols of this length, (n, length)."""
    return torch.tensor(list(itertools.product(range(len(task.symbols)), repeat=length)), dtype=torch.long)


@pytest.mark.parametrize("name", SEQUENCE_TASKS + RECOGNITION_TASKS)
def test_regular_labels_equal_the_solver_at_short_and_long_lengths(name):
    task = get_task(name)
    for length in [1, 2, 3, 7, task.train_lengths[-1], task.test_lengths[0], task.block_size]:
        x, y = task.sample(32, seeded(length), length=length)
        assert x.shape == (32, length) and torch.equal(y, task.solve(x)), length
        assert (y[:, :-1] == -1).all() and (x < len(task.symbols)).all()
        assert (y[:, -1] >= len(task.symbols)).all() and (y[:, -1] < task.vocab_size).all()
    x, y = task.sample(512, seeded(1), length=task.train_lengths[-1])  # every symbol and class occurs
    assert set(x.unique().tolist()) == set(range(len(task.symbols)))
    assert set(y[:, -1].unique().tolist()) == set(range(len(task.symbols), task.vocab_size))


@pytest.mark.parametrize("name", RECOGNITION_TASKS)
def test_the_dfa_accepts_exactly_the_members_among_every_string_up_to_length_12(name):
    # Two routes to one language: the DFA that sample() walks, and is_member, which labels.
    task = get_task(name)
    accepting = torch.zeros(len(task.transitions), dtype=torch.bool)
    accepting[data.Tomita.DFAS[task.number][1] if name.startswith("tomita") else 0] = True
    for length in range(13):
        strings = all_strings(task, length)
        state = torch.zeros(len(strings), dtype=torch.long)
        for t in range(length):
            state = task.transitions[state, strings[:, t]]
        assert accepting[state].tolist() == [task.is_member("".join(task.symbols[i] for i in row))
                                             for row in strings.tolist()], length


@pytest.mark.parametrize("name", RECOGNITION_TASKS)
def test_recognition_batches_are_balanced_where_both_classes_exist(name):
    task = get_task(name)
    for length in [1, 2, 3, 4, 5, 8, 37, 50]:
        if length <= 8:  # which classes exist, by brute force over every string
            exists = set(task.solve(all_strings(task, length))[:, -1].tolist())
        else:  # D_n and T5 have no odd-length members; every other case has both classes
            odd = length % 2 == 1 and (name.startswith("d") or name == "tomita5")
            exists = {task.vocab.index(label) for label in (["no"] if odd else ["no", "yes"])}
        _, y = task.sample(64, seeded(length), length=length)
        counts = collections.Counter(y[:, -1].tolist())
        assert (list(counts.values()) == [32, 32]) if len(exists) == 2 else (set(counts) == exists), length
    labels = task.sample(64, seeded(0), length=10)[1][:, -1]  # members first would give the label away
    assert not torch.equal(labels, labels.sort(descending=True).values)


def test_d2_draws_its_members_and_non_members_uniformly():
    task = get_task("d2")  # at length 8: 8 members (Dyck words of depth <= 2) among 256 strings
    every = all_strings(task, 8)
    members = {tuple(row) for row in every[task.solve(every)[:, -1] == task.vocab.index("yes")].tolist()}
    assert len(members) == 8
    x, y = task.sample(16000, seeded(), length=8)
    yes = y[:, -1] == task.vocab.index("yes")
    counts = collections.Counter(map(tuple, x[yes].tolist()))
    assert set(counts) == members and all(abs(n - 1000) < 150 for n in counts.values())
    counts = collections.Counter(map(tuple, x[~yes].tolist()))
    assert len(counts) == 248 and max(counts.values()) < 70
    x, y = get_task("d12").sample(8, seeded(), length=1200)  # 2^1200 strings: past float64 unscaled
    assert torch.equal(y, get_task("d12").solve(x))


def test_docstring_worked_examples_match_the_solver():
    named = set()  # "NAME example: a a b -> yes" or "NAME: a a b -> yes" in each class's docstring
    for name in SEQUENCE_TASKS + RECOGNITION_TASKS:
        task = get_task(name)
        for tokens, label in re.findall(rf"{name}(?: example)?: (.+?) -> (\S+)", inspect.getdoc(type(task))):
            x = torch.tensor([[task.vocab.index(token) for token in tokens.split()]])
            assert task.vocab[int(task.solve(x)[0, -1])] == label.rstrip(".,;)"), (name, tokens)
            named.add(name)
    assert named >= set(SEQUENCE_TASKS) | {"d2", "tomita3", "tomita4", "tomita5", "tomita6"}


def test_modular_arithmetic_by_hand_and_as_python_reads_it():
    task = get_task("modular_arithmetic")
    x, y = task.sample(64, seeded(1), length=21)
    for row, label in zip(x.tolist(), y[:, -1].tolist()):  # * first, by hand
        terms, sign = [], 1
        for word in (task.vocab[i] for i in row):
            if word in "+-*":
                sign = "*" if word == "*" else 1 if word == "+" else -1
            elif sign == "*":
                terms[-1] *= int(word)
            else:
                terms.append(sign * int(word))
        assert task.vocab[label] == f"={sum(terms) % 5}"
        assert task.vocab[label] == f"={eval(' '.join(task.vocab[i] for i in row)) % 5}"
    x, y = task.sample(4, seeded(), length=10001)  # past what Python's parser nests
    assert torch.equal(task.solve(x), y)


class EvenLengthSolver(torch.nn.Module):
    """Stands in for a model: right (the solver's label) at even lengths, wrong at odd ones."""

    def __init__(self, task):
        super().__init__()
        self.task, self.shapes = task, []

    def forward(self, x, y=None, **layout):
        self.shapes.append(tuple(x.shape))
        target = self.task.solve(x).clamp(min=0)
        if x.size(1) % 2:
            target = (target + 1) % self.task.vocab_size
        return torch.nn.functional.one_hot(target, self.task.vocab_size).float(), torch.tensor(0.0)


def test_length_scores_are_means_over_strings_of_each_test_length():
    task = get_task("parity", max_train_length=6, max_test_length=11, length_samples=5)
    model = EvenLengthSolver(task)
    metrics = task.evaluate(model, 8, 4, seeded(), final=True)
    assert metrics["length_acc"] == {"7": 0, "8": 1, "9": 0, "10": 1, "11": 0}
    assert metrics["length_score"] == pytest.approx(2 / 5)
    assert [shape for shape in model.shapes if shape[1] > 6] == [(5, n) for n in range(7, 12)]


# Evaluation's arithmetic, with stand-in models.

class Lookup(torch.nn.Module):
    """Fixed random logits per token id, and the model's loss: the mean cross-entropy over the
    targets that are not -1. Wrong on `wrong_rows` of a batch where told."""

    def __init__(self, vocab_size):
        super().__init__()
        self.table = 3 * torch.randn(vocab_size, vocab_size, generator=seeded(0))

    def forward(self, x, y=None, **layout):
        logits = self.table[x]
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)


def test_eval_loss_and_accuracy_are_means_over_every_scored_token_of_all_batches():
    # Batches of 3, 3 and 2 rows: the whole is one cross-entropy over all their tokens at once.
    task, model = get_task("toy", n_blocks=4, block_len=4), Lookup(16)
    metrics = task.evaluate(model, n_samples=8, batch_size=3, generator=seeded(4))
    generator = seeded(4)
    batches = [task.sample(n, generator, split="test") for n in (3, 3, 2)]
    logits = torch.cat([model.table[x].flatten(0, 1) for x, _ in batches])
    targets = torch.cat([y.flatten() for _, y in batches])
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1)
    assert metrics["eval_loss"] == pytest.approx(loss.item(), rel=1e-6)
    scored = targets != -1
    hits = (logits.argmax(-1) == targets)[scored]
    assert metrics["eval_acc"] == pytest.approx(hits.float().mean().item())
    depth = torch.cat([task.chain_depth(x).flatten() for x, _ in batches])[scored]
    by_depth = {str(d): hits[depth == d].float().mean().item() for d in (1, 2, 3)}
    assert metrics["eval_acc_by_depth"] == pytest.approx(by_depth)


# Text: windows of a file, bytes or GPT-2 token ids.

def test_text_windows_stay_on_their_side_and_labels_are_the_next_bytes(corpus):
    task = get_task("text", data=str(corpus), context=16)
    text = corpus.read_bytes()  # the last tenth is validation
    for split, inside in (("train", lambda at: 0 <= at and at + 17 <= 18_000), ("test", lambda at: at >= 18_000)):
        x, y = task.sample(64, seeded(0), split=split)
        assert all(inside(text.find(bytes(row))) for row in x.tolist())
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, task.solve(x))
        assert all(text.find(bytes(xr + yr[-1:])) >= 0 for xr, yr in zip(x.tolist(), y.tolist()))


def test_text_worked_example_of_the_docstring(tmp_path):
    (tmp_path / "tom.txt").write_text("Tom's cat sat." * 10)
    task = get_task("text", data=str(tmp_path / "tom.txt"), context=8)
    x = task.encode("Tom's ca")
    assert x.tolist() == [84, 111, 109, 39, 115, 32, 99, 97] and task.decode(x) == "Tom's ca"
    assert task.solve(x[None]).tolist() == [[111, 109, 39, 115, 32, 99, 97, 116]]


def test_gpt2_token_files_are_read_as_aligned_uint16(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    task = get_task("text", data=str(tmp_path / "tokens.bin"), context=32)
    x, y = task.sample(8, seeded(0))
    assert task.vocab_size == 50257 and torch.equal(y, task.solve(x))
    # The bytes of (0x0201, 0x0403) first occur straddling three other tokens (09 01 | 02 03 |
    # 04 0A, little-endian); only the aligned pair is followed by 0x0505.
    straddled = np.array([0x0109, 0x0302, 0x0A04, 0x0201, 0x0403, 0x0505] + [7] * 200, dtype=np.uint16)
    straddled.tofile(tmp_path / "straddled.bin")
    task = get_task("text", data=str(tmp_path / "straddled.bin"), context=2)
    assert task.solve(torch.tensor([[0x0201, 0x0403]])).tolist() == [[0x0403, 0x0505]]


def test_perplexity_is_exp_of_the_validation_loss_and_overflows_to_inf(corpus):
    task = get_task("text", data=str(corpus), context=16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16))
    metrics = task.evaluate(model, 64, 16, seeded())
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert 200 < metrics["eval_perplexity"] < 330  # untrained: near uniform over 256 bytes
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    metrics = task.evaluate(model, 64, 16, seeded())
    assert metrics["eval_loss"] > 709 and metrics["eval_perplexity"] == math.inf
