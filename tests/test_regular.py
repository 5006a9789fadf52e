"""The twelve regular-language tasks: labels against the plain-Python solver, and the promises
of the interface (one length per batch, one label at the end, balanced and uniform sampling)."""

import collections
import itertools
import re

import pytest
import torch

from data import Tomita, get_task

SEQUENCE_TASKS = ["even_pairs", "parity", "cycle_navigation", "modular_arithmetic"]
RECOGNITION_TASKS = ["d2", "d3", "d4", "d12", "tomita3", "tomita4", "tomita5", "tomita6"]
ALL_TASKS = SEQUENCE_TASKS + RECOGNITION_TASKS


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def all_strings(task, length):
    """Every string of input symbols of this length, as a (n, length) LongTensor."""
    ids = range(len(task.symbols))
    return torch.tensor(list(itertools.product(ids, repeat=length)), dtype=torch.long)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_labels_equal_the_solver_at_short_and_long_lengths(name):
    task = get_task(name)
    lengths = [1, 2, 3, 4, 7, task.train_lengths[-1], task.test_lengths[0], task.block_size]
    for length in lengths:
        x, y = task.sample(32, seeded(length), length=length)
        assert x.shape == y.shape == (32, length)
        assert torch.equal(y, task.solve(x)), f"{name} at length {length}"
        assert (y[:, :-1] == -1).all()
        assert (y[:, -1] >= len(task.symbols)).all() and (y[:, -1] < task.vocab_size).all()
        assert (x >= 0).all() and (x < len(task.symbols)).all()  # inputs never use class tokens
        assert torch.equal(task.chain_depth(x), torch.full_like(x, length))


@pytest.mark.parametrize("name", ALL_TASKS)
def test_interface_and_vocabulary(name):
    task = get_task(name)
    assert task.name == name
    assert task.vocab_size == len(task.vocab) == len(task.symbols) + len(task.classes)
    assert task.vocab[len(task.symbols):] == task.classes
    assert task.block_size == task.test_lengths[-1]
    assert task.test_lengths[0] == task.train_lengths[-1] + 1 and task.train_lengths[0] == 1
    expected = (40, 500) if name in SEQUENCE_TASKS else (50, 100)
    assert (task.train_lengths[-1], task.block_size) == expected
    x, y = task.sample(2, seeded(), length=5)
    assert task.decode(x[0]).count(" ") == 4
    assert task.vocab[int(y[0, -1])] in task.describe(x[0], y[0], predictions=y[0])
    assert "(right)" in task.describe(x[0], y[0], predictions=y[0])  # cycle navigation has a symbol "right"


@pytest.mark.parametrize("name", ALL_TASKS)
def test_every_symbol_and_every_class_occurs(name):
    # a class no string can have, or a symbol never drawn, would pass the solver's check
    task = get_task(name)
    x, y = task.sample(512, seeded(1), length=task.train_lengths[-1])
    assert set(x.unique().tolist()) == set(range(len(task.symbols)))
    assert set(y[:, -1].unique().tolist()) == set(range(len(task.symbols), task.vocab_size))


