"""The attention cores against independent references, in float64 on small random inputs."""

import pytest
import torch

import attention
from attention import (ATTENTIONS, CHACAL_BLOCKED_FROM, attention_weights, chacal_attention,
                       chacal_keep_diagonal, group_visibility, standard_attention)
from model import GPTConfig


def random_qkv(B=2, nh=3, T=9, hs=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=g, dtype=dtype) for _ in range(3)]


def explicit_softmax_attention(q, k):
    """Row by row, with Python loops: softmax over keys 0..t for query t."""
    B, nh, T, hs = q.shape
    A = torch.zeros(B, nh, T, T, dtype=q.dtype)
    for t in range(T):
        scores = (q[:, :, t:t + 1] @ k[:, :, :t + 1].transpose(-2, -1)) / hs ** 0.5
        A[:, :, t, :t + 1] = scores.softmax(dim=-1)[:, :, 0]
    return A


def test_attention_weights_match_row_by_row_softmax():
    q, k, _ = random_qkv()
    torch.testing.assert_close(attention_weights(q, k), explicit_softmax_attention(q, k))


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.99])
def test_chacal_equals_explicit_inverse(gamma):
    q, k, v = random_qkv()
    A = explicit_softmax_attention(q, k)
    T = A.size(-1)
    no_diagonal = A - torch.diag_embed(torch.diagonal(A, dim1=-2, dim2=-1))
    expected = torch.linalg.inv(torch.eye(T, dtype=A.dtype) - gamma * no_diagonal) @ ((1 - gamma) * A @ v)
    y = chacal_attention(q, k, v, gamma)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)


def test_chacal_keeps_the_diagonal_out_of_the_inverse():
    # Keeping the diagonal inside the inverse gives a different operator (paper, Section 4.1):
    # the test above would not notice if both readings agreed, so check they do not.
    q, k, v = random_qkv()
    gamma, A = 0.9, explicit_softmax_attention(q, k)
    with_diagonal = (1 - gamma) * torch.linalg.inv(torch.eye(A.size(-1), dtype=A.dtype) - gamma * A) @ A @ v
    assert (chacal_attention(q, k, v, gamma) - with_diagonal).abs().max() > 1e-3


@pytest.mark.parametrize("blocked_from", [None, 4])  # 4: a length where the automatic path would block
def test_chacal_under_group_masks_equals_explicit_masked_inverse(blocked_from, monkeypatch):
    """The inductive scratchpad's masks with ChaCAL: A is the softmax over the keys each row may
    see (built here with loops), and Y = (I - γA')⁻¹(1-γ)AV in float64. A mask keeps the one-solve
    path at any length (the blocked path takes none)."""
    if blocked_from:
        monkeypatch.setitem(attention.CHACAL_BLOCKED_FROM, "cpu", blocked_from)
    q, k, v = random_qkv(T=10)
    groups = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    A = torch.zeros(2, 3, 10, 10, dtype=torch.float64)
    for b in range(2):
        for t in range(10):
            seen = [j for j in range(t + 1) if groups[b, j] in (0, groups[b, t])]
            scores = q[b, :, t:t + 1] @ k[b, :, seen].transpose(-2, -1) / 2  # √hs = 2
            A[b, :, t, seen] = scores.softmax(dim=-1)[:, 0]
    no_diagonal = A - torch.diag_embed(torch.diagonal(A, dim1=-2, dim2=-1))
    expected = torch.linalg.inv(torch.eye(10, dtype=A.dtype) - 0.9 * no_diagonal) @ (0.1 * A @ v)
    y = chacal_attention(q, k, v, 0.9, visible=group_visibility(groups, groups))
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", [attention.StandardAttention, attention.ChaCALAttention])
def test_cached_decoding_under_group_masks_equals_the_full_pass(layer):
    # A prompt, a block of two, then one token at a time, each against the keys (and their
    # groups) of the cache: the full pass's outputs, in float64.
    torch.manual_seed(0)
    attn = layer(GPTConfig(n_embd=16, n_head=2)).double().eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    groups = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3], [0, 0, 1, 1, 1, 2, 2, 3, 3]])
    cache, ends = attention.LayerCache(), [0, 4, 6, 7, 8, 9]
    cached = [attn(x[:, start:end], cache=cache, groups=groups[:, start:end])
              for start, end in zip(ends, ends[1:])]
    full = attn(x, groups=groups)
    torch.testing.assert_close(torch.cat(cached, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.99])
