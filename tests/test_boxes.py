"""Boxes: the simulator against the paper's Tables 5 and 6 and hand-written cases, the generator's
rules, the splits, labels against the simulator, and answers scored as a reader would score them."""

import collections
import functools
import itertools
import random
import re

import pytest
import torch

import data
from data import (BOS, EOS, OBJECTS, PAD, SEP, VOCAB, decode, encode, generate_example, get_task,
                  parse_answer, render_answer, signature_split, simulate)

# The ChaCAL paper's appendix, Table 5 (default version) and Table 6 (advanced version).
TABLE_5_PROMPT = (
    "The radio is in Box D, the bone and the clock and the television are in Box C, the bill and "
    "the computer and the tea are in Box B, there is nothing in Box E, the ice and the plant are in "
    "Box A, the game is in Box G, there is nothing in Box F. Move the computer and the tea from Box "
    "B to Box E. Put the milk into Box A. Put the cake into Box B. Remove the computer from Box E. "
    "Move the bone and the television from Box C to Box E. Remove the radio from Box D. Remove the "
    "bill from Box B. Remove the cake from Box B. Move the contents of Box E to Box F. Put the drug "
    "and the map into Box D. Move the contents of Box G to Box D. Move the tea from Box F to Box C. "
    "Move the tea from Box C to Box B. Move the ice from Box A to Box G. Remove the tea from Box B. "
    "Move the map from Box D to Box A. Move the drug from Box D to Box E. Move the contents of Box G "
    "to Box D. Move the contents of Box E to Box D. Remove the game and the ice from Box D. Put the "
    "cake into Box G. Put the disk into Box F. Remove the clock from Box C. Remove the drug from Box "
    "D. Remove the bone from Box F. Put the bell into Box E. Put the stone into Box F. Move the "
    "contents of Box G to Box C. Move the stone and the television from Box F to Box B. Put the "
    "magazine into Box G. Remove the disk from Box F. Remove the television from Box B.")
TABLE_5_ANSWER = (
    "Box A contains the map and the milk and the plant, Box B contains the stone, Box C contains "
    "the cake, Box D is empty, Box E contains the bell, Box F is empty, Box G contains the magazine.")
TABLE_6_PROMPT = (
    "The television is in Box A, the cigarette is in Box B, the machine is in Box C, the cream is in "
    "Box H. Move the contents of Box B to Box F. Move the contents of Box F to Box E. Put the sheet "
    "into Box C. Remove the sheet from Box C. Put the coat into Box A. Remove the coat from Box A. "
    "Move the contents of Box H to Box F. Move the contents of Box E to Box G. Move the contents of "
    "Box G to Box E. Move the contents of Box A to Box D. Move the contents of Box D to Box G. Move "
    "the contents of Box C to Box D. Move the contents of Box G to Box C.")
TABLE_6_ANSWER = ("Box C contains the television, Box D contains the machine, Box E contains the "
                  "cigarette, Box F contains the cream.")
# The worked example of the Boxes docstring.
TINY_PROMPT = ("The cup is in Box B, there is nothing in Box A, the key and the map are in Box C. "
               "Move the key from Box C to Box A. Move the contents of Box B to Box C.")
TINY_ANSWER = "Box A contains the key, Box B is empty, Box C contains the cup and the map."


SMALL = dict(n_boxes=8, n_filled=2, n_objects=10, min_ops=1, max_ops=7)  # lesson 04's size


@functools.cache
def examples(version, n, small=False):
    rng = random.Random(f"test-{version}")
    return [generate_example(rng, version, **(SMALL if small else {})) for _ in range(n)]


@functools.cache
def task(version):
    return get_task("boxes", boxes_version=version, n_train=300, n_test=100, data_seed=3, cache_dir=None)


def steps(prompt):
    """(operation, boxes before, boxes after) for every operation, by simulating each prefix."""
    description, *operations = prompt.rstrip(".").split(". ")
    states = [simulate(". ".join([description, *operations[:k]]) + ".")[0] for k in range(len(operations) + 1)]
    return list(zip(operations, states[:-1], states[1:], strict=True))


def initial_signature(prompt, letters):
    """Items per box at the start, in letter order, read from the description's text."""
    boxes, _ = simulate(prompt.split(". ")[0] + ".")
    return tuple(len(boxes.get(letter, ())) for letter in letters)


def prompt_of(row):
    return decode(row[1:row.tolist().index(SEP)])


@pytest.mark.parametrize("prompt, answer, with_empty", [(TABLE_5_PROMPT, TABLE_5_ANSWER, True),
                                                        (TABLE_6_PROMPT, TABLE_6_ANSWER, False)])
