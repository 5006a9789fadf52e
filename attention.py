"""
The attention variants of nanoChaCAL, each a small class with the same `forward` signature.

Shapes: B batch, T tokens, C = n_embd channels, nh heads, hs = C / nh head size.
Every variant maps x (B, T, C) to (B, T, C) and is called as

    attn(x, cache=None, token_ids=None, depth=0)

- `cache` is a LayerCache when decoding token by token (see GPT.generate), else None.
- `token_ids` (B, T) and `depth` (the index of the layer in the stack) are passed to every variant
  so that variants which need them (LEGO attention reads token ids, Sliding-Dilated-Attention
  picks its dilation from the depth) fit the same call. Standard attention and ChaCAL ignore them.

`ATTENTIONS` at the bottom maps the `--attn` name to the class.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# Functional cores on (B, nh, T, hs) tensors: small enough to read, test and benchmark alone.

def causal_visibility(n_queries, n_keys, device):
    """Boolean (n_queries, n_keys) mask, True where a query may look at a key.

    The queries are the *last* n_queries of the n_keys positions: in training both are the whole
    sequence; when decoding with a cache the keys also hold every earlier token. So query i sees
    keys 0 .. (n_keys - n_queries) + i.
    """
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)


def causal_attention_weights(q, k):
    """A = softmax(q kᵀ / √hs + M), M = -inf above the causal diagonal. Returns (B, nh, Tq, Tk)."""
    scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)  # scaling q is cheaper than T x T
    visible = causal_visibility(q.size(-2), k.size(-2), q.device)
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)


def standard_attention(q, k, v):
    """Y = A V, the readable path of ordinary causal attention (ChaCAL paper, Eq. 1-2)."""
    return causal_attention_weights(q, k) @ v


def chacal_attention(q, k, v, gamma, past_k=None, past_mixed=None):
    """ChaCAL: Y = (1-γ)·(I - γA')⁻¹·A·V, where A' = A with its diagonal removed.

    Computed without any inverse, as the unit lower-triangular system (paper, Eq. 7)

        (I - γA') Y = (1-γ) A V.

    The series behind it, Y = (1-γ)(A + γA'A + γ²A'²A + ...)V, sums the paths of every length
    through the attention graph: one layer follows a chain of references to its end.

    Decoding continues an earlier solve (paper, Eq. 9). Write row t of the system out:

        y_t = Σ_{i<t} A_ti·m_i + (1-γ)·A_tt·v_t,    with mixed values m_i = (1-γ)v_i + γy_i,

    so tokens already solved enter only through (k_i, m_i). Given their keys `past_k` and mixed
    values `past_mixed`, the new tokens solve a small triangular system of their own, and a single
    new token needs no solve at all: it is ordinary attention over the mixed values.

    q, k, v: (B, nh, Tq, hs) for the new tokens; past_k, past_mixed: (B, nh, Tp, hs) or None.
    The solve runs in float32 even under autocast (CUDA has no half-precision triangular solve,
    and the chain sums benefit from the precision); float64 inputs stay float64. Returns Y
    (B, nh, Tq, hs) in that solve dtype.
    """
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma={gamma} is outside [0, 1): the series diverges at gamma >= 1")
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        values = (1 - gamma) * v                                   # what a new token contributes
        if past_k is not None:
            k = torch.cat([past_k.to(dtype), k], dim=-2)           # (B, nh, Tp+Tq, hs)
            values = torch.cat([past_mixed.to(dtype), values], dim=-2)
        A = causal_attention_weights(q, k)                         # (B, nh, Tq, Tp+Tq)
        rhs = A @ values                                           # (B, nh, Tq, hs)
        n_new = q.size(-2)
        # The solver treats the diagonal as 1 (unitriangular) and ignores the upper triangle, so
        # -γA among the new tokens *is* I - γA' to it: the diagonal leaves the inverse for free.
        return torch.linalg.solve_triangular(-gamma * A[..., -n_new:], rhs,
                                             upper=False, unitriangular=True)


# -----------------------------------------------------------------------------
# The cache used when decoding.

class LayerCache:
    """Keys and values of every token a layer has seen so far, appended as decoding goes.

    Standard attention stores its values v_i; ChaCAL stores its mixed values m_i instead, so both
    keep one (key, value) pair per token and decode at the same cost.
    """

    def __init__(self):
        self.keys = None    # (B, nh, T_seen, hs)
        self.values = None  # (B, nh, T_seen, hs)

    def __len__(self):
        return 0 if self.keys is None else self.keys.size(-2)

    def append(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)


# -----------------------------------------------------------------------------
# The modules.

class CausalSelfAttention(nn.Module):
    """Standard multi-head causal self-attention, as in GPT-2.

        A = softmax(Q Kᵀ / √hs + M),   Y = A V,   out = concat_heads(Y) W_o

    (Vaswani et al. 2017; ChaCAL paper Section 2.1, Eq. 1-2.) Parameter names follow GPT-2
    (`c_attn` holds W_q, W_k, W_v; `c_proj` is W_o) so its weights load by name.

    Subclasses change how the heads mix their values by overriding `mix` alone.
    """

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # The fused kernel (flash / memory-efficient) is the fast path; the manual path shows the
        # math, and tests compare the two.
        self.fused = True

    def forward(self, x, cache=None, token_ids=None, depth=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = self.mix(q, k, v, cache)                                      # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                  # heads side by side
        return self.resid_dropout(self.c_proj(y))

    def mix(self, q, k, v, cache):
        """Each head's output from its queries, keys and values: here Y = A V."""
        if cache is not None:
            cache.append(k, v)
            k, v = cache.keys, cache.values
        if not self.fused:
            return standard_attention(q, k, v)
        n_queries, n_keys = q.size(-2), k.size(-2)
        if n_queries == n_keys:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # With a cache the queries sit at the end of the keys; SDPA's is_causal aligns them at
        # the start, so pass the mask. One new token sees every key and needs none.
        mask = None if n_queries == 1 else causal_visibility(n_queries, n_keys, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class ChaCALAttention(CausalSelfAttention):
    """ChaCAL, Chain and Causal Attention (Fagnou et al. 2024, Section 4, Eq. 5-9).

        Y = (1-γ)·(I - γA')⁻¹·A·V,   A' = A minus its diagonal,   γ ∈ [0, 1)

    Reading A as the adjacency matrix of "who refers to whom", A'ᵏA follows paths of k+1 hops,
    so one layer sees the end of a chain that standard attention would need ⌈log2(n+1)⌉ layers
    for (the paper's Theorem 1). γ = 0 gives back standard attention exactly. Same parameters as
    standard attention: only the mixing differs. See `chacal_attention` for the solve, and for
    why decoding caches mixed values m_t = (1-γ)v_t + γy_t in place of v_t.
    """

    def __init__(self, config):
        super().__init__(config)
        self.gamma = config.gamma  # GPTConfig has checked that it lies in [0, 1)

    def mix(self, q, k, v, cache):
        if cache is None:
            return chacal_attention(q, k, v, self.gamma).to(v.dtype)
        if q.size(-2) > 1:  # a prompt, or a block of tokens: one small triangular solve (Eq. 9)
            y = chacal_attention(q, k, v, self.gamma, cache.keys, cache.values).to(v.dtype)
            cache.append(k, (1 - self.gamma) * v + self.gamma * y)
            return y
        # One new token: its row of the system is plain attention over the cached mixed values
        # and its own (1-γ)v_t, so the fused kernel computes it, at the cost of standard decoding.
        cache.append(k, (1 - self.gamma) * v)
        y = F.scaled_dot_product_attention(q, cache.keys, cache.values)
        cache.values[..., -1:, :] += self.gamma * y  # complete m_t = (1-γ)v_t + γy_t in place
        return y


# The --attn name of each variant.
ATTENTIONS = {
    "standard": CausalSelfAttention,
    "chacal": ChaCALAttention,
}
