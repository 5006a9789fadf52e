"""LEGO: the task's labels against a resolver written apart, and LEGO attention against its
definitions (maps built by explicit loops, causality, a GPT that trains with it)."""

import copy
import itertools
import math

import pytest
import torch

import bench
import train
from attention import ATTENTIONS, mimic, mimicking_loss, mimicking_targets
from conftest import docstring_lines
from data import LEGO, get_task
from model import GPT, GPTConfig


def batch(task, n=64, seed=0):
    return task.sample(n, torch.Generator().manual_seed(seed))


def chain_positions_by_hand(task, row):
    """{slot: chain position} for one row (list of ids), by walking each clause back to the root."""
    words = [task.vocab[i] for i in row[1:-1]]
    clauses = [words[s:s + 5] for s in range(0, len(words), 5)]
    slot_of = {clause[0]: s for s, clause in enumerate(clauses)}
    positions = {}
    for s, clause in enumerate(clauses):
        steps, argument = 0, clause[3]
        while argument not in task.value_words:
            steps, argument = steps + 1, clauses[slot_of[argument]][3]
        positions[s] = steps
    return positions


# ----------------------------------------------------------------------------------------------
# The task.

@pytest.mark.parametrize("group", ["z2", "s3"])
@pytest.mark.parametrize("n_vars, n_supervised, supervise_last",
                         [(3, None, False), (3, 1, False), (3, 1, True),
                          (12, None, False), (12, 6, False), (12, 5, True)])
def test_labels_match_the_resolver_and_are_minus_one_exactly_where_promised(
        group, n_vars, n_supervised, supervise_last):
    task = get_task("lego", group=group, n_vars=n_vars, n_supervised=n_supervised,
                    supervise_last=supervise_last)
    x, y = batch(task)
    solved = task.solve(x)
    trained = set(range(n_supervised or n_vars)) | ({n_vars - 1} if supervise_last else set())
    for r in range(x.size(0)):
        positions = chain_positions_by_hand(task, x[r].tolist())
        for t in range(x.size(1)):
            slot, offset = divmod(t - 1, 5)
            if 1 <= t <= 5 * n_vars and offset == 0 and positions[slot] in trained:
                assert y[r, t] == solved[r, t] and y[r, t] in task.values
            else:
                assert y[r, t] == -1
    x, y = task.sample(64, torch.Generator().manual_seed(1), split="test")  # the test scores all
    assert torch.equal(y, task.solve(x)) and (y[:, 1:-1:5] != -1).all()


@pytest.mark.parametrize("group", ["z2", "s3"])
@pytest.mark.parametrize("n_vars", [3, 12, 26])
def test_every_clause_is_five_tokens_and_the_variables_are_distinct(group, n_vars):
    task = get_task("lego", group=group, n_vars=n_vars)
    x, _ = batch(task)
    assert x.shape == (64, 5 * n_vars + 2) and task.block_size == 5 * n_vars + 2
    for row in x.tolist():
        words = [task.vocab[i] for i in row]
        assert words[0] == "[CLS]" and words[-1] == "[SEP]"
        clauses = [words[s:s + 5] for s in range(1, 5 * n_vars + 1, 5)]
        variables = [clause[0] for clause in clauses]
        assert len(set(variables)) == n_vars
        assert all(v in "abcdefghijklmnopqrstuvwxyz" for v in variables)
        for variable, equals, op, argument, comma in clauses:
            assert (equals, comma) == ("=", ",") and op in task.ops
            assert argument in task.value_words or argument in variables
        assert sum(clause[3] in task.value_words for clause in clauses) == 1  # one root
        root = next(clause for clause in clauses if clause[3] in task.value_words)
        assert root[2] == task.ops[0]
        assert all(LEGO.apply(root[2], value) == value for value in task.value_words)  # identity


@pytest.mark.parametrize("group", ["z2", "s3"])
def test_the_root_value_and_the_other_ops_are_uniform(group):
    task = get_task("lego", group=group, n_vars=12)
    x, _ = batch(task, 6000)
    clauses = x[:, 1:-1].reshape(-1, 5)
    is_root = clauses[:, 3] >= task.first_value
    for column, mask, n in ((3, is_root, len(task.values)), (2, ~is_root, len(task.ops))):
        counts = clauses[mask, column].bincount(minlength=task.vocab_size)
        counts = counts[counts > 0].double()
        assert len(counts) == n and (counts / counts.mean() - 1).abs().max() < 0.1