def test_simulator_reproduces_the_papers_tables_5_and_6(prompt, answer, with_empty):
    boxes, _ = simulate(prompt)
    assert render_answer(boxes, with_empty) == answer
    assert decode(encode(prompt)) == prompt and decode(encode(answer)) == answer
    assert len(encode(TABLE_5_PROMPT)) + len(encode(TABLE_5_ANSWER)) == 388
    # Table 6: the cigarette rode B->F->E->G->E, the television A->D->G->C; empty boxes are 0
    assert simulate(TABLE_6_PROMPT)[1] == dict(A=0, B=0, C=3, D=1, E=4, F=1, G=0, H=0)


def test_simulator_on_hand_written_cases():
    boxes, depth = simulate(TINY_PROMPT)
    assert render_answer(boxes) == TINY_ANSWER and depth == dict(A=0, B=0, C=1)  # the key is named by its move
    boxes, depth = simulate("There is nothing in Box A, the egg is in Box B. Put the fan and the map into "
                            "Box A. Remove the map from Box A. Move the contents of Box A to Box B. Put "
                            "the map into Box A.")
    assert boxes == dict(A={"map"}, B={"egg", "fan"}) and depth == dict(A=0, B=1)
    # A sentence that names an item, a move or a put, starts its chain again.
    _, depth = simulate("The egg is in Box A, there is nothing in Box B, there is nothing in Box C. "
                        "Move the contents of Box A to Box B. Move the egg from Box B to Box C.")
    assert depth == dict(A=0, B=0, C=0)
    for impossible in ("The egg is in Box A. Remove the fan from Box A.", "The egg is in Box A. Shake Box A."):
        with pytest.raises(ValueError):  # no right answer to score
            simulate(impossible)


def test_default_generator_follows_the_rules():
    orders, counts, put_sizes, moves = set(), [], [], []
    for prompt, answer in examples("default", 60):
        assert render_answer(simulate(prompt)[0]) == answer and decode(encode(prompt)) == prompt
        letters = [clause[-1] for clause in prompt.split(". ")[0].split(", ")]
        assert sorted(letters) == list("ABCDEFG")
        orders.add("".join(letters))
        counts += initial_signature(prompt, "ABCDEFG")
        operations = steps(prompt)
        assert len(operations) == 32
        for op, before, after in operations:
            assert all(len(items) <= 3 for items in after.values()), op
            if op.startswith("Move"):  # "Move the contents" exactly when the move empties the box
                source = op.split("Box ")[1][0]
                assert before[source] and op.startswith("Move the contents of") == (not after[source]), op
                moves.append(op.startswith("Move the contents of"))
            if op.startswith("Put"):
                put_sizes.append(len(after[op[-1]]) - len(before[op[-1]]))
    assert len(orders) > 50 and max(counts) == 3 and 0 in counts and 1.5 < sum(counts) / len(counts) < 2.1
    # Kim & Schuster's draws: a put of Poisson(1) items (>= 1): mostly one; a move keeps each
    # item with probability 1/2, so about half the moves take everything.
    assert 0.6 < put_sizes.count(1) / len(put_sizes) < 0.85 and 0.4 < sum(moves) / len(moves) < 0.65


def test_advanced_generator_follows_the_rules():
    n_ops, filled, targets, free_moves = [], [], [], []
    for prompt, answer in examples("advanced", 300):
        assert render_answer(simulate(prompt)[0], with_empty=False) == answer
        clauses = prompt.split(". ")[0].split(", ")
        assert len(clauses) == 4 and all(" is in Box " in clause for clause in clauses)
        filled += [clause[-1] for clause in clauses]
        assert filled[-4:] == sorted(filled[-4:])  # in letter order, as Table 6
        operations = steps(prompt)
        n_ops.append(len(operations))
        k = 0
        while k < len(operations):
            op, _, after = operations[k]
            assert all(len(items) <= 2 for items in after.values()) and set(after) <= set("ABCDEFGH")
            if len(operations) - k >= 3:  # a free draw: a move 3 times in 4, else a put/remove pair
                free_moves.append(op.startswith("Move"))
            if op.startswith("Move"):
                assert op.startswith("Move the contents of") and sum(map(bool, after.values())) == 4, op
                targets.append(op[-1])
                k += 1
            else:  # a put is undone by the very next operation
                assert operations[k + 1][0] == op.replace("Put", "Remove").replace("into", "from")
                k += 2
    for chosen in (filled, targets):  # every box as likely as the others
        shares = collections.Counter(chosen)
        assert all(0.08 < shares[letter] / len(chosen) < 0.17 for letter in "ABCDEFGH"), shares
    assert min(n_ops) == 1 and 25 <= max(n_ops) <= 31 and 0.12 < n_ops.count(1) / len(n_ops) < 0.3  # log-uniform
    assert 0.72 < sum(free_moves) / len(free_moves) < 0.78


