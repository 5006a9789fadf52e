"""
The inductive scratchpad (Abbe, Bengio, Lotfi, Sandon, Saremi 2024, "How Far Can Transformers
Reason? The Globality Barrier and Inductive Scratchpad", Appendix C), for any task whose
scratchpad is a sequence of states:

    Q : s1 # s2 # ... # sk        Q the question, ":" the start token, "#" closes a state

The model should write state s[i] as if the sequence were only Q : s[i-1] #, so that it learns
one induction step, applied as often as a test needs. Three pieces, none knowing a task:

- training_form: every closed state twice, Q : s1 # s1 # s2 # s2 # ... sk (the appendix's
  second training method, the one its code uses);
- inductive_layout: the attention group and position of every token of that form. Group 0 is
  Q up to and including ":"; then group 1 = s1 #, group 2 = (s1 #)' s2 #, group 3 = (s2 #)' s3 #,
  ... A token sees the earlier tokens of its own group and group 0 (attention.group_visibility),
  and positions restart after Q in every group. The first copy of a state ends its group, the
  second, as the previous state, opens the next; the task gives the second no loss;
- generate_inductive: decoding with the same masks and positions, with or without a cache.

With t tokens in Q, a state of two tokens (node, #) and k = 3 states, the form and its layout:

    token     Q ... :   s1 #    s1 #   s2 #    s2 #   s3
    group     0 ... 0   1  1    2  2   2  2    3  3   3
    position  0 ... t-1 t  t+1  t  t+1 t+2 t+3 t  t+1 t+2
    loss      as Q      1  1    0  0   1  1    0  0   1

GPT.forward takes the positions and groups as arguments; without them a model is unchanged.
"""

import torch

DEAD = -1  # the group of padding: no real token has it, so no real token sees these entries


def training_form(ids, start_id, sep_id):
    """Q : s1 # s2 # ... sk -> Q : s1 # s1 # s2 # s2 # ... sk, as lists of token ids: every
    state that a # closes, twice. A sequence without the start token is returned as it is."""
    if start_id not in ids:
        return list(ids)
    cut = ids.index(start_id) + 1
    form, state = list(ids[:cut]), []
    for token in ids[cut:]:
        state.append(token)
        if token == sep_id:
            form += state + state
            state = []
    return form + state


def segments(idx, start_id, sep_id):
    """(B, T): -1 up to and including the first start token, then j on the j-th segment (a
    state's tokens and the # closing it) of the training form: 0, 1, 2, ... Odd j are copies."""
    is_start = (idx == start_id).long()
    started = is_start.cumsum(1) - is_start > 0        # a start token strictly before
    closes = ((idx == sep_id) & started).long()
    return torch.where(started, closes.cumsum(1) - closes, -1)