def test_chacal_rows_sum_between_one_minus_gamma_and_one(gamma):
    """(1-γ)(I - γA')⁻¹·1: token 0 has no chain behind it and keeps 1-γ; a row's sum grows with the
    weight its chain carries below the diagonal, never past 1. Kept in the inverse, the diagonal
    makes every row a weighted average: (I - γA)⁻¹(1-γ)·1 = 1."""
    q, k, _ = random_qkv(T=12)
    ones = torch.ones(2, 3, 12, 1, dtype=torch.float64)
    sums = chacal_attention(q, k, ones, gamma)[..., 0]
    torch.testing.assert_close(sums[..., 0], torch.full((2, 3), 1 - gamma, dtype=torch.float64))
    assert (sums[..., 1:] > 1 - gamma).all() and (sums <= 1 + 1e-12).all()
    torch.testing.assert_close(chacal_keep_diagonal(q, k, ones, gamma), ones)


def test_chacal_is_the_fixed_point_of_its_iteration():
    # Y = γA'Y + (1-γ)AV: iterate Z <- γA'Z + (1-γ)AV from zero (the paper's Eq. 6, diagonal
    # removed from the recurrent term) until it stops moving.
    q, k, v = random_qkv(T=16)
    gamma, A = 0.9, explicit_softmax_attention(q, k)
    no_diagonal = torch.tril(A, diagonal=-1)
    z = torch.zeros_like(v)
    for _ in range(200):
        z = gamma * no_diagonal @ z + (1 - gamma) * A @ v
    torch.testing.assert_close(chacal_attention(q, k, v, gamma), z, rtol=1e-10, atol=1e-12)


def test_gamma_zero_is_standard_attention():
    q, k, v = random_qkv()
    torch.testing.assert_close(chacal_attention(q, k, v, 0.0), standard_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(standard_attention(q, k, v), explicit_softmax_attention(q, k) @ v)


def test_chacal_gradients_match_finite_differences():
    q, k, v = (t.requires_grad_() for t in random_qkv(B=1, nh=2, T=5, hs=3))
    assert torch.autograd.gradcheck(lambda q, k, v: chacal_attention(q, k, v, 0.9), (q, k, v))


def test_chacal_continues_a_solve_from_cached_mixed_values():
    # Solve the first Tp tokens, cache (k, m = (1-γ)v + γy), then solve the rest against the
    # cache (the paper's Eq. 9): the same as one solve over the whole sequence.
    q, k, v = random_qkv(T=12)
    gamma, Tp = 0.9, 5
    full = chacal_attention(q, k, v, gamma)
    first = chacal_attention(q[:, :, :Tp], k[:, :, :Tp], v[:, :, :Tp], gamma)
    mixed = (1 - gamma) * v[:, :, :Tp] + gamma * first
    rest = chacal_attention(q[:, :, Tp:], k[:, :, Tp:], v[:, :, Tp:], gamma,
                            past_k=k[:, :, :Tp], past_mixed=mixed)
    torch.testing.assert_close(torch.cat([first, rest], dim=-2), full, rtol=1e-10, atol=1e-12)


def test_chacal_rejects_gamma_outside_unit_interval():
    q, k, v = random_qkv()
    for gamma in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            chacal_attention(q, k, v, gamma)


def test_chacal_solves_in_float32_under_autocast():
    q, k, v = random_qkv(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = chacal_attention(q, k, v, 0.9)
    assert y.dtype == torch.float32
    reference = chacal_attention(q.double(), k.double(), v.double(), 0.9)
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_changing_a_future_token_changes_no_earlier_output(name):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=2, attn=name)).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6] += 1.0
    out, out_changed = attn(x), attn(changed)
    torch.testing.assert_close(out[:, :6], out_changed[:, :6], rtol=0, atol=0)
    assert (out[:, 6:] - out_changed[:, 6:]).abs().max() > 1e-6