@pytest.mark.parametrize("group", ["z2", "s3"])
def test_chain_depth_gives_the_chain_position_at_left_hand_tokens(group):
    task = get_task("lego", group=group, n_vars=12)
    x, _ = batch(task)
    depth = task.chain_depth(x)
    for r in range(x.size(0)):
        positions = chain_positions_by_hand(task, x[r].tolist())
        assert depth[r, 1:-1:5].tolist() == [positions[s] for s in range(12)]
        assert sorted(positions.values()) == list(range(12))
    others = torch.ones(x.size(1), dtype=torch.bool)
    others[1:-1:5] = False
    assert (depth[:, others] == -1).all()


def test_the_docstring_example():
    # The grid in LEGO's docstring, read back: its token, y and chain rows.
    rows = {line.split()[0]: line.split()[1:] for line in docstring_lines(LEGO)
            if line.startswith(" " * 4) and line.split()[0] in ("token", "y", "chain")}
    sentence = " ".join(rows["token"])
    assert sentence == "[CLS] a = - c , b = + 1 , c = - b , [SEP]"
    task = get_task("lego", n_vars=3)
    x = task.encode(sentence)[None]
    labels = [task.vocab[i] if i != -1 else "-" for i in task.solve(x)[0].tolist()]
    assert labels == rows["y"]
    depth = [str(d) if d != -1 else "-" for d in task.chain_depth(x)[0].tolist()]
    assert depth == rows["chain"]
    assert task.decode(x[0]) == sentence
    assert "#0 b=1  #1 c=0  #2 a=1" in task.describe(x[0])


def test_vocabularies_and_what_the_model_is_built_for():
    z2, s3 = get_task("lego", group="z2"), get_task("lego", group="s3")
    assert (z2.vocab_size, s3.vocab_size) == (34, 42)
    for task in (z2, s3):
        assert [task.vocab[i] for i in task.broadcast_ids] == ["[CLS]", "[SEP]"]
        assert [task.vocab[i] for i in task.values] == task.value_words
    assert s3.value_words == ["012", "021", "102", "120", "201", "210"]
    assert s3.ops == ["p" + value for value in s3.value_words]
    assert LEGO.apply("p120", "012") == "120" and LEGO.apply("-", "0") == "1"
    assert s3.decode(s3.encode("p021 210")) == "p021 210"


# The chain followed apart from the task's solver, with each group's action written out.

def resolve(words, act):
    """{variable: value word} of one sentence (its words, [CLS] .. [SEP]): start at the clause
    whose argument is a value, then follow the chain, setting each variable to act(op, the
    value before it), on words."""
    clauses = [words[s:s + 5] for s in range(1, len(words) - 1, 5)]
    reading = {clause[3]: clause for clause in clauses}  # the clause that reads each argument
    clause = next(clause for clause in clauses if clause[3] not in {c[0] for c in clauses})
    values = {clause[0]: act(clause[2], clause[3])}
    while clause[0] in reading:
        previous, clause = clause[0], reading[clause[0]]
        values[clause[0]] = act(clause[2], values[previous])
    assert len(values) == len(clauses)
    return values


def test_z2_labels_match_a_resolver_where_plus_keeps_and_minus_flips():
    # Task 1 by its definition, apart from LEGO.apply and the images table: - is XOR with 1.
    task = get_task("lego", group="z2")
    x, y = task.sample(100, torch.Generator().manual_seed(0), split="test")  # every clause scored
    for ids, labels in zip(x.tolist(), y.tolist()):
        words = [task.vocab[i] for i in ids]
        values = resolve(words, lambda op, value: str(int(value) ^ (op == "-")))
        assert [task.vocab[labels[t]] for t in range(1, len(words) - 1, 5)] == \
               [values[words[t]] for t in range(1, len(words) - 1, 5)]


# S3 by brute force: every element a tuple (p(0), p(1), p(2)) from itertools, products written out.

def element(word):
    """The permutation a value word (120) or an op word (p120) names: i -> digit i."""
    return tuple(int(digit) for digit in word.removeprefix("p"))


def left_product(g, x):
    """g·x: x first, then g."""
    return tuple(g[x[i]] for i in range(3))


def right_product(g, x):
    """x·g: g first, then x. Not what LEGO's clause means; the tests show it gives other labels."""
    return tuple(x[g[i]] for i in range(3))


