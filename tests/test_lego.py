"""LEGO: the task's labels against resolvers written apart (Z2 by XOR, S3 by permutations from
itertools), LEGO attention against its definitions (maps and pathways built by loops), and
mimicking against the reverse KL computed by hand."""

import copy
import inspect
import itertools
import math

import pytest
import torch

from attention import ATTENTIONS, mimic, mimicking_loss, mimicking_targets
from data import LEGO, get_task
from model import GPT, GPTConfig


def batch(task, n=64, seed=0, split="train"):
    return task.sample(n, torch.Generator().manual_seed(seed), split=split)


def resolve(words, act):
    """{variable: value word} of one sentence ([CLS] .. [SEP]): start at the clause whose
    argument is a value, then follow the chain, each variable act(op, the value before it)."""
    clauses = [words[s:s + 5] for s in range(1, len(words) - 1, 5)]
    reading = {clause[3]: clause for clause in clauses}  # the clause that reads each argument
    clause = next(clause for clause in clauses if clause[3] not in {c[0] for c in clauses})
    values, steps = {clause[0]: act(clause[2], clause[3])}, {clause[0]: 0}
    while clause[0] in reading:
        previous, clause = clause[0], reading[clause[0]]
        values[clause[0]], steps[clause[0]] = act(clause[2], values[previous]), steps[previous] + 1
    assert len(values) == len(clauses)
    return values, steps


def element(word):
    """The permutation a value word (120) or an op word (p120) names: i -> digit i."""
    return tuple(int(digit) for digit in word.removeprefix("p"))


def left_product(g, x):  # g·x: x first, then g
    return tuple(g[x[i]] for i in range(3))


def right_product(g, x):  # x·g: not what a LEGO clause means; it gives other labels
    return tuple(x[g[i]] for i in range(3))


ACTIONS = {"z2": lambda op, value: str(int(value) ^ (op == "-")),  # - flips, + keeps
           "s3": lambda op, value: "".join(map(str, left_product(element(op), element(value))))}


@pytest.mark.parametrize("group", ["z2", "s3"])
@pytest.mark.parametrize("n_vars, n_supervised, supervise_last", [(3, None, False), (12, 6, False), (12, 5, True)])
def test_labels_match_a_resolver_and_are_scored_where_promised(group, n_vars, n_supervised, supervise_last):
    task = get_task("lego", group=group, n_vars=n_vars, n_supervised=n_supervised, supervise_last=supervise_last)
    trained = set(range(n_supervised or n_vars)) | ({n_vars - 1} if supervise_last else set())
    for split in ("train", "test"):  # the test split scores every clause
        x, y = batch(task, split=split)
        solved = task.solve(x)  # every clause's label: training scores the first n_supervised of a chain
        assert x.shape == (64, 5 * n_vars + 2) and torch.equal(y[y != -1], solved[y != -1])
        depth = task.chain_depth(x)
        for ids, labels, depths in zip(x.tolist(), y.tolist(), depth.tolist()):
            words = [task.vocab[i] for i in ids]
            assert words[0] == "[CLS]" and words[-1] == "[SEP]" and words[2:-1:5] == ["="] * n_vars
            values, steps = resolve(words, ACTIONS[group])
            for t in range(1, len(words) - 1, 5):
                assert depths[t] == steps[words[t]]
                scored = split == "test" or steps[words[t]] in trained
                assert labels[t] == (task.vocab.index(values[words[t]]) if scored else -1)
            assert all(labels[t] == -1 == depths[t] for t in range(len(words)) if t % 5 != 1 or t == len(words) - 1)


def test_s3_products_are_left_multiplications_of_the_six_permutations():
    task = get_task("lego", group="s3", n_vars=6)
    group = set(itertools.permutations(range(3)))
    assert {element(w) for w in task.value_words} == {element(w) for w in task.ops} == group
    x, y = batch(task, 200)
    differs = 0
    for ids in x.tolist():  # the right product would label some rows otherwise
        words = [task.vocab[i] for i in ids]
        differs += resolve(words, ACTIONS["s3"])[0] != resolve(
            words, lambda op, value: "".join(map(str, right_product(element(op), element(value)))))[0]
    assert differs > 50
    s3 = get_task("lego", group="s3", n_vars=1)  # a typed root op: p120·021 = 102
    assert s3.vocab[int(s3.solve(s3.encode("[CLS] a = p120 021 , [SEP]")[None])[0, 1])] == "102"


