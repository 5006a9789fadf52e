"""The attention cores and modules against independent references, in float64 on small inputs:
explicit inverses, loops over queries, finite differences."""

import pytest
import torch

from attention import (ATTENTIONS, LayerCache, blocked_chacal_attention, chacal_attention, group_visibility,
                       standard_attention)
from model import GPTConfig


def random_qkv(B=2, nh=3, T=9, hs=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=g, dtype=dtype) for _ in range(3)]


def softmax_weights(q, k, causal=True, visible=None):
    """A, row by row with Python loops: softmax of q·k/√hs over the keys query t may see."""
    B, nh, T, hs = q.shape
    A = torch.zeros(B, nh, T, k.size(2), dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            seen = [j for j in range(k.size(2)) if (j <= t or not causal)
                    and (visible is None or visible(b, t, j))]
            A[b, :, t, seen] = (q[b, :, t:t + 1] @ k[b, :, seen].transpose(-2, -1) / hs ** 0.5).softmax(-1)[:, 0]
    return A


def explicit_chacal(q, k, v, gamma, causal=True, keep_diagonal=False, visible=None):
    """Y = (I - γS)⁻¹ (1-γ) A V with the inverse formed; S = A without its diagonal (ChaCAL,
    Section 4.1), or A itself (the ablation that keeps the diagonal)."""
    A = softmax_weights(q, k, causal, visible)
    S = A if keep_diagonal else A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
    eye = torch.eye(A.size(-1), dtype=A.dtype)
    return torch.linalg.inv(eye - gamma * S) @ ((1 - gamma) * A @ v)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keep_diagonal", [False, True])
def test_chacal_equals_the_explicit_inverse(gamma, causal, keep_diagonal):
    q, k, v = random_qkv()
    y = chacal_attention(q, k, v, gamma, causal=causal, keep_diagonal=keep_diagonal)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, explicit_chacal(q, k, v, gamma, causal, keep_diagonal),
                               rtol=1e-10, atol=1e-12)
    if gamma:  # the two readings of the paper differ: the test above tells them apart
        other = explicit_chacal(q, k, v, gamma, causal, not keep_diagonal)
        assert (y - other).abs().max() > 1e-3


def test_gamma_zero_is_standard_attention_and_standard_is_the_softmax():
    q, k, v = random_qkv()
    torch.testing.assert_close(chacal_attention(q, k, v, 0.0), standard_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)
    for causal in (True, False):
        torch.testing.assert_close(standard_attention(q, k, v, causal=causal),
                                   softmax_weights(q, k, causal) @ v)


def test_chacal_is_the_fixed_point_of_its_iteration():
    # The paper's Eq. 6 with the diagonal out of the recurrent term: Z <- γA'Z + (1-γ)AV from 0.
    q, k, v = random_qkv(T=16)
    A = softmax_weights(q, k)
    z = torch.zeros_like(v)
    for _ in range(200):
        z = 0.9 * torch.tril(A, diagonal=-1) @ z + 0.1 * A @ v
    torch.testing.assert_close(chacal_attention(q, k, v, 0.9), z, rtol=1e-10, atol=1e-12)


