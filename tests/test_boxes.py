"""Boxes: the generator's rules, the simulator against the paper's examples, tokens, splits, cache."""

import collections
import functools
import itertools
import random
import re
import subprocess
import sys

import pytest
import torch

import data
from conftest import ROOT, OpensAFileWhenUnpickled
from data import (BOS, EOS, OBJECTS, PAD, SEP, TOKEN_IDS, VOCAB, box_sizes, decode, encode, generate_example,
                  get_task, parse_answer, render_answer, signature_split, simulate)


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


# A small advanced version, the size a CPU trains in minutes (lesson 4, the README).
SMALL = dict(n_boxes=8, n_filled=2, n_objects=10, min_ops=1, max_ops=7)


@functools.cache
def examples(version, n, small=False):
    rng = random.Random(f"test-{version}")
    return [generate_example(rng, version, **(SMALL if small else {})) for _ in range(n)]


@functools.cache
def task(version):
    return get_task("boxes", boxes_version=version, n_train=300, n_test=100, data_seed=3,
                    cache_dir=None)


def steps(prompt):
    """(operation, boxes before, boxes after) for every operation, by simulating each prefix."""
    description, *operations = prompt.rstrip(".").split(". ")
    prefixes = [". ".join([description, *operations[:k]]) + "." for k in range(len(operations) + 1)]
    states = [simulate(prefix)[0] for prefix in prefixes]
    return list(zip(operations, states[:-1], states[1:], strict=True))


def initial_signature(prompt, letters):
    """Items per box, in letter order, read from the description's text."""
    boxes, _ = simulate(prompt.split(". ")[0] + ".")
    return tuple(len(boxes.get(letter, ())) for letter in letters)


def test_vocabulary_is_fixed_sorted_and_small():
    assert len(VOCAB) <= 132 and len(set(VOCAB)) == len(VOCAB)
    assert VOCAB[:4] == ["<pad>", "<bos>", "<sep>", "<eos>"] and VOCAB[4:] == sorted(VOCAB[4:])
    assert len(set(OBJECTS)) == 100 and set(OBJECTS) <= set(VOCAB)


@pytest.mark.parametrize("prompt, answer, with_empty", [(TABLE_5_PROMPT, TABLE_5_ANSWER, True),
                                                        (TABLE_6_PROMPT, TABLE_6_ANSWER, False)])
def test_simulator_reproduces_the_papers_tables_5_and_6(prompt, answer, with_empty):
    boxes, _ = simulate(prompt)
    assert render_answer(boxes, with_empty) == answer
    assert decode(encode(prompt)) == prompt and decode(encode(answer)) == answer


def test_table_5_is_388_tokens_and_table_6_has_reference_chains():
    assert len(encode(TABLE_5_PROMPT)) + len(encode(TABLE_5_ANSWER)) == 388
    _, depth = simulate(TABLE_6_PROMPT)
    # the cigarette rode B->F->E->G->E, the television A->D->G->C; empty boxes are 0
    assert depth == dict(A=0, B=0, C=3, D=1, E=4, F=1, G=0, H=0)