@pytest.mark.parametrize("name, causal", [("standard", True), ("standard", False),
                                          ("dilated", True)])
def test_fused_and_manual_paths_agree(name, causal):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=2, attn=name, causal=causal))
    x = torch.randn(3, 11, 16)
    for depth in range(3):
        attn.fused = True
        fused = attn(x, depth=depth)
        attn.fused = False
        torch.testing.assert_close(attn(x, depth=depth), fused, rtol=1e-5, atol=1e-6)


def test_dilated_attention_gathers_its_entries_unless_asked_for_the_map(monkeypatch):
    # The two paths agree (above); the default one must be the O(T·C) gather, not the T x T map.
    attn = ATTENTIONS["dilated"](GPTConfig(n_embd=16, n_head=2, attn="dilated"))
    monkeypatch.setattr(attn, "padded_map", lambda *args: pytest.fail("built the T x T map"))
    assert attn(torch.randn(2, 11, 16), depth=1).shape == (2, 11, 16)


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_forward_and_backward_run_for_every_variant(name):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=4, attn=name))
    out = attn(torch.randn(2, 7, 16))
    out.square().sum().backward()
    assert out.shape == (2, 7, 16)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99])
def test_bidirectional_chacal_equals_explicit_inverse(gamma):
    q, k, v = random_qkv(T=7)
    A = (q @ k.transpose(-2, -1) / q.size(-1) ** 0.5).softmax(dim=-1)  # no mask at all
    off_diagonal = A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
    expected = torch.linalg.inv(torch.eye(7, dtype=A.dtype) - gamma * off_diagonal) @ ((1 - gamma) * A @ v)
    torch.testing.assert_close(chacal_attention(q, k, v, gamma, causal=False), expected)


@pytest.mark.parametrize("name", ["standard", "chacal", "chacal_diagonal"])
def test_bidirectional_attention_lets_a_later_token_change_earlier_outputs(name):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=2, attn=name, causal=False)).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6] += 1.0
    assert (attn(x)[:, :6] - attn(changed)[:, :6]).abs().min() > 1e-9