def test_small_advanced_answers_need_the_chain():
    lengths, depths = [], []
    for prompt, answer in examples("advanced", 400, small=True):
        assert render_answer(simulate(prompt)[0], with_empty=False) == answer
        assert set(re.findall(r"the (\w+)", prompt)) - {"contents"} <= set(OBJECTS[:10])
        lengths.append(len(encode(prompt)) + len(encode(answer)) + 3)
        boxes, depth = simulate(prompt)
        depths += [depth[box] for box in boxes if boxes[box]]
    assert max(lengths) < 128 and 15 < sum(lengths) / len(lengths) < 90
    share = collections.Counter(depths)
    assert share[0] > 80 and share[1] > 80 and share[2] > 32 and sum(n for d, n in share.items() if d >= 3) > 16
    # With one filled box the answer's box is the last move's destination: nothing to follow.
    rng = random.Random("one filled box")
    for _ in range(100):
        prompt, answer = generate_example(rng, "advanced", **{**SMALL, "n_filled": 1})
        last = (re.findall(r"is in Box (\w)", prompt) + re.findall(r"to Box (\w)", prompt))[-1]
        assert re.findall(r"Box (\w) contains", answer) == [last]


@pytest.mark.parametrize("version", ["default", "advanced"])
def test_train_and_test_never_share_an_initial_signature(version):
    letters = "ABCDEFGH" if version == "advanced" else "ABCDEFG"
    seen = {split: {initial_signature(prompt_of(row), letters) for row in task(version).rows[split]}
            for split in ("train", "test")}
    train, test = signature_split(version, seed=3)
    assert seen["train"] <= train and seen["test"] <= test and not train & test
    every = ({s for s in itertools.product((0, 1), repeat=8) if sum(s) == 4} if version == "advanced"
             else set(itertools.product(range(4), repeat=7)))
    assert train | test == every
    x, _ = task(version).sample(64, torch.Generator().manual_seed(0), split="test")  # evaluation reads its split
    assert {initial_signature(prompt_of(row), letters) for row in x} <= test


@pytest.mark.parametrize("version", ["default", "advanced"])
def test_labels_are_the_answer_only_and_equal_the_simulators(version):
    t = task(version)
    x, y = t.sample(32, torch.Generator().manual_seed(0))
    assert x.size(1) == int((x != PAD).sum(1).max()) <= t.block_size  # trimmed to the longest row
    assert all((rows == EOS).any(1).all() for rows in t.rows.values())  # no example was cut
    positions = torch.arange(x.size(1))
    sep, eos = ((x == token).int().argmax(1, keepdim=True) for token in (SEP, EOS))
    answer = (positions >= sep) & (positions < eos)
    assert (x[:, 0] == BOS).all() and (y[~answer] == -1).all()
    assert torch.equal(y[:, :-1][answer[:, :-1]], x[:, 1:][answer[:, :-1]]) and torch.equal(t.solve(x), y)
    depth = t.chain_depth(x)
    assert torch.equal(depth == -1, y == -1) and depth.max() > (3 if version == "advanced" else 0)


def test_docstring_example_labels_and_chain_depth():
    answer = encode(TINY_ANSWER) + [EOS]
    x = torch.tensor([[BOS, *encode(TINY_PROMPT), SEP, *answer]])
    sep = len(encode(TINY_PROMPT)) + 1
    y, depth = task("default").solve(x)[0], task("default").chain_depth(x)[0]
    assert y[sep:-1].tolist() == answer and (y[:sep] == -1).all() and y[-1] == -1
    clause_box = "A" * 6 + "B" * 5 + "C" * 10  # "Box A contains the key ," ... "map . <eos>"
    assert depth[sep:-1].tolist() == [dict(A=0, B=0, C=1)[b] for b in clause_box]