@pytest.mark.parametrize("prompt, error", [
    (".", "cannot read the description clause ''"),
    (". Move the contents of Box A to Box B.", "cannot read the description clause ''"),
    ("The cup is in Box A, the cup is in Box B.", "'the cup is in Box B' names an item already in a box"),
    ("The cup is in Box A, the key is in Box A.", "says twice what is in Box A"),
    ("The cup is in Box A, there is nothing in Box A.", "says twice what is in Box A"),
])
def test_simulator_refuses_a_description_with_no_single_answer(prompt, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        simulate(prompt)


def test_simulator_on_hand_written_cases():
    boxes, depth = simulate(TINY_PROMPT)
    assert render_answer(boxes) == TINY_ANSWER
    assert depth == dict(A=0, B=0, C=1)  # the key is named by its move; the cup is not
    boxes, depth = simulate("There is nothing in Box A, the egg is in Box B. Put the fan and the "
                            "map into Box A. Remove the map from Box A. Move the contents of Box "
                            "A to Box B. Put the map into Box A.")
    assert boxes == dict(A={"map"}, B={"egg", "fan"}) and depth == dict(A=0, B=1)
    # A sentence that names an item, a move or a put, starts its chain again.
    _, depth = simulate("The egg is in Box A, there is nothing in Box B, there is nothing in Box C. "
                        "Move the contents of Box A to Box B. Move the egg from Box B to Box C.")
    assert depth == dict(A=0, B=0, C=0)
    _, depth = simulate("The egg is in Box A, there is nothing in Box B. Move the contents of Box A "
                        "to Box B. Remove the egg from Box B. Put the egg into Box A.")
    assert depth == dict(A=0, B=0)
    for bad, error in [("Remove the fan from Box A", "takes what is not in Box A"),  # not in it
                       ("Remove the egg and the fan from Box A", "takes what is not in Box A"),  # partly
                       ("Put the egg into Box B", "puts an item that is already in a box"),
                       ("Move the contents of Box B to Box A", "takes what is not in Box B"),  # nothing
                       ("Shake Box A", "cannot read the operation 'Shake Box A'")]:
        with pytest.raises(ValueError, match=re.escape(error)):
            simulate(f"The egg is in Box A. {bad}.")


def test_default_generator_follows_the_rules():
    seen_orders, counts, put_sizes, moves = set(), [], [], []
    for prompt, _ in examples("default", 40):
        clauses = prompt.split(". ")[0].split(", ")
        letters = [clause[-1] for clause in clauses]
        assert sorted(letters) == list("ABCDEFG")
        seen_orders.add("".join(letters))
        counts += initial_signature(prompt, "ABCDEFG")
        operations = steps(prompt)
        assert len(operations) == 32
        for op, before, after in operations:
            assert all(len(items) <= 3 for items in after.values()), op
            if op.startswith("Move"):
                source = op.split("Box ")[1][0]
                # "Move the contents" exactly when the move empties the box.
                assert op.startswith("Move the contents of") == (not after[source]), op
                assert before[source]
                moves.append((op.startswith("Move the contents of"), len(after[op[-1]])))
            if op.startswith("Put"):
                put_sizes.append(len(after[op[-1]]) - len(before[op[-1]]))
    assert len(seen_orders) > 30  # the description order is shuffled
    assert max(counts) == 3 and 0 in counts and 1.5 < sum(counts) / len(counts) < 2.1
    # Kim & Schuster's draws: a put of Poisson(1) items (>= 1, room allowing): mostly one; a move
    # keeps each item with probability 1/2, so about half the moves take everything; a move may
    # fill its target to the 3 items a box holds.
    assert 0.6 < put_sizes.count(1) / len(put_sizes) < 0.85 and max(put_sizes) == 3
    assert 0.4 < sum(whole for whole, _ in moves) / len(moves) < 0.65
    assert any(size == 3 for _, size in moves)


def test_a_move_keeps_each_item_with_probability_one_half_redrawing_nothing():
    # Kim & Schuster's rule: given two items, {a}, {b} and {a, b} each come a third of the time
    rng = random.Random(0)
    draws = collections.Counter(frozenset(data._nonempty_subset(rng, {"cup", "key"}))
                                for _ in range(6000))
    assert set(draws) == {frozenset({"cup"}), frozenset({"key"}), frozenset({"cup", "key"})}
    assert all(abs(count / 6000 - 1 / 3) < 0.03 for count in draws.values()), draws


def test_advanced_generator_follows_the_rules():
    n_ops, letters, filled, targets = [], set(), [], []
    for prompt, _ in examples("advanced", 300):
        clauses = prompt.split(". ")[0].split(", ")
        assert len(clauses) == 4 and all(" is in Box " in clause for clause in clauses)
        filled += [clause[-1] for clause in clauses]
        assert filled[-4:] == sorted(filled[-4:])  # in letter order, as Table 6
        operations = steps(prompt)
        n_ops.append(len(operations))
        for k, (op, _, after) in enumerate(operations):
            letters |= set(after)
            assert not op.startswith("Move") or op.startswith("Move the contents of"), op
            if op.startswith("Put"):  # undone by the very next operation
                assert operations[k + 1][0] == op.replace("Put", "Remove").replace("into", "from")
            if op.startswith("Move"):
                assert sum(bool(items) for items in after.values()) == 4
                targets.append(op[-1])
            assert all(len(items) <= 2 for items in after.values())
    assert letters == set("ABCDEFGH")
    for chosen in (filled, targets):  # every box as likely as the others, the last one too
        shares = collections.Counter(chosen)
        assert all(0.08 < shares[letter] / len(chosen) < 0.17 for letter in "ABCDEFGH"), shares
    assert min(n_ops) == 1 and max(n_ops) <= 31 and max(n_ops) >= 25
    assert 0.12 < n_ops.count(1) / len(n_ops) < 0.3  # log-uniform: P(1) = 0.2


def test_advanced_operations_are_moves_three_times_in_four():
    # Each draw is a move or a put/remove pair, a move with probability 3/4. Only draws made with
    # 3 or more operations left are free: with one left a move is forced, and with two a pair
    # ends the prompt. Those free draws must be moves 3/4 of the time.
    moves = []
    for prompt, _ in examples("advanced", 600):
        operations = prompt.rstrip(".").split(". ")[1:]
        k = 0
        while k < len(operations):
            is_move = operations[k].startswith("Move")
            if len(operations) - k >= 3:
                moves.append(is_move)
            k += 1 if is_move else 2
    assert len(moves) > 2500 and 0.72 < sum(moves) / len(moves) < 0.78, sum(moves) / len(moves)


@pytest.mark.parametrize("version", ["default", "advanced"])
def test_generator_answers_equal_the_simulator_and_tokens_round_trip(version):
    for prompt, answer in examples(version, 100 if version == "default" else 300):
        assert render_answer(simulate(prompt)[0], with_empty=version == "default") == answer
        assert decode(encode(prompt)) == prompt and decode(encode(answer)) == answer
    with pytest.raises(ValueError, match="'unicorn' is not a word of this task"):
        encode("Put the unicorn into Box A.")


def test_generator_is_deterministic_given_its_rng():
    a = generate_example(random.Random(7))
    assert a == generate_example(random.Random(7)) != generate_example(random.Random(8))


def test_a_split_the_draw_cannot_meet_is_refused_not_redrawn_forever():
    # e.g. a generator that ignored --n_filled while the split followed it
    with pytest.raises(RuntimeError, match="the split and the draw disagree"):
        generate_example(random.Random(0), "advanced", {(1, 1, 0)}, n_boxes=3, n_filled=1, n_objects=4)


@pytest.mark.parametrize("version", ["default", "advanced"])
def test_train_and_test_never_share_an_initial_signature(version):
    seen, letters = {}, "ABCDEFGH" if version == "advanced" else "ABCDEFG"
    for split in ("train", "test"):
        rows = task(version).rows[split]
        seen[split] = {initial_signature(decode(row[1:row.tolist().index(SEP)]), letters)
                       for row in rows}
    assert seen["train"] and seen["test"] and not seen["train"] & seen["test"]
    train, test = signature_split(version, seed=3)
    assert seen["train"] <= train and seen["test"] <= test and not train & test
    every = ({s for s in itertools.product((0, 1), repeat=8) if sum(s) == 4} if version == "advanced"
             else set(itertools.product(range(4), repeat=7)))  # 0..3 items in each of 7 boxes
    assert train | test == every
    if version == "default":
        assert 3 in {count for signature in seen["train"] for count in signature}
    for split, half in (("train", train), ("test", test)):  # what evaluation reads is its split's
        x, _ = task(version).sample(64, torch.Generator().manual_seed(0), split=split)
        assert {initial_signature(decode(row[1:row.tolist().index(SEP)]), letters) for row in x} <= half


@pytest.mark.parametrize("version", ["default", "advanced"])
def test_sample_scores_only_the_answer_and_matches_the_solver(version):
    t = task(version)
    x, y = t.sample(32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape and x.size(0) == 32 and x.size(1) <= t.block_size
    longest = max(int((rows != PAD).sum(1).max()) for rows in t.rows.values())
    assert t.block_size % 64 == 0 and t.block_size - 64 < longest <= t.block_size  # rounded up
    assert all((rows == EOS).any(1).all() for rows in t.rows.values())  # no example was cut
    assert x.dtype == y.dtype == torch.long and t.vocab_size == len(VOCAB) and x.max() < t.vocab_size
    positions = torch.arange(x.size(1))
    sep = (x == SEP).int().argmax(1, keepdim=True)
    eos = (x == EOS).int().argmax(1, keepdim=True)
    answer = (positions >= sep) & (positions < eos)
    assert (x[:, 0] == BOS).all() and (y[~answer] == -1).all()
    assert torch.equal(y[:, :-1][answer[:, :-1]], x[:, 1:][answer[:, :-1]])
    assert torch.equal(t.solve(x), y)
    depth = t.chain_depth(x)
    assert torch.equal(depth == -1, y == -1) and depth.max() > (3 if version == "advanced" else 0)
    a, b = t.sample(4, torch.Generator().manual_seed(5)), t.sample(4, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batches_are_trimmed_to_their_longest_row():
    t = task("advanced")
    x, y = t.sample(8, torch.Generator().manual_seed(1))
    longest = int((x != PAD).sum(1).max())
    assert x.size(1) == longest < t.block_size and (x[:, -1] != PAD).any()
    assert torch.equal(t.solve(x), y)  # nothing scored was cut


def test_answers_are_scored_whole_and_box_by_box():
    t = task("default")
    prompt = torch.tensor([BOS, *encode(TINY_PROMPT), SEP])
    assert parse_answer(TINY_ANSWER) == {"A": {"key"}, "B": set(), "C": {"cup", "map"}}
    assert parse_answer("Box A contains the key, Box A is empty.") == {"A": set()}  # the last counts
    assert t.score_answer(prompt, TINY_ANSWER) == (True, [(0, True), (0, True), (1, True)])
    wrong_c = "Box A contains the key, Box B is empty, Box C contains the cup."
    assert t.score_answer(prompt, wrong_c) == (False, [(0, True), (0, True), (1, False)])
    garbled = "Box A contains the key, Box B Box, the map"  # B unreadable, C missing
    assert t.score_answer(prompt, garbled) == (False, [(0, True), (0, False), (1, False)])
    assert t.score_answer(prompt, TINY_ANSWER[:-1])[0] is False  # no final period: not exact
    reordered = "Box C contains the map and the cup, Box B is empty, Box A contains the key."
    assert t.score_answer(prompt, reordered) == (False, [(0, True), (0, True), (1, True)])
    # The advanced version names only filled boxes: an empty box is not scored.
    advanced = task("advanced")
    assert advanced.score_answer(prompt, "Box A contains the key, Box C contains the cup and "
                                 "the map.") == (True, [(0, True), (1, True)])


class SimulatorModel:
    """Stands in for a GPT in write_answers: it writes the simulator's answer after each prompt."""

    config = type("Config", (), {"block_size": 128})

    def can_cache(self):
        return True

    def generate(self, prompts, max_new_tokens, temperature, use_cache, stop_token, prompt_lengths):
        # Exact match scores greedy answers, written until <eos> or the end of the block.
        assert temperature == 0 and stop_token == EOS and use_cache
        assert int(prompt_lengths.max()) + max_new_tokens == self.config.block_size
        rows = []
        for prompt, length in zip(prompts.tolist(), prompt_lengths.tolist()):
            answer = render_answer(simulate(decode(prompt[1:length - 1]))[0], with_empty=False)
            rows.append(torch.tensor(prompt[:length] + encode(answer) + [EOS, PAD, PAD]))
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def test_written_answers_follow_the_test_prompts_in_order():
    t = task("advanced")
    answers = t.write_answers(SimulatorModel(), n=5, batch_size=2)  # batches of 2, 2 and 1
    assert answers == [t.prompt_and_answer(i)[1] for i in range(5)]
    assert all(t.score_answer(t.prompt_and_answer(i)[0], a)[0] for i, a in enumerate(answers))


class PaddingModel(SimulatorModel):
    """Writes the simulator's answer with a <pad> after its first word: wrong token by token."""

    def generate(self, prompts, max_new_tokens, temperature, use_cache, stop_token, prompt_lengths):
        rows = super().generate(prompts, max_new_tokens, temperature, use_cache, stop_token, prompt_lengths)
        return torch.stack([torch.cat([row[:length + 1], torch.tensor([PAD]), row[length + 1:-1]])
                            for row, length in zip(rows, prompt_lengths.tolist())])


def test_a_written_pad_makes_an_answer_wrong():
    t = task("advanced")
    answers = t.write_answers(PaddingModel(), n=3, batch_size=2)
    assert all(a.startswith("Box <pad> ") for a in answers)
    assert t.score_answers(answers)["eval_exact_match"] == 0
    ids = torch.cat([t.prompt_and_answer(0)[0], torch.tensor([TOKEN_IDS["Box"], PAD])])
    assert "model : Box <pad>" in t.describe(ids)


class HalfRightModel(SimulatorModel, torch.nn.Module):
    """Right on the prompts whose token ids sum to an even number, wrong on the others, alike in
    a forward pass (logits that pick the labels) and in generate (the simulator's answer)."""

    def __init__(self):
        torch.nn.Module.__init__(self)

    @staticmethod
    def right(prompt):
        return sum(prompt) % 2 == 0

    def forward(self, x, y):
        labels = torch.where(y == -1, 0, y)
        for r, row in enumerate(x.tolist()):
            if not self.right(row[:row.index(SEP) + 1]):
                labels[r] = (labels[r] + 1) % len(VOCAB)
        logits = torch.nn.functional.one_hot(labels, len(VOCAB)).float()
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)

    def generate(self, prompts, max_new_tokens, temperature, use_cache, stop_token, prompt_lengths):
        rows = super().generate(prompts, max_new_tokens, temperature, use_cache, stop_token, prompt_lengths)
        for r, length in enumerate(prompt_lengths.tolist()):
            if not self.right(prompts[r, :length].tolist()):
                rows[r, length] = TOKEN_IDS["Box"] if rows[r, length] != TOKEN_IDS["Box"] else EOS
        return rows


def test_evaluation_scores_the_prompts_it_answers():
    # Loss, accuracy and whole sequences are read on the prompts whose answers are written, so for
    # a greedy model the share of whole sequences right is its exact match
    t = task("advanced")
    rows = [x for x, _ in t.evaluation_batches(30, 8, torch.Generator())]
    assert [len(x) for x in rows] == [8, 8, 8, 6]
    assert all(torch.equal(x[i], t.rows["test"][k * 8 + i, :x.size(1)].long())
               for k, x in enumerate(rows) for i in range(len(x)))
    metrics = t.evaluate(HalfRightModel(), 30, 8, torch.Generator())
    right = sum(HalfRightModel.right(t.prompt_and_answer(i)[0].tolist()) for i in range(30)) / 30
    assert 0 < right < 1 and metrics["eval_whole_sequences"] == metrics["eval_exact_match"] == right


def test_answers_are_scored_by_their_deepest_box():
    t = task("advanced")
    truths = [t.prompt_and_answer(i)[1] for i in range(40)]
    swapped = [re.sub(r"the (\w+)(.*)the (\w+)", r"the \3\2the \1", a) for a in truths]
    answers = [s if i % 3 == 0 else a for i, (a, s) in enumerate(zip(truths, swapped))]
    # The reference: exact match and box accuracy counted answer by answer, box by box.
    exact, boxes = {}, {}
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
    assert t.score_answers(truths)["eval_exact_match_by_depth"] == {d: 1.0 for d in sorted(map(str, exact))}


def test_docstring_example_labels_and_chain_depth():
    t = task("default")
    answer = encode(TINY_ANSWER) + [EOS]
    x = torch.tensor([[BOS, *encode(TINY_PROMPT), SEP, *answer]])
    sep = len(encode(TINY_PROMPT)) + 1
    y, depth = t.solve(x)[0], t.chain_depth(x)[0]
    assert y[sep:-1].tolist() == answer  # at <sep> the first answer word, at the last "." <eos>
    assert (y[:sep] == -1).all() and y[-1] == -1
    clause_box = "A" * 6 + "B" * 5 + "C" * 10  # "Box A contains the key ," ... "map . <eos>"
    assert depth[sep:-1].tolist() == [dict(A=0, B=0, C=1)[b] for b in clause_box]
    assert (depth[:sep] == -1).all() and depth[-1] == -1


def test_prompt_and_answer_and_describe():
    t = task("advanced")
    prompt, answer = t.prompt_and_answer(0)
    assert prompt[0] == BOS and prompt[-1] == SEP and (prompt == SEP).sum() == 1
    assert answer == render_answer(simulate(decode(prompt[1:-1]))[0], with_empty=False)
    x, y = t.sample(1, split="test")
    text = t.describe(x[0], y[0], predictions=y[0])
    assert decode(y[0][y[0] != -1]) in text and "exact match" in text
    assert "exact match" not in t.describe(x[0], y[0], predictions=torch.zeros_like(y[0]))


def test_dataset_is_cached_once_and_reused(tmp_path, monkeypatch):
    options = dict(boxes_version="default", n_train=40, n_test=10, data_seed=1, cache_dir=str(tmp_path))
    first = get_task("boxes", **options)
    [name] = [p.name for p in tmp_path.iterdir()]
    assert re.fullmatch(r"boxes-default-7boxes-100objects-32to32ops-seed1-40\+10-[0-9a-f]{8}\.pt",
                        name)  # the last part: a digest of the rules (vocabulary, constants)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of reading the cache")
    monkeypatch.setattr(data, "generate_example", no_generation)
    again = get_task("boxes", **options)
    assert torch.equal(first.rows["train"], again.rows["train"]) and len(again.rows["test"]) == 10
    monkeypatch.setattr(torch, "load", no_generation)  # read once, then kept in memory
    assert torch.equal(get_task("boxes", **options).rows["test"], again.rows["test"])
    assert len(list(tmp_path.iterdir())) == 1
    with pytest.raises(AssertionError, match="generated again"):  # a new seed is not cached
        get_task("boxes", **{**options, "data_seed": 2})
    with pytest.raises(AssertionError, match="generated again"):  # nor are new sizes
        get_task("boxes", **{**options, "n_boxes": 5, "n_objects": 20})
    monkeypatch.setattr(data, "OBJECTS", data.OBJECTS[::-1])  # the same words, drawn otherwise
    with pytest.raises(AssertionError, match="generated again"):  # nor new rules
        get_task("boxes", **options)
    monkeypatch.setattr(data, "OBJECTS", data.OBJECTS[::-1])
    monkeypatch.setattr(data, "ADVANCED_MOVE_PROBABILITY", 0.5)
    with pytest.raises(AssertionError, match="generated again"):
        get_task("boxes", **options)


def test_the_cache_and_the_split_follow_every_size_and_the_data_seed(tmp_path):
    options = dict(boxes_version="advanced", n_train=20, n_test=10, cache_dir=str(tmp_path),
                   n_boxes=8, max_ops=7)
    for n_filled in (2, 3):  # each its own file, and its own number of filled boxes
        task = get_task("boxes", **options, n_filled=n_filled)
        for row in task.rows["train"]:
            prompt = decode(row[1:row.tolist().index(SEP)])
            assert sum(map(bool, initial_signature(prompt, "ABCDEFGH"))) == n_filled
    assert len(list(tmp_path.iterdir())) == 2
    assert signature_split("advanced", 3, **SMALL) != signature_split("advanced", 4, **SMALL)


def test_boxes_is_registered_and_options_are_checked():
    assert data.TASKS["boxes"] is data.Boxes
    with pytest.raises(ValueError, match="--boxes_version"):
        get_task("boxes", boxes_version="hard", cache_dir=None)


def test_describe_scores_an_answer_written_after_the_prompt():
    t = task("default")
    prompt = [BOS, *encode(TINY_PROMPT), SEP]
    right = t.describe(torch.tensor(prompt + encode(TINY_ANSWER) + [EOS, PAD]))
    assert f"model : {TINY_ANSWER}" in right and "exact match: yes; boxes right 3/3" in right
    wrong = t.describe(torch.tensor(prompt + encode("Box B is empty.")))
    assert "exact match: no; boxes right 1/3" in wrong


def test_example_is_a_test_prompt_or_the_typed_one():
    t = task("default")
    x, n_prompt = t.example(torch.Generator().manual_seed(0))
    assert x.size(1) == n_prompt and x[0, 0] == BOS and x[0, -1] == SEP
    assert any(torch.equal(x[0], t.prompt_and_answer(i)[0]) for i in range(len(t.rows["test"])))
    typed, _ = t.example(None, prompt=TINY_PROMPT)
    assert typed[0].tolist() == [BOS, *encode(TINY_PROMPT), SEP]
    for spaced in (TINY_PROMPT + " ", TINY_PROMPT.replace(". ", ".\n"), TINY_PROMPT.replace(" ", "  "),
                   TINY_PROMPT.rstrip(".")):  # whitespace is no word; the last "." is implied
        assert torch.equal(t.example(None, prompt=spaced)[0], typed)
    for impossible in ["Juggle Box A.", "The cup is in Box A. Remove the key from Box A.", " \n"]:
        with pytest.raises(ValueError, match="--prompt"):  # unreadable, or no right answer
            t.example(None, prompt=impossible)
    assert decode([BOS, *encode(TINY_PROMPT), SEP]) == f"<bos> {TINY_PROMPT} <sep>"


# The small advanced version: the paper's rules at a size a laptop learns.

def test_small_advanced_answers_equal_the_simulator_and_every_move_is_implicit():
    n_ops, lengths = [], []
    for prompt, answer in examples("advanced", 400, small=True):
        assert render_answer(simulate(prompt)[0], with_empty=False) == answer
        clauses = prompt.split(". ")[0].split(", ")
        assert len(clauses) == 2 and all(" is in Box " in clause for clause in clauses)
        operations = steps(prompt)
        n_ops.append(len(operations))
        for op, _, after in operations:
            assert set(after) <= set("ABCDEFGH")  # the 8 boxes of SMALL
            assert not op.startswith("Move") or op.startswith("Move the contents of"), op
            assert set(re.findall(r"the (\w+)", op)) - {"contents"} <= set(OBJECTS[:10]), op
        lengths.append(len(encode(prompt)) + len(encode(answer)) + 3)
    assert min(n_ops) == 1 and max(n_ops) == 7  # a last put/remove pair never overruns max_ops
    assert 15 < sum(lengths) / len(lengths) < 90 and max(lengths) < 128  # tens of tokens


def test_small_advanced_depths_are_spread_and_splits_apart():
    depths = [d for prompt, _ in examples("advanced", 400, small=True)
              for box, d in simulate(prompt)[1].items() if simulate(prompt)[0][box]]
    share = {d: depths.count(d) / len(depths) for d in set(depths)}
    assert len(depths) == 800 and max(depths) <= 8  # 2 filled boxes; at most 8 moves
    assert share[0] > 0.2 and share[1] > 0.2 and share[2] > 0.08 and sum(
        v for d, v in share.items() if d >= 3) > 0.04  # every depth up to past 3 is taught
    t = get_task("boxes", boxes_version="advanced", n_train=200, n_test=50, data_seed=3,
                 cache_dir=None, **SMALL)
    train, test = signature_split("advanced", 3, **SMALL)
    assert len(train) == len(test) == 14 and not train & test  # C(8, 2) = 28 initial states
    for split, allowed in (("train", train), ("test", test)):
        seen = {initial_signature(decode(row[1:row.tolist().index(SEP)]), "ABCDEFGH")
                for row in t.rows[split]}
        assert seen <= allowed
    x, y = t.sample(64, torch.Generator().manual_seed(0))
    assert t.block_size == 128 and torch.equal(t.solve(x), y)
    depth = t.chain_depth(x)
    assert torch.equal(depth == -1, y == -1) and depth.max() >= 3


def test_one_filled_box_leaves_no_chain_to_follow_and_two_do():
    """Boxes' docstring: with --n_filled 1 the answer's box is the last move's destination, so
    the small configuration needs two filled boxes for its answers to need the chain."""
    def last_destination(prompt):  # or, with no move, where the items started
        return (re.findall(r"is in Box (\w)", prompt)
                + re.findall(r"Move the contents of Box \w to Box (\w)", prompt))[-1]

    rng = random.Random("one filled box")
    for _ in range(200):
        prompt, answer = generate_example(rng, "advanced", **{**SMALL, "n_filled": 1})
        assert re.findall(r"Box (\w) contains", answer) == [last_destination(prompt)]
    moved_first = [box for prompt, answer in examples("advanced", 400, small=True)
                   for box, items in simulate(prompt)[0].items()
                   if items and box != last_destination(prompt)]
    assert len(moved_first) == 400  # the other item's box is never the last move's


@pytest.mark.parametrize("version, sizes, flag", [
    ("advanced", dict(n_boxes=9), "--n_boxes"), ("advanced", dict(n_boxes=1), "--n_boxes"),
    ("advanced", dict(n_filled=0), "--n_filled"), ("advanced", dict(n_boxes=4, n_filled=4), "--n_filled"),
    ("advanced", dict(n_boxes=3), r"--n_filled 4 \(the paper's, as none was given\)"),  # untyped
    ("default", dict(n_filled=2), "--n_filled"), ("advanced", dict(n_objects=4), "--n_objects"),
    ("advanced", dict(n_objects=101), "--n_objects"), ("default", dict(n_objects=20), "--n_objects"),
    ("advanced", dict(min_ops=0), "--min_ops"), ("advanced", dict(min_ops=5, max_ops=3), "--max_ops")])
def test_bad_sizes_fail_naming_the_flag(version, sizes, flag):
    with pytest.raises(ValueError, match=flag):
        box_sizes(version, **sizes)
    with pytest.raises(ValueError, match=flag):
        get_task("boxes", boxes_version=version, cache_dir=None, **sizes)
    assert box_sizes(version) == data.PAPER_SIZES[version]  # left out: the paper's


def test_sizes_at_the_edge_of_what_is_allowed_build():
    # 2 boxes; the fewest objects: one more than the filled boxes (advanced), 3 per box (default)
    assert box_sizes("advanced", n_boxes=2, n_filled=1, n_objects=2)["n_objects"] == 2
    assert box_sizes("default", n_boxes=2, n_objects=6)["n_objects"] == 6
    with pytest.raises(ValueError, match="--n_objects 5 must lie in 6"):
        box_sizes("default", n_boxes=2, n_objects=5)
    small = get_task("boxes", boxes_version="advanced", n_train=1, n_test=1, cache_dir=None, **SMALL)
    assert [len(rows) for rows in small.rows.values()] == [1, 1]
    for n_train, n_test in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=f"--n_train {n_train} and --n_test {n_test} must be"):
            get_task("boxes", n_train=n_train, n_test=n_test, cache_dir=None)


def test_bad_sizes_fail_at_the_start_of_train_py_in_one_line():
    result = subprocess.run([sys.executable, "train.py", "--task", "boxes", "--boxes_version",
                             "advanced", "--n_boxes", "4", "--n_filled", "4"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "--n_filled 4" in result.stderr


def test_a_dataset_cache_unpickles_nothing_but_tensors(tmp_path):
    # A cache file could come from anywhere: reading it must not run code a pickle names.
    marker, cache = tmp_path / "ran", tmp_path / "boxes.pt"
    rows = torch.zeros(2, 8, dtype=torch.uint8)
    torch.save({"train": rows, "test": rows, "extra": OpensAFileWhenUnpickled(str(marker))}, cache)
    with pytest.raises(ValueError, match="is not a boxes dataset"):
        data._read_dataset(str(cache), 0.0)
    assert not marker.exists()


def test_exact_match_is_word_for_word_case_included():
    task = get_task("boxes", boxes_version="default", n_train=20, n_test=5, data_seed=1, cache_dir=None)
    prompt, answer = task.prompt_and_answer(0)
    assert task.score_answer(prompt, answer)[0]
    assert not task.score_answer(prompt, answer.lower())[0]


def test_encode_lowers_a_capital_after_a_special_as_at_the_start():
    assert encode("<bos> The key is in Box A. <sep>") == [BOS] + encode("The key is in Box A.") + [SEP]