def test_clauses_are_shuffled_and_roots_and_ops_uniform():
    task = get_task("lego", n_vars=5)
    x, _ = batch(task, 600)
    in_order, root_slots = 0, set()
    for ids in x.tolist():
        steps = resolve([task.vocab[i] for i in ids], ACTIONS["z2"])[1]
        slots = sorted(range(5), key=lambda s: steps[task.vocab[ids[1 + 5 * s]]])
        in_order += slots == sorted(slots)
        root_slots.add(slots[0])
    assert in_order < 20 and root_slots == set(range(5))  # 1 row in 120 by chance
    clauses = x[:, 1:-1].reshape(-1, 5)
    is_root = clauses[:, 3] >= task.first_value
    for column, mask in ((3, is_root), (2, ~is_root)):
        counts = clauses[mask, column].bincount(minlength=task.vocab_size).double()
        counts = counts[counts > 0]
        assert (counts / counts.mean() - 1).abs().max() < 0.15


def test_the_docstring_example():
    doc = [line.split() for line in inspect.cleandoc(LEGO.__doc__).splitlines() if line.startswith("    ")]
    rows = {line[0]: line[1:] for line in doc if line[0] in ("token", "y", "chain")}
    task = get_task("lego", n_vars=3)
    x = task.encode(" ".join(rows["token"]))[None]
    assert [task.vocab[i] if i != -1 else "-" for i in task.solve(x)[0].tolist()] == rows["y"]
    assert [str(d) if d != -1 else "-" for d in task.chain_depth(x)[0].tolist()] == rows["chain"]


# LEGO attention.

TOKENS = torch.tensor([[0, 5, 7, 5, 9, 7, 5, 1, 4]])  # 0 = [CLS], 1 = [SEP] here


def lego_attention(name, causal, n_embd=16, n_head=2, broadcast_ids=(0, 1)):
    torch.manual_seed(0)
    return ATTENTIONS[name](GPTConfig(n_embd=n_embd, n_head=n_head, attn=name, causal=causal,
                                      broadcast_ids=broadcast_ids)).double()


@pytest.mark.parametrize("causal", [False, True])
def test_association_and_broadcast_maps_follow_their_definitions(causal):
    u, T = TOKENS[0].tolist(), 9
    maps = lego_attention("lego_v0", causal).fixed_maps(TOKENS, torch.float64)[0]
    rules = [lambda i, j: u[i] == u[j], lambda i, j: u[j] == 0, lambda i, j: u[j] == 1]
    assert maps.shape == (3, T, T)
    for m, rule in enumerate(rules):
        expected = torch.tensor([[float(rule(i, j) and (j <= i or not causal)) for j in range(T)]
                                 for i in range(T)], dtype=torch.float64)
        expected /= expected.sum(-1, keepdim=True).clamp(min=1)
        torch.testing.assert_close(maps[m], expected, rtol=0, atol=1e-15)
    alone = lego_attention("lego_v0", False, broadcast_ids=())  # no broadcast ids: association alone
    assert alone.fixed_maps(TOKENS).shape == (1, 1, 9, 9)
    x = torch.randn(2, 9, 16, dtype=torch.float64)  # without token ids every token is distinct
    torch.testing.assert_close(alone(x), alone(x, token_ids=torch.arange(100, 109).expand(2, 9)))


@pytest.mark.parametrize("name, n_head, layout", [("lego_v0", 2, (0, 4, 4)), ("lego_v1", 2, (1, 2, 2)),
                                                  ("lego_v1", 4, (2, 2, 2))])
@pytest.mark.parametrize("causal", [False, True])
def test_output_equals_pathways_and_heads_computed_by_hand(name, n_head, layout, causal):
    # n_embd 16. v0: four pathways (association, [CLS], [SEP], a convolution) share the 16
    # channels, 4 each. v1 keeps half the heads standard; the pathways share the rest.
    attn = lego_attention(name, causal, n_head=n_head)
    assert (attn.n_standard, attn.map_width, attn.conv_width) == layout
    kept, w, hs, T = layout[0], layout[1], 16 // n_head, 9
    x = torch.randn(1, T, 16, dtype=torch.float64)
    values = x[0] @ attn.c_value.weight.T + attn.c_value.bias
    maps = attn.fixed_maps(TOKENS, torch.float64)[0]
    heads = [maps[p] @ values[:, p * w:(p + 1) * w] for p in range(3)]
    left = 20 if causal else 10  # where the 21-tap kernel's first tap reads
    conv = torch.zeros(T, attn.conv_width, dtype=torch.float64)
    for i, c, tap in itertools.product(range(T), range(attn.conv_width), range(21)):
        if tap == 0:
            conv[i, c] = attn.conv.bias[c]
        if 0 <= i - left + tap < T:
            conv[i, c] += attn.conv.weight[c, 0, tap] * values[i - left + tap, 3 * w + c]
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
def test_causal_lego_attention_never_reads_a_future_token_or_its_id(name):
    attn = lego_attention(name, causal=True)
    x, ids = torch.randn(2, 9, 16, dtype=torch.float64), TOKENS.expand(2, 9).clone()
    changed_x, changed_ids = x.clone(), ids.clone()
    changed_x[:, 5] += 1.0
    changed_ids[:, 5] = 5  # now equal to the earlier 5s
    out, out_changed = attn(x, token_ids=ids), attn(changed_x, token_ids=changed_ids)
    torch.testing.assert_close(out[:, :5], out_changed[:, :5], rtol=0, atol=0)


