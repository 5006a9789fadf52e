"""A GPT-2 style transformer whose attention is chosen per layer (attention.py).

Pre-LayerNorm blocks, learned positions, tied embeddings, GELU MLP and GPT-2's parameter names, as
nanoGPT. One option away each: post-LayerNorm, no positions, bidirectional, shared weights, and a
depth that follows the input (adaptive, RegularGPT) or is drawn per batch (stochastic, LEGO). It
knows no task: token ids in, logits out; per-token positions and attention groups are optional."""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import ATTENTIONS, LayerCache

CHOICES = {"pos": ("learned", "none"), "norm": ("pre", "post"), "weight_init": ("gpt2", "xavier"),
           "gelu_approximate": ("none", "tanh")}


@dataclass
class GPTConfig:
    block_size: int = 128   # rows of the position table: with --pos learned, the longest sequence
    vocab_size: int = 128   # number of distinct token ids
    n_layer: int = 1        # layers run per input (distinct blocks: n_blocks())
    n_head: int = 4         # attention heads per block; n_embd must be a multiple of it
    n_embd: int = 128       # width of the residual stream; the MLP is 4x wider, as GPT-2
    dropout: float = 0.0    # dropout on embeddings and residual branches; ChaCAL's paper used none
    bias: bool = True       # biases in Linear and LayerNorm layers, as GPT-2
    attn: str = "chacal"    # every block's attention ("chacal"), or one each ("standard,chacal")
    gamma: float = 0.9      # ChaCAL's γ in [0, 1): 0 is standard attention, the paper uses 0.9
    causal: bool = True     # False: every token sees every other (BERT-like, for LEGO); no decoding
    pos: str = "learned"    # "learned" positions (GPT-2), or "none" (RegularGPT: any length)
    norm: str = "pre"       # "pre": x + f(LN(x)) (GPT-2); "post": LN(x + f(x)) (BERT)
    share_weights: bool = False  # reuse `thickness` distinct blocks at every depth (ALBERT)
    thickness: int = 1      # K: distinct blocks when sharing; Sliding-Dilated layers per dilation
    chunk: int = 2          # C: Sliding-Dilated-Attention's chunk size, and adaptive depth's base
    adaptive_depth: bool = False  # K·L layers, L the smallest >= 1 with chunk^L >= T, per batch
    min_train_layers: int = 0     # > 0: each training batch runs min_train_layers..n_layer layers
    broadcast_ids: tuple = ()     # LEGO attention: token ids every token reads ([CLS], [SEP])
    gelu_approximate: str = "none"  # the MLP's GELU: "none" (exact), or "tanh" (GPT-2's gelu_new)
    weight_init: str = "gpt2"     # "gpt2": tied, N(0, 0.02); "xavier": untied, nn.Transformer's

    def __post_init__(self):
        # What would fail deep inside a forward, or train a model other than the one asked for.
        names = self.attention_per_block()
        unknown = [name for name in names if name not in ATTENTIONS]
        if unknown:
            raise ValueError(f"--attn: unknown attention {unknown[0]!r}; choose from "
                             f"{', '.join(ATTENTIONS)}, or a comma list with one per layer")
        if len(names) != self.n_blocks():
            raise ValueError(f"--attn lists {len(names)} attentions ({self.attn}) for "
                             f"{self.n_blocks()} blocks (--n_layer, or --thickness when sharing)")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"--gamma {self.gamma} is outside [0, 1); the paper uses 0.9")
        for field, allowed in CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"--{field} {getattr(self, field)!r}: choose "
                                 f"{' or '.join(allowed)}")
        if min(self.n_layer, self.n_head, self.n_embd, self.thickness, self.chunk - 1) < 1 \
                or self.n_embd % self.n_head:
            raise ValueError(f"--n_layer, --n_head, --thickness must be at least 1, --chunk 2, and "
                             f"--n_embd {self.n_embd} a multiple of --n_head {self.n_head}")
        if self.thickness > self.n_layer and not self.adaptive_depth:
            raise ValueError(f"--thickness {self.thickness} exceeds --n_layer {self.n_layer}: "
                             f"lower --thickness or raise --n_layer")
        if (self.adaptive_depth or self.min_train_layers) and not self.share_weights:
            raise ValueError("--n_layer auto and --min_train_layers need --share_weights: a depth "
                             "that varies must reuse the same blocks")
        fixed = "auto" if self.adaptive_depth else self.n_layer
        if self.min_train_layers and (fixed == "auto" or not 1 <= self.min_train_layers <= fixed):
            raise ValueError(f"--min_train_layers {self.min_train_layers} needs a fixed --n_layer "
                             f"of at least as many, not {fixed}")
        one_way = [name for name in names if "bidirectional" not in ATTENTIONS[name].supports]
        if not self.causal and one_way:
            raise ValueError(f"--bidirectional: --attn {one_way[0]} only looks back; drop one")

    def describe(self):
        """The model in a few words: "2 layer(s) of standard,chacal (gamma 0.9), pre-LayerNorm"."""
        depth = "adaptive depth" if self.adaptive_depth else f"{self.n_layer} layer(s)"
        shared = f", {self.thickness} shared block(s)" if self.share_weights else ""
        gamma = f" (gamma {self.gamma})" if "chacal" in self.attn else ""
        return f"{depth} of {self.attn}{gamma}{shared}, {self.norm}-LayerNorm"

    def n_blocks(self):
        """Distinct blocks (with their own weights): thickness when shared, else n_layer."""
        return self.thickness if self.share_weights else self.n_layer

    def attention_per_block(self):
        """Each distinct block's attention name: 'standard,chacal' -> ['standard', 'chacal']."""
        names = [name.strip() for name in self.attn.split(",")]
        return names * self.n_blocks() if len(names) == 1 else names

    def abilities(self):
        """"causal" or "bidirectional", and what every block's attention supports of "groups",
        "cache" (causal, fixed depth) and "mimic" (LEGO's initialisation of heads 0 and 1)."""
        supported = frozenset.intersection(*[ATTENTIONS[name].supports
                                             for name in self.attention_per_block()])
        needs = {"groups": True, "cache": self.causal and not self.adaptive_depth,
                 "mimic": self.n_head >= 2}  # what each needs besides the attention
        direction = "causal" if self.causal else "bidirectional"
        return {direction} | {ability for ability in supported if needs.get(ability)}