def allowed_offsets(chunk, thickness, depth):
    """Sliding-Dilated-Attention's definition, written out: C offsets spaced C^(depth // K) apart."""
    dilation = chunk ** (depth // thickness)
    return {step * dilation for step in range(chunk)}


@pytest.mark.parametrize("chunk, thickness", [(2, 1), (3, 1), (2, 2), (5, 1)])
def test_dilated_mask_of_every_layer_matches_its_offsets(chunk, thickness):
    config = GPTConfig(n_embd=8, n_head=2, n_layer=6, attn="dilated", chunk=chunk, thickness=thickness)
    attn = ATTENTIONS["dilated"](config)
    T = 40
    for depth in range(6):
        offsets = allowed_offsets(chunk, thickness, depth)
        visible = torch.isfinite(attn.score_bias(T, T, depth, "cpu"))[0]
        expected = torch.tensor([[m - n in offsets for n in range(T)] for m in range(T)])
        assert torch.equal(visible[:, 1:], expected), f"layer {depth}"
        # Column 0, the pad, stands in for the offsets that reach before position 0.
        reaches_before_start = torch.tensor([any(m - o < 0 for o in offsets) for m in range(T)])
        assert torch.equal(visible[:, 0], reaches_before_start), f"layer {depth}"
        # The same rows when the queries are the last few tokens of a cache.
        last_rows = torch.isfinite(attn.score_bias(3, T, depth, "cpu"))[0]
        assert torch.equal(last_rows, visible[-3:])


def test_dilated_attention_equals_a_softmax_over_c_entries_with_the_pad_before_the_start():
    # Written out per query: the C keys at offsets 0, d, .., (C-1)d, each offset that lands
    # before position 0 a separate copy of the pad's key and value, each with its own r.
    torch.manual_seed(0)
    chunk, n_head, hs, T = 3, 2, 4, 11
    attn = ATTENTIONS["dilated"](GPTConfig(n_embd=n_head * hs, n_head=n_head, attn="dilated",
                                           chunk=chunk)).double()
    q, k, v = random_qkv(B=2, nh=n_head, T=T, hs=hs)
    _, pad_key, pad_value = attn.c_attn(attn.pad).split(n_head * hs)
    pad_key, pad_value = pad_key.view(n_head, hs), pad_value.view(n_head, hs)
    for depth in range(3):
        dilation = chunk ** depth
        expected = torch.empty_like(q)
        for b in range(2):
            for h in range(n_head):
                for m in range(T):
                    values, scores = [], []
                    for step in range(chunk):
                        n = m - step * dilation
                        key, value = (k[b, h, n], v[b, h, n]) if n >= 0 else (pad_key[h], pad_value[h])
                        scores.append(q[b, h, m] @ key / hs ** 0.5 + attn.offset_bias[h, step])
                        values.append(value)
                    weights = torch.stack(scores).softmax(dim=0)
                    expected[b, h, m] = (weights[:, None] * torch.stack(values)).sum(dim=0)
        for fused in (True, False):
            attn.fused = fused
            torch.testing.assert_close(attn.mix(q, k, v, None, depth), expected)


def test_dilated_output_depends_exactly_on_the_allowed_offsets():
    torch.manual_seed(0)
    attn = ATTENTIONS["dilated"](GPTConfig(n_embd=8, n_head=2, attn="dilated", chunk=3)).double()
    x = torch.randn(1, 20, 8, dtype=torch.float64)
    depth, query = 1, 19
    for key in range(20):
        changed = x.clone()
        changed[:, key] += 1.0
        moved = (attn(x, depth=depth) - attn(changed, depth=depth))[0, query].abs().max() > 1e-9
        assert moved == (query - key in allowed_offsets(3, 1, depth)), f"key {key}"


def test_dilated_token_zero_alone_differs_from_a_pair_of_equal_tokens():
    # Parity needs this: parity(1) = 1 but parity(1, 1) = 0. Token 0 reads the pad where a later
    # token reads its neighbour; with nothing there, both would mix the same single value.
    torch.manual_seed(0)
    attn = ATTENTIONS["dilated"](GPTConfig(n_embd=8, n_head=2, attn="dilated")).double()
    one = torch.randn(1, 1, 8, dtype=torch.float64)
    alone, pair = attn(one, depth=0)[0, 0], attn(one.repeat(1, 2, 1), depth=0)[0, 1]
    assert (alone - pair).abs().max() > 1e-3


def test_dilated_offset_bias_is_one_learned_scalar_per_head_and_step():
    attn = ATTENTIONS["dilated"](GPTConfig(n_embd=8, n_head=2, attn="dilated", chunk=3))
    with torch.no_grad():
        attn.offset_bias.copy_(torch.tensor([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]]))
    bias = attn.score_bias(9, 9, 1, "cpu").detach()[:, :, 1:]  # dilation 3: offsets 0, 3, 6
    assert bias[1, 8, 8] == 1.0 and bias[1, 8, 5] == 2.0 and bias[1, 8, 2] == 3.0
    assert bias[0, 7, 4] == pytest.approx(0.2) and bias[0, 7, 6] == float("-inf")


@pytest.mark.parametrize("name", ["chacal", "chacal_diagonal"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [9, CHACAL_BLOCKED_FROM["cpu"] + 3])  # the long one takes the blocked path
def test_chacal_attention_map_is_the_explicit_inverse(name, causal, T):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=2, attn=name, causal=causal, gamma=0.8))
    q, k, _ = random_qkv(B=2, nh=2, T=T, hs=8)
    A = explicit_softmax_attention(q, k) if causal else (q @ k.transpose(-2, -1) / 8 ** 0.5).softmax(-1)
    # ChaCAL mixes over A' = A without its diagonal; the ablation keeps the diagonal in the sum
    summed = A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1)) if name == "chacal" else A
    eye = torch.eye(T, dtype=torch.float64)
    expected = 0.2 * torch.linalg.inv(eye - 0.8 * summed) @ A  # (1-γ)(I - γ summed)⁻¹A
    torch.testing.assert_close(attn.attention_map(q, k, None, 0), expected)


# The map is read apart from the output only in standard and dilated attention; ChaCAL's map and
# output are one solve against I or against V, each checked against the explicit inverse above.
@pytest.mark.parametrize("name, causal", [("standard", True), ("standard", False),
                                          ("dilated", True)])  # dilated: causal only