def test_under_group_masks_both_cores_equal_their_explicit_masked_form():
    # The inductive scratchpad's masks: a token sees group 0 and its own group, causally.
    q, k, v = random_qkv(T=10)
    groups = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    rule = lambda b, t, j: groups[b, j] in (0, groups[b, t])
    visible = group_visibility(groups, groups)
    torch.testing.assert_close(chacal_attention(q, k, v, 0.9, visible=visible),
                               explicit_chacal(q, k, v, 0.9, visible=rule), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(standard_attention(q, k, v, visible=visible),
                               softmax_weights(q, k, visible=rule) @ v)


def test_group_visibility_equals_its_definition():
    groups = torch.randint(0, 4, (3, 9), generator=torch.Generator().manual_seed(0)).sort(dim=1).values
    for n_queries in (9, 4, 1):  # the last queries of a cache, against all of its keys
        visible = group_visibility(groups[:, -n_queries:], groups)
        for b in range(3):
            for i in range(n_queries):
                t = 9 - n_queries + i
                expected = [j <= t and int(groups[b, j]) in (0, int(groups[b, t])) for j in range(9)]
                assert visible[b, 0, i].tolist() == expected


def test_chacal_gradients_match_finite_differences():
    q, k, v = (t.requires_grad_() for t in random_qkv(B=1, nh=2, T=5, hs=3))
    assert torch.autograd.gradcheck(lambda q, k, v: chacal_attention(q, k, v, 0.9), (q, k, v))


def cached_prefix(q, k, v, gamma, n_past):
    """The first n_past tokens solved: their keys and mixed values m = (1-γ)v + γy, as a cache holds."""
    first = explicit_chacal(q[:, :, :n_past], k[:, :, :n_past], v[:, :, :n_past], gamma)
    return k[:, :, :n_past], (1 - gamma) * v[:, :, :n_past] + gamma * first


@pytest.mark.parametrize("gamma", [0.0, 0.9, 0.99])
@pytest.mark.parametrize("n_past", [1, 4, 11])
def test_a_solve_continued_from_cached_mixed_values_equals_one_explicit_inverse(gamma, n_past):
    # Decoding by substitution (the paper's Eq. 9): the new tokens against the cached keys and
    # mixed values give the rows of one solve over the whole sequence.
    q, k, v = random_qkv(T=12)
    past_k, past_mixed = cached_prefix(q, k, v, gamma, n_past)
    y = chacal_attention(*(x[:, :, n_past:] for x in (q, k, v)), gamma, past_k, past_mixed)
    torch.testing.assert_close(y, explicit_chacal(q, k, v, gamma)[:, :, n_past:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows_per_block", [3, 5, 12])
@pytest.mark.parametrize("gamma", [0.0, 0.9, 0.99])
def test_the_blocked_fast_path_equals_the_explicit_inverse(rows_per_block, gamma):
    q, k, v = random_qkv(T=12)
    torch.testing.assert_close(blocked_chacal_attention(q, k, v, gamma, rows_per_block=rows_per_block),
                               explicit_chacal(q, k, v, gamma), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows_per_block", [2, 7])
@pytest.mark.parametrize("gamma", [0.5, 0.99])
def test_blocked_gradients_match_finite_differences_and_the_one_solve(rows_per_block, gamma):
    qkv = [t.requires_grad_() for t in random_qkv(B=1, nh=2, T=6, hs=3)]
    assert torch.autograd.gradcheck(lambda *x: blocked_chacal_attention(*x, gamma, rows_per_block=rows_per_block), qkv)
    weights = torch.randn(1, 2, 6, 3, dtype=torch.float64)
    y = blocked_chacal_attention(*qkv, gamma, rows_per_block=rows_per_block)
    blocked = torch.autograd.grad((y * weights).sum(), qkv)
    one = torch.autograd.grad((chacal_attention(*qkv, gamma) * weights).sum(), qkv)
    for got, want in zip(blocked, one):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_blocked_gradients_with_the_models_head_layout():
    # The model splits heads with a transpose: q, k, v arrive as (B, T, nh, hs) memory viewed as
    # (B, nh, T, hs). The blocked backward's sums into such a layout must reach the one solve's.
    g = torch.Generator().manual_seed(2)
    qkv = [torch.randn(2, 11, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
           for _ in range(3)]
    weights = torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64)
    blocked, one = (torch.autograd.grad((solve(*qkv, 0.9) * weights).sum(), qkv)
                    for solve in (lambda *x: blocked_chacal_attention(*x, rows_per_block=4), chacal_attention))
    for got, want in zip(blocked, one):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solve", [chacal_attention, lambda *x: blocked_chacal_attention(*x, rows_per_block=5)])
def test_chacal_solves_in_float32_under_bf16_autocast(solve):
    q, k, v = random_qkv(T=12, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = solve(q, k, v, 0.9)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), explicit_chacal(q.double(), k.double(), v.double(), 0.9),
                               rtol=1e-5, atol=1e-5)


def module(name, **options):
    torch.manual_seed(0)
    return ATTENTIONS[name](GPTConfig(**{"n_embd": 16, "n_head": 2, "attn": name, **options})).double()


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_a_future_token_changes_no_earlier_output_and_gradients_flow(name):
    attn = module(name)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6] += 1.0
    out, out_changed = attn(x), attn(changed)
    torch.testing.assert_close(out[:, :6], out_changed[:, :6], rtol=0, atol=0)
    assert (out[:, 6:] - out_changed[:, 6:]).abs().max() > 1e-6
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("name", [name for name in ATTENTIONS if "bidirectional" in ATTENTIONS[name].supports])
def test_a_bidirectional_attention_lets_a_later_token_change_earlier_outputs(name):
    attn = module(name, causal=False)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6] += 1.0
    assert (attn(x)[:, :6] - attn(changed)[:, :6]).abs().min() > 1e-9


@pytest.mark.parametrize("name", [name for name in ATTENTIONS if "cache" in ATTENTIONS[name].supports])
def test_what_an_attention_supports_it_does(name):
    """supports: a cache decodes as the full pass does, in pieces of 4, 2 and 1 tokens; group
    masks (where declared) reach the cached pieces too."""
    attn = module(name).eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    groups = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3], [0, 0, 1, 1, 1, 2, 2, 3, 3]])
    layout = {"groups": groups} if "groups" in attn.supports else {}
    cache, ends = LayerCache(), [0, 4, 6, 7, 8, 9]
    pieces = [attn(x[:, a:b], cache=cache, **{k: v[:, a:b] for k, v in layout.items()})
              for a, b in zip(ends, ends[1:])]
    torch.testing.assert_close(torch.cat(pieces, dim=1), attn(x, **layout), rtol=1e-10, atol=1e-10)


