"""The inductive scratchpad (model.py) and the cycles task: the training form against the
appendix's other training method, cached generation against uncached, the group mask against
its definition, the cycles labels against the brute-force walk, and bad flags at start."""

import pytest
import torch

import train
from attention import group_visibility
from data import CYCLE_PAD, CYCLE_START, CYCLE_SEP, Cycles, get_task
from model import (GPT, GPTConfig, copies, generate_inductive, inductive_layout, segments,
                   training_form)

ATTENTIONS = ["standard", "chacal", "standard,chacal"]
START, SEP = 6, 7  # the start token and separator of the small models below (vocabulary 8)


def small_model(attn, fused=True):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=48, vocab_size=8, n_layer=len(attn.split(",")), n_head=2,
                          n_embd=16, attn=attn)).double().eval()
    for block in model.transformer.h:
        block.attn.fused = fused
    return model


def layout_of(ids):
    x = torch.tensor([ids])
    positions, groups = inductive_layout(x, START, SEP)
    return x, positions, groups


def test_training_form_and_layout_of_the_worked_example():
    q, s1, s2, s3 = [0, 1, 2, START], [3, SEP], [4, SEP], [5]
    form = training_form(q + s1 + s2 + s3, START, SEP)
    assert form == q + s1 + s1 + s2 + s2 + s3
    x, positions, groups = layout_of(form)
    assert groups[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 4, 5, 6]
    assert copies(x, START, SEP)[0].tolist() == [False] * 6 + [True] * 2 + [False] * 2 + \
        [True] * 2 + [False]
    assert segments(x, START, SEP)[0].tolist() == [-1] * 4 + [0, 0, 1, 1, 2, 2, 3, 3, 4]
    # Without the start token: the ordinary layout.
    x, positions, groups = layout_of([0, 1, SEP, 2])
    assert positions[0].tolist() == [0, 1, 2, 3] and groups[0].tolist() == [0, 0, 0, 0]


def test_group_mask_equals_its_definition():
    generator = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 4, (3, 9), generator=generator).sort(dim=1).values
    for n_queries in (9, 4, 1):
        visible = group_visibility(groups[:, -n_queries:], groups)
        assert visible.shape == (3, 1, n_queries, 9)
        for b in range(3):
            for i in range(n_queries):
                query = 9 - n_queries + i
                for j in range(9):
                    allowed = j <= query and (groups[b, j] == groups[b, query] or groups[b, j] == 0)
                    assert bool(visible[b, 0, i, j]) == bool(allowed)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("attn", ATTENTIONS)
def test_training_form_equals_each_state_read_on_its_own(attn, fused):
    """Appendix C's two training methods agree: Q s1# s1# s2# s2# s3 with groups and positions
    gives, on each state, the logits of Q s[i-1]# s[i] read alone, and the same loss."""
    model = small_model(attn, fused)
    q, states = [1, 2, 3, 0, 4, START], [[2, 5, SEP], [3, SEP], [1, 1, 4, SEP], [5, 0]]
    ids = q + [token for state in states for token in state]
    form = training_form(ids, START, SEP)
    x, positions, groups = layout_of(form)
    targets = torch.tensor([form[1:] + [-1]]).masked_fill(copies(x, START, SEP).roll(-1, 1), -1)
    targets[0, :len(q) - 1] = -1  # the question is not scored, as in the cycles task
    logits, loss = model(x, targets, positions=positions, groups=groups)

    alone_loss, n_scored, at = 0.0, 0, len(q) - 1  # `at`: the form's token predicting state i
    for i, state in enumerate(states):
        previous = states[i - 1] if i else []
        alone = torch.tensor([q + previous + state])
        alone_logits, _ = model(alone)
        # In the form, the token before state i (":" or the copy's "#") and state i itself.
        mine = logits[0, at:at + len(state)]
        theirs = alone_logits[0, len(q) + len(previous) - 1:-1]
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)
        alone_targets = torch.tensor(state)
        alone_loss += torch.nn.functional.cross_entropy(theirs, alone_targets, reduction="sum")
        n_scored += len(state)
        at += len(state) + (len(state) if i < len(states) - 1 else 0)  # skip the copy
    torch.testing.assert_close(loss, alone_loss / n_scored, rtol=1e-10, atol=1e-10)
    # and on the question itself the form is the ordinary model
    torch.testing.assert_close(logits[0, :len(q)], model(torch.tensor([q]))[0][0], rtol=1e-10,
                               atol=1e-10)