def test_attention_map_times_values_is_the_output(name, causal):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=2, attn=name, causal=causal)).double()
    # fused: the map against the fast path (SDPA for standard, the C-entry gather for dilated)
    attn.fused = name in ("standard", "dilated")
    q, k, v = random_qkv(B=2, nh=2, T=9, hs=8)
    weights = attn.attention_map(q, k, None, 2)
    expected = weights @ v
    if name == "dilated":  # what the tokens do not take goes to the pad
        pad_value = attn.c_attn(attn.pad)[-16:].view(1, 2, 1, 8)
        expected = expected + (1 - weights.sum(dim=-1, keepdim=True)) * pad_value
        assert (weights.sum(dim=-1) < 1 - 1e-6).any()
    torch.testing.assert_close(expected, attn.mix(q, k, v, None, 2))


@pytest.mark.parametrize("causal", [True, False])
def test_chacal_keeping_the_diagonal_equals_its_explicit_inverse(causal):
    q, k, v = random_qkv()
    gamma = 0.9
    A = explicit_softmax_attention(q, k) if causal else (q @ k.transpose(-2, -1) / 2).softmax(-1)
    eye = torch.eye(A.size(-1), dtype=A.dtype)
    expected = (1 - gamma) * torch.linalg.inv(eye - gamma * A) @ A @ v
    torch.testing.assert_close(chacal_keep_diagonal(q, k, v, gamma, causal=causal), expected)
    if causal:  # its own weight amplified by 1/(1 - γA_tt): the map's diagonal against ChaCAL's
        eye_values = eye.expand_as(A)
        ratio = (chacal_keep_diagonal(q, k, eye_values, gamma).diagonal(dim1=-2, dim2=-1)
                 / chacal_attention(q, k, eye_values, gamma).diagonal(dim1=-2, dim2=-1))
        torch.testing.assert_close(ratio, 1 / (1 - gamma * A.diagonal(dim1=-2, dim2=-1)))


# The blocked path of chacal_attention: block sizes that divide T = 12 (3, 4, 12) and that do not
# (5, 7), with and without a cached prefix of 4 tokens, against the explicit inverse and the
# one-solve path.

def explicit_chacal(q, k, v, gamma):
    """(1-γ)(I - γA')⁻¹ A V with the inverse formed, over the whole sequence."""
    A = explicit_softmax_attention(q, k)
    no_diagonal = A - torch.diag_embed(torch.diagonal(A, dim1=-2, dim2=-1))
    eye = torch.eye(A.size(-1), dtype=A.dtype)
    return torch.linalg.inv(eye - gamma * no_diagonal) @ ((1 - gamma) * A @ v)


def cached_prefix(q, k, v, gamma, n_past):
    """Solve the first n_past tokens: their keys and mixed values, as a decoding cache holds."""
    first = explicit_chacal(q[:, :, :n_past], k[:, :, :n_past], v[:, :, :n_past], gamma)
    return k[:, :, :n_past], (1 - gamma) * v[:, :, :n_past] + gamma * first