def resolve_s3(words, product):
    """resolve() in S3: each variable is product(op, the value before it), as permutations."""
    return resolve(words, lambda op, value: "".join(map(str, product(element(op),
                                                                     element(value)))))


def test_s3_acts_on_itself_its_ops_and_values_are_the_six_permutations():
    task = get_task("lego", group="s3")
    group = set(itertools.permutations(range(3)))
    assert {element(w) for w in task.value_words} == {element(w) for w in task.ops} == group
    for op, row in zip(task.ops, task.images.tolist()):  # every product, against the table
        for value, image in zip(task.value_words, row):
            expected = left_product(element(op), element(value))
            assert element(task.value_words[image]) == expected == element(LEGO.apply(op, value))


def test_s3_labels_match_a_brute_force_left_multiplication_and_not_the_right_one():
    task = get_task("lego", group="s3", n_vars=6)
    x, y = batch(task, 200)
    rows_where_the_order_matters = 0
    for ids, labels in zip(x.tolist(), y.tolist()):
        words = [task.vocab[i] for i in ids]
        left, right = resolve_s3(words, left_product), resolve_s3(words, right_product)
        assert [task.vocab[labels[t]] for t in range(1, len(words) - 1, 5)] == \
               [left[words[t]] for t in range(1, len(words) - 1, 5)]
        rows_where_the_order_matters += left != right
    assert rows_where_the_order_matters > 100  # most chains of 6 tell g·x from x·g


def test_the_s3_docstring_example():
    sentence = "[CLS] b = p201 c , a = p012 120 , c = p021 a , [SEP]"
    resolved = "#0 a=120  #1 c=210  #2 b=102"
    doc = " ".join(LEGO.__doc__.split())
    assert sentence in doc and " ".join(resolved.split()) in doc
    task = get_task("lego", group="s3", n_vars=3)
    x = task.encode(sentence)[None]
    assert resolved in task.describe(x[0])
    words = sentence.split()
    assert resolve_s3(words, left_product) == {"a": "120", "c": "210", "b": "102"}
    assert resolve_s3(words, right_product)["c"] == "102"  # a·p021, the other order
    assert [task.vocab[i] for i in task.solve(x)[0, 1:-1:5].tolist()] == ["102", "120", "210"]


def test_clauses_are_shuffled_and_the_chain_visits_the_variables_in_random_order():
    # Neither the sentence order nor the alphabet may give the chain away: with n = 5, a chain
    # written in sentence order, or in alphabetical order, happens by chance in 1 row of 120.
    task = get_task("lego", n_vars=5)
    x, _ = batch(task, 300)
    in_sentence_order = in_alphabetical_order = 0
    root_slots = set()
    for row in x.tolist():
        positions = chain_positions_by_hand(task, row)
        slots = sorted(positions, key=positions.get)  # the slots in chain order
        variables = [task.vocab[row[1 + 5 * s]] for s in slots]
        in_sentence_order += slots == sorted(slots)
        in_alphabetical_order += variables == sorted(variables)
        root_slots.add(slots[0])
    assert in_sentence_order < 15 and in_alphabetical_order < 15
    assert root_slots == set(range(5))  # the root's clause anywhere


def test_n_supervised_may_be_every_chain_position():
    task = get_task("lego", n_vars=4, n_supervised=4)
    x, y = batch(task, 8)
    assert (y[:, 1:-1:5] != -1).all()


def test_the_solver_applies_the_roots_op_to_a_typed_sentence():
    # sample() always writes the identity at the root; a typed sentence need not.
    z2 = get_task("lego", n_vars=2)
    x = z2.encode("[CLS] b = + a , a = - 1 , [SEP]")[None]
    assert [z2.vocab[i] for i in z2.solve(x)[0, 1:-1:5].tolist()] == ["0", "0"]  # a = -1, b = a
    s3 = get_task("lego", group="s3", n_vars=1)
    x = s3.encode("[CLS] a = p120 021 , [SEP]")[None]
    # p120·021: 0 -> 0 -> 1, 1 -> 2 -> 0, 2 -> 1 -> 2
    assert s3.vocab[int(s3.solve(x)[0, 1])] == "102"


def test_describe_counts_only_the_scored_positions():
    task = get_task("lego", n_vars=3)
    x = task.encode("[CLS] a = - c , b = + 1 , c = - b , [SEP]")  # b=1, c=0, a=1
    truth = task.solve(x[None])[0]
    y = torch.full_like(x, -1)
    y[6] = truth[6]                        # only b, the root, scored
    predictions = truth.clone()
    predictions[6] = task.token_ids["0"]   # b wrong; a and c right but not scored
    assert "(0/1 scored right)" in task.describe(x, y, predictions)