def adaptive_levels(length, chunk):
    """The smallest L >= 1 with chunk^L >= length, in integers: math.log(125, 5) > 3."""
    levels, reach = 1, chunk
    while reach < length:
        levels, reach = levels + 1, reach * chunk
    return levels


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)): GPT-2's pre-LayerNorm block; or, with
    norm="post", LN(x + attention(x)), then LN(x + MLP(x)), the original Transformer's."""

    def __init__(self, config, attention_name):
        super().__init__()
        self.post_norm = config.norm == "post"
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = ATTENTIONS[attention_name](config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, token_ids=None, depth=0, groups=None):
        if self.post_norm:
            # A normalised stream has one scale at every depth, as a shared block needs (lesson 02).
            x = self.ln_1(x + self.attn(x, cache, token_ids, depth, groups))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), cache, token_ids, depth, groups)
        return x + self.mlp(self.ln_2(x))


@contextlib.contextmanager
def evaluating(model):
    """model in eval mode for the block, then in the mode it was in, even if the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, name) for name in config.attention_per_block()]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.weight_init == "gpt2":
            self.transformer.wte.weight = self.lm_head.weight  # tied embeddings, as GPT-2
        # GPT-2's initialisation: N(0, 0.02), with the projections that write into the residual
        # stream scaled down by √(2·n_layer) so the stream's variance does not grow with depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.weight_init == "xavier":
            # nn.Transformer's: at d 64 GPT-2's leaves a token's own signal too small (lesson 05).
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear) and name.startswith("transformer.h."):
                    torch.nn.init.xavier_uniform_(module.weight)
            for embedding in (self.transformer.wte, getattr(self.transformer, "wpe", None)):
                if embedding is not None:
                    torch.nn.init.normal_(embedding.weight, mean=0.0, std=1.0)
            self.lm_head.reset_parameters()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        """Parameters, the tied embedding counted once (the paper's "Size" column)."""
        return sum(p.numel() for p in self.parameters())

    def configure_optimizer(self, weight_decay, lr, betas):
        """AdamW, decaying the weights that mix inputs (matrices, but the dilated attention's offset
        bias r), as GPT-2; biases, gains and the pad set levels."""
        decayed, kept = [], []
        for name, p in self.named_parameters():
            (decayed if p.dim() >= 2 and not name.endswith("offset_bias") else kept).append(p)
        return torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                  {"params": kept, "weight_decay": 0.0}], lr=lr, betas=betas)

    def attention_maps(self, idx):
        """Each layer's attention weights (B, nh, T, T) on idx (B, T), differentiable (mimic)."""
        maps = []
        for block in self.transformer.h:
            block.attn.maps = maps
        try:
            self(idx)
        finally:
            for block in self.transformer.h:
                block.attn.maps = None
        return maps

    def can_cache(self):  # kept for callers: "cache" in config.abilities()
        return "cache" in self.config.abilities()

    def new_caches(self):
        """One empty LayerCache per layer, to pass to forward() when decoding."""
        if not self.can_cache():
            raise ValueError("this model cannot decode against a cache (bidirectional, adaptive "
                             "depth, or LEGO attention); decode with use_cache=False")
        return [LayerCache() for _ in range(self.config.n_layer)]

    def forward(self, idx, targets=None, caches=None, positions=None, groups=None):
        """idx (B, T) -> (logits (B, T, vocab), mean cross-entropy over targets not -1, or None).
        caches: from new_caches(), extended by these tokens. positions, groups (B, T): each token's
        position and attention group (attention.group_visibility); None: 0, 1, ... and causal."""
        if groups is not None and "groups" not in self.config.abilities():
            raise ValueError(f"--attn {self.config.attn} does not take attention groups")
        B, T = idx.size()
        start = len(caches[0]) if caches else 0
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            n_positions = start + T if positions is None else int(positions.max()) + 1
            if n_positions > self.config.block_size:
                raise ValueError(f"position {n_positions - 1} is beyond block_size "
                                 f"{self.config.block_size}; train with a larger --block_size")
            if positions is None:
                positions = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
            x = x + self.transformer.wpe(positions)  # positions (T,) or (B, T)
        x = self.transformer.drop(x)
        config, blocks = self.config, self.transformer.h
        n_layers = config.n_layer  # fixed; or adaptive to the length, or drawn per training batch
        if config.adaptive_depth:
            n_layers = config.thickness * adaptive_levels(start + T, config.chunk)
        elif self.training and config.min_train_layers:
            n_layers = int(torch.randint(config.min_train_layers, config.n_layer + 1, ()))
        for depth in range(n_layers):
            # Shared weights cycle through the `thickness` blocks; otherwise block == depth.
            cache = caches[depth] if caches else None
            x = blocks[depth % len(blocks)](x, cache, idx, depth, groups)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @classmethod
    def from_pretrained(cls, model, **overrides):
        """A GPT with the weights of `model`, a GPT-2 name ("gpt2", ...) or GPT2LMHeadModel, and
        overrides that need no new weights: attn="chacal" as the ChaCAL paper's Section 5.3."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise ValueError("GPT.from_pretrained needs transformers (pip install it)") from None
        if isinstance(model, str):
            try:  # the cache first: offline, a download would be retried for half a minute
                model = GPT2LMHeadModel.from_pretrained(model, local_files_only=True)
            except OSError:
                try:
                    model = GPT2LMHeadModel.from_pretrained(model)
                except OSError as error:
                    reason = (str(error).strip() or "offline").splitlines()[0]
                    raise OSError(f"GPT-2 {model!r} is not in transformers' cache and cannot be "
                                  f"downloaded: {reason}") from None
        hf, gelu = model.config, {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
        if (hf.activation_function not in gelu or hf.layer_norm_epsilon != 1e-5
                or not hf.scale_attn_weights or hf.scale_attn_by_inverse_layer_idx
                or hf.n_inner not in (None, 4 * hf.n_embd)):
            raise ValueError("GPT.from_pretrained: this GPT-2's activation, epsilon, MLP width or "
                             "attention scaling is not one our GPT builds")
        fixed = dict(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer,
                     n_head=hf.n_head, n_embd=hf.n_embd, bias=True, pos="learned", norm="pre")
        ours = cls(GPTConfig(**{**fixed, "dropout": 0.0, "attn": "standard",
                                "gelu_approximate": gelu[hf.activation_function], **overrides}))
        params = dict(ours.named_parameters())  # the tied lm_head.weight appears once, as wte's
        # HF's Conv1D stores (in, out), nn.Linear (out, in); attn.bias and masked_bias are masks.
        theirs = {name: w.t() if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
                  else w for name, w in model.state_dict().items()
                  if not name.endswith((".attn.bias", ".attn.masked_bias", "lm_head.weight"))}
        if (any(overrides.get(k, v) != v for k, v in fixed.items())
                or theirs.keys() != params.keys()
                or any(params[name].shape != w.shape for name, w in theirs.items())):
            raise ValueError(f"GPT.from_pretrained: overrides {overrides} would change GPT-2's "
                             f"weights; use ones that need none, e.g. attn='chacal'")
        ours.load_state_dict(theirs, strict=False)  # lm_head.weight is wte.weight: tied
        return ours

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
                 generator=None, stop_token=None, prompt_lengths=None):
        """Continue idx (B, T) by max_new_tokens tokens (temperature 0: greedy), in eval mode. With
        use_cache each new token costs one step against the cache; without, it rereads everything.
        stop_token: stop once every row wrote it. prompt_lengths (B,): row r's prompt is
        idx[r, :prompt_lengths[r]]; a row still inside its prompt takes the prompt's token."""
        if not self.config.causal:
            raise ValueError("a bidirectional model (--bidirectional) cannot decode left to right")
        prompts, lengths = idx, torch.as_tensor(prompt_lengths if prompt_lengths is not None
                                                else [idx.size(1)] * idx.size(0), device=idx.device)
        idx, end = idx[:, :int(lengths.min())], int(lengths.max()) + max_new_tokens
        with evaluating(self):
            caches = self.new_caches() if use_cache else None
            new_tokens = idx  # what the next forward has to read: all of it without a cache
            finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
            while idx.size(1) < end:
                logits, _ = self(new_tokens if use_cache else idx, caches=caches)
                next_token = self.pick_token(logits[:, -1, :], temperature, top_k, generator)
                in_prompt = idx.size(1) < lengths
                if in_prompt.any():
                    next_token = torch.where(in_prompt[:, None],
                                             prompts[:, idx.size(1):idx.size(1) + 1], next_token)
                idx, new_tokens = torch.cat([idx, next_token], dim=1), next_token
                if stop_token is not None:
                    finished |= (next_token[:, 0] == stop_token) & ~in_prompt
                    if finished.all():
                        break
        return idx

    @staticmethod
    def pick_token(logits, temperature, top_k=None, generator=None):
        """The next token (B, 1) from logits (B, vocab): argmax at temperature 0, else a draw at
        that temperature, among the top_k (and any tied with the k-th, as nanoGPT) if given."""
        if not temperature >= 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"temperature {temperature} must be >= 0 and top_k {top_k} at least 1")
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
