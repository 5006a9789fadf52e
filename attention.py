"""The attention variants: functional cores, one module per variant, the registry, the fast path.
B batch, T tokens, C = n_embd, nh heads, hs = C / nh. Each module maps x (B, T, C) to (B, T, C) as
attn(x, cache=None, token_ids=None, depth=0, groups=None) and declares in `supports` which of
"groups" (the scratchpad's masks), "bidirectional", "cache", "mimic" it has."""
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_visibility(n_queries, n_keys, device):
    """(n_queries, n_keys), True where a query sees a key; the queries are the last of the keys."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)


def group_visibility(query_groups, key_groups):
    """The inductive scratchpad's mask (Abbe et al. 2024, Appendix C), (B, 1, Tq, Tk): causal and
    (group_j == group_i or group_j == 0); query_groups (B, Tq) end key_groups (B, Tk)."""
    causal = causal_visibility(query_groups.size(1), key_groups.size(1), query_groups.device)
    keys = key_groups[:, None, :]                                       # (B, 1, Tk)
    same = (query_groups[:, :, None] == keys) | (keys == 0)             # (B, Tq, Tk)
    return (causal & same)[:, None]                                     # (B, 1, Tq, Tk)


def attention_weights(q, k, causal=True, visible=None):
    """A = softmax(q kᵀ / √hs + M) (B, nh, Tq, Tk), M -inf where not `visible` (None: causal)."""
    scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)  # scaling q is cheaper than T x T
    if visible is None and causal:
        visible = causal_visibility(q.size(-2), k.size(-2), q.device)
    return (scores if visible is None else scores.masked_fill(~visible, float("-inf"))).softmax(-1)


def standard_attention(q, k, v, causal=True, visible=None):
    """Y = A V, the readable path of ordinary attention (ChaCAL paper, Eq. 1-2)."""
    return attention_weights(q, k, causal, visible) @ v


def chacal_attention(q, k, v, gamma, past_k=None, past_mixed=None, causal=True, visible=None,
                     keep_diagonal=False):
    """ChaCAL in one solve (paper, Section 4.1, Eq. 7), A' = A with its diagonal removed:

        (I - γA') Y = (1-γ) A V

    Earlier tokens enter by their keys `past_k` and mixed values m = (1-γ)v + γy (Eq. 9).
    keep_diagonal solves (I - γA) Y instead. Y (B, nh, Tq, hs) is float32 (or float64)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        values = (1 - gamma) * v                                   # what a new token contributes
        if past_k is not None:
            k = torch.cat([past_k.to(dtype), k], dim=-2)           # (B, nh, Tp+Tq, hs)
            values = torch.cat([past_mixed.to(dtype), values], dim=-2)
        A = attention_weights(q, k, causal, visible)               # (B, nh, Tq, Tp+Tq)
        rhs = A @ values                                           # (B, nh, Tq, hs)
        own = A[..., -q.size(-2):]                                 # among the new tokens
        if causal and not keep_diagonal:
            # The solver takes the diagonal as 1 (unitriangular) and ignores the upper triangle, so
            # -γA among the new tokens *is* I - γA' to it: the diagonal leaves the inverse for free.
            return torch.linalg.solve_triangular(-gamma * own, rhs, upper=False, unitriangular=True)
        eye = torch.eye(own.size(-1), dtype=dtype, device=q.device)
        system = eye - gamma * (own if keep_diagonal else own * (1 - eye))  # I - γA' (or I - γA)
        return torch.linalg.solve_triangular(system, rhs, upper=False) if causal else torch.linalg.solve(system, rhs)


class LayerCache:
    """Per layer when decoding: each token's key and value (ChaCAL: mixed value), and its group."""
    keys = values = groups = None  # an empty cache

    def __len__(self):
        return 0 if self.keys is None else self.keys.size(-2)

    def append(self, k, v, groups=None):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        if groups is not None:
            self.groups = groups if self.groups is None else torch.cat([self.groups, groups], -1)
        return self.keys, self.values

    def keep(self, columns):  # forget all entries but those at `columns`, a (T,) boolean
        self.keys, self.values = self.keys[..., columns, :], self.values[..., columns, :]
        self.groups = self.groups[:, columns]


class StandardAttention(nn.Module):
    """Standard multi-head attention, as GPT-2 (Vaswani et al. 2017; ChaCAL paper, Section 2.1):

        A = softmax(Q Kᵀ / √hs + M),   Y = A V,   out = concat_heads(Y) W_o

    M masks the future unless bidirectional; c_attn holds W_q, W_k, W_v and c_proj W_o, as GPT-2."""
    supports = frozenset({"groups", "bidirectional", "cache", "mimic"})

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_size = config.n_head, config.n_embd // config.n_head
        self.causal = config.causal
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.fused = True  # the fused SDPA kernel; False takes the readable path
        self.maps = None   # a list while GPT.attention_maps collects each layer's map

    def queries_keys_values(self, x):
        B, T, _ = x.size()
        return [t.view(B, T, -1, self.head_size).transpose(1, 2)      # (B, nh, T, hs)
                for t in self.c_attn(x).chunk(3, dim=2)]

    def forward(self, x, cache=None, token_ids=None, depth=0, groups=None):
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
        """Each head's output from its queries, keys and values: here Y = A V (B, nh, T, hs)."""
        if cache is not None:
            k, v = cache.append(k, v, groups)  # every key and value so far
        seen = groups if cache is None else cache.groups  # the group of every key
        visible = None if groups is None else group_visibility(groups, seen)
        if not self.fused:
            return standard_attention(q, k, v, self.causal, visible)
        n_queries, n_keys = q.size(-2), k.size(-2)
        if visible is None and self.causal and 1 < n_queries < n_keys:  # SDPA's is_causal would
            visible = causal_visibility(n_queries, n_keys, q.device)    # align them with key 0
        is_causal = self.causal and visible is None and n_queries == n_keys
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=is_causal)