def test_answers_are_scored_by_their_deepest_box_and_box_by_box():
    t = task("advanced")
    truths = [t.prompt_and_answer(i)[1] for i in range(40)]
    swapped = [re.sub(r"the (\w+)(.*)the (\w+)", r"the \3\2the \1", a) for a in truths]
    answers = [s if i % 3 == 0 else a for i, (a, s) in enumerate(zip(truths, swapped))]
    exact, boxes = {}, {}  # the reference, answer by answer and box by box
    for i, answer in enumerate(answers):
        depth = simulate(decode(t.prompt_and_answer(i)[0][1:-1].tolist()))[1]
        stated, truth = parse_answer(answer), parse_answer(truths[i])
        exact.setdefault(max(depth[b] for b in truth), []).append(answer == truths[i])
        for b in truth:
            boxes.setdefault(depth[b], []).append(stated[b] == truth[b])
    scores = t.score_answers(answers)
    assert scores["eval_exact_match"] == sum(a == b for a, b in zip(answers, truths)) / 40 < 1
    assert scores["eval_exact_match_by_depth"] == {str(d): sum(v) / len(v) for d, v in sorted(exact.items())}
    assert scores["eval_box_acc_by_depth"] == {str(d): sum(v) / len(v) for d, v in sorted(boxes.items())}
    truth = truths[0]  # case, order and the final "." count, for exact match; boxes are read box by box
    reordered = ", ".join(reversed(truth[:-1].split(", "))) + "."
    for written, exact, boxes in ((truth, 1, 1), (truth.lower(), 0, 0), (truth[:-1], 0, 1), (reordered, 0, 1)):
        scores = t.score_answers([written])
        assert (scores["eval_exact_match"], scores["eval_box_acc"]) == (exact, boxes), written


class SimulatorModel(torch.nn.Module):
    """Stands in for a GPT: generate() writes the simulator's answer after each prompt, spoiled
    (Box A's contents changed) in the prompts whose token ids sum to an odd number."""

    config = type("Config", (), {"block_size": 128, "abilities": lambda: {"causal", "cache"}})

    @staticmethod
    def right(prompt):
        return sum(prompt) % 2 == 0

    def forward(self, x, y=None, **layout):  # teacher-forced: right everywhere
        return torch.nn.functional.one_hot(y.clamp(min=0), len(VOCAB)).float(), torch.tensor(0.0)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, stop_token=None,
                 prompt_lengths=None, **options):
        rows = []
        for prompt, length in zip(prompts.tolist(), prompt_lengths.tolist()):
            boxes = simulate(decode(prompt[1:length - 1]))[0]
            if not self.right(prompt[:length]):
                boxes["A"] = set() if boxes.get("A") else {"cup"}
            rows.append(torch.tensor(prompt[:length] + encode(render_answer(boxes, with_empty=False)) + [EOS, PAD]))
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def test_evaluation_writes_answers_to_the_test_prompts_and_scores_them():
    t = task("advanced")
    metrics = t.evaluate(SimulatorModel(), 30, 8, torch.Generator())
    right = sum(SimulatorModel.right(t.prompt_and_answer(i)[0].tolist()) for i in range(30)) / 30
    assert 0 < right < 1 and metrics["eval_exact_match"] == pytest.approx(right)


def test_dataset_is_cached_once_and_reused(tmp_path, monkeypatch):
    options = dict(boxes_version="default", n_train=40, n_test=10, data_seed=1, cache_dir=str(tmp_path))
    first = get_task("boxes", **options)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(data, "generate_example", lambda *args, **kwargs: pytest.fail("generated again"))
    assert torch.equal(first.rows["train"], get_task("boxes", **options).rows["train"])
    for changed in (dict(data_seed=2), dict(n_boxes=5, n_objects=20)):  # a new seed or size: a new file
        with pytest.raises(BaseException, match="generated again"):
            get_task("boxes", **{**options, **changed})


def test_box_clauses_labels_and_depths_equal_the_simulators_on_1000_prompts(tmp_path):
    t = get_task("box_clauses", n_train=1, n_test=1000, n_objects=10, min_ops=4, max_ops=31,
                 cache_dir=str(tmp_path))
    x, y = t.clause_rows["test"]
    assert torch.equal(t.solve(x), y) and torch.equal((t.chain_depth(x) == -1), y == -1)
    depths = t.chain_depth(x)
    for r, row in enumerate(t.rows["test"].tolist()):
        prompt = decode(row[1:row.index(SEP)])
        description, *operations = prompt.rstrip(".").split(". ")
        expected = []  # (item, depth) the simulator gives each move's target, then each query
        for k, op in enumerate(operations):
            if op.startswith("Move the contents"):
                boxes, box_depth = simulate(". ".join([description, *operations[:k + 1]]) + ".")
                expected.append((*boxes[op[-1]], box_depth[op[-1]]))
        boxes, box_depth = simulate(prompt)
        expected += [(*boxes[b], box_depth[b]) for b in sorted(boxes) if boxes[b]]
        scored = y[r] != -1
        got = [(t.vocab[i], d) for i, d in zip(y[r][scored].tolist(), depths[r][scored].tolist())]
        assert got == expected, prompt
    counts = collections.Counter(depths[y != -1].tolist())
    assert all(counts[d] >= 50 for d in range(1, 9)), counts  # the lesson's depths 1..8