def allowed_offsets(chunk, thickness, depth):
    """Sliding-Dilated-Attention's definition: C offsets spaced C^(depth // K) apart."""
    return {step * chunk ** (depth // thickness) for step in range(chunk)}


def test_dilated_attention_is_a_softmax_over_c_entries_with_the_pad_before_the_start():
    # Per query, with loops: the C keys at offsets 0, d, .., (C-1)d, each offset before position
    # 0 a copy of the pad's key and value, each entry with its own learned bias r.
    chunk, n_head, hs, T = 3, 2, 4, 11
    attn = module("dilated", chunk=chunk, n_embd=n_head * hs)
    q, k, v = random_qkv(B=2, nh=n_head, T=T, hs=hs)
    _, pad_key, pad_value = (part.view(n_head, hs) for part in attn.c_attn(attn.pad).split(n_head * hs))
    for depth in range(3):
        expected = torch.empty_like(q)
        for b in range(2):
            for h in range(n_head):
                for m in range(T):
                    keys = [(k[b, h, m - s * chunk ** depth], v[b, h, m - s * chunk ** depth])
                            if m - s * chunk ** depth >= 0 else (pad_key[h], pad_value[h]) for s in range(chunk)]
                    scores = torch.stack([q[b, h, m] @ key / hs ** 0.5 + attn.offset_bias[h, s]
                                          for s, (key, _) in enumerate(keys)])
                    expected[b, h, m] = scores.softmax(0) @ torch.stack([value for _, value in keys])
        for fused in (True, False):  # the O(T·C) gather and the masked T x T map
            attn.fused = fused
            torch.testing.assert_close(attn.mix(q, k, v, None, depth), expected)


@pytest.mark.parametrize("chunk, thickness", [(2, 1), (3, 1), (2, 2)])
def test_dilated_output_depends_exactly_on_the_allowed_offsets(chunk, thickness):
    attn = module("dilated", chunk=chunk, thickness=thickness, n_layer=4)
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    for depth in range(4):
        out = attn(x, depth=depth)
        for key in range(20):
            changed = x.clone()
            changed[:, key] += 1.0
            moved = (out - attn(changed, depth=depth))[0, 19].abs().max() > 1e-9
            assert moved == (19 - key in allowed_offsets(chunk, thickness, depth)), (depth, key)


def test_dilated_token_zero_alone_differs_from_a_pair_of_equal_tokens():
    # Parity needs it: parity(1) = 1, parity(1, 1) = 0. Token 0 reads the pad where a later token
    # reads its neighbour; with nothing there both would mix the same single value.
    attn = module("dilated")
    one = torch.randn(1, 1, 16, dtype=torch.float64)
    assert (attn(one, depth=0)[0, 0] - attn(one.repeat(1, 2, 1), depth=0)[0, 1]).abs().max() > 1e-3


@pytest.mark.parametrize("name, causal", [("standard", True), ("standard", False), ("dilated", True)])
def test_fused_and_readable_paths_agree(name, causal):
    attn = module(name, causal=causal).float()
    x = torch.randn(3, 11, 16)
    for depth in range(3):
        attn.fused = True
        fused = attn(x, depth=depth)
        attn.fused = False
        torch.testing.assert_close(attn(x, depth=depth), fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["chacal", "chacal_diagonal"])
@pytest.mark.parametrize("causal", [True, False])
def test_chacal_attention_map_is_the_explicit_inverse(name, causal):
    attn = module(name, causal=causal, gamma=0.8)
    q, k, _ = random_qkv(B=2, nh=2, T=9, hs=8)
    A = softmax_weights(q, k, causal)
    S = A if name == "chacal_diagonal" else A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
    expected = 0.2 * torch.linalg.inv(torch.eye(9, dtype=A.dtype) - 0.8 * S) @ A
    torch.testing.assert_close(attn.attention_map(q, k, None, 0), expected)


@pytest.mark.parametrize("name, causal", [("standard", True), ("standard", False), ("dilated", True)])
def test_attention_map_times_values_is_the_output(name, causal):
    attn = module(name, causal=causal)
    q, k, v = random_qkv(B=2, nh=2, T=9, hs=8)
    weights = attn.attention_map(q, k, None, 2)
    expected = weights @ v
    if name == "dilated":  # what the tokens do not take goes to the pad
        pad_value = attn.c_attn(attn.pad)[-16:].view(1, 2, 1, 8)
        expected = expected + (1 - weights.sum(dim=-1, keepdim=True)) * pad_value
    torch.testing.assert_close(expected, attn.mix(q, k, v, None, 2))