class ChaCALAttention(StandardAttention):
    """ChaCAL, Chain and Causal Attention (Fagnou et al. 2024, Section 4, Eq. 5-9):

        Y = (1-γ)·(I - γA')⁻¹·A·V,   A' = A minus its diagonal,   γ ∈ [0, 1)

    With A as "who refers to whom", A'ᵏA follows paths of k+1 hops: one layer follows a chain to
    its end, where standard attention needs ⌈log2(n+1)⌉ layers (Theorem 1); γ = 0 is standard."""
    keep_diagonal = False

    def __init__(self, config):
        super().__init__(config)
        self.gamma = config.gamma

    def solve(self, q, k, v, past_k=None, past_mixed=None, visible=None):
        """The new tokens' Y; on a CPU a long causal input takes the blocked path (faster there)."""
        if (self.causal and visible is None and past_k is None and not self.keep_diagonal
                and q.device.type == "cpu" and q.size(-2) >= CHACAL_BLOCKED_FROM):
            return blocked_chacal_attention(q, k, v, self.gamma)
        return chacal_attention(q, k, v, self.gamma, past_k, past_mixed, self.causal, visible, self.keep_diagonal)

    def attention_map(self, q, k, token_ids, depth):
        """(1-γ)(I - γA')⁻¹A, every path's weight summed: the solve against V = I."""
        eye = torch.eye(k.size(-2), dtype=q.dtype, device=q.device).expand(*k.shape[:-1], -1)
        return self.solve(q, k, eye)

    def mix(self, q, k, v, cache, depth, groups=None):
        if cache is not None and q.size(-2) == 1 and not self.keep_diagonal:
            # One new token: attention over the cached m_i and its own (1-γ)v_t, as v - γv (no scalar tensor)
            y = super().mix(q, k, torch.add(v, v, alpha=-self.gamma), cache, depth, groups)
            cache.values[..., -1:, :].add_(y, alpha=self.gamma)  # m_t = (1-γ)v_t + γy_t
            return y
        past = LayerCache() if cache is None else cache  # the tokens solved before these
        seen = groups if past.groups is None else torch.cat([past.groups, groups], 1)
        visible = None if groups is None else group_visibility(groups, seen)
        y = self.solve(q, k, v, past.keys, past.values, visible).to(v.dtype)
        if cache is not None:  # their mixed values m = (1-γ)v + γy, for the tokens after (Eq. 9)
            cache.append(k, (1 - self.gamma) * v + self.gamma * y, groups)
        return y