@pytest.mark.parametrize("name", ["parity", "d4", "modular_arithmetic"])
def test_one_length_per_batch_drawn_from_the_training_lengths_reproducibly(name):
    task = get_task(name)
    generator = seeded(3)
    lengths = [task.sample(1, generator)[0].size(1) for _ in range(200)]
    assert set(lengths) <= set(task.train_lengths)
    assert len(set(lengths)) > 0.75 * len(task.train_lengths)  # spread over the range
    a, b = task.sample(8, seeded(7)), task.sample(8, seeded(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_length_options_move_the_ranges():
    task = get_task("tomita4", max_train_length=10, max_test_length=20)
    assert task.train_lengths == range(1, 11) and task.test_lengths == range(11, 21)
    assert task.block_size == 20
    task = get_task("parity", max_train_length=100)
    assert task.test_lengths == range(101, 501)


def test_the_smallest_ranges_allowed_build_and_sample():
    task = get_task("parity", max_train_length=1, max_test_length=2, length_samples=1)
    assert task.train_lengths == range(1, 2) and task.test_lengths == range(2, 3)
    x, y = task.sample(3, seeded(), length=1)
    assert x.shape == (3, 1) and torch.equal(y, task.solve(x))
    assert task.example(seeded(), length=1)[0].shape == (1, 1)


@pytest.mark.parametrize("length", [60, 61, 100])
def test_describe_cuts_a_string_longer_than_60_to_its_first_and_last_28_symbols(length):
    task = get_task("parity")
    x, _ = task.sample(1, seeded(), length=length)
    shown = task.describe(x[0]).splitlines()[0].split(": ")[1]
    symbols = "".join(task.vocab[i] for i in x[0].tolist())
    assert shown == (symbols if length <= 60 else symbols[:28] + "…" + symbols[-28:])


@pytest.mark.parametrize("name, options, flag", [
    ("parity", dict(p_one=1.5), "--p_one"),
    ("parity", dict(p_one=0.0), "--p_one"),
    ("even_pairs", dict(max_train_length=0), "--max_train_length"),
    ("d2", dict(max_train_length=0), "--max_train_length"),
    ("tomita6", dict(max_test_length=50), "--max_test_length"),
    ("modular_arithmetic", dict(max_train_length=600), "--max_test_length"),
    ("parity", dict(p_one=1.0), "--p_one"),  # all ones: one class at every length
    ("cycle_navigation", dict(length_samples=0), "--length_samples"),
])
def test_bad_options_name_the_flag(name, options, flag):
    with pytest.raises(ValueError, match=flag):
        get_task(name, **options)


def docstring_examples():
    """Every "<task> example: tokens -> label" line in the task classes' docstrings."""
    found = set()
    for name in ALL_TASKS:
        doc = type(get_task(name)).__doc__
        found |= set(re.findall(r"(\w+) example: (.+?) -> (\S+)", doc))
    return sorted(found)


def test_docstring_worked_examples_match_the_solver():
    examples = docstring_examples()
    assert {name for name, _, _ in examples} >= set(SEQUENCE_TASKS) | {"d2", "tomita3", "tomita4",
                                                                       "tomita5", "tomita6"}
    for name, tokens, label in examples:
        task = get_task(name)
        x = torch.tensor([[task.vocab.index(token) for token in tokens.split()]])
        assert task.vocab[int(task.solve(x)[0, -1])] == label, f"{name}: {tokens}"


def test_sampled_labels_agree_with_a_slow_direct_computation():
    # A third route for the arithmetic: evaluate * first by hand, no eval, no torch.
    task = get_task("modular_arithmetic")
    x, y = task.sample(64, seeded(1), length=21)
    for row, label in zip(x.tolist(), y[:, -1].tolist()):
        words = [task.vocab[i] for i in row]
        terms, sign = [], 1
        for word in words:
            if word in "+-":
                sign = 1 if word == "+" else -1
            elif word == "*":
                sign = "*"
            elif sign == "*":
                terms[-1] *= int(word)
            else:
                terms.append(sign * int(word))
        assert task.vocab[label] == f"={sum(terms) % 5}"


def test_modular_arithmetic_is_solved_at_any_length_and_as_python_reads_it():
    task = get_task("modular_arithmetic")
    x, y = task.sample(4, seeded(), length=10001)  # past what Python's parser nests
    assert torch.equal(task.solve(x), y)
    x, y = task.sample(64, seeded(2), length=30)  # Python's precedence, where its parser reaches
    for row, label in zip(x.tolist(), y[:, -1].tolist()):
        assert task.vocab[label] == f"={eval(' '.join(task.vocab[i] for i in row)) % 5}"


def test_modular_arithmetic_layout_and_leading_plus():
    task = get_task("modular_arithmetic")
    digits, operators = torch.arange(5), torch.tensor([5, 6, 7])
    for length in (1, 2, 9, 10, 40):
        x, _ = task.sample(16, seeded(length), length=length)
        first_digit = 1 - length % 2  # even lengths start with the leading +
        if first_digit:
            assert (x[:, 0] == task.vocab.index("+")).all()
        assert torch.isin(x[:, first_digit::2], digits).all()
        assert torch.isin(x[:, 1 - first_digit::2], operators).all()
    x, _ = task.sample(512, seeded(), length=41)
    ops = x[:, 1::2].flatten().bincount(minlength=8)[5:] / x[:, 1::2].numel()
    assert (abs(ops - 1 / 3) < 0.03).all()  # + - * uniform


@pytest.mark.parametrize("p", [0.1, 0.7])
def test_parity_p_one_sets_the_fraction_of_ones(p):
    x, _ = get_task("parity", p_one=p).sample(256, seeded(), length=40)
    assert abs(x.float().mean().item() - p) < 0.02


@pytest.mark.parametrize("name", RECOGNITION_TASKS)
def test_recognition_batches_are_balanced_or_one_class(name):
    task = get_task(name)
    for length in [1, 2, 3, 4, 5, 6, 7, 8, 37, 50, 97, 100]:
        if length <= 8:  # which classes exist, by brute force over every string
            exists = set(task.solve(all_strings(task, length))[:, -1].tolist())
        else:  # D_n and T5 have no odd-length members; every other case has both classes
            no_members = length % 2 == 1 and (name.startswith("d") or name == "tomita5")
            labels = ["no"] if no_members else ["no", "yes"]
            exists = {task.vocab.index(label) for label in labels}
        x, y = task.sample(64, seeded(length), length=length)
        counts = collections.Counter(y[:, -1].tolist())
        if len(exists) == 2:
            assert list(counts.values()) == [32, 32], f"{name} at length {length}"
        else:
            assert set(counts) == exists
        members = [task.is_member("".join(task.vocab[i] for i in row))
                   for row, label in zip(x.tolist(), y[:, -1].tolist())
                   if task.vocab[label] == "yes"]
        assert all(members)


@pytest.mark.parametrize("name", RECOGNITION_TASKS)
def test_the_dfa_accepts_exactly_the_members_among_every_string_up_to_length_12(name):
    # Two routes to one language: the DFA that sample() walks, and is_member, which labels.
    task = get_task(name)
    # Tomita's accepting states are listed beside its table; D_n accepts in state 0 (depth 0)
    accepting = torch.zeros(len(task.transitions), dtype=torch.bool)
    accepting[Tomita.DFAS[task.number][1] if name.startswith("tomita") else 0] = True
    for length in range(13):
        strings = all_strings(task, length)
        state = torch.zeros(len(strings), dtype=torch.long)
        for t in range(length):
            state = task.transitions[state, strings[:, t]]
        members = [task.is_member("".join(task.symbols[i] for i in row))
                   for row in strings.tolist()]
        assert accepting[state].tolist() == members, f"{name} at length {length}"


def test_known_single_class_lengths():
    # From the RegularGPT fork's notes: T3 length 1 and T4 lengths < 3 are all positive,
    # T6 length 1 all negative.
    for name, length, label in [("tomita3", 1, "yes"), ("tomita4", 2, "yes"), ("tomita6", 1, "no")]:
        task = get_task(name)
        _, y = task.sample(16, seeded(), length=length)
        assert (y[:, -1] == task.vocab.index(label)).all()


def test_positives_and_negatives_are_uniform_on_a_small_case():
    # D_2 at length 8 has 8 members (Dyck words of depth <= 2) among the 256 strings.
    task = get_task("d2")
    every = all_strings(task, 8)
    is_yes = task.solve(every)[:, -1] == task.vocab.index("yes")
    members = {tuple(row) for row in every[is_yes].tolist()}
    assert len(members) == 8
    x, y = task.sample(16000, seeded(), length=8)
    yes = y[:, -1] == task.vocab.index("yes")
    counts = collections.Counter(map(tuple, x[yes].tolist()))
    assert set(counts) == members
    assert all(abs(n - 1000) < 150 for n in counts.values())  # 8000 draws, about 1000 each
    # Negatives: 248 non-members, 8000 draws, about 32 each; all of them show up.
    counts = collections.Counter(map(tuple, x[~yes].tolist()))
    assert len(counts) == 248 and max(counts.values()) < 70


def test_long_lengths_do_not_overflow_the_counts():
    task = get_task("d12")
    x, y = task.sample(8, seeded(), length=1200)  # 2^1200 strings: beyond float64 unscaled
    assert torch.equal(y, task.solve(x))


class EvenLengthSolver(torch.nn.Module):
    """Stands in for a model: right (via the solver) at even lengths, wrong at odd ones; records
    the shape of every batch it is asked about."""

    def __init__(self, task):
        super().__init__()
        self.task, self.shapes = task, []

    def forward(self, x, y):
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
    assert metrics["length_score"] == pytest.approx(2 / 5)  # the mean over test lengths
    tested = [shape for shape in model.shapes if shape[1] > 6]
    assert [shape[1] for shape in tested] == [7, 8, 9, 10, 11]  # each length once, in one batch
    assert all(shape[0] == 5 for shape in tested)  # length_samples strings of each


def test_long_test_lengths_are_split_into_batches_of_at_most_length_samples():
    task = get_task("parity", max_train_length=6, max_test_length=2 ** 14 + 1, length_samples=7)
    task.test_lengths = [2 ** 14 + 1]  # 2^16 tokens hold 3 such strings: batches of 3, 3, 1
    model = EvenLengthSolver(task)
    assert task.accuracy_by_length(model, seeded()) == {str(2 ** 14 + 1): 0}
    assert [shape[0] for shape in model.shapes] == [3, 3, 1]


def test_sampling_refuses_an_empty_string():
    with pytest.raises(ValueError, match="length 0"):
        get_task("parity").sample(4, seeded(), length=0)


def test_every_training_length_is_drawn_the_longest_included():
    task = get_task("even_pairs", max_train_length=6, max_test_length=9)
    generator = seeded(5)
    lengths = collections.Counter(task.sample(1, generator)[0].size(1) for _ in range(600))
    assert set(lengths) == {1, 2, 3, 4, 5, 6}
    assert min(lengths.values()) > 60  # uniform: about 100 each


def test_cycle_navigation_moves_are_uniform():
    # The docstring: left, stay and right equally likely (a walk that never goes right would
    # still be labelled right, but is not the task).
    x, _ = get_task("cycle_navigation").sample(256, seeded(), length=40)
    shares = x.flatten().bincount(minlength=3) / x.numel()
    assert (abs(shares - 1 / 3) < 0.02).all()


def test_example_is_a_fresh_string_read_whole_or_one_of_the_asked_length():
    task = get_task("d2")
    x, n_prompt = task.example(seeded(1))  # no --length: a training length, read at once
    assert x.dim() == 2 and x.size(0) == 1 and x.size(1) in task.train_lengths
    assert n_prompt == x.size(1)
    x, n_prompt = task.example(seeded(1), length=73)
    assert x.shape == (1, 73) and n_prompt == 73
    assert ((x >= 0) & (x < len(task.symbols))).all()


@pytest.mark.parametrize("name", ["d2", "tomita5"])
def test_a_batch_of_one_is_a_member_or_not_by_a_coin_flip(name):
    # sample.py draws one string: it must be able to show a member (it once never did).
    task = get_task(name)
    labels = [task.vocab[int(task.sample(1, seeded(s), length=8)[1][0, -1])] for s in range(40)]
    assert 10 <= labels.count("yes") <= 30 and labels.count("yes") + labels.count("no") == 40


def test_balanced_batches_are_shuffled():
    # Members first, then the rest, would let a label be read from a row's place in the batch.
    _, y = get_task("d2").sample(64, torch.Generator().manual_seed(0), length=10)
    labels = y[:, -1]
    assert 0 < labels.sum() and not torch.equal(labels, labels.sort(descending=True).values)