def sep_friendly(model):
    """Make the separator likely, so that sampled sequences close many states."""
    with torch.no_grad():
        model.lm_head.weight[SEP] = model.lm_head.weight[:START].mean(0) * 3
    return model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("attn", ATTENTIONS)
def test_cached_inductive_generation_equals_uncached(attn, fused):
    model = sep_friendly(small_model(attn, fused))
    prompts = torch.randint(0, START, (4, 7), generator=torch.Generator().manual_seed(1))
    prompts[:, -1] = START                                      # Q :
    prompts[1, 3:] = torch.tensor([START, 2, SEP, 4])           # a prompt inside a state
    prompts[2, 5:] = torch.tensor([START, 3])                   # ...inside the first state
    prompts[3, -1] = 1                                          # Q not finished: no start yet
    results = {}
    for use_cache in (True, False):
        results[use_cache] = generate_inductive(
            model, prompts, 30, START, SEP, temperature=1.0, use_cache=use_cache,
            generator=torch.Generator().manual_seed(5), return_logits=True)
    (cached, cached_logits), (plain, plain_logits) = results[True], results[False]
    assert torch.equal(cached, plain) and cached.shape == (4, 37)
    assert cached_logits.shape == (4, 30, model.config.vocab_size)  # (B, new tokens, vocab)
    torch.testing.assert_close(cached_logits, plain_logits, rtol=1e-10, atol=1e-10)
    assert (cached[:, 7:] == SEP).sum() >= 8  # many states were closed


def test_no_new_tokens_give_no_logits_of_the_models_dtype():
    model = small_model("standard", True)
    prompt = torch.tensor([[1, 2, START]])
    out, logits = generate_inductive(model, prompt, 0, START, SEP, return_logits=True)
    assert torch.equal(out, prompt) and logits.shape == (1, 0, model.config.vocab_size)
    assert logits.dtype == model.lm_head.weight.dtype != torch.float32  # the tests' float64


@pytest.mark.parametrize("attn", ["standard", "chacal"])
def test_the_cache_keeps_the_question_and_two_states_only(attn, monkeypatch):
    model = sep_friendly(small_model(attn))
    caches = []
    new_caches = model.new_caches
    monkeypatch.setattr(model, "new_caches", lambda: caches.append(new_caches()) or caches[-1])
    prompt = torch.tensor([[1, 2, 3, START]])
    out = generate_inductive(model, prompt, 25, START, SEP, temperature=1.0,
                             generator=torch.Generator().manual_seed(3))[0].tolist()
    read = out[4:-1]  # what the model read after Q; the last token picked was never read
    *closed, current = " ".join(map(str, read)).split(str(SEP))
    previous = closed[-1].split() + [SEP] if closed else []  # the last closed state, and its #
    assert len(closed) >= 3
    assert len(caches[0][0]) == 4 + len(previous) + len(current.split())


