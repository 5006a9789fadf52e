"""The attention cores against independent references, in float64 on small random inputs."""

import pytest
import torch

from attention import (ATTENTIONS, causal_attention_weights, chacal_attention,
                       standard_attention)
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
    torch.testing.assert_close(causal_attention_weights(q, k), explicit_softmax_attention(q, k))


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
    # Keeping the diagonal inside the inverse gives a different operator (decisions.md):
    # the test above would not notice if both readings agreed, so check they do not.
    q, k, v = random_qkv()
    gamma, A = 0.9, explicit_softmax_attention(q, k)
    with_diagonal = (1 - gamma) * torch.linalg.inv(torch.eye(A.size(-1), dtype=A.dtype) - gamma * A) @ A @ v
    assert (chacal_attention(q, k, v, gamma) - with_diagonal).abs().max() > 1e-3


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


def test_fused_and_manual_standard_paths_agree():
    torch.manual_seed(0)
    attn = ATTENTIONS["standard"](GPTConfig(n_embd=16, n_head=2, attn="standard"))
    x = torch.randn(3, 11, 16)
    fused = attn(x)
    attn.fused = False
    torch.testing.assert_close(attn(x), fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_forward_and_backward_run_for_every_variant(name):
    torch.manual_seed(0)
    attn = ATTENTIONS[name](GPTConfig(n_embd=16, n_head=4, attn=name))
    out = attn(torch.randn(2, 7, 16))
    out.square().sum().backward()
    assert out.shape == (2, 7, 16)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())
