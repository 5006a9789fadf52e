"""The inductive scratchpad and the cycles task: the training form against Appendix C's other
training method (each step read alone), cached generation against uncached, and the cycles rows,
labels and generated walks against a walk by hand of each prompt's text."""

import pytest
import torch

from data import (CYCLE_PAD, CYCLE_SEP, CYCLE_START, Cycles, copies, generate_inductive, get_task,
                  inductive_layout, segments, training_form)
from model import GPT, GPTConfig

ATTENTIONS = ["standard", "chacal", "standard,chacal"]
START, SEP = 6, 7  # the start token and separator of the small models below (vocabulary 8)


def small_model(attn):
    """A random model whose greedy writing depends on what it reads (Xavier's N(0, 1) embeddings),
    closing a state every few tokens."""
    torch.manual_seed(4)
    model = GPT(GPTConfig(block_size=48, vocab_size=8, n_layer=len(attn.split(",")), n_head=2, n_embd=16, attn=attn,
                          weight_init="xavier")).double().eval()
    with torch.no_grad():
        model.lm_head.weight[SEP] *= 1.5
    return model


def layout_of(ids):
    x = torch.tensor([ids])
    return (x, *inductive_layout(x, START, SEP))


def test_training_form_and_layout_of_the_worked_example():
    q, s1, s2, s3 = [0, 1, 2, START], [3, SEP], [4, SEP], [5]
    form = training_form(q + s1 + s2 + s3, START, SEP)
    assert form == q + s1 + s1 + s2 + s2 + s3
    x, positions, groups = layout_of(form)
    assert groups[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 4, 5, 6]
    assert copies(x, START, SEP)[0].tolist() == [False] * 6 + [True] * 2 + [False] * 2 + [True] * 2 + [False]
    assert segments(x, START, SEP)[0].tolist() == [-1] * 4 + [0, 0, 1, 1, 2, 2, 3, 3, 4]
    x, positions, groups = layout_of([0, 1, SEP, 2])  # without the start token: the ordinary layout
    assert positions[0].tolist() == [0, 1, 2, 3] and groups[0].tolist() == [0, 0, 0, 0]
    model = small_model("standard,chacal")  # which the model reads as if no layout were given
    torch.testing.assert_close(model(x, positions=positions, groups=groups)[0], model(x)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_training_form_equals_each_state_read_on_its_own(attn):
    """Appendix C's two training methods agree: Q s1# s1# s2# s2# s3 with groups and positions
    gives, on each state, the logits of Q s[i-1]# s[i] read alone, and the same loss."""
    model = small_model(attn)
    q, states = [1, 2, 3, 0, 4, START], [[2, 5, SEP], [3, SEP], [1, 1, 4, SEP], [5, 0]]
    form = training_form(q + [token for state in states for token in state], START, SEP)
    x, positions, groups = layout_of(form)
    targets = torch.tensor([form[1:] + [-1]]).masked_fill(copies(x, START, SEP).roll(-1, 1), -1)
    targets[0, :len(q) - 1] = -1  # the question is not scored, as in the cycles task
    logits, loss = model(x, targets, positions=positions, groups=groups)
    alone_loss, n_scored, at = 0.0, 0, len(q) - 1  # at: the form's token predicting state i
    for i, state in enumerate(states):
        previous = states[i - 1] if i else []
        theirs = model(torch.tensor([q + previous + state]))[0][0, len(q) + len(previous) - 1:-1]
        torch.testing.assert_close(logits[0, at:at + len(state)], theirs, rtol=1e-10, atol=1e-10)
        alone_loss += torch.nn.functional.cross_entropy(theirs, torch.tensor(state), reduction="sum")
        n_scored += len(state)
        at += 2 * len(state) if i < len(states) - 1 else len(state)  # skip the copy
    torch.testing.assert_close(loss, alone_loss / n_scored, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_cached_inductive_generation_equals_uncached(attn):
    model = small_model(attn)
    prompts = torch.randint(0, START, (4, 7), generator=torch.Generator().manual_seed(1))
    prompts[:, -1] = START                                      # Q :
    prompts[1, 3:] = torch.tensor([START, 2, SEP, 4])           # a prompt inside a state
    prompts[2, 5:] = torch.tensor([START, 3])                   # ...inside the first state
    prompts[3, -1] = 1                                          # Q not finished: no start yet
    cached, plain = (generate_inductive(model, prompts, 30, START, SEP, use_cache=use_cache)
                     for use_cache in (True, False))
    assert torch.equal(cached, plain) and cached.shape == (4, 37) and (cached[:, 7:] == SEP).sum() >= 8


@pytest.mark.parametrize("attn", ["standard", "chacal"])
def test_the_cache_keeps_the_question_and_two_states_only(attn, monkeypatch):
    model = small_model(attn)
    caches, new_caches = [], model.new_caches
    monkeypatch.setattr(model, "new_caches", lambda: caches.append(new_caches()) or caches[-1])
    out = generate_inductive(model, torch.tensor([[1, 2, 3, START]]), 25, START, SEP)[0].tolist()
    *closed, current = " ".join(map(str, out[4:-1])).split(str(SEP))  # what the model read after Q
    assert len(closed) >= 3
    assert len(caches[0][0]) == 4 + len(closed[-1].split()) + 1 + len(current.split())


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_once_every_row_wrote_the_stop_token_or_outgrew_the_positions(use_cache):
    model = small_model("chacal")
    prompts = torch.randint(0, START, (4, 6), generator=torch.Generator().manual_seed(4))
    prompts[:, -1] = START
    out = generate_inductive(model, prompts, 40, START, SEP, use_cache=use_cache, stop_token=SEP)
    first = [row.index(SEP) for row in out[:, 6:].tolist()]  # every row wrote one
    assert max(first) == out.size(1) - 7  # on until the last row's first
    for r in range(4):  # the same beside others as alone
        alone = generate_inductive(model, prompts[r:r + 1], 40, START, SEP, use_cache=use_cache, stop_token=SEP)
        assert torch.equal(out[r, :alone.size(1)], alone[0])
    with torch.no_grad():
        model.lm_head.weight[SEP] = model.lm_head.weight[0]  # never a #: a tie goes to the first token
    out = generate_inductive(model, torch.tensor([[1, 2, START]]), 100, START, SEP, use_cache=use_cache)
    assert out.size(1) == model.config.block_size + 1  # positions 0..block_size-1 read, the last pick kept


# The cycles task.

SETTINGS = [dict(cycle_n=2), dict(cycle_n=5, cycle_distance=3), dict(cycle_n=3, test_cycle_n=6, test_cycle_distance=8),
            dict(cycle_n=4, cycle_names=8), dict(cycle_n=5, cycle_distance=2, test_cycle_distance=3)]


def expected_completion(words, scratchpad, n, distance):
    """The words after a cycles prompt, from its text alone: walk the edges from A by hand, and
    check the graph is what the task promises (a 2n-cycle with B `distance` steps ahead of A, or
    A on a cycle of `distance` nodes and B on the other). Inductive rows are in the training
    form: each closed state twice."""
    query = words.index("?")
    successor = dict(zip(words[0:query - 1:4], words[2:query - 1:4]))
    a, b = words[query - 1], words[query + 1]
    walk = [a]
    while len(walk) == 1 or walk[-1] != a:
        walk.append(successor[walk[-1]])
    connected = b in walk
    assert len(successor) == 2 * n and sorted(successor.values()) == sorted(successor)
    assert len(walk) - 1 == (2 * n if connected else distance)
    if connected:
        assert walk.index(b) == distance
        walk = walk[:distance + 1]
    answer = ["1" if connected else "0", "."]
    if scratchpad == "none":
        return answer
    if scratchpad == "full":
        return " > ".join(walk).split() + [";"] + answer
    return [word for node in walk[:-1] for word in (node, "#", node, "#")] + [walk[-1], ";"] + answer


def plain_form(completion):
    """An inductive completion without its copies: what generation writes."""
    return [w for i, w in enumerate(completion) if not (i < len(completion) - 4 and i % 4 >= 2)]


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
@pytest.mark.parametrize("options", SETTINGS)
def test_cycles_rows_and_labels_equal_a_walk_by_hand_of_their_text(options, scratchpad):
    """y scores exactly the next word outside the prompt, the copies of states and the padding;
    the chain depth of a scored word is the walk's length, `distance` for both labels."""
    task = get_task("cycles", scratchpad=scratchpad, **options)
    longest = 0
    for split in ("train", "test"):
        x, y = task.sample(16, torch.Generator().manual_seed(2), split=split)
        assert torch.equal(task.solve(x), y) and int(x.max()) < task.vocab_size
        longest = max(longest, int((x != CYCLE_PAD).sum(1).max()))
        n, distance = task.sizes[split]
        answers = []
        for row, labels, depths in zip(x.tolist(), y.tolist(), task.chain_depth(x).tolist()):
            words = [task.vocab[i] for i in row]
            assert all(int(w[1:]) < options.get("cycle_names", 100) for w in words if w[0] == "v")
            n_prompt = words.index("?") + 3 + (scratchpad == "inductive")  # ... ; then ":"
            completion = expected_completion(words, scratchpad, n, distance)
            answers.append(completion[-2])
            end = n_prompt + len(completion)
            assert words[n_prompt:end] == completion and set(words[end:]) <= {"<pad>"}
            for t in range(len(row)):
                copy = (scratchpad == "inductive" and 0 <= t + 1 - n_prompt < len(completion) - 4
                        and (t + 1 - n_prompt) % 4 >= 2)  # the second "node #" of each 4
                should = n_prompt - 1 <= t < end - 1 and not copy
                assert (labels[t] != -1) == should and (not should or labels[t] == row[t + 1]), (words, t)
                assert depths[t] == (distance if should else -1)
        assert answers.count("1") == answers.count("0")  # balanced
    assert task.block_size >= longest


def test_cycles_worked_example_of_the_docstring():
    for scratchpad in ("none", "full", "inductive"):
        task = get_task("cycles", cycle_n=3, scratchpad=scratchpad)
        prompt = task.prompts(task.sample(1, torch.Generator().manual_seed(1))[0])[0]
        shown = (": " if scratchpad == "inductive" else "") + task.decode(task.completion(prompt))
        assert f"{scratchpad:10s} {shown}" in Cycles.__doc__
    assert task.decode(prompt).startswith("v46 > v39 ; v77 > v46 ;")
    x, _ = task.sample(2, torch.Generator().manual_seed(0))  # the inductive rows' layout, for the model
    positions, groups = inductive_layout(x, CYCLE_START, CYCLE_SEP)
    assert torch.equal(task.layout(x)["positions"], positions) and torch.equal(task.layout(x)["groups"], groups)
    assert groups.max() > 1 and get_task("cycles", scratchpad="full").layout(x) == {}


def test_cycles_default_names_cover_the_larger_test_graph():
    task = get_task("cycles", cycle_n=3, test_cycle_n=60)  # 120 nodes: more than 100 names
    x, _ = task.sample(2, torch.Generator().manual_seed(0), split="test")
    for row in x.tolist():
        words = [task.vocab[i] for i in row]
        assert len(set(words[0:words.index("?") - 1:4])) == 120


class MaskedWalker(torch.nn.Module):
    """Stands in for a model that has learned one step of the walk: each token's logit comes from
    what the inductive masks let it see (group 0, its own group), so it writes the walk only if
    it is given the right groups. With more than one previous state in view it writes <pad>."""

    def __init__(self, task):
        super().__init__()
        self.task = task
        self.config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, pos="none")

    def next_word(self, seen):
        if ":" not in seen:
            return "<pad>"
        question, state = seen[:seen.index(":")], seen[seen.index(":") + 1:]
        q = question.index("?")
        successor = dict(zip(question[0:q - 1:4], question[2:q - 1:4]))
        a, b = question[q - 1], question[q + 1]
        if len(state) in (0, 1):  # the first state: A
            return [a, "#"][len(state)]
        if len(state) == 2 and state[1] == "#":  # the previous state: one step on
            return successor[state[0]]
        if len(state) == 3:
            return ";" if state[2] in (a, b) else "#"
        if len(state) in (4, 5) and state[3] == ";":
            return "." if len(state) == 5 else "1" if state[2] == b else "0"
        return "<pad>"

    def forward(self, tokens, targets=None, caches=None, positions=None, groups=None):
        assert caches is None and groups is not None
        logits = torch.zeros(*tokens.shape, self.config.vocab_size)
        for r in range(tokens.size(0)):
            for i in range(tokens.size(1)):
                seen = [self.task.vocab[int(tokens[r, j])] for j in range(i + 1)
                        if int(groups[r, j]) in (0, int(groups[r, i]))]
                logits[r, i, self.task.vocab.index(self.next_word(seen))] = 1.0
        return logits, None


def test_inductive_generation_under_the_masks_walks_the_graph_one_state_at_a_time():
    task = get_task("cycles", cycle_n=3, cycle_distance=2, scratchpad="inductive")
    x, _ = task.sample(4, torch.Generator().manual_seed(0))
    prompts = torch.tensor(task.prompts(x))
    out = task.generate(MaskedWalker(task), prompts, 12, use_cache=False)
    for prompt, row in zip(prompts.tolist(), out.tolist()):
        words = [task.vocab[i] for i in prompt]
        written = [task.vocab[i] for i in row[len(prompt):]]
        form = expected_completion(words[:-1], "inductive", *task.sizes["train"])
        assert written[:written.index(".") + 1] == plain_form(form)


@pytest.mark.parametrize("scratchpad", ["none", "inductive"])
def test_cycles_evaluate_scores_the_generated_answers(scratchpad, monkeypatch):
    task = get_task("cycles", cycle_n=3, test_cycle_n=4, scratchpad=scratchpad)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_embd=32, n_head=2, attn="chacal"))
    ids, written = {word: i for i, word in enumerate(task.vocab)}, iter(range(6))

    def write(model, prompts, room, use_cache=True):  # right in prompts 0, 2, 4; flipped in 1, 3; no "." in 5
        rows = []
        for prompt in prompts.tolist():
            k = next(written)
            right = expected_completion([task.vocab[i] for i in prompt], "none", *task.sizes["test"])[0]
            answer = {"1": "0", "0": "1"}[right] if k in (1, 3) else right
            if k < 5:
                row = ([ids["v0"]] * room + [ids[answer], ids["."]])[-room:]
            else:
                row = ([ids[answer]] + [ids["v0"]] * room)[:room]
            rows.append(prompt + row)
        return torch.tensor(rows)

    monkeypatch.setattr(task, "generate", write)
    assert task.evaluate(model, 6, 4, torch.Generator().manual_seed(0))["eval_answer_acc"] == 3 / 6