@pytest.mark.parametrize("use_cache", [True, False])
def test_inductive_generation_stops_once_every_row_wrote_the_stop_token(use_cache):
    model = sep_friendly(small_model("chacal"))
    prompts = torch.randint(0, START, (4, 6), generator=torch.Generator().manual_seed(4))
    prompts[:, -1] = START
    out = generate_inductive(model, prompts, 40, START, SEP, temperature=1.0, use_cache=use_cache,
                             generator=torch.Generator().manual_seed(6), stop_token=SEP)
    first = [row.index(SEP) for row in out[:, 6:].tolist()]  # every row wrote one
    assert min(first) < max(first) == out.size(1) - 7  # it ran on until the last row's first
    alone = [generate_inductive(model, prompts[r:r + 1], 40, START, SEP, temperature=0,
                                use_cache=use_cache, stop_token=SEP) for r in range(4)]
    together = generate_inductive(model, prompts, 40, START, SEP, temperature=0,
                                  use_cache=use_cache, stop_token=SEP)
    for r, row in enumerate(alone):  # greedy (no row stops here): the same beside others as alone
        assert torch.equal(together[r, :row.size(1)], row[0])


@pytest.mark.parametrize("use_cache", [True, False])
def test_inductive_generation_decodes_in_eval_mode_and_restores_the_mode(use_cache):
    torch.manual_seed(0)
    model = sep_friendly(GPT(GPTConfig(block_size=48, vocab_size=8, n_layer=3, n_head=2, n_embd=16,
                                       attn="chacal", dropout=0.5, share_weights=True,
                                       min_train_layers=1)).double().eval())
    prompts = torch.randint(0, START, (2, 6), generator=torch.Generator().manual_seed(2))
    prompts[:, -1] = START
    in_eval = generate_inductive(model, prompts, 20, START, SEP, temperature=0, use_cache=use_cache)
    model.train()  # dropout and a drawn depth would change every token's pass
    assert torch.equal(generate_inductive(model, prompts, 20, START, SEP, temperature=0,
                                          use_cache=use_cache), in_eval)
    assert model.training
    with pytest.raises(ValueError, match="temperature -1"):  # also when decoding fails
        generate_inductive(model, prompts, 20, START, SEP, temperature=-1, use_cache=use_cache)
    assert model.training


def test_greedy_inductive_generation_writes_the_same_with_and_without_cache():
    model = sep_friendly(small_model("chacal"))
    prompts = torch.randint(0, START, (3, 6), generator=torch.Generator().manual_seed(2))
    prompts[:, -1] = START
    out = [generate_inductive(model, prompts, 25, START, SEP, temperature=0, use_cache=c)
           for c in (True, False)]
    assert torch.equal(out[0], out[1]) and torch.equal(out[0][:, :6], prompts)


def test_inductive_generation_samples_at_temperature_1_by_default():
    model = sep_friendly(small_model("chacal"))
    prompts = torch.randint(0, START, (3, 6), generator=torch.Generator().manual_seed(2))
    prompts[:, -1] = START
    out = [generate_inductive(model, prompts, 25, START, SEP, **options,
                              generator=torch.Generator().manual_seed(3))
           for options in ({}, dict(temperature=1.0))]
    assert torch.equal(out[0], out[1])


def test_ordinary_layout_passed_explicitly_changes_nothing():
    model = small_model("standard,chacal")
    x = torch.randint(0, 8, (2, 12), generator=torch.Generator().manual_seed(3))
    plain, _ = model(x)
    explicit, _ = model(x, positions=torch.arange(12).expand(2, 12),
                        groups=torch.zeros(2, 12, dtype=torch.long))
    torch.testing.assert_close(explicit, plain, rtol=1e-10, atol=1e-10)


def test_attentions_without_groups_refuse_them_naming_the_flag():
    model = small_model("dilated")
    x = torch.tensor([[1, 2, START, 3, SEP]])
    with pytest.raises(ValueError, match="--attn dilated cannot take"):
        model(x, **dict(zip(("positions", "groups"), inductive_layout(x, START, SEP))))


def test_generation_stops_when_a_state_outgrows_the_position_table():
    model = small_model("chacal")
    with torch.no_grad():
        model.lm_head.weight[SEP] = -10 * model.lm_head.weight[:START].mean(0)  # never a #
    prompt = torch.tensor([[1, 2, START]])
    for use_cache in (True, False):
        out = generate_inductive(model, prompt, 100, START, SEP, temperature=0, use_cache=use_cache)
        # Positions 0..block_size-1 were read; the token picked at the last one is kept.
        assert out.size(1) == model.config.block_size + 1 and (out[0, 3:] != SEP).all()