def test_sampling_is_seeded():
    task = get_task("lego", group="s3")
    x1, y1 = batch(task, 1000, seed=3)
    x2, y2 = batch(task, 1000, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, batch(task, 1000, seed=4)[0])


def test_a_small_bidirectional_model_learns_the_root_in_a_few_steps():
    # #0 is read from its own clause; were it the XOR of two tokens (a random op at the root),
    # this model would stay at chance for thousands of steps.
    torch.manual_seed(0)
    task = get_task("lego", n_vars=4, n_supervised=1)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=1,
                          n_head=2, n_embd=32, attn="standard", causal=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        _, loss = model(*task.sample(64, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    x, y = task.sample(512, generator)
    scored = y != -1
    assert (model(x)[0].argmax(-1)[scored] == y[scored]).float().mean() > 0.95


@pytest.mark.parametrize("options, flag", [
    (dict(n_vars=27), "--n_vars 27 exceeds"), (dict(n_vars=0), "--n_vars 0"),
    (dict(n_supervised=0), "--n_supervised 0"), (dict(n_supervised=13), "--n_supervised 13"),
    (dict(group="z3"), "--group"),
])
def test_bad_options_raise_naming_the_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        get_task("lego", **options)


def test_supervise_last_typed_to_train_py_trains_on_the_last_position():
    _, task, _, _ = train.parse_args(["--task", "lego", "--bidirectional", "--n_vars", "6",
                                      "--n_supervised", "3", "--supervise_last"])
    assert task.supervised.tolist() == [True, True, True, False, False, True]


# ----------------------------------------------------------------------------------------------
# LEGO attention.

TOKENS = torch.tensor([[0, 5, 7, 5, 9, 7, 5, 1, 4]])  # 0 = [CLS], 1 = [SEP] here


def lego_attention(name, causal, n_embd=16, n_head=2, broadcast_ids=(0, 1)):
    torch.manual_seed(0)
    config = GPTConfig(n_embd=n_embd, n_head=n_head, attn=name, causal=causal,
                       broadcast_ids=broadcast_ids)
    return ATTENTIONS[name](config).double()


@pytest.mark.parametrize("causal", [False, True])
def test_association_and_broadcast_maps_follow_their_definitions(causal):
    u = TOKENS[0].tolist()
    T = len(u)
    maps = lego_attention("lego_v0", causal).fixed_maps(TOKENS, torch.float64)[0]
    assert maps.shape == (3, T, T)
    rules = [lambda i, j: u[i] == u[j], lambda i, j: u[j] == 0, lambda i, j: u[j] == 1]
    for m, rule in enumerate(rules):
        expected = torch.zeros(T, T, dtype=torch.float64)
        for i in range(T):
            for j in range(T):
                expected[i, j] = float(rule(i, j) and (j <= i or not causal))
            if expected[i].sum() > 0:
                expected[i] /= expected[i].sum()
        torch.testing.assert_close(maps[m], expected, rtol=0, atol=1e-15)  # 1/3 in float64
    sums = maps.sum(dim=-1)
    # Association always has the diagonal, and [CLS] comes first: their rows all sum to 1.
    torch.testing.assert_close(sums[:2], torch.ones(2, T, dtype=torch.float64))
    if causal:  # [SEP] is at position 7: nothing before it has a [SEP] to read
        assert (maps.triu(1) == 0).all()
        assert sums[2].tolist() == [0.0] * 7 + [1.0, 1.0]
    else:
        torch.testing.assert_close(sums[2], torch.ones(T, dtype=torch.float64))


def test_without_broadcast_ids_only_association_is_built():
    maps = lego_attention("lego_v0", False, broadcast_ids=()).fixed_maps(TOKENS)
    assert maps.shape == (1, 1, 9, 9)


@pytest.mark.parametrize("name, n_head, layout", [("lego_v0", 2, (0, 4, 4)), ("lego_v1", 2, (1, 2, 2)),
                                                  ("lego_v1", 4, (2, 2, 2))])
@pytest.mark.parametrize("causal", [False, True])
def test_output_equals_pathways_and_heads_computed_by_hand(name, n_head, layout, causal):
    # n_embd 16. v0: four pathways share the 16 channels, 4 each. v1 with 2 heads of 8: one
    # standard head, and the other head's 8 channels shared by the four pathways, 2 each; with
    # 4 heads of 4: two standard heads (their outputs side by side), and 8 channels as before.
    attn = lego_attention(name, causal, n_head=n_head)
    assert (attn.n_standard, attn.map_width, attn.conv_width) == layout
    kept, w, hs, T = layout[0], layout[1], 16 // n_head, 9
    x = torch.randn(1, T, 16, dtype=torch.float64)
    values = x[0] @ attn.c_value.weight.T + attn.c_value.bias            # (T, 3w + conv)
    maps = attn.fixed_maps(TOKENS, torch.float64)[0]
    heads = [maps[p] @ values[:, p * w:(p + 1) * w] for p in range(3)]
    conv_values = values[:, 3 * w:]
    left = 20 if causal else 10  # how far back the kernel's first tap reads
    conv = torch.zeros(T, attn.conv_width, dtype=torch.float64)
    for i in range(T):
        for c in range(attn.conv_width):
            conv[i, c] = attn.conv.bias[c]
            for tap in range(21):
                source = i - left + tap
                if 0 <= source < T:
                    conv[i, c] += attn.conv.weight[c, 0, tap] * conv_values[source, c]
    standard = []
    if kept:
        q, k, v = (x[0] @ attn.c_attn.weight.T + attn.c_attn.bias).split(kept * hs, dim=1)
        for h in range(kept):
            part = slice(h * hs, (h + 1) * hs)
            scores = q[:, part] @ k[:, part].T / math.sqrt(hs)
            if causal:
                scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            standard.append(scores.softmax(dim=-1) @ v[:, part])
    expected = attn.c_proj(torch.cat(heads + [conv] + standard, dim=1))
    torch.testing.assert_close(attn(x, token_ids=TOKENS)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["lego_v0", "lego_v1"])
def test_causal_lego_attention_never_reads_the_future(name):
    attn = lego_attention(name, causal=True)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    ids = TOKENS.expand(2, 9).clone()
    changed_x, changed_ids = x.clone(), ids.clone()
    changed_x[:, 5] += 1.0
    changed_ids[:, 5] = 5  # also the token id: now equal to the earlier 5s
    out, out_changed = attn(x, token_ids=ids), attn(changed_x, token_ids=changed_ids)
    torch.testing.assert_close(out[:, :5], out_changed[:, :5], rtol=0, atol=0)
    assert (out[:, 5:] - out_changed[:, 5:]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["lego_v0", "lego_v1"])
def test_bidirectional_lego_attention_lets_later_tokens_matter(name):
    attn = lego_attention(name, causal=False)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 7] += 1.0
    out, out_changed = attn(x, token_ids=TOKENS), attn(changed, token_ids=TOKENS)
    assert (out[:, :7] - out_changed[:, :7]).abs().max() > 1e-6


@pytest.mark.parametrize("name, c_proj_in", [("lego_v0", 16), ("lego_v1", 16)])
def test_forward_and_backward_run_and_both_are_as_wide_as_standard_attention(name, c_proj_in):
    attn = lego_attention(name, causal=False)
    assert attn.c_proj.in_features == c_proj_in
    assert hasattr(attn, "c_attn") == (name == "lego_v1")
    out = attn(torch.randn(2, 9, 16, dtype=torch.float64), token_ids=TOKENS.expand(2, 9))
    out.square().sum().backward()
    assert out.shape == (2, 9, 16)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("name, n_embd, n_head, kept, map_width, conv_width", [
    ("lego_v0", 128, 4, 0, 32, 32), ("lego_v0", 16, 2, 0, 4, 4), ("lego_v0", 18, 2, 0, 4, 6),
    ("lego_v1", 128, 4, 2, 16, 16), ("lego_v1", 16, 2, 1, 2, 2), ("lego_v1", 256, 8, 4, 32, 32),
    ("lego_v1", 48, 3, 1, 8, 8), ("lego_v1", 12, 2, 1, 1, 3)])
def test_the_pathways_share_the_channels_of_the_heads_they_replace(name, n_embd, n_head, kept,
                                                                   map_width, conv_width):
    # v0 replaces every head; v1 keeps half of them, rounded down. The four pathways
    # (association, [CLS], [SEP], the convolution) split what is left; the conv takes the rest.
    attn = lego_attention(name, causal=False, n_embd=n_embd, n_head=n_head)
    assert (attn.n_standard, attn.map_width, attn.conv_width) == (kept, map_width, conv_width)
    replaced = n_embd - kept * (n_embd // n_head)  # the channels of the heads replaced
    assert attn.c_value.out_features == 3 * map_width + conv_width == replaced
    assert attn.c_proj.in_features == n_embd  # as wide as standard attention
    if kept:
        assert attn.c_attn.out_features == 3 * kept * (n_embd // n_head)


@pytest.mark.parametrize("n_embd, n_head", [(128, 4), (32, 2), (256, 8)])
def test_v0_and_v1_have_fewer_parameters_and_flops_than_standard_attention(n_embd, n_head):
    # bench.py's counter (its table 4): FLOPs of one forward + backward of a one-layer
    # bidirectional model, with softmax attention through its readable path so it is counted,
    # and the attention's parameters.
    lego = dict(causal=False, broadcast_ids=(0, 1))
    size = dict(n_embd=n_embd, n_head=n_head)
    (flops, params), *lego_counts = [bench.count_step(attn, 64, 128, size, **lego)
                                     for attn in ["standard", "lego_v0", "lego_v1"]]
    for lego_flops, lego_params in lego_counts:
        assert lego_params < params and lego_flops < flops


@pytest.mark.parametrize("name, options, flag", [
    ("lego_v1", dict(n_head=1, n_embd=16), "--n_head 2 or more"),
    ("lego_v1", dict(n_head=2, n_embd=4), "--attn lego_v1 .* raise --n_embd"),
    ("lego_v0", dict(n_head=1, n_embd=3), "--attn lego_v0 .* raise --n_embd")])
def test_too_few_heads_or_channels_raise_naming_the_flag(name, options, flag):
    with pytest.raises(ValueError, match=flag):
        lego_attention(name, causal=False, **options)


def test_lego_attention_refuses_a_decoding_cache():
    from attention import LayerCache
    with pytest.raises(ValueError, match="use_cache=False"):
        lego_attention("lego_v0", causal=True)(torch.randn(1, 3, 16, dtype=torch.float64),
                                               cache=LayerCache())


def test_a_bidirectional_gpt_with_lego_v1_trains_on_lego_and_shows_its_maps():
    task = get_task("lego", group="s3", n_vars=4)
    torch.manual_seed(0)
    config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=2,
                       n_head=2, n_embd=32, attn="lego_v1", causal=False,
                       broadcast_ids=task.broadcast_ids)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(5):
        x, y = task.sample(16, generator)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    maps = model.attention_maps(x)
    assert len(maps) == 2
    assert all(m.shape == (16, 3 + 1, task.block_size, task.block_size) for m in maps)  # 1 kept
    torch.testing.assert_close(maps[0][:, :3].sum(-1), torch.ones(16, 3, task.block_size))
    # The kept softmax head is bidirectional too: by hand, softmax(q kᵀ / √hs) over every key.
    block, h = model.transformer.h[0], model.transformer.wpe.weight[:task.block_size]
    q, k, _ = block.attn.c_attn(block.ln_1(model.transformer.wte(x) + h)).split(16, dim=2)
    expected = (q @ k.transpose(1, 2) / 16 ** 0.5).softmax(dim=-1)
    torch.testing.assert_close(maps[0][:, 3], expected)
    future = torch.ones(task.block_size, task.block_size, dtype=torch.bool).triu(1)
    assert (maps[0][:, 3][:, future] > 0).all()  # every later key has weight


def test_lego_attention_alone_counts_every_token_as_distinct():
    attn = lego_attention("lego_v0", causal=False)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    distinct = attn(x, token_ids=torch.arange(100, 109).expand(2, 9))  # no broadcast id among them
    torch.testing.assert_close(attn(x), distinct)
    assert not torch.allclose(attn(x, token_ids=torch.zeros(2, 9, dtype=torch.long)), distinct)
    assert torch.equal(attn.fixed_maps(torch.arange(100, 109).expand(2, 9))[:, 0], torch.eye(9).expand(2, 9, 9))


@pytest.mark.parametrize("causal", [False, True])  # a causal map is 0 on the future: no NaN from log 0
def test_mimicking_lowers_the_mimicking_loss(causal):
    torch.manual_seed(0)
    task = get_task("lego", n_vars=4)  # unlabelled LEGO sentences, as in the paper
    config = GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=2,
                       n_head=2, n_embd=32, attn="standard", causal=causal)
    model = GPT(config)
    x, _ = task.sample(16, torch.Generator().manual_seed(1))
    loss = lambda: mimicking_loss(model.attention_maps(x), x, causal).item()
    before = loss()
    generator = torch.Generator().manual_seed(0)
    batches = (task.sample(16, generator)[0] for _ in range(40))
    losses = mimic(model, batches, lr=3e-3, betas=(0.9, 0.98))
    assert len(losses) == 40
    assert loss() < 0.5 * before
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_mimicking_steps_are_adamw_without_weight_decay():
    # Weight decay would shrink the embeddings and gains too: mimic's steps are AdamW's at 0.
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=10, n_layer=2, n_head=2, n_embd=16,
                          attn="standard"))
    by_hand = copy.deepcopy(model)
    x = torch.randint(0, 10, (4, 12), generator=torch.Generator().manual_seed(1))
    mimic(model, [x, x], lr=1e-2, betas=(0.9, 0.95))
    optimizer = torch.optim.AdamW(by_hand.parameters(), 1e-2, (0.9, 0.95), weight_decay=0)
    for batch in [x, x]:
        mimicking_loss(by_hand.attention_maps(batch), batch, True).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (name, mimicked), stepped in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(mimicked, stepped, rtol=0, atol=1e-7, msg=name)