class ChaCALKeepDiagonal(ChaCALAttention):
    """Lesson 01's ablation, Y = (1-γ)·(I - γA)⁻¹·A·V: the diagonal the paper removes (4.1) kept."""
    keep_diagonal = True


class SlidingDilatedAttention(StandardAttention):
    """Sliding-Dilated-Attention, the attention of RegularGPT (Chi et al. 2023, Section 3.1).

    Layer j sees the offsets 0, d, ..., (C-1)·d (chunk C, dilation d = C^(j // K), K = thickness),
    each step s = offset / d with a learned bias r[h, s], the levels below for C = 2, T = 8:

        A[m, n] = softmax_n(q_m·k_n / √hs + r[h, (m-n)/d])   if m-n ∈ {0, d, ..., (C-1)d}, else 0

        level 0, d = 1      level 1, d = 2      level 2, d = 4
        x . . . . . . .     x . . . . . . .     x . . . . . . .
        x x . . . . . .     . x . . . . . .     . x . . . . . .
        . x x . . . . .     x . x . . . . .     . . x . . . . .
        . . x x . . . .     . x . x . . . .     . . . x . . . .
        . . . x x . . .     . . x . x . . .     x . . . x . . .
        . . . . x x . .     . . . x . x . .     . x . . . x . .
        . . . . . x x .     . . . . x . x .     . . x . . . x .
        . . . . . . x x     . . . . . x . x     . . . x . . . x

    Offsets before 0 read a learned pad p, as the official code: else token 0 alone looks like two
    equal tokens, and parity(1) ≠ parity(1, 1)."""
    supports = frozenset({"cache", "mimic"})  # its offsets reach across any group; it looks back

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

    def pad_in_front(self, x, which, count=1):  # `count` copies of the pad's key (1) or value (2)
        B, nh, _, hs = x.shape
        pad = self.c_attn(self.pad).split(nh * hs)[which].view(1, nh, 1, hs)
        return torch.cat([pad.expand(B, -1, count, -1).to(x.dtype), x], dim=-2)

    def attention_map(self, q, k, token_ids, depth, with_pad=False):
        """The weights on the tokens (B, nh, T, T); with_pad, the pad's column (the rest) first."""
        scores = (q / math.sqrt(q.size(-1))) @ self.pad_in_front(k, 1).transpose(-2, -1)
        bias = self.score_bias(q.size(-2), k.size(-2), depth, q.device)
        weights = (scores + bias.to(q.dtype)).softmax(dim=-1)
        return weights if with_pad else weights[..., 1:]

    def mix(self, q, k, v, cache, depth, groups=None):
        if cache is not None:
            k, v = cache.append(k, v)
        if not self.fused:  # the readable path: the masked T x T map above
            return self.attention_map(q, k, None, depth, with_pad=True) @ self.pad_in_front(v, 2)
        # O(T·C), not O(T²): behind `reach` pads, step s of every query is one slice, s·d back.
        n_queries, n_keys = q.size(-2), k.size(-2)
        dilation = self.dilation(depth)
        reach = min((self.chunk - 1) * dilation, n_keys)
        k, v = self.pad_in_front(k, 1, reach), self.pad_in_front(v, 2, reach)
        end = reach + n_keys  # one past the last query's own entry
        shifts = [min(step * dilation, reach) for step in range(self.chunk)]
        k, v = [torch.stack([x[..., end - n_queries - s: end - s, :] for s in shifts], dim=-2)
                for x in (k, v)]  # (B, nh, Tq, C, hs): entry s of query m is at m - s·d (or a pad)
        scores = torch.einsum("bhmd,bhmsd->bhms", q, k) / math.sqrt(q.size(-1))
        weights = (scores + self.offset_bias[:, None, :].to(q.dtype)).softmax(dim=-1)
        return torch.einsum("bhms,bhmsd->bhmd", weights, v)