# ----------------------------------------------------------------------------------------------
# The cycles task.

CYCLE_SETTINGS = [dict(cycle_n=2), dict(cycle_n=5, cycle_distance=3), dict(cycle_n=4),
                  dict(cycle_n=3, test_cycle_n=6, test_cycle_distance=8),
                  dict(cycle_n=4, cycle_names=8),  # every graph uses every name
                  dict(cycle_n=5, cycle_distance=2, test_cycle_distance=3)]  # both walks short of n


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
@pytest.mark.parametrize("options", CYCLE_SETTINGS)
def test_cycles_rows_are_balanced_and_fit_their_block_vocabulary_and_names(options, scratchpad):
    task = get_task("cycles", scratchpad=scratchpad, **options)
    for split in ("train", "test"):
        x, y = task.sample(32, torch.Generator().manual_seed(0), split=split)
        assert x.size(1) <= task.block_size and int(x.max()) < task.vocab_size
        answers = [row[row.index(".") - 1] for row in (task.decode(r).split() for r in x)]
        assert answers.count("1") == answers.count("0") == 16  # balanced
        depth = task.chain_depth(x)
        assert ((depth == -1) == (y == -1)).all()
        n, distance = task.sizes[split]
        assert set(depth[y != -1].tolist()) <= {n, distance}
        names = {int(word[1:]) for row in x for word in task.decode(row).split()
                 if word[0] == "v" and word[1:].isdigit()}
        assert max(names) < options.get("cycle_names", 100)


def expected_completion(words, scratchpad, n, distance):
    """The words after a cycles prompt, from its text alone: walk the edges from A by hand, and
    check the graph is what the task promises (two n-cycles, or one 2n-cycle with B `distance`
    steps ahead of A). Inductive rows are in the training form: each closed state twice."""
    query = words.index("?")
    successor = dict(zip(words[0:query - 1:4], words[2:query - 1:4]))
    a, b = words[query - 1], words[query + 1]
    walk = [a]
    while len(walk) == 1 or walk[-1] != a:  # around A's whole cycle
        walk.append(successor[walk[-1]])
    connected = b in walk
    assert len(successor) == 2 * n and len(walk) - 1 == (2 * n if connected else n)
    if connected:
        assert walk.index(b) == distance
        walk = walk[:distance + 1]
    answer = ["1" if connected else "0", "."]
    if scratchpad == "none":
        return answer
    if scratchpad == "full":
        return " > ".join(walk).split() + [";"] + answer
    return [word for node in walk[1:] for word in (node, "#", node, "#")] + answer


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
@pytest.mark.parametrize("options", CYCLE_SETTINGS)
def test_cycles_rows_and_labels_equal_a_walk_by_hand_of_their_text(options, scratchpad):
    """Independent of the task's own walk and row builder (which sample() and solve() share):
    the text after each prompt is what walking its edges gives, and y, as solve() gives it too,
    scores exactly the next word outside the prompt, the copies of states and the padding. The
    chain depth of a scored word is the walk's length: `distance` to B, or n back to A."""
    task = get_task("cycles", scratchpad=scratchpad, **options)
    for split in ("train", "test"):
        x, y = task.sample(16, torch.Generator().manual_seed(2), split=split)
        assert torch.equal(task.solve(x), y)
        n, distance = task.sizes[split]
        for row, labels, depths in zip(x.tolist(), y.tolist(), task.chain_depth(x).tolist()):
            words = [task.vocab[i] for i in row]
            n_prompt = words.index("?") + 3 + (scratchpad == "inductive")  # ... ; then ":"
            completion = expected_completion(words, scratchpad, n, distance)
            walked = distance if completion[-2] == "1" else n  # the walk by hand met B, or A again
            end = n_prompt + len(completion)
            assert words[n_prompt:end] == completion and set(words[end:]) <= {"<pad>"}
            scored = [labels[t] != -1 for t in range(len(row))]
            copy = [scratchpad == "inductive" and 0 < t - n_prompt < len(completion) - 2
                    and (t - n_prompt) % 4 >= 2 for t in range(len(row))]  # 2nd "node #" of each 4
            for t in range(len(row)):
                should = n_prompt - 1 <= t < end - 1 and not copy[t + 1]
                assert scored[t] == should, (words, t)
                assert not should or labels[t] == row[t + 1]
                assert depths[t] == (walked if should else -1)


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
def test_score_question_trains_on_every_question_token_and_tests_what_follows_alone(scratchpad, tmp_path):
    plain = get_task("cycles", cycle_n=3, scratchpad=scratchpad)
    args, task, _, _ = train.parse_args(["--task", "cycles", "--cycle_n", "3", "--scratchpad", scratchpad,
                                         "--score_question", "--out_dir", str(tmp_path)])
    assert args.score_question and task.score_question
    for split in ("train", "test"):
        x, y = plain.sample(16, torch.Generator().manual_seed(5), split=split)
        x_scored, y_scored = task.sample(16, torch.Generator().manual_seed(5), split=split)
        assert torch.equal(x_scored, x)
        end = len(plain.prompts(x)[0]) - 1  # y[end] is the first target after the prompt
        assert (y[:, :end] == -1).all() and torch.equal(y_scored[:, end:], y[:, end:])
        question = x[:, 1:end + 1] if split == "train" else torch.full_like(y[:, :end], -1)
        assert torch.equal(y_scored[:, :end], question)  # each next token of the prompt, in training


