"""
The attention variants of nanoChaCAL, each a small class with the same `forward` signature.

Shapes: B batch, T tokens, C = n_embd channels, nh heads, hs = C / nh head size.
Every variant maps x (B, T, C) to (B, T, C) and is called as

    attn(x, cache=None, token_ids=None, depth=0, groups=None)

- `cache` is a LayerCache when decoding token by token (see GPT.generate), else None.
- `groups` (B, T) are the attention groups of the inductive scratchpad (model.inductive_layout),
  or None for the ordinary causal mask. Standard attention and ChaCAL honour them; the others
  (and ChaCAL's chacal_diagonal ablation) refuse them.
- `token_ids` (B, T) and `depth` (the index of the layer in the stack) are passed to every variant
  so that variants which need them (LEGO attention reads token ids, Sliding-Dilated-Attention
  picks its dilation from the depth) fit the same call. Standard attention and ChaCAL ignore them.

`ATTENTIONS` at the bottom maps the `--attn` name to the class.
"""

import contextlib
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


def group_visibility(query_groups, key_groups):
    """The inductive scratchpad's mask (Abbe et al. 2024, Appendix C), (B, 1, Tq, Tk) boolean:

        visible[i, j] = causal(i, j) and (group_j == group_i or group_j == 0)

    A token sees the earlier tokens of its own group and the question (group 0), nothing else.
    query_groups (B, Tq) are the last Tq of key_groups (B, Tk), as in causal_visibility. Group 0
    is a prefix, so its own rows are plain causal rows, and every row sees at least itself.
    """
    causal = causal_visibility(query_groups.size(1), key_groups.size(1), query_groups.device)
    keys = key_groups[:, None, :]                                       # (B, 1, Tk)
    same = (query_groups[:, :, None] == keys) | (keys == 0)             # (B, Tq, Tk)
    return (causal & same)[:, None]                                     # (B, 1, Tq, Tk)


def attention_weights(q, k, causal=True, visible=None):
    """A = softmax(q kᵀ / √hs + M), M = -inf above the causal diagonal (none if not causal), or
    -inf wherever `visible` (broadcastable to (B, nh, Tq, Tk), e.g. group_visibility) is False.
    Returns (B, nh, Tq, Tk)."""
    scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)  # scaling q is cheaper than T x T
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal:
        visible = causal_visibility(q.size(-2), k.size(-2), q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1)


def standard_attention(q, k, v, causal=True, visible=None):
    """Y = A V, the readable path of ordinary attention (ChaCAL paper, Eq. 1-2)."""
    return attention_weights(q, k, causal, visible) @ v