def test_a_bidirectional_gpt_with_lego_v1_shows_its_maps_and_its_kept_head_sees_every_key():
    task = get_task("lego", group="s3", n_vars=4)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=2, n_head=2,
                          n_embd=32, attn="lego_v1", causal=False, broadcast_ids=task.broadcast_ids))
    x, _ = batch(task, 16)
    maps = model.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (16, 4, task.block_size, task.block_size)  # 3 maps + 1 head
    block, h = model.transformer.h[0], model.transformer.wpe.weight[:task.block_size]
    q, k, _ = block.attn.c_attn(block.ln_1(model.transformer.wte(x) + h)).split(16, dim=2)
    torch.testing.assert_close(maps[0][:, 3], (q @ k.transpose(1, 2) / 16 ** 0.5).softmax(dim=-1))


# Mimicking (Section 4 of the LEGO paper): heads pulled towards fixed target maps.

def smooth(m):
    return (m + 1e-3) / (m + 1e-3).sum(-1, keepdim=True)


TOKENS_6 = [5, 7, 5, 9, 7, 5]
MANIPULATION = torch.tensor([[{0: 4, 1: 2, 2: 1}.get(abs(i - j), 0) for j in range(6)] for i in range(6)],
                            dtype=torch.double)
ASSOCIATION = torch.tensor([[float(a == b and i != j) for j, b in enumerate(TOKENS_6)] for i, a in enumerate(TOKENS_6)],
                           dtype=torch.double)


def test_mimicking_targets_and_loss_follow_their_definitions():
    tokens = torch.tensor([TOKENS_6])
    manipulation, association = mimicking_targets(tokens, causal=False)
    torch.testing.assert_close(manipulation[0], smooth(MANIPULATION).float())
    torch.testing.assert_close(association[0], smooth(ASSOCIATION).float())
    for target, weights in zip(mimicking_targets(tokens, causal=True), (MANIPULATION, ASSOCIATION)):
        kept = (weights + 1e-3).tril()  # causal: the past and the query itself only
        torch.testing.assert_close(target[0], (kept / kept.sum(1, keepdim=True)).float())
    # The loss: Σ_k p log(p / target) per query, averaged; head 0 against manipulation, 1 association.
    maps = torch.rand(1, 3, 6, 6, generator=torch.Generator().manual_seed(0)).softmax(-1)
    expected = sum((p * (p / smooth(target)).log()).sum(-1).mean().item()
                   for p, target in ((smooth(maps[0, 0].double()), MANIPULATION),
                                     (smooth(maps[0, 1].double()), ASSOCIATION)))
    assert abs(mimicking_loss([maps], tokens, causal=False).item() - expected) < 1e-5
    assert abs(mimicking_loss([maps, maps], tokens, causal=False).item() - 2 * expected) < 1e-5


@pytest.mark.parametrize("causal", [False, True])  # causal maps are 0 on the future: no nan from log 0
def test_mimicking_lowers_the_mimicking_loss(causal):
    torch.manual_seed(0)
    task = get_task("lego", n_vars=4)
    model = GPT(GPTConfig(block_size=task.block_size, vocab_size=task.vocab_size, n_layer=2, n_head=2,
                          n_embd=32, attn="standard", causal=causal))
    x, _ = batch(task, 16, seed=1)
    before = mimicking_loss(model.attention_maps(x), x, causal).item()
    generator = torch.Generator().manual_seed(0)
    losses = mimic(model, (task.sample(16, generator)[0] for _ in range(40)), lr=3e-3, betas=(0.9, 0.98))
    assert len(losses) == 40 and mimicking_loss(model.attention_maps(x), x, causal).item() < 0.5 * before


def test_mimicking_steps_are_adamw_without_weight_decay():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=10, n_layer=2, n_head=2, n_embd=16, attn="standard"))
    by_hand = copy.deepcopy(model)
    x = torch.randint(0, 10, (4, 12), generator=torch.Generator().manual_seed(1))
    mimic(model, [x, x], lr=1e-2, betas=(0.9, 0.95))
    optimizer = torch.optim.AdamW(by_hand.parameters(), 1e-2, (0.9, 0.95), weight_decay=0)
    for batch_ in [x, x]:
        mimicking_loss(by_hand.attention_maps(batch_), batch_, True).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (name, mimicked), stepped in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(mimicked, stepped, rtol=0, atol=1e-7, msg=name)