def test_cycles_graph_walk_by_hand():
    task = Cycles(cycle_n=2, scratchpad="inductive")
    # v1 > v2 > v3 > v4 > v1, one 4-cycle; A = v1, B = v3 two steps ahead.
    prompt = [task.token_ids[w] for w in "v1 > v2 ; v3 > v4 ; v2 > v3 ; v4 > v1 ; v1 ? v3 ; :".split()]
    assert task.decode(task.completion(prompt)) == "v2 # v3 # 1 ."
    prompt = [task.token_ids[w] for w in "v1 > v2 ; v3 > v4 ; v2 > v1 ; v4 > v3 ; v1 ? v3 ; :".split()]
    assert task.decode(task.completion(prompt)) == "v2 # v1 # 0 ."
    task.scratchpad = "full"
    assert task.decode(task.completion(prompt[:-1])) == "v1 > v2 > v1 ; 0 ."


def test_cycles_worked_example_of_the_docstring():
    lines = {}  # what the docstring shows after the prompt, one line per format
    for scratchpad in ("none", "full", "inductive"):
        task = get_task("cycles", cycle_n=3, scratchpad=scratchpad)
        prompt = task.prompts(task.sample(1, torch.Generator().manual_seed(1))[0])[0]
        start = ": " if scratchpad == "inductive" else ""  # ":" ends an inductive prompt
        lines[scratchpad] = start + task.decode(task.completion(prompt))
        assert f"{scratchpad:10s} {lines[scratchpad]}" in Cycles.__doc__
    assert task.decode(prompt).startswith("v46 > v39 ; v77 > v46 ;")


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
@pytest.mark.parametrize("options", CYCLE_SETTINGS)
def test_cycles_block_size_is_the_longest_row_of_either_split(options, scratchpad):
    task = get_task("cycles", scratchpad=scratchpad, **options)
    longest = 0
    for split in ("train", "test"):  # half the rows walk the longer of n and distance
        x, _ = task.sample(16, torch.Generator().manual_seed(0), split=split)
        longest = max(longest, int((x != CYCLE_PAD).sum(1).max()))
    assert task.block_size == longest