def test_mimicking_loss_is_the_reverse_kl_to_each_heads_target():
    tokens = torch.tensor([[5, 7, 5, 9, 7, 5]])
    maps = torch.rand(1, 3, 6, 6, generator=torch.Generator().manual_seed(0)).softmax(-1)
    # By hand, in float64: smooth each map as the targets are, then Σ_k p_k log(p_k / q_k) per
    # query, averaged over queries; head 0 against manipulation, head 1 against association.
    smooth = lambda m: (m + 1e-3) / (m + 1e-3).sum(-1, keepdim=True)
    manipulation = torch.tensor([[{0: 4, 1: 2, 2: 1}.get(abs(i - j), 0) for j in range(6)]
                                 for i in range(6)], dtype=torch.double)
    association = torch.tensor([[float(a == b and i != j) for j, b in enumerate(tokens[0].tolist())]
                                for i, a in enumerate(tokens[0].tolist())], dtype=torch.double)
    expected = 0.0
    for head, target in ((0, smooth(manipulation)), (1, smooth(association))):
        p = smooth(maps[0, head].double())
        expected += (p * (p / target).log()).sum(-1).mean().item()
    assert abs(mimicking_loss([maps], tokens, causal=False).item() - expected) < 1e-5
    assert abs(mimicking_loss([maps, maps], tokens, causal=False).item() - 2 * expected) < 1e-5