class LEGOAttention(StandardAttention):
    """LEGO attention v0 (Zhang et al. 2022, Section 5, Figure 8): maps read off the token ids u
    and a convolution in place of queries and keys; each map's rows normalised to sum to 1:

        (A_asso)_ij = 1[u_i = u_j],   (A_b)_ij = 1[u_j = b] for b in broadcast_ids ([CLS], [SEP])
        out = concat(A_asso X W_asso, A_b X W_b ..., DepthwiseConv21(X W_conv)) W_o

    The pathways share the replaced heads' channels (the paper's Appendix C is missing)."""
    supports = frozenset({"bidirectional"})  # maps and convolution read the whole sequence
    kernel_size, keeps_half = 21, False

    def __init__(self, config):
        super().__init__(config)  # c_attn (resized by v1, dropped by v0), c_proj (C -> C)
        self.broadcast_ids = tuple(config.broadcast_ids)
        self.n_maps = 1 + len(self.broadcast_ids)  # association, then one map per broadcast id
        self.n_standard = config.n_head // 2 if self.keeps_half else 0  # ordinary softmax heads
        shared, n_pathways = (config.n_head - self.n_standard) * self.head_size, self.n_maps + 1
        if shared < n_pathways or self.keeps_half and not self.n_standard:
            raise ValueError(f"{type(self).__name__}: {n_pathways} pathways share {shared} "
                             f"channels of {config.n_head} heads; raise --n_embd or --n_head")
        self.map_width = shared // n_pathways
        self.conv_width = shared - self.n_maps * self.map_width
        self.c_value = nn.Linear(config.n_embd, shared, bias=config.bias)  # every pathway's v
        self.conv = nn.Conv1d(self.conv_width, self.conv_width, self.kernel_size,
                              groups=self.conv_width, bias=config.bias)  # depthwise
        if self.n_standard:  # queries, keys and values for the kept heads only, in c_attn's place
            self.c_attn = nn.Linear(config.n_embd, 3 * (config.n_embd - shared), bias=config.bias)
        else:
            del self.c_attn  # v0 learns no queries and keys

    def fixed_maps(self, token_ids, dtype=torch.float32):
        """(B, n_maps, T, T) in dtype: A_asso, then A_b for each broadcast id b; rows sum to 1."""
        B, T = token_ids.shape
        same = token_ids[:, :, None] == token_ids[:, None, :]                   # (B, T, T)
        broadcast = [(token_ids == b)[:, None, :].expand(B, T, T) for b in self.broadcast_ids]
        maps = torch.stack([same, *broadcast], dim=1).to(dtype)                 # (B, n_maps, T, T)
        maps = maps.tril() if self.causal else maps  # before normalising: 1 among visible keys
        return maps / maps.sum(dim=-1, keepdim=True).clamp(min=1)  # a row with nothing stays 0

    def forward(self, x, cache=None, token_ids=None, depth=0, groups=None):
        B, T, C = x.size()
        if token_ids is None:  # a module on its own: negative ids, all distinct, none broadcast
            token_ids = torch.arange(-T, 0, device=x.device).expand(B, T)
        map_values, conv_values = self.c_value(x).split(
            [self.n_maps * self.map_width, self.conv_width], dim=2)
        map_values = map_values.view(B, T, self.n_maps, self.map_width).transpose(1, 2)
        maps = self.fixed_maps(token_ids, torch.promote_types(map_values.dtype, torch.float32))
        y_maps = maps.to(map_values.dtype) @ map_values                     # (B, n_maps, T, w)
        reach = self.kernel_size - 1  # the convolution pathway; causal, it reads no future token
        left = reach if self.causal else reach // 2
        conv_values = F.pad(conv_values.transpose(1, 2), (left, reach - left))  # (B, w, T + 20)
        heads = [y_maps.transpose(1, 2).reshape(B, T, -1), self.conv(conv_values).transpose(1, 2)]
        if self.n_standard:
            q, k, v = self.queries_keys_values(x)                           # (B, kept, T, hs)
            heads.append(self.mix(q, k, v, None, depth).transpose(1, 2).reshape(B, T, -1))
            if self.maps is not None:  # the fixed maps, then the kept heads' weights
                maps = torch.cat([maps.to(q.dtype), attention_weights(q, k, self.causal)], dim=1)
        if self.maps is not None:
            self.maps.append(maps)
        y = torch.cat(heads, dim=2)                     # (B, T, pathways [+ kept·hs]) side by side
        return self.resid_dropout(self.c_proj(y))