@pytest.mark.parametrize("options, test_size", [
    (dict(cycle_n=5, cycle_distance=3), (5, 3)),  # the test split follows training's distance
    (dict(cycle_n=5, cycle_distance=3, test_cycle_distance=7), (5, 7)),
    (dict(cycle_n=3, cycle_distance=2, test_cycle_n=6), (6, 6)),  # a test n of its own: its default
    (dict(cycle_n=5, cycle_distance=3, test_cycle_n=5), (5, 3)),  # training's n typed again
    (dict(cycle_n=4), (4, 4)), (dict(cycle_n=4, cycle_distance=1), (4, 1))])
def test_cycles_test_split_sizes_default_to_the_training_splits(options, test_size):
    task = get_task("cycles", **options)
    assert task.sizes["test"] == test_size


def test_cycles_default_names_cover_the_larger_test_graph():
    task = get_task("cycles", cycle_n=3, test_cycle_n=60)  # 120 nodes: more than 100 names
    assert task.n_names == 120 and get_task("cycles", cycle_n=3).n_names == 100
    x, _ = task.sample(2, torch.Generator().manual_seed(0), split="test")
    for row in x.tolist():
        words = [task.vocab[i] for i in row]
        query = words.index("?")
        assert len(set(words[0:query - 1:4])) == 120  # every edge from its own node


class MaskedWalker(torch.nn.Module):
    """Stands in for a model that has learned one step of the walk: the logit of each token it
    reads comes from what the inductive masks let that token see (group 0, its own group, earlier
    ones), so it writes the walk only if it is given the right groups. More than one previous
    state in view, or none of the start token, it writes <pad>."""

    def __init__(self, task):
        super().__init__()
        self.task = task
        self.config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, pos="none")
        self.pick_token = GPT.pick_token

    def next_word(self, seen):
        if ":" not in seen:
            return "<pad>"
        question, state = seen[:seen.index(":")], seen[seen.index(":") + 1:]
        q = question.index("?")
        successor = dict(zip(question[0:q - 1:4], question[2:q - 1:4]))
        a, b = question[q - 1], question[q + 1]
        if state == []:
            return successor[a]
        if len(state) in (1, 3) and state[-1] in ("0", "1"):
            return "."
        if len(state) in (1, 3):
            return "#"
        if len(state) == 2 and state[1] == "#":  # the previous state: one step on
            return "1" if state[0] == b else "0" if state[0] == a else successor[state[0]]
        return "<pad>"

    def forward(self, tokens, caches=None, positions=None, groups=None):
        assert caches is None and groups is not None
        logits = torch.zeros(*tokens.shape, self.config.vocab_size)
        for r in range(tokens.size(0)):
            for i in range(tokens.size(1)):
                seen = [self.task.vocab[int(tokens[r, j])] for j in range(i + 1)
                        if int(groups[r, j]) in (0, int(groups[r, i]))]
                logits[r, i, self.task.vocab.index(self.next_word(seen))] = 1.0
        return logits, None


def test_cycles_generation_under_the_masks_walks_the_graph_one_state_at_a_time():
    task = get_task("cycles", cycle_n=3, cycle_distance=2, scratchpad="inductive")
    x, _ = task.sample(4, torch.Generator().manual_seed(0))  # walks of 2 (connected) and 3 steps
    prompts = torch.tensor(task.prompts(x))
    out = task.generate(MaskedWalker(task), prompts, 12, use_cache=False)
    for prompt, row in zip(prompts.tolist(), out.tolist()):
        words = [task.vocab[i] for i in prompt]
        answer = expected_completion(words[:-1], "none", *task.sizes["train"])
        states = expected_completion(words[:-1], "inductive", *task.sizes["train"])[:-2:4]
        written = [task.vocab[i] for i in row[len(prompt):]]
        assert written[:written.index(".") + 1] == [w for s in states for w in (s, "#")] + answer


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
def test_cycles_describe_shows_a_written_answer_and_teacher_forced_predictions(scratchpad):
    task = get_task("cycles", cycle_n=2, scratchpad=scratchpad)
    x, y = task.sample(1, torch.Generator().manual_seed(0))
    prompt = task.prompts(x)[0]
    truth = task.decode(task.completion(prompt))
    # A row that wrote its stop token before the others goes on writing until they stop too.
    written = torch.tensor(prompt + task.completion(prompt) + task.completion(prompt)[:2])
    assert task.describe(written).endswith(f"truth : {truth}\nmodel : {truth}")
    n = int((y[0] != -1).sum())  # the scored tokens: the inductive copies are not among them
    assert task.describe(x[0], y[0], predictions=y[0]).endswith(
        f"model : {truth}  ({n}/{n} tokens, exact match)")
    # without labels, the solver's: the same lines
    assert task.describe(x[0], predictions=y[0]) == task.describe(x[0], y[0], predictions=y[0])