def chacal_attention(q, k, v, gamma, past_k=None, past_mixed=None, causal=True, visible=None,
                     rows_per_block=None):
    """ChaCAL: Y = (1-γ)·(I - γA')⁻¹·A·V, where A' = A with its diagonal removed.

    Computed without any inverse, as the unit lower-triangular system of the paper's Eq. 7, with
    the diagonal taken out of its B = I - γA (Section 4.1):

        (I - γA') Y = (1-γ) A V.

    The paper's Eq. 5 writes the product the other way round, (1-γ)A(I - γA)⁻¹V; the two agree
    while the diagonal stays in the inverse, and with A' they do not: we follow Eq. 7, the solve.

    The series behind it, Y = (1-γ)(A + γA'A + γ²A'²A + ...)V, sums the paths of every length
    through the attention graph: one layer follows a chain of references to its end.

    Decoding continues an earlier solve (paper, Eq. 9). Write row t of the system out:

        y_t = Σ_{i<t} A_ti·m_i + (1-γ)·A_tt·v_t,    with mixed values m_i = (1-γ)v_i + γy_i,

    so tokens already solved enter only through (k_i, m_i). Given their keys `past_k` and mixed
    values `past_mixed`, the new tokens solve a small triangular system of their own, and a single
    new token needs no solve at all: it is ordinary attention over the cached mixed values and its
    own (1-γ)v_t.

    Two paths compute the causal case. The one-solve path below builds A, T x T, and solves once:
    the readable reference, and the faster one for short sequences. The blocked path
    (`BlockedChaCAL`) applies the same row equation to one block of queries at a time, the
    earlier blocks entering through their keys and mixed values exactly as a cache does, and
    recomputes A in its backward: O(T·hs) memory instead of O(T²). `rows_per_block` is the
    number of query rows per block; 0 takes the one-solve path, and None picks by device: the
    blocked path (CHACAL_ROWS_PER_BLOCK rows) from CHACAL_BLOCKED_FROM[device type] new tokens
    on, where it is also the faster one, and the one-solve path on a device without an entry.

    Without the causal mask (a bidirectional model, as for LEGO) the system is dense; it stays
    solvable because every row of γA' sums to at most γ < 1, so I - γA' is diagonally dominant.
    The paper names this case as future work; here it is one general solve.

    A mask `visible` (the inductive scratchpad's groups, see group_visibility) only removes
    entries below the diagonal, so the system stays unit lower-triangular and the same solve
    applies: the chains then run within a group and through the question, as the groups allow.
    It takes the one-solve path.

    q, k, v: (B, nh, Tq, hs) for the new tokens; past_k, past_mixed: (B, nh, Tp, hs) or None.
    The solve runs in float32 even under autocast (CUDA has no half-precision triangular solve,
    and the chain sums benefit from the precision); float64 inputs stay float64. Returns Y
    (B, nh, Tq, hs) in that solve dtype.
    """
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma={gamma} is outside [0, 1): the bidirectional solve needs γ < 1, "
                         f"and (1-γ) keeps every row of the map summing to at most 1")
    if rows_per_block is None:
        long = q.size(-2) >= CHACAL_BLOCKED_FROM.get(q.device.type, math.inf)
        rows_per_block = CHACAL_ROWS_PER_BLOCK if causal and visible is None and long else 0
    if rows_per_block and (not causal or visible is not None):
        raise ValueError("the blocked ChaCAL path is causal, without a mask (a bidirectional "
                         "system is dense); pass rows_per_block=None or 0")
    if not causal and past_k is not None:
        raise ValueError("a bidirectional ChaCAL layer has no cache: it sees every token")
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        if rows_per_block:  # it casts q, k, v itself, so that it keeps no float32 copy of them
            if past_k is not None:
                past_k, past_mixed = past_k.to(dtype), past_mixed.to(dtype)
            return BlockedChaCAL.apply(q, k, v, past_k, past_mixed, gamma, rows_per_block, dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        values = (1 - gamma) * v                                   # what a new token contributes
        if past_k is not None:
            k = torch.cat([past_k.to(dtype), k], dim=-2)           # (B, nh, Tp+Tq, hs)
            values = torch.cat([past_mixed.to(dtype), values], dim=-2)
        A = attention_weights(q, k, causal, visible)               # (B, nh, Tq, Tp+Tq)
        rhs = A @ values                                           # (B, nh, Tq, hs)
        if not causal:
            off_diagonal = A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
            eye = torch.eye(A.size(-1), dtype=dtype, device=A.device)
            return torch.linalg.solve(eye - gamma * off_diagonal, rhs)
        n_new = q.size(-2)
        # The solver treats the diagonal as 1 (unitriangular) and ignores the upper triangle, so
        # -γA among the new tokens *is* I - γA' to it: the diagonal leaves the inverse for free.
        return torch.linalg.solve_triangular(-gamma * A[..., -n_new:], rhs,
                                             upper=False, unitriangular=True)


# The blocked path's rows per block, and the number of new tokens from which chacal_attention
# takes it unasked, both measured on a 2-core CPU (fp32, d 128, forward + backward): timed with
# blocks of 32, 64 and 128 rows, blocks of 32 beat the others up to T = 512 and match them beyond;
# bench.py --long_only, table 6b, shows the switch: the one-solve path is faster up to T = 64
# (its T x T matrices are still small there), the blocked one from T = 128 on (0.8x the time
# at 128, 0.2-0.4x at 256).
# A GPU has no entry: there the blocked path's Python loop of small solves, one launch after
# another, is what costs, at the pace of the host that launches it. On two H100 machines (bf16,
# d 512) it took 1.2-1.4x the one solve's time at T = 32 and 3-5x at 512 (table 6b), and 3.3x and
# 5.7x at T = 8192 (table 6), where the one solve held 8.3 GB and the blocked path under 160 MiB.
# A GPU run whose T x T maps do not fit in its memory gives "cuda" an entry here.
CHACAL_ROWS_PER_BLOCK = 32
CHACAL_BLOCKED_FROM = {"cpu": 128}


def block_weights(q_block, keys, log_normaliser=None):
    """A for a block of n queries that are the last n of `keys`, causally masked among
    themselves: (B, nh, n, n_keys), and each row's log Σ exp (B, nh, n, 1). Given the
    log-normalisers (the backward), A is recomputed, not renormalised."""
    scores = (q_block / math.sqrt(q_block.size(-1))) @ keys.transpose(-2, -1)  # (B, nh, n, n_keys)
    n = q_block.size(-2)
    future = torch.ones(n, n, dtype=torch.bool, device=keys.device).triu(1)
    scores[..., -n:].masked_fill_(future, float("-inf"))  # only the last n columns hold a future
    if log_normaliser is None:
        log_normaliser = scores.logsumexp(dim=-1, keepdim=True)
    return scores.sub_(log_normaliser).exp_(), log_normaliser  # in place: one n x n_keys buffer


def solve_keys(k, past_k, dtype):
    """Every key the new tokens see, in the solve's dtype: (B, nh, Tp+Tq, hs)."""
    return k.to(dtype) if past_k is None else torch.cat([past_k, k.to(dtype)], dim=-2)


def mixed_values(v, y, gamma, past_mixed):
    """Every token's mixed value m = (1-γ)v + γy, cached ones first: (B, nh, Tp+Tq, hs_v)."""
    mixed = torch.lerp(v, y, gamma)  # (1-γ)v + γy in one buffer
    return mixed if past_mixed is None else torch.cat([past_mixed, mixed], dim=-2)


class BlockedChaCAL(torch.autograd.Function):
    """Causal ChaCAL solved one block of query rows at a time, in O(T·hs) memory.

    Forward. Split the new tokens into blocks of n rows. For a block b whose first row comes after
    `e` earlier tokens (cached and new), the row equation of `chacal_attention` splits into the
    earlier tokens, already solved, and the block's own:

        (I - γA'_bb) Y_b = A_b,<e M_<e + (1-γ) A_bb V_b,

    with A_b the block's rows of A (normalised over every key up to the row, as always), M_<e
    the earlier mixed values and A_bb the block's own n x n lower triangle: a small unit
    lower-triangular solve per block. Only q, k, v, Y, each row's log-normaliser (and a past's
    keys and mixed values) are kept, q, k and v in their own dtype: under bf16 autocast they are
    cast to the solve's float32 a block of rows at a time (the keys once per pass), since float32
    copies of all three, kept for the backward, would cost more memory than fused attention's
    whole step.

    Backward. With C = (1-γ)AV (plus A M_past for a cache) and N = γA' among the new tokens,
    Y = (I - N)⁻¹C, so for g = dL/dY

        R = dL/dC = (I - N)⁻ᵀ g,     dL/dN = R Yᵀ.

    (I - N)ᵀ is unit upper-triangular: R_j = g_j + γ Σ_{t>j} A_tj R_t. Block by block from the
    last to the first, the sum splits into the later blocks, already done and accumulated as
    dM_j = Σ_{t>j} A_tj R_t (the gradient of the mixed value m_j), and the block's own part, one
    small upper-triangular solve. R is then the whole gradient reaching y_j, through m_j too.
    Gathering dL/dC and dL/dN entry by entry,

        dA_tj = R_t · w_tj,     w_tj = m_j for j < t,  w_tt = (1-γ) v_t,

    so dA is the gradient of ordinary attention whose values are the mixed values, but for
    the diagonal; and dV_j = (1-γ)(dM_j + A_jj R_j), dM_past = A_pastᵀ R. The rest is the
    ordinary softmax backward, on A recomputed from the saved log-normalisers:
    dS = A ⊙ (dA - Σ_j A_tj dA_tj), where the row sum is R_t · y_t because y_t = Σ_j A_tj w_tj,
    then dQ = dS K / √hs and dK = dSᵀ Q / √hs.
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_mixed, gamma, rows_per_block, dtype):
        n_past, n_new = (0 if past_k is None else past_k.size(-2)), q.size(-2)
        keys = solve_keys(k, past_k, dtype)                                 # (B, nh, Tp+Tq, hs)
        # Filled block by block; as wide as v, which need not be hs (attention_map solves against I).
        mixed = keys.new_empty(*keys.shape[:-1], v.size(-1))                # (B, nh, Tp+Tq, hs_v)
        if past_k is not None:
            mixed[..., :n_past, :] = past_mixed
        y = v.new_empty(v.shape, dtype=dtype)                               # (B, nh, Tq, hs)
        log_normaliser = v.new_empty(*v.shape[:-1], 1, dtype=dtype)         # (B, nh, Tq, 1)
        for start in range(0, n_new, rows_per_block):
            stop = min(start + rows_per_block, n_new)
            earlier, end = n_past + start, n_past + stop
            v_block = v[..., start:stop, :].to(dtype)
            A, log_normaliser[..., start:stop, :] = block_weights(q[..., start:stop, :].to(dtype),
                                                                  keys[..., :end, :])
            own = A[..., earlier:]                                          # (B, nh, n, n)
            rhs = (A[..., :earlier] @ mixed[..., :earlier, :]              # earlier tokens
                   + (1 - gamma) * own @ v_block)                          # (B, nh, n, hs)
            y_block = torch.linalg.solve_triangular(-gamma * own, rhs, upper=False,
                                                    unitriangular=True)
            y[..., start:stop, :] = y_block
            mixed[..., earlier:end, :] = torch.lerp(v_block, y_block, gamma)
        ctx.save_for_backward(q, k, v, past_k, past_mixed, y, log_normaliser)
        ctx.gamma, ctx.rows_per_block = gamma, rows_per_block
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        q, k, v, past_k, past_mixed, y, log_normaliser = ctx.saved_tensors
        gamma, rows_per_block = ctx.gamma, ctx.rows_per_block
        scale = 1 / math.sqrt(q.size(-1))
        n_past, n_new = (0 if past_k is None else past_k.size(-2)), q.size(-2)
        keys = solve_keys(k, past_k, y.dtype)                              # (B, nh, Tp+Tq, hs)
        mixed = mixed_values(v.to(y.dtype), y, gamma, past_mixed)           # (B, nh, Tp+Tq, hs_v)
        grad_q = torch.empty_like(q)  # q's dtype: each block's rows are final when written
        grad_keys = torch.zeros_like(keys)
        # dM_j = Σ_{t>j} A_tj R_t over the blocks done so far. Once a block is done its own rows
        # are never read again, so they take its dV: the memory of one tensor saved.
        grad_mixed = torch.zeros_like(mixed)
        for start in reversed(range(0, n_new, rows_per_block)):
            stop = min(start + rows_per_block, n_new)
            earlier, end = n_past + start, n_past + stop
            q_block = q[..., start:stop, :].to(y.dtype)                     # (B, nh, n, hs)
            A, _ = block_weights(q_block, keys[..., :end, :],
                                 log_normaliser[..., start:stop, :])       # (B, nh, n, end)
            own = A[..., earlier:]                                          # (B, nh, n, n)
            grad_own = grad_mixed[..., earlier:end, :]                      # dM_b, later blocks
            # R_b = g_b + γ(dM_b + A'_bbᵀ R_b): the transposed system's block, upper-triangular.
            R = torch.linalg.solve_triangular(-gamma * own.transpose(-2, -1),
                                              grad_y[..., start:stop, :] + gamma * grad_own,
                                              upper=True, unitriangular=True)  # (B, nh, n, hs)
            grad_own.add_(own.transpose(-2, -1) @ R).mul_(1 - gamma)       # dV_b, in place
            grad_mixed[..., :earlier, :] += A[..., :earlier].transpose(-2, -1) @ R
            # dA_tj = R_t·m_j, except on the diagonal, where the value is (1-γ)v_t = m_t - γy_t.
            grad_A = R @ mixed[..., :end, :].transpose(-2, -1)              # (B, nh, n, end)
            R_dot_y = (R * y[..., start:stop, :]).sum(dim=-1, keepdim=True)  # (B, nh, n, 1)
            grad_A[..., earlier:].diagonal(dim1=-2, dim2=-1).sub_(gamma * R_dot_y[..., 0])
            grad_scores = grad_A.sub_(R_dot_y).mul_(A)  # softmax backward, A ⊙ (dA - rowsum)
            grad_q[..., start:stop, :] = grad_scores @ keys[..., :end, :] * scale
            grad_keys[..., :end, :] += grad_scores.transpose(-2, -1) @ (q_block * scale)
        grad_v = grad_mixed[..., n_past:, :]
        if past_k is None:
            return grad_q, grad_keys, grad_v, None, None, None, None, None
        return (grad_q, grad_keys[..., n_past:, :], grad_v, grad_keys[..., :n_past, :],
                grad_mixed[..., :n_past, :], None, None, None)


# -----------------------------------------------------------------------------
# The cache used when decoding.

class LayerCache:
    """Keys and values of every token a layer has seen so far, appended as decoding goes.

    Standard attention stores its values v_i; ChaCAL stores its mixed values m_i instead, so both
    keep one (key, value) pair per token and decode at the same cost. Under the inductive
    scratchpad's masks it also keeps each token's group, and forgets a state's tokens once no
    query can see them any more (model.generate_inductive).
    """

    def __init__(self):
        self.keys = None    # (B, nh, T_seen, hs)
        self.values = None  # (B, nh, T_seen, hs)
        self.groups = None  # (B, T_seen), or None without groups

    def __len__(self):
        return 0 if self.keys is None else self.keys.size(-2)

    def append(self, k, v, groups=None):
        if self.keys is None:
            self.keys, self.values, self.groups = k, v, groups
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
            if groups is not None:
                self.groups = torch.cat([self.groups, groups], dim=-1)

    def keep(self, columns):
        """Keep only the entries at `columns` (a (T_seen,) boolean): the rest are forgotten."""
        self.keys, self.values = self.keys[..., columns, :], self.values[..., columns, :]
        self.groups = self.groups[:, columns]


# -----------------------------------------------------------------------------
# The modules.

NO_GROUPS = ("--attn {attn} cannot take the inductive scratchpad's group masks (--scratchpad "
             "inductive); use --attn standard or chacal")


class StandardAttention(nn.Module):
    """Standard multi-head self-attention, as in GPT-2.

        A = softmax(Q Kᵀ / √hs + M),   Y = A V,   out = concat_heads(Y) W_o

    (Vaswani et al. 2017; ChaCAL paper Section 2.1, Eq. 1-2.) M masks the future; a
    bidirectional model (config.causal False, for LEGO) drops it. Parameter names follow GPT-2
    (`c_attn` holds W_q, W_k, W_v; `c_proj` is W_o), so GPT.from_pretrained maps its weights.

    Subclasses change how the heads mix their values by overriding `mix` (and `attention_map`,
    the map that the lessons draw).
    """

    learned_maps = True  # heads 0 and 1 learn their maps (LEGO's mimicking shapes them)
    decodes_with_cache = True  # GPT.generate may decode one token at a time against a cache
    # Honours the inductive scratchpad's group masks; where False, forward refuses groups (and
    # train.py refuses the flags at start).
    takes_groups = True

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_size = config.n_head, config.n_embd // config.n_head
        self.causal = config.causal
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # The fused kernel (flash / memory-efficient) is the fast path; the manual path shows the
        # math, and tests compare the two.
        self.fused = True
        self.maps = None  # a list while GPT.attention_maps collects each layer's weights

    @property
    def attn_name(self):
        """Its --attn name, read from ATTENTIONS (the registry at the end of this file), so that
        an error message names the flag's value without a second copy of it."""
        return next((name for name, cls in ATTENTIONS.items() if cls is type(self)),
                    type(self).__name__)  # a subclass of one's own, not in the registry

    def queries_keys_values(self, x):
        """x (B, T, C) -> q, k, v, each (B, nh, T, hs): one matmul, then split into heads. nh is
        n_head, except in LEGO attention v1, whose c_attn serves only the heads it keeps."""
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)                    # (B, T, nh·hs) each
        q = q.view(B, T, -1, self.head_size).transpose(1, 2)        # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_size).transpose(1, 2)        # (B, nh, T, hs)
        v = v.view(B, T, -1, self.head_size).transpose(1, 2)        # (B, nh, T, hs)
        return q, k, v

    def refuse_groups(self, groups):
        """Group masks come from the inductive scratchpad; an attention with takes_groups False
        cannot honour them and says so, whichever forward it runs."""
        if groups is not None and not self.takes_groups:
            raise ValueError(NO_GROUPS.format(attn=self.attn_name))

    def forward(self, x, cache=None, token_ids=None, depth=0, groups=None):
        self.refuse_groups(groups)
        B, T, C = x.size()
        q, k, v = self.queries_keys_values(x)
        if self.maps is not None:
            self.maps.append(self.attention_map(q, k, token_ids, depth))  # (B, nh, T, T)
        y = self.mix(q, k, v, cache, depth, groups)                       # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                  # heads side by side
        return self.resid_dropout(self.c_proj(y))

    def attention_map(self, q, k, token_ids, depth):
        """The weights each query gives each key, (B, nh, T, T), such that Y = map @ V."""
        return attention_weights(q, k, self.causal)

    def mix(self, q, k, v, cache, depth, groups=None):
        """Each head's output from its queries, keys and values: here Y = A V."""
        visible = None
        if cache is not None:
            cache.append(k, v, groups)
            k, v = cache.keys, cache.values
        if groups is not None:
            visible = group_visibility(groups, groups if cache is None else cache.groups)
        if not self.fused:
            return standard_attention(q, k, v, self.causal, visible)
        if visible is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        n_queries, n_keys = q.size(-2), k.size(-2)
        if n_queries == n_keys or not self.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        # With a cache the queries sit at the end of the keys; SDPA's is_causal aligns them at
        # the start, so pass the mask. One new token sees every key and needs none.
        mask = None if n_queries == 1 else causal_visibility(n_queries, n_keys, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class ChaCALAttention(StandardAttention):
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

    # A new token's row of ChaCAL's system is plain attention over the mixed values before it,
    # so one token decodes with the fused kernel; an ablation whose row is not says False.
    decodes_one_token_by_attention = True

    def solve(self, q, k, v, past_k=None, past_mixed=None, visible=None):
        """The new tokens' Y from the system, earlier tokens entering through their mixed values:
        the one method a variant of the system overrides."""
        return chacal_attention(q, k, v, self.gamma, past_k, past_mixed, causal=self.causal,
                                visible=visible)

    def attention_map(self, q, k, token_ids, depth):
        """(1-γ)(I - γA')⁻¹A: every path's weight summed. Solving against V = I gives it."""
        eye = torch.eye(k.size(-2), dtype=q.dtype, device=q.device).expand(*k.shape[:-1], -1)
        return self.solve(q, k, eye)

    def mix(self, q, k, v, cache, depth, groups=None):
        if cache is None:
            visible = None if groups is None else group_visibility(groups, groups)
            return self.solve(q, k, v, visible=visible).to(v.dtype)
        # The cache holds keys and mixed values in k's and v's dtype, as any KV cache holds its
        # values: under bf16 autocast, decoding rounds the m_t that a full pass keeps in float32.
        # With groups, the new tokens see the cached ones their groups allow (key groups: the
        # cached ones' and their own).
        visible = None
        if groups is not None:
            key_groups = groups if cache.groups is None else torch.cat([cache.groups, groups], 1)
            visible = group_visibility(groups, key_groups)
        if q.size(-2) > 1 or not self.decodes_one_token_by_attention:
            # a prompt, a block of tokens, or the ablation's one token: a small solve (Eq. 9)
            y = self.solve(q, k, v, cache.keys, cache.values, visible).to(v.dtype)
            cache.append(k, (1 - self.gamma) * v + self.gamma * y, groups)  # as one token's below
            return y
        # One new token: its row of the system is plain attention over the cached mixed values
        # and its own (1-γ)v_t, so the fused kernel computes it, at the cost of standard decoding.
        cache.append(k, (1 - self.gamma) * v, groups)
        y = (F.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=visible)
             if self.fused else standard_attention(q, cache.keys, cache.values, False, visible))
        cache.values[..., -1:, :].add_(y, alpha=self.gamma)  # m_t = (1-γ)v_t + γy_t, one kernel
        return y