class LEGOAttentionV1(LEGOAttention):
    """LEGO attention v1 (Figure 8, (a)-(c)): v0's pathways in half the heads, softmax in half."""
    keeps_half = True


# ----- LEGO's mimicking (Section 4.2.2): pull heads 0 and 1 toward two maps of a trained BERT -----
def smoothed(maps, causal):
    """Add 1e-3 to every weight a query may give and renormalise, so that the KL stays finite."""
    maps = (maps + 1e-3).tril() if causal else maps + 1e-3
    return maps / maps.sum(dim=-1, keepdim=True)


def mimicking_targets(token_ids, causal):
    """(B, T, T) each, smoothed: manipulation 1, 2, 4, 2, 1 on the tokens two before to two after;
    association on every *other* token equal to this one."""
    B, T = token_ids.shape
    distance = (torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)).abs().to(token_ids.device)
    manipulation = torch.where(distance <= 2, 4 / 2.0 ** distance, 0.0).expand(B, T, T)
    association = (token_ids.view(B, T, 1) == token_ids.view(B, 1, T)).float() * (distance > 0)
    return smoothed(manipulation, causal), smoothed(association, causal)


def mimicking_loss(maps_per_layer, token_ids, causal):
    """Σ over the layers' maps of KL(head 0 ‖ manipulation) + KL(head 1 ‖ association), as LEGO."""
    manipulation, association = mimicking_targets(token_ids, causal)
    loss = 0.0
    for maps in maps_per_layer:
        for head, target in ((0, manipulation), (1, association)):
            p = smoothed(maps[:, head].float(), causal)
            # 0·log(tiny) = 0 with a finite gradient on a causal map's future, where log 0 is NaN
            log_ratio = p.clamp_min(1e-30).log() - target.clamp_min(1e-30).log()
            loss = loss + (p * log_ratio).sum(dim=-1).mean()
    return loss


def mimic(model, batches, lr, betas, autocast=contextlib.nullcontext()):
    """Train the maps by mimicking_loss on batches of ids (B, T), AdamW with no weight decay."""
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


ATTENTIONS = {"standard": StandardAttention, "chacal": ChaCALAttention,  # the --attn names
              "chacal_diagonal": ChaCALKeepDiagonal, "dilated": SlidingDilatedAttention,
              "lego_v0": LEGOAttention, "lego_v1": LEGOAttentionV1}


CHACAL_ROWS_PER_BLOCK = 32  # query rows per block: larger ones are faster on long inputs, and hold more memory
CHACAL_BLOCKED_FROM = 64  # ChaCALAttention takes the blocked path from this many tokens on a CPU
CHACAL_KEEP_WEIGHTS_UP_TO = 1024  # tokens up to which backward keeps A (T²/2 floats) over recomputing it