def test_cycles_layout_is_for_the_inductive_format_only():
    assert get_task("cycles", scratchpad="full").layout(torch.zeros(1, 3, dtype=torch.long)) == {}
    task = get_task("cycles", scratchpad="inductive")
    x, _ = task.sample(2, torch.Generator().manual_seed(0))
    layout = task.layout(x)
    assert layout["groups"].max() > 1 and layout["positions"].max() < task.block_size
    assert torch.equal(layout["groups"], inductive_layout(x, CYCLE_START, CYCLE_SEP)[1])


@pytest.mark.parametrize("scratchpad", ["none", "full", "inductive"])
def test_cycles_evaluate_scores_teacher_forced_and_generated_answers(scratchpad, monkeypatch):
    task = get_task("cycles", cycle_n=3, test_cycle_n=4, scratchpad=scratchpad)  # longer tests
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_embd=32,
                          n_head=2, attn="chacal"))
    metrics = task.evaluate(model, 6, 4, torch.Generator().manual_seed(0))
    assert 0 <= metrics["eval_answer_acc"] <= 1 and metrics["eval_loss"] > 0
    assert set(metrics["eval_acc_by_depth"]) == {"4"}
    # Generation replaced by a writer of known answers (the walk by hand's) that uses all the
    # room it is given: right in prompts 0, 2, 4, flipped in 1 and 3, and in 5 the right digit
    # first but no "." anywhere: the answer accuracy is 3 / 6.
    ids = task.token_ids
    written = iter(range(6))
    def write(model, prompts, room, use_cache=True):
        rows = []
        for prompt in prompts.tolist():
            k = next(written)
            words = [task.vocab[i] for i in prompt]
            right = expected_completion(words, "none", *task.sizes["test"])[0]
            answer = {"1": "0", "0": "1"}[right] if k in (1, 3) else right
            if k < 5:
                written_row = ([ids["v0"]] * room + [ids[answer], ids["."]])[-room:]
            else:
                written_row = ([ids[answer]] + [ids["v0"]] * room)[:room]
            rows.append(prompt + written_row if room > 0 else prompt)
        return torch.tensor(rows)
    monkeypatch.setattr(task, "generate", write)
    assert task.evaluate(model, 6, 4, torch.Generator().manual_seed(0))["eval_answer_acc"] == 3 / 6


def test_cycles_smoke_run_through_train_py(tmp_path):
    summary = train.main(["--task", "cycles", "--scratchpad", "inductive", "--cycle_n", "3",
                          "--n_embd", "32", "--n_head", "2", "--batch_size", "8",
                          "--eval_samples", "8", "--max_iters", "2", "--eval_interval", "2",
                          "--no-progress", "--device", "cpu", "--out_dir", str(tmp_path)])
    assert "eval_answer_acc" in summary["final"]