@pytest.mark.parametrize("rows_per_block", [3, 4, 5, 7, 12])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("n_past", [0, 4])
def test_blocked_chacal_equals_explicit_inverse_and_one_solve(rows_per_block, gamma, n_past):
    q, k, v = random_qkv(T=12)
    expected = explicit_chacal(q, k, v, gamma)[:, :, n_past:]
    past_k, past_mixed = cached_prefix(q, k, v, gamma, n_past) if n_past else (None, None)
    new = [x[:, :, n_past:] for x in (q, k, v)]
    blocked = chacal_attention(*new, gamma, past_k, past_mixed, rows_per_block=rows_per_block)
    one_solve = chacal_attention(*new, gamma, past_k, past_mixed, rows_per_block=0)
    torch.testing.assert_close(blocked, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(blocked, one_solve, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("rows_per_block", [2, 3, 7])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("n_past", [0, 3])
def test_blocked_chacal_gradients_match_one_solve_and_finite_differences(rows_per_block, gamma, n_past):
    # Gradients reach the cached keys and mixed values too, so gradcheck covers all five inputs.
    q, k, v, past_k, past_mixed = random_qkv(B=1, nh=2, T=6, hs=3)[:3] + random_qkv(
        B=1, nh=2, T=n_past, hs=3, seed=1)[:2]
    inputs = [t.requires_grad_() for t in (q, k, v) + ((past_k, past_mixed) if n_past else ())]

    def blocked(*x):
        return chacal_attention(*x[:3], gamma, *x[3:], rows_per_block=rows_per_block)

    assert torch.autograd.gradcheck(blocked, inputs)
    weights = torch.randn(1, 2, 6, 3, dtype=torch.float64)
    expected = torch.autograd.grad((chacal_attention(*inputs[:3], gamma, *inputs[3:], rows_per_block=0)
                                    * weights).sum(), inputs)
    for got, want in zip(torch.autograd.grad((blocked(*inputs) * weights).sum(), inputs), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_blocked_chacal_gradients_with_the_models_head_layout():
    # The model splits heads with a transpose, so q, k, v arrive as (B, T, nh, hs) memory viewed
    # as (B, nh, T, hs), where the other tests pass contiguous tensors: the blocked backward's
    # in-place sums into such a layout must reach the gradients the one solve computes.
    g = torch.Generator().manual_seed(2)
    qkv = [torch.randn(2, 11, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
           for _ in range(3)]
    weights = torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64)
    blocked, one_solve = (
        torch.autograd.grad((chacal_attention(*qkv, 0.9, rows_per_block=rows) * weights).sum(), qkv)
        for rows in (4, 0))
    for got, want in zip(blocked, one_solve):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_chacal_picks_the_blocked_path_from_its_device_threshold_on(monkeypatch):
    import attention
    calls = []
    monkeypatch.setattr(attention.BlockedChaCAL, "apply",
                        lambda *args: calls.append(args) or torch.zeros(()))
    monkeypatch.setattr(attention, "CHACAL_BLOCKED_FROM", {"cpu": 8})
    for T, blocked in [(7, False), (8, True)]:
        calls.clear()
        chacal_attention(*random_qkv(T=T), 0.9)
        assert bool(calls) == blocked, f"T = {T}"
    chacal_attention(*random_qkv(T=8), 0.9, causal=False)  # bidirectional: always one solve
    assert len(calls) == 1
    with pytest.raises(ValueError, match="rows_per_block"):
        chacal_attention(*random_qkv(T=8), 0.9, causal=False, rows_per_block=4)
    calls.clear()
    monkeypatch.setattr(attention, "CHACAL_BLOCKED_FROM", {"cuda": 8})  # the cpu has no entry
    chacal_attention(*random_qkv(T=8), 0.9)
    assert not calls


def test_blocked_chacal_solves_in_float32_under_autocast():
    q, k, v = random_qkv(T=12, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = chacal_attention(q, k, v, 0.9, rows_per_block=5)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), chacal_attention(q.double(), k.double(), v.double(), 0.9),
                               rtol=1e-5, atol=1e-5)


def test_blocked_chacal_keeps_half_precision_inputs_and_computes_as_in_float32():
    # Under bf16 autocast the blocked path casts q, k, v to float32 a block at a time: it keeps
    # them for the backward as they are (float32 copies of all three would cost more memory than
    # fused attention's whole step), and computes exactly what it computes from float32 inputs.
    q, k, v = (t.requires_grad_() for t in random_qkv(T=12, dtype=torch.bfloat16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = chacal_attention(q, k, v, 0.9, rows_per_block=5)
    shape, row_shape = tuple(q.shape), (*q.shape[:-1], 1)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.bfloat16", shape)] * 3                                         # q, k, v
        + [("torch.float32", shape), ("torch.float32", row_shape)])            # Y, log-normalisers
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    as_float = [t.detach().float().requires_grad_() for t in (q, k, v)]
    y_float = chacal_attention(*as_float, 0.9, rows_per_block=5)
    assert torch.equal(y, y_float)
    for got, want in zip(torch.autograd.grad((y * weights).sum(), (q, k, v)),
                         torch.autograd.grad((y_float * weights).sum(), as_float)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