def blocked_chacal_attention(q, k, v, gamma, rows_per_block=CHACAL_ROWS_PER_BLOCK):
    """The fast path (lesson 01): chacal_attention's causal Y, no mask or cache, block by block."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        return BlockedChaCAL.apply(q, k, v, gamma, rows_per_block, dtype)


def block_weights(q_block, keys, buffer):
    """A (B, nh, n, n_keys) for n queries, the last of the keys: their causal softmax (in buffer's front)."""
    n, scale = q_block.size(-2), 1 / math.sqrt(q_block.size(-1))
    shape = (*keys.shape[:-2], n, keys.size(-2))                          # (B, nh, n, n_keys)
    out = None if buffer is None else buffer[:math.prod(shape)].view(shape)
    scores = torch.matmul(q_block * scale, keys.mT, out=out)
    future = torch.ones(n, n, dtype=torch.bool, device=keys.device).triu(1)
    scores[..., -n:].masked_fill_(future, float("-inf"))  # only the last n columns hold a future
    return torch.softmax(scores, dim=-1, out=scores)  # fused and in place


class BlockedChaCAL(torch.autograd.Function):
    """Block b from row e: (I - γA'_bb) Y_b = A_b,<e M_<e + (1-γ) A_bb V_b; backward from the last
    block: R_b = g_b + γ(dM_b + A'_bbᵀ R_b), dA_tj = R_t·m_j ((1-γ)v_t on the diagonal)."""

    @staticmethod
    def forward(ctx, q, k, v, gamma, rows_per_block, dtype):
        keys, n = k.to(dtype).contiguous(), q.size(-2)
        mixed = keys.new_empty(*keys.shape[:-1], v.size(-1))  # v's width: attention_map solves I
        y = v.new_empty(v.shape, dtype=dtype)                               # (B, nh, T, hs)
        kept = [] if n <= CHACAL_KEEP_WEIGHTS_UP_TO and any(ctx.needs_input_grad) else None
        # Unless kept, every block's A shares one buffer: a fresh (n, T) tensor's page faults cost more than its block.
        buffer = None if kept is not None else keys.new_empty(keys[..., 0].numel() * rows_per_block)
        for start in range(0, n, rows_per_block):
            stop = min(start + rows_per_block, n)
            mixed[..., start:stop, :] = v[..., start:stop, :].to(dtype) * (1 - gamma)  # own: (1-γ)v
            A = block_weights(q[..., start:stop, :].to(dtype), keys[..., :stop, :], buffer)
            y[..., start:stop, :] = y_b = torch.linalg.solve_triangular(
                A[..., start:] * -gamma, A @ mixed[..., :stop, :], upper=False, unitriangular=True)
            mixed[..., start:stop, :].add_(y_b, alpha=gamma)  # m = (1-γ)v + γy
            if kept is not None:
                kept.append(A)
        ctx.save_for_backward(q, k, v, y)  # q, k, v as given: float32 costs more
        ctx.gamma, ctx.rows_per_block, ctx.kept = gamma, rows_per_block, kept
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        q, k, v, y = ctx.saved_tensors
        gamma, scale, n = ctx.gamma, 1 / math.sqrt(q.size(-1)), q.size(-2)
        keys, mixed = k.to(y.dtype).contiguous(), torch.lerp(v.to(y.dtype), y, gamma).contiguous()
        grad_q, grad_keys = torch.empty_like(q), torch.zeros_like(keys)  # contiguous, as keys: flatten is a view
        grad_mixed = torch.zeros_like(mixed)  # dM; a finished block's own rows then hold its dV
        weights, grads = (keys.new_empty(keys[..., 0].numel() * ctx.rows_per_block) for _ in range(2))
        for start in reversed(range(0, n, ctx.rows_per_block)):
            stop = min(start + ctx.rows_per_block, n)
            q_block = q[..., start:stop, :].to(y.dtype)                     # (B, nh, n, hs)
            A = ctx.kept.pop() if ctx.kept else block_weights(q_block, keys[..., :stop, :], weights)
            own, grad_own = A[..., start:], grad_mixed[..., start:stop, :]
            R = torch.linalg.solve_triangular(-gamma * own.mT, grad_y[..., start:stop, :] + gamma * grad_own,
                                              upper=True, unitriangular=True)  # (B, nh, n, hs)
            grad_mixed.flatten(0, -3)[:, :stop].baddbmm_(A.flatten(0, -3).mT, R.flatten(0, -3))  # dM, earlier rows
            grad_own.mul_(1 - gamma)                                         # dV_b, in place
            grad_A = torch.matmul(R, mixed[..., :stop, :].mT, out=grads[:A.numel()].view(A.shape))
            R_dot_y = (R * y[..., start:stop, :]).sum(dim=-1, keepdim=True)  # Σ_j A_tj dA_tj
            grad_A[..., start:].diagonal(dim1=-2, dim2=-1).sub_(gamma * R_dot_y[..., 0])
            grad_scores = grad_A.sub_(R_dot_y).mul_(A)  # softmax backward, A ⊙ (dA - rowsum)
            grad_q[..., start:stop, :] = grad_scores @ keys[..., :stop, :] * scale
            grad_keys.flatten(0, -3)[:, :stop].baddbmm_(grad_scores.flatten(0, -3).mT, q_block.flatten(0, -3),
                                                        alpha=scale)
        return grad_q, grad_keys, grad_mixed, None, None, None