@pytest.mark.parametrize("flags, named", [
    (["--cycle_n", "1"], "--cycle_n"),
    (["--test_cycle_n", "1"], "--test_cycle_n"),
    (["--cycle_n", "3", "--cycle_distance", "6"], "--cycle_distance"),
    (["--cycle_distance", "0"], "--cycle_distance"),
    (["--test_cycle_n", "4", "--test_cycle_distance", "8"], "--test_cycle_distance"),
    (["--scratchpad", "dfs"], "--scratchpad"),
    (["--cycle_n", "4", "--cycle_names", "7"], "--cycle_names"),
])
def test_bad_cycles_flags_fail_at_start_with_one_line_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        train.main(["--task", "cycles", "--device", "cpu"] + flags)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("train.py: error:") and named in error[0]


@pytest.mark.parametrize("attn", ["dilated", "lego_v0", "lego_v1", "chacal_diagonal",
                                  "standard,dilated"])
def test_inductive_scratchpad_refuses_attentions_without_group_masks_at_start(attn, capsys):
    """Such an attention would fail at the first training step; train.py refuses it before."""
    flags = ["--task", "cycles", "--cycle_n", "2", "--attn", attn, "--n_layer",
             str(len(attn.split(","))), "--device", "cpu"]
    with pytest.raises(SystemExit) as stopped:
        train.main(flags + ["--scratchpad", "inductive"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("train.py: error:")
    assert f"--attn {attn}" in error[0] and "--scratchpad inductive" in error[0]
    train.parse_args(flags + ["--scratchpad", "full"])  # the same model, without groups: fine


def test_inductive_scratchpad_refuses_them_from_trained_weights_too(tmp_path, capsys):
    tiny = ["--task", "cycles", "--cycle_n", "2", "--scratchpad", "inductive", "--n_embd", "16",
            "--n_head", "2", "--batch_size", "4", "--eval_samples", "4", "--max_iters", "1",
            "--no-progress", "--device", "cpu"]
    train.main(tiny + ["--attn", "standard", "--out_dir", str(tmp_path / "standard")])
    with pytest.raises(SystemExit):  # chacal_diagonal has standard attention's weights
        train.parse_args(tiny + ["--attn", "chacal_diagonal", "--init_from",
                                 str(tmp_path / "standard"), "--out_dir", str(tmp_path / "swap")])
    assert "--attn chacal_diagonal cannot take" in capsys.readouterr().err


def test_cycles_typed_prompts_are_read_or_refused():
    task = get_task("cycles", scratchpad="inductive")
    x, n_prompt = task.example(None, "v1 > v2 ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3 ;")
    assert task.decode(x[0]) == "v1 > v2 ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3 ; :"
    assert n_prompt == x.size(1) == 21
    typed_start = task.example(None, "v1 > v2 ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3 ; :")
    assert torch.equal(typed_start[0], x) and typed_start[1] == 21  # the ":" as it was printed
    # Not cycles; an edge out of nowhere; a word that is no token; no ";" after the query (the
    # model's first token would be read as part of it); an edge without ">"; two edges out of v1.
    for bad in ("v1 > v2 ; v2 > v3 ; v3 > v2 ; v1 ? v5 ;", "v1 > v2 ; v1 ? v3 ;", "w1 ? v2 ;",
                "v1 > v2 ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3",
                "v1 v2 ; ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3 ;",
                "v1 > v2 ; v1 > v2 ; v2 > v1 ; v3 > v4 ; v4 > v3 ; v1 ? v3 ;"):
        with pytest.raises(ValueError, match="--prompt"):
            task.example(None, bad)


def test_cycles_decode_leaves_the_padding_out():
    task = get_task("cycles", scratchpad="inductive", cycle_distance=3)  # rows of two lengths
    x, _ = task.sample(8, torch.Generator().manual_seed(0))
    assert (x == CYCLE_PAD).any()
    for row in x:
        assert task.decode(row) == " ".join(task.vocab[int(i)] for i in row[row != CYCLE_PAD])


def test_cycles_flags_have_help():
    usage = train.build_parser().format_help()
    for flag in Cycles.flags:
        assert f"--{flag}" in usage and Cycles.flags[flag]["help"].split()[0] == "cycles:"