def chacal_keep_diagonal(q, k, v, gamma, past_k=None, past_mixed=None, causal=True):
    """The ablation of lesson 01: Y = (1-γ)·(I - γA)⁻¹·A·V, the diagonal kept in the inverse.

    Row t then reads y_t = Σ_{i<t} A_ti m_i + (1-γ)A_tt v_t + γA_tt y_t, so the solve divides by
    1 - γA_tt: a token's own weight is amplified by 1/(1 - γA_tt), the sum of its self-loops
    t -> t -> t ... that ChaCAL leaves out (paper, Section 4.1). The same mixed values enter from a
    cache; the solve, lower-triangular but not unit, runs even for one new token. Shapes as
    chacal_attention's."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        values = (1 - gamma) * v
        if past_k is not None:
            k = torch.cat([past_k.to(dtype), k], dim=-2)           # (B, nh, Tp+Tq, hs)
            values = torch.cat([past_mixed.to(dtype), values], dim=-2)
        A = attention_weights(q, k, causal)                        # (B, nh, Tq, Tp+Tq)
        n_new = q.size(-2)
        system = torch.eye(n_new, dtype=dtype, device=q.device) - gamma * A[..., -n_new:]
        if not causal:
            return torch.linalg.solve(system, A @ values)
        return torch.linalg.solve_triangular(system, A @ values, upper=False)


class ChaCALKeepDiagonal(ChaCALAttention):
    """ChaCAL with the diagonal kept inside the inverse, Y = (1-γ)·(I - γA)⁻¹·A·V: the paper
    removes the diagonal as trivial and says that improves learning (Section 4.1), with no table.
    Lesson 01 trains this ablation beside ChaCAL. See `chacal_keep_diagonal`."""

    takes_groups = False  # lesson 01's ablation, written without a masked path
    decodes_one_token_by_attention = False  # its row divides by 1 - γA_tt: a solve even for one

    def solve(self, q, k, v, past_k=None, past_mixed=None, visible=None):
        return chacal_keep_diagonal(q, k, v, self.gamma, past_k, past_mixed, causal=self.causal)


class SlidingDilatedAttention(StandardAttention):
    """Sliding-Dilated-Attention, the attention of RegularGPT (Chi et al. 2023, Section 3.1).

    Layer j looks back only at the offsets {0, d, 2d, ..., (C-1)·d}, with chunk size C and
    dilation d = C^(j // K) (K = thickness, the layers per level), and adds a learned scalar
    r[h, s] per head h and step s = offset / d to the scores:

        A[m, n] = softmax_n( q_m·k_n / √hs + r[h, (m-n)/d] )   if m-n ∈ {0, d, ..., (C-1)d}

    and 0 elsewhere. Stacking levels l = 0, 1, 2, ... makes a tree: after L levels position m
    has read every position in m - C^L + 1 .. m exactly once, in log_C T steps. This is the
    divide-and-conquer that lets one shared layer, applied ⌈log_C T⌉ times, compute parity (or
    any regular language) at lengths never seen in training. Our RegularGPT runs have no
    positional embeddings (--pos none; the paper does not mention them), since a learned table
    stops at the training lengths: r and the mask are then the only notion of position. Which tokens
    each query sees, for C = 2 on eight tokens (row = query, x = attended):

        level 0, d = 1      level 1, d = 2      level 2, d = 4
        x . . . . . . .     x . . . . . . .     x . . . . . . .
        x x . . . . . .     . x . . . . . .     . x . . . . . .
        . x x . . . . .     x . x . . . . .     . . x . . . . .
        . . x x . . . .     . x . x . . . .     . . . x . . . .
        . . . x x . . .     . . x . x . . .     x . . . x . . .
        . . . . x x . .     . . . x . x . .     . x . . . x . .
        . . . . . x x .     . . . . x . x .     . . x . . . x .
        . . . . . . x x     . . . . . x . x     . . . x . . . x

    The paper's code computes the same tree for the last token by shrinking the sequence C-fold
    per level; this mask form gives an output at every position instead, as a GPT needs.

    Offsets that reach before position 0 read a learned pad vector p instead (its key and value
    are c_attn(p), with the offset's own r), as the official code pads every level on the left.
    So every query mixes exactly C entries. Without the pad, parity cannot be learned: token 0
    alone at level 0 would mix v(x_0) with nothing, which is exactly what a pair of two equal
    tokens gives, yet parity(1) = 1 and parity(1, 1) = 0. The pad is one extra key column, at
    the front, whose score takes log Σ exp(r[h, s]) over the steps s that land before 0.
    """

    takes_groups = False  # its fixed offsets reach across states, whatever a mask would allow

    def __init__(self, config):
        super().__init__(config)
        self.chunk, self.thickness = config.chunk, config.thickness
        self.offset_bias = nn.Parameter(0.02 * torch.randn(config.n_head, config.chunk))  # r
        self.pad = nn.Parameter(0.02 * torch.randn(config.n_embd))                         # p

    def dilation(self, depth):
        """d = C^(depth // K): the spacing of the offsets at this depth."""
        return self.chunk ** (depth // self.thickness)

    def score_bias(self, n_queries, n_keys, depth, device):
        """(nh, Tq, 1 + Tk): r[h, step] where the query sees the key, -inf elsewhere; column 0 is
        the pad's, the log-sum-exp of r over the steps that land before position 0."""
        dilation = self.dilation(depth)
        query_pos = torch.arange(n_keys - n_queries, n_keys, device=device).view(-1, 1)
        offset = query_pos - torch.arange(n_keys, device=device).view(1, -1)   # (Tq, Tk)
        step = offset // dilation
        visible = (offset >= 0) & (offset % dilation == 0) & (step < self.chunk)
        bias = self.offset_bias[:, step.clamp(0, self.chunk - 1)]                # (nh, Tq, Tk)
        steps = torch.arange(self.chunk, device=device)
        before_start = query_pos < steps * dilation                               # (Tq, C)
        pad = self.offset_bias[:, None, :].masked_fill(~before_start, float("-inf"))
        return torch.cat([pad.logsumexp(dim=-1, keepdim=True),                  # (nh, Tq, 1)
                          bias.masked_fill(~visible, float("-inf"))], dim=-1)

    def pad_in_front(self, x, which, count=1):
        """x (B, nh, Tk, hs) with `count` copies of the pad's "key" or "value" (which) in front:
        (B, nh, count + Tk, hs)."""
        B, nh, _, hs = x.shape
        q_k_v = self.c_attn(self.pad).split(nh * hs)
        pad = q_k_v[{"key": 1, "value": 2}[which]].view(1, nh, 1, hs)
        return torch.cat([pad.expand(B, -1, count, -1).to(x.dtype), x], dim=-2)

    def padded_map(self, q, k, depth):
        """(B, nh, Tq, 1 + Tk): the weights on the pad (column 0) and on every key."""
        scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)
        bias = self.score_bias(q.size(-2), k.size(-2) - 1, depth, q.device)
        return (scores + bias.to(q.dtype)).softmax(dim=-1)

    def attention_map(self, q, k, token_ids, depth):
        """The weights on the tokens, (B, nh, T, T); what a row lacks of 1 went to the pad."""
        return self.padded_map(q, self.pad_in_front(k, "key"), depth)[..., 1:]

    def mix(self, q, k, v, cache, depth, groups=None):
        if cache is not None:
            cache.append(k, v)
            k, v = cache.keys, cache.values
        if not self.fused:  # the readable path: the masked T x T map above
            weights = self.padded_map(q, self.pad_in_front(k, "key"), depth)
            return weights @ self.pad_in_front(v, "value")
        # The fast path reads each query's C entries and nothing else: O(T·C) work where the
        # mask costs O(T²), which matters at the test lengths (T = 500, 9 levels). With `reach`
        # pads in front, the entries at step s of all queries are one contiguous slice, shifted
        # back s·d; a shift beyond the first token lands wholly in the pads, as it should.
        n_queries, n_keys = q.size(-2), k.size(-2)
        dilation = self.dilation(depth)
        reach = min((self.chunk - 1) * dilation, n_keys)
        k, v = self.pad_in_front(k, "key", reach), self.pad_in_front(v, "value", reach)
        end = reach + n_keys  # one past the last query's own entry
        shifts = [min(step * dilation, reach) for step in range(self.chunk)]

        def at_each_step(x):  # (B, nh, Tq, C, hs): entry s of query m is x at m - s·d (or a pad)
            return torch.stack([x[..., end - n_queries - shift: end - shift, :] for shift in shifts],
                               dim=-2)

        scores = torch.einsum("bhmd,bhmsd->bhms", q, at_each_step(k)) / math.sqrt(q.size(-1))
        weights = (scores + self.offset_bias[:, None, :].to(q.dtype)).softmax(dim=-1)
        return torch.einsum("bhms,bhmsd->bhmd", weights, at_each_step(v))


class LEGOAttention(StandardAttention):
    """LEGO attention v0 (Zhang et al. 2022, Section 5, Figure 8): heads whose maps are read off
    the token ids, and a convolution, in place of learned queries and keys.

    From the raw token ids u_1..u_T, maps with no parameters at all,

        (A_asso)_ij = 1[u_i = u_j]      association: each token reads every copy of itself
        (A_cls)_ij  = 1[u_j = [CLS]]    broadcast: every token reads what [CLS] holds
        (A_sep)_ij  = 1[u_j = [SEP]]    and likewise [SEP]

    each scaled so that its rows sum to 1. Manipulation, the local pattern, is a convolution of
    kernel 21 along the sequence (the paper's "temporal convolution"). A pathway p learns only a
    value map W_p (C -> w), and the pathways take the place of heads, sharing their channels: in v0
    of every head, so with P = n_maps + 1 pathways each gets w = n_embd // P channels (the
    convolution also takes any remainder), and out has the shape of standard attention's:

        head_p    = A_p · X W_p            for p in asso, cls, sep        (B, T, w) each
        head_conv = DepthwiseConv21(X W_conv)
        out       = concat(head_asso, head_cls, head_sep, head_conv) W_o

    No q·kᵀ and no softmax: building a map is T x T comparisons of integers, the paper's
    saving in Flops. One broadcast map per id in config.broadcast_ids (the task's [CLS] and
    [SEP]; none when it is empty).

    Our choices, where the paper's Appendix C (the details) is missing:
    - the convolution is depthwise (one kernel per channel), over its own value map W_conv;
    - the pathways share the channels of the heads they replace, and are concatenated and
      projected by c_proj (W_o) as ordinary heads are, rather than summed;
    - the maps are rebuilt in every layer from the same ids (the paper builds them once and
      shares them; they are the same maps, and cheap);
    - a causal model removes the future from the maps before normalising, and pads the
      convolution with 20 zeros on the left (position i reads i-20..i); a bidirectional one
      pads 10 on each side ('same', i-10..i+10). A row with nothing to read (a causal row
      before [SEP]) stays all zero;
    - called without token_ids (a module on its own), every token counts as distinct: the
      association map is the identity and no token broadcasts;
    - no decoding cache: LEGO is a bidirectional task.

    attention_map gives (B, n_maps, T, T), the association map then the broadcast maps (and,
    in v1, the standard heads after them). The convolution has no single map (each channel
    has its own kernel), so it is left out.
    """

    kernel_size = 21
    learned_maps = False    # its first heads are the fixed maps, which mimicking cannot shape
    takes_groups = False    # maps read off token ids and a convolution: no mask to restrict
    decodes_with_cache = False  # no cached path: maps and convolution read the whole sequence

    def __init__(self, config):
        super().__init__(config)  # gives c_attn (resized by v1, dropped by v0), c_proj (C -> C)
        C, hs = config.n_embd, self.head_size
        self.broadcast_ids = tuple(config.broadcast_ids)
        self.n_maps = 1 + len(self.broadcast_ids)  # association, then one map per broadcast id
        self.n_standard = self.kept_heads(config.n_head)
        # The pathways share the channels of the heads they replace.
        shared, n_pathways = (config.n_head - self.n_standard) * hs, self.n_maps + 1
        if shared < n_pathways:
            raise ValueError(f"--attn {self.attn_name} shares {shared} channels among "
                             f"{n_pathways} pathways: raise --n_embd so that each gets one")
        self.map_width = shared // n_pathways
        self.conv_width = shared - self.n_maps * self.map_width
        # The value maps of every pathway side by side: the fixed maps' first, the conv's last.
        self.c_value = nn.Linear(C, shared, bias=config.bias)
        self.conv = nn.Conv1d(self.conv_width, self.conv_width, self.kernel_size,
                              groups=self.conv_width, bias=config.bias)  # depthwise
        if self.n_standard:  # queries, keys and values for the standard heads kept, no more
            self.c_attn = nn.Linear(C, 3 * self.n_standard * hs, bias=config.bias)
        else:
            del self.c_attn  # v0 learns no queries and keys

    def kept_heads(self, n_head):
        """How many of the n_head heads stay ordinary softmax heads: none in v0."""
        return 0

    def fixed_maps(self, token_ids, dtype=torch.float32):
        """(B, n_maps, T, T) in dtype: A_asso, then A_b for each broadcast id b; rows sum to 1."""
        B, T = token_ids.shape
        same = token_ids[:, :, None] == token_ids[:, None, :]                   # (B, T, T)
        broadcast = [(token_ids == b)[:, None, :].expand(B, T, T) for b in self.broadcast_ids]
        maps = torch.stack([same, *broadcast], dim=1).to(dtype)                 # (B, n_maps, T, T)
        if self.causal:
            maps = maps.tril()  # before normalising, so each row shares 1 among visible keys
        return maps / maps.sum(dim=-1, keepdim=True).clamp(min=1)  # 1 / count, rounded in dtype

    def manipulate(self, v):
        """The convolution pathway on its values v (B, T, w): returns (B, T, w)."""
        reach = self.kernel_size - 1
        left = reach if self.causal else reach // 2          # causal: nothing from the future
        v = F.pad(v.transpose(1, 2), (left, reach - left))   # (B, w, T + 20)
        return self.conv(v).transpose(1, 2)

    def attention_map(self, q, k, token_ids, depth):
        """The fixed maps, then (v1, q and k not None) the standard heads' softmax weights."""
        if q is None:
            return self.fixed_maps(token_ids)
        maps = self.fixed_maps(token_ids, torch.promote_types(q.dtype, torch.float32))
        return torch.cat([maps.to(q.dtype), attention_weights(q, k, self.causal)], dim=1)

    def forward(self, x, cache=None, token_ids=None, depth=0, groups=None):
        self.refuse_groups(groups)
        if cache is not None:
            raise ValueError(f"--attn {self.attn_name} keeps no decoding cache; generate with "
                             f"use_cache=False")
        B, T, C = x.size()
        if token_ids is None:  # a module on its own: negative ids, all distinct, none broadcast
            token_ids = torch.arange(-T, 0, device=x.device).expand(B, T)
        map_values, conv_values = self.c_value(x).split(
            [self.n_maps * self.map_width, self.conv_width], dim=2)
        map_values = map_values.view(B, T, self.n_maps, self.map_width).transpose(1, 2)
        # 1 / count at the values' precision, or float32's under bf16 autocast, then cast
        maps = self.fixed_maps(token_ids, torch.promote_types(map_values.dtype, torch.float32))
        maps = maps.to(map_values.dtype)                                    # (B, n_maps, T, T)
        y_maps = maps @ map_values                                          # (B, n_maps, T, w)
        heads = [y_maps.transpose(1, 2).reshape(B, T, -1), self.manipulate(conv_values)]
        q = k = None
        if self.n_standard:
            q, k, v = self.queries_keys_values(x)                           # (B, kept, T, hs)
            y_standard = self.mix(q, k, v, None, depth)
            heads.append(y_standard.transpose(1, 2).reshape(B, T, -1))
        if self.maps is not None:
            self.maps.append(self.attention_map(q, k, token_ids, depth))
        y = torch.cat(heads, dim=2)                     # (B, T, pathways [+ kept·hs]) side by side
        return self.resid_dropout(self.c_proj(y))


class LEGOAttentionV1(LEGOAttention):
    """LEGO attention v1 (Figure 8, pathways (a), (b) and (c)): the pathways take the place of
    some of the standard heads, and every head is concatenated, then projected by c_proj.

    Of the n_head heads of hs channels, v1 keeps n_head // 2 ordinary softmax heads. The
    pathways (association, one broadcast map per id, the convolution: P = n_maps + 1 of them)
    take the place of the other n_head - n_head // 2 and share their channels: each gets
    (n_head - n_head // 2)·hs // P, the convolution any remainder. c_proj reads n_embd
    channels, as in standard attention and v0. At n_embd 128, n_head 4 and [CLS], [SEP]: 2
    standard heads of 32 channels and 4 pathways of 16 (v0: 4 pathways of 32):

        head_h = softmax(q_h k_hᵀ / √hs) v_h            for h = 1 .. k,  k = n_head // 2
        out    = concat(head_asso, head_cls, head_sep, head_conv, head_1, ..., head_k) W_o

    Why half: the paper's v1 replaces some of BERT's heads, and is smaller and cheaper than BERT
    (Figure 9), but how many is in its missing Appendix C. Association and manipulation (Section
    4.2.1) and broadcasting (Section 5) make a considerable share of a pretrained BERT's heads;
    half, rounded down, keeps at least one ordinary head and replaces at least one (n_head >= 2).
    Any replaced head saves: it loses its queries and keys (2·n_embd·hs weights) and its T x T
    softmax, and its channels go to pathways that learn only a value map.
    """

    def kept_heads(self, n_head):
        if n_head < 2:
            raise ValueError(f"--attn {self.attn_name} replaces half the heads with its pathways: "
                             f"it needs --n_head 2 or more, not {n_head}")
        return n_head // 2


# -----------------------------------------------------------------------------
# LEGO's mimicking initialisation (Zhang et al. 2022, Section 4.2.2): before training on the task,
# pull heads 0 and 1 of every layer toward the two maps a pretrained BERT's heads show.

def smoothed(maps, causal):
    """Add 1e-3 to every weight a query may give, then renormalise rows, as LEGO's mimicking
    does, so that the KL below stays finite."""
    maps = maps + 1e-3
    if causal:
        maps = maps.tril()
    return maps / maps.sum(dim=-1, keepdim=True)


def mimicking_targets(token_ids, causal):
    """Manipulation: weights 1, 2, 4, 2, 1 on the tokens from two before to two after, whatever
    they are; association: every *other* token equal to this one. Each (B, T, T), smoothed."""
    B, T = token_ids.shape
    offset = torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)  # key minus query position
    manipulation = torch.zeros(T, T)
    for distance, weight in {-2: 1, -1: 2, 0: 4, 1: 2, 2: 1}.items():
        manipulation[offset == distance] = weight
    association = (token_ids.view(B, T, 1) == token_ids.view(B, 1, T)).float()
    association = association * (1 - torch.eye(T, device=token_ids.device))  # not the diagonal
    return (smoothed(manipulation.expand(B, T, T).to(token_ids.device), causal),
            smoothed(association, causal))


def mimicking_loss(maps_per_layer, token_ids, causal):
    """Σ over layers of KL(head 0 ‖ manipulation) + KL(head 1 ‖ association), the model's map
    first (a reverse KL, as the LEGO code), averaged over sequences and queries.
    maps_per_layer: a list of (B, nh, T, T), from GPT.attention_maps."""
    manipulation, association = mimicking_targets(token_ids, causal)
    loss = 0.0
    for maps in maps_per_layer:
        for head, target in ((0, manipulation), (1, association)):
            p = smoothed(maps[:, head].float(), causal)
            # A causal map is 0 on the future in both p and the target. The clamp makes those
            # terms 0·log(tiny) = 0 with a finite gradient, where log 0 would give NaN.
            log_ratio = p.clamp_min(1e-30).log() - target.clamp_min(1e-30).log()
            loss = loss + (p * log_ratio).sum(dim=-1).mean()
    return loss


def mimic(model, batches, lr, betas, autocast=contextlib.nullcontext()):
    """LEGO's mimicking initialisation: train the attention maps alone, with mimicking_loss, on
    batches of token ids (B, T) (unlabelled sequences of the task), by AdamW without weight
    decay. Returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr, betas, weight_decay=0)
    losses = []
    for x in batches:
        with autocast:
            loss = mimicking_loss(model.attention_maps(x), x, model.config.causal)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# The --attn name of each variant.
ATTENTIONS = {
    "standard": StandardAttention,
    "chacal": ChaCALAttention,
    "chacal_diagonal": ChaCALKeepDiagonal,
    "dilated": SlidingDilatedAttention,
    "lego_v0": LEGOAttention,
    "lego_v1": LEGOAttentionV1,
}