def inductive_layout(idx, start_id, sep_id):
    """(positions, groups), each (B, T), of sequences idx (B, T) in the training form.

        group    = 0 on Q (up to the start token), else 1 + ⌈j / 2⌉ on segment j
        position = its index on Q, else t + (its index - the index of its group's first token)

    t being the length of Q in that row. A row without the start token is all group 0 with
    positions 0, 1, 2, ...: the ordinary layout."""
    segment = segments(idx, start_id, sep_id)
    groups = torch.where(segment < 0, 0, 1 + (segment + 1) // 2)
    index = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
    begins = torch.ones_like(groups, dtype=torch.bool)
    begins[:, 1:] = groups[:, 1:] != groups[:, :-1]
    first = torch.where(begins, index, 0).cummax(dim=1).values  # each group's first token
    question = (segment < 0).sum(dim=1, keepdim=True)           # t, per row
    return torch.where(segment < 0, index, question + index - first), groups


def copies(idx, start_id, sep_id):
    """(B, T) True on the second copy of every state: the tokens that carry no loss."""
    segment = segments(idx, start_id, sep_id)
    return (segment > 0) & (segment % 2 == 1)


class Rows:
    """Where each row of a batch being decoded stands: the group and position of its next
    token, the length of its Q once the start token is written, its current state's tokens.
    step() turns a row's next token into what the model must read for it."""

    def __init__(self, batch_size, start_id, sep_id):
        self.start_id, self.sep_id = start_id, sep_id
        self.group, self.position = [0] * batch_size, [0] * batch_size
        self.question = [None] * batch_size  # t, once the start token is in
        self.state = [[] for _ in range(batch_size)]

    def step(self, r, token):
        """(tokens, positions, groups) that row r reads for its next token."""
        group, position, t = self.group[r], self.position[r], self.question[r]
        if t is not None and token == self.sep_id:
            # A # closes the state: it becomes the previous state of a new group, read again
            # from position t (the appendix's "compute the key-value pairs again").
            block = self.state[r] + [token]
            self.group[r], self.position[r], self.state[r] = group + 1, t + len(block), []
            return block, list(range(t, t + len(block))), [group + 1] * len(block)
        if t is None and token == self.start_id:  # Q is complete: states start at position t
            self.question[r], self.group[r] = position + 1, 1
        elif t is not None:
            self.state[r].append(token)
        self.position[r] = position + 1
        return [token], [position], [group]


def left_padded(blocks, device):
    """(tokens, positions, groups), each (B, L), from one (tokens, positions, groups) block per
    row: shorter blocks padded on the left with entries of group DEAD, which no real token
    sees, so every row's last column is its real last token."""
    width = max(len(block[0]) for block in blocks)
    rows = [[[0] * (width - len(block[0])) + block[0],
             [0] * (width - len(block[0])) + block[1],
             [DEAD] * (width - len(block[0])) + block[2]] for block in blocks]
    return [torch.tensor([row[i] for row in rows], device=device) for i in range(3)]


@torch.no_grad()
def generate_inductive(model, idx, max_new_tokens, start_id, sep_id, temperature=1.0,
                       top_k=None, use_cache=True, generator=None, stop_token=None,
                       return_logits=False):
    """Continue idx (B, T) by max_new_tokens tokens under the inductive scratchpad's masks and
    positions; returns (B, T + new) in the plain form Q : s1 # s2 # ... (no copies), and with
    return_logits also the logits (B, new, vocab) each token was picked from.

    Without a cache every token rereads the training form of the sequence so far with its
    layout (inductive_layout): slow, and obviously what training computes. With a cache a token
    costs one step of ordinary cached decoding, and a # that closes state s[i] costs reading
    s[i] # again, as the previous state of the next group at positions t, t+1, ... (Appendix C's
    first option). The cache then forgets group i, which no later token can see: it keeps Q and
    at most two states. Same options as GPT.generate (no prompt_lengths). Decoding stops early
    if a state outgrows the position table (a model that has not learned to write # yet).
    """
    was_training = model.training
    model.eval()
    B, device = idx.size(0), idx.device
    rows, caches = Rows(B, start_id, sep_id), model.new_caches() if use_cache else None
    blocks = [([], [], []) for _ in range(B)]
    for r, prompt in enumerate(idx.tolist()):  # the prompt, read as its tokens come
        for token in prompt:
            for whole, part in zip(blocks[r], rows.step(r, token)):
                whole += part
    chosen = []
    for _ in range(max_new_tokens):
        if use_cache:  # what is new since the last step; each row's last column is its last token
            tokens, positions, groups = left_padded(blocks, device)
            last = torch.full((B,), tokens.size(1) - 1, device=device)
        else:          # everything, in the training form
            tokens, positions, groups, last = padded_training_forms(idx, start_id, sep_id)
        if model.config.pos == "learned" and int(positions.max()) >= model.config.block_size:
            break  # a state longer than the position table: a model that does not write # yet
        logits = model(tokens, caches=caches, positions=positions, groups=groups)[0]
        logits = logits[torch.arange(B), last]                                  # (B, vocab)
        if use_cache:
            forget(caches, torch.tensor(rows.group, device=device))
        next_token = model.pick_token(logits, temperature, top_k, generator)  # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
        chosen.append(logits)
        blocks = [rows.step(r, token) for r, token in enumerate(next_token[:, 0].tolist())]
        if stop_token is not None and (idx[:, -len(chosen):] == stop_token).any(1).all():
            break
    model.train(was_training)
    if not return_logits:
        return idx
    return idx, torch.stack(chosen, dim=1) if chosen else torch.empty(B, 0, model.config.vocab_size)


def forget(caches, current_groups):
    """Drop the cache entries no row can see any more: a row's next tokens are in its current
    group (B,), so they see only group 0 and that group. A column stays while any row needs it."""
    groups = caches[0].groups                                                    # (B, T_seen)
    needed = (groups == 0) | (groups == current_groups[:, None])
    columns = needed.any(dim=0)
    if not columns.all():
        for cache in caches:
            cache.keep(columns)


def padded_training_forms(idx, start_id, sep_id):
    """(tokens, positions, groups, last) of the rows of idx (B, T) in the training form, padded
    on the right: (B, L) each, and last (B,) the index of each row's last real token."""
    forms = [torch.tensor(training_form(row, start_id, sep_id)) for row in idx.tolist()]
    lengths = torch.tensor([len(form) for form in forms], device=idx.device)
    padded = torch.nn.utils.rnn.pad_sequence(forms, batch_first=True).to(idx.device)
    positions, groups = inductive_layout(padded, start_id, sep_id)
    # Padding on the right is unseen by the real tokens (causal); keep its positions in range.
    pad = torch.arange(padded.size(1), device=idx.device) >= lengths[:, None]
    return padded, positions.masked_fill(pad, 0), groups.masked_fill(pad, DEAD), lengths - 1