def test_mimicking_targets_follow_their_definitions():
    tokens = torch.tensor([[5, 7, 5, 9, 7, 5]])
    manipulation, association = mimicking_targets(tokens, causal=False)
    raw = torch.zeros(6, 6)
    for i in range(6):
        for j in range(6):
            raw[i, j] = {0: 4, 1: 2, 2: 1}.get(abs(i - j), 0)
    expected = (raw + 1e-3) / (raw + 1e-3).sum(dim=1, keepdim=True)
    torch.testing.assert_close(manipulation[0], expected)
    equal = torch.tensor([[float(a == b and i != j) for j, b in enumerate(tokens[0])]
                          for i, a in enumerate(tokens[0])])
    torch.testing.assert_close(association[0], (equal + 1e-3) / (equal + 1e-3).sum(1, keepdim=True))
    # Causal (the toy task's mimicking): the same weights on the past and the query itself only
    for target, weights in zip(mimicking_targets(tokens, causal=True), (raw, equal)):
        kept = (weights + 1e-3).tril()
        torch.testing.assert_close(target[0], kept / kept.sum(1, keepdim=True))


@pytest.mark.parametrize("n_supervised", [None, 5, 6])
def test_supervise_last_with_no_gap_before_the_last_position_is_refused(n_supervised):
    with pytest.raises(ValueError, match="--supervise_last .* needs k below 5") as refused:
        get_task("lego", n_vars=6, n_supervised=n_supervised, supervise_last=True)
    assert str(refused.value).endswith("; set --n_supervised") == (n_supervised is None)  # k not typed
    get_task("lego", n_vars=6, n_supervised=4, supervise_last=True)  # #0..#3 and #5: a gap at #4
