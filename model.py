"""
A GPT-2 style transformer whose attention is chosen per layer (standard, ChaCAL, ...).

Pre-LayerNorm blocks, learned absolute positions, input and output embeddings tied, GELU MLP, as
GPT-2 and nanoGPT; parameter names follow GPT-2, so GPT.from_pretrained("gpt2") loads its weights
by name, with ChaCAL swapped in if asked (the ChaCAL paper's Section 5.3; it needs the optional
`pip install transformers`). Post-LayerNorm blocks (the original Transformer's and BERT's;
RegularGPT's released code uses them) are one option away. The model knows nothing about tasks: it
maps token ids to logits, and ignores targets equal to -1 in the loss. Per-token positions and
attention groups (the inductive scratchpad, at the end of this file) are optional arguments of
forward().

Three options from the papers, each usable with any attention (but Sliding-Dilated-Attention,
which only looks back, is never bidirectional):
- weight sharing (ALBERT; RegularGPT): `thickness` distinct blocks, reused at every depth;
- depth that follows the input: adaptive (RegularGPT: ⌈log_chunk T⌉ levels, so a longer input
  gets more layers) or stochastic (LEGO: drawn per training batch, fixed at test);
- no positional embeddings (what lets RegularGPT run at unseen lengths), and a bidirectional,
  BERT-like mode (LEGO).
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import ATTENTIONS, LayerCache


@dataclass
class GPTConfig:
    block_size: int = 128   # rows of the position table: with --pos learned, the longest sequence
    vocab_size: int = 128   # number of distinct token ids
    n_layer: int = 1        # layers run per input (distinct blocks: n_blocks())
    n_head: int = 4         # attention heads per block; n_embd must be a multiple of it
    n_embd: int = 128       # width of the residual stream; the MLP is 4x wider, as GPT-2
    dropout: float = 0.0    # dropout on embeddings and residual branches; ChaCAL's paper used none
    bias: bool = True       # biases in Linear and LayerNorm layers, as GPT-2
    attn: str = "chacal"    # attention of every block ("chacal"), or one per block ("standard,chacal")
    gamma: float = 0.9      # ChaCAL's γ in [0, 1): 0 is standard attention, the paper uses 0.9
    causal: bool = True     # False: every token sees every other (BERT-like, for LEGO); no decoding
    pos: str = "learned"    # "learned" absolute positions (GPT-2), or "none" (RegularGPT), which
                            # lets a model run at lengths it never saw
    norm: str = "pre"       # "pre": x + f(LN(x)) (GPT-2); "post": LN(x + f(x)) (BERT), whose
                            # output has one scale at any depth, as a block reused L times needs
    share_weights: bool = False  # reuse `thickness` distinct blocks at every depth (ALBERT)
    thickness: int = 1      # K: distinct blocks when sharing; Sliding-Dilated layers per dilation
    chunk: int = 2          # C: Sliding-Dilated-Attention's chunk size, and adaptive depth's base
    adaptive_depth: bool = False  # K·L layers, L the smallest >= 1 with chunk^L >= T, per batch
    min_train_layers: int = 0     # stochastic depth: if > 0, each training batch runs a depth
                                  # drawn uniformly in min_train_layers..n_layer; tests n_layer
    broadcast_ids: tuple = ()     # LEGO attention: token ids every token reads ([CLS], [SEP])
    gelu_approximate: str = "none"  # the MLP's GELU: "none" (exact, erf), or "tanh", the
                                    # approximation GPT-2 was trained with (`gelu_new`)
    weight_init: str = "gpt2"     # "gpt2": tied embeddings and N(0, 0.02) weights (GPT-2's);
                                  # "xavier": untied N(0, 1) embeddings, Xavier-uniform weights

    def __post_init__(self):
        # Fail here, at construction, with the flag's name, rather than deep inside a forward.
        names = self.attention_per_block()
        unknown = [name for name in names if name not in ATTENTIONS]
        if unknown:
            raise ValueError(f"--attn: unknown attention {unknown[0]!r}; choose from "
                             f"{', '.join(ATTENTIONS)}, or a comma list with one per layer")
        if len(names) != self.n_blocks():
            what = "--thickness (distinct shared blocks)" if self.share_weights else "--n_layer"
            raise ValueError(f"--attn lists {len(names)} attentions ({self.attn}) but {what} is "
                             f"{self.n_blocks()}; give one name for all layers or one per layer")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"--gamma {self.gamma} is outside [0, 1); the paper uses 0.9")
        if self.n_layer < 1:
            raise ValueError(f"--n_layer {self.n_layer} must be at least 1")
        if self.n_head < 1 or self.n_embd < 1 or self.n_embd % self.n_head:
            raise ValueError(f"--n_embd {self.n_embd} must be a positive multiple of "
                             f"--n_head {self.n_head}: each head gets n_embd / n_head channels")
        if self.pos not in ("learned", "none"):
            raise ValueError(f"--pos {self.pos!r}: choose learned or none")
        if self.norm not in ("pre", "post"):
            raise ValueError(f"--norm {self.norm!r}: choose pre or post")
        if self.weight_init not in ("gpt2", "xavier"):
            raise ValueError(f"--weight_init {self.weight_init!r}: choose gpt2 or xavier")
        if self.gelu_approximate not in ("none", "tanh"):
            raise ValueError(f"gelu_approximate {self.gelu_approximate!r}: choose none (exact "
                             f"GELU) or tanh (GPT-2's gelu_new)")
        if self.chunk < 2:
            raise ValueError(f"--chunk {self.chunk} must be at least 2: a chunk of 1 never looks "
                             f"past the token itself")
        if self.chunk != 2 and not self.adaptive_depth and "dilated" not in names:
            raise ValueError(f"--chunk {self.chunk} only means something with --attn dilated or "
                             f"--n_layer auto; add one or drop it")
        if self.thickness < 1:
            raise ValueError(f"--thickness {self.thickness} must be at least 1")
        if self.thickness > 1 and not self.share_weights and "dilated" not in names:
            raise ValueError(f"--thickness {self.thickness} only means something with "
                             f"--share_weights or --attn dilated; add one or drop it")
        if self.share_weights and not self.adaptive_depth and self.thickness > self.n_layer:
            idle = self.thickness - self.n_layer
            raise ValueError(f"--thickness {self.thickness} exceeds --n_layer {self.n_layer}: "
                             f"{idle} shared block{'s' * (idle > 1)} would never run; lower "
                             f"--thickness or raise --n_layer")
        if not self.share_weights and self.thickness > self.n_layer:  # (--attn dilated, above)
            raise ValueError(f"--thickness {self.thickness} exceeds --n_layer {self.n_layer}: "
                             f"with {self.thickness} layers per dilation, every layer has "
                             f"dilation 1 already; lower --thickness or raise --n_layer")
        if self.adaptive_depth and not self.share_weights:
            raise ValueError("--n_layer auto (adaptive depth) needs --share_weights: a depth that "
                             "grows with the input must reuse the same blocks")
        if self.min_train_layers:
            stochastic = f"--min_train_layers {self.min_train_layers} (stochastic depth)"
            if not self.share_weights:
                raise ValueError(f"{stochastic} needs --share_weights: every depth drawn "
                                 f"reuses the same block, as LEGO's ALBERT does")
            if self.adaptive_depth:
                raise ValueError(f"{stochastic} needs a fixed --n_layer, not auto")
            if not 1 <= self.min_train_layers <= self.n_layer:
                raise ValueError(f"{stochastic} must lie in 1..--n_layer {self.n_layer}")
        if not self.causal and "dilated" in names:
            raise ValueError("--bidirectional: Sliding-Dilated-Attention only looks back; "
                             "drop --bidirectional or pick another --attn")

    def describe(self):
        """The model in a few words: "2 layer(s) of standard,chacal (gamma 0.9), pre-LayerNorm"."""
        depth = "adaptive depth" if self.adaptive_depth else f"{self.n_layer} layer(s)"
        shared = f", {self.thickness} shared block(s)" if self.share_weights else ""
        gamma = f" (gamma {self.gamma})" if self.uses_gamma() else ""
        return f"{depth} of {self.attn}{gamma}{shared}, {self.norm}-LayerNorm"

    def n_blocks(self):
        """Distinct blocks (with their own weights): thickness when shared, else n_layer."""
        return self.thickness if self.share_weights else self.n_layer

    def attention_per_block(self):
        """The attention name of each distinct block, e.g. 'standard,chacal' -> [standard, chacal]."""
        names = [name.strip() for name in self.attn.split(",")]
        return names * self.n_blocks() if len(names) == 1 else names

    def uses_gamma(self):
        """Whether γ means anything to this model: a ChaCAL layer (or its ablation) in it."""
        return "chacal" in self.attn


def adaptive_levels(length, chunk):
    """The smallest L >= 1 with chunk^L >= length, in integers (math.log(125, 5) is 3.0000000000000004)."""
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
            # The residual stream itself is normalised, so a shared block sees states of one
            # scale at every depth: RegularGPT's parity extrapolates with it (lesson 02).
            x = self.ln_1(x + self.attn(x, cache=cache, token_ids=token_ids, depth=depth,
                                        groups=groups))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), cache=cache, token_ids=token_ids, depth=depth,
                          groups=groups)
        return x + self.mlp(self.ln_2(x))


def first_line(error):
    """What a one-line refusal quotes of an exception from transformers (whose messages run to
    paragraphs): its message's first line, at most 200 characters, or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def from_hub(loader, name):
    """loader.from_pretrained(name) of transformers (GPT2LMHeadModel, AutoTokenizer): from its
    cache, else downloaded. Offline and not cached, an OSError at once; transformers itself
    would retry the download for half a minute."""
    try:
        return loader.from_pretrained(name, local_files_only=True)
    except OSError:
        pass
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants
    hub = urlparse(constants.ENDPOINT)
    try:
        port = hub.port or (80 if hub.scheme == "http" else 443)
        socket.create_connection((hub.hostname, port), timeout=5).close()
    except OSError as error:
        raise OSError(f"{name} is not in transformers' cache and {hub.hostname} cannot be "
                      f"reached to download it ({error})") from None
    return loader.from_pretrained(name)


@contextlib.contextmanager
def evaluating(model):
    """model in eval mode for the block, then in the mode it was in, even if the block raises:
    a caller that catches the error would otherwise go on training without its dropout."""
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
            self.init_xavier()

    def init_xavier(self):
        """nn.Transformer's and nn.Embedding's initialisation: untied N(0, 1) token and
        position embeddings, Xavier-uniform linear maps in the blocks, the head nn.Linear's own.
        GPT-2's N(0, 0.02) was chosen for d 768; at d 64 the tokens' own signal is small beside
        what the blocks write into the stream, and lookups by token identity come late or not
        at all: lesson 05's two layers of d 64 learn the cycles walk with these, and no walk in
        3,000 steps with GPT-2's."""
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
        """AdamW with weight decay on the weights that mix inputs (linear maps, embeddings,
        convolutions), as GPT-2. Biases, LayerNorm gains, the dilated attention's pad vector and
        its score bias r (a matrix, but of offsets) set levels instead, and are not decayed."""
        decayed, kept = [], []
        for name, p in self.named_parameters():
            mixes = p.dim() >= 2 and not name.endswith("offset_bias")
            (decayed if mixes else kept).append(p)
        return torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                  {"params": kept, "weight_decay": 0.0}], lr=lr, betas=betas)

    def attention_maps(self, idx):
        """The attention weights of every layer run on idx (B, T), in order: a list of
        (B, nh, T, T) (LEGO attention: its fixed maps, then its kept heads, on the second axis),
        differentiable (mimicking trains them). Shared blocks give one per use."""
        maps = []
        for block in self.transformer.h:
            block.attn.maps = maps
        try:
            self(idx)
        finally:
            for block in self.transformer.h:
                block.attn.maps = None
        return maps

    def n_layers_for(self, length):
        """How many layers run on an input of this length: fixed, adaptive, or stochastic."""
        config = self.config
        if config.adaptive_depth:
            return config.thickness * adaptive_levels(length, config.chunk)
        if self.training and config.min_train_layers:
            return int(torch.randint(config.min_train_layers, config.n_layer + 1, ()))
        return config.n_layer

    def can_cache(self):
        """Whether generate() can decode against a cache: only a causal model (a bidirectional
        one does not decode at all), not under adaptive depth (the layer count grows with the
        sequence), nor with LEGO attention (it has no cached path: its maps and convolution read
        the whole sequence)."""
        return (self.config.causal and not self.config.adaptive_depth
                and all(ATTENTIONS[name].decodes_with_cache
                        for name in self.config.attention_per_block()))

    def new_caches(self):
        """One empty LayerCache per layer, to pass to forward() when decoding."""
        if not self.can_cache():
            raise ValueError("this model cannot decode against a cache (bidirectional, adaptive "
                             "depth, or LEGO attention); decode with use_cache=False")
        return [LayerCache() for _ in range(self.config.n_layer)]

    def forward(self, idx, targets=None, caches=None, positions=None, groups=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None).

        targets (B, T): the loss is the mean cross-entropy over positions whose target is not -1.
        caches: from new_caches(); each layer appends this call's tokens to its cache, and
        positions continue after the tokens already cached.
        positions, groups (B, T): the inductive scratchpad's layout (inductive_layout): each token's
        row of the position table, and its attention group (it sees the earlier tokens of its
        group and of group 0). None, as for every ordinary task: positions 0, 1, 2, ... and the
        causal mask.
        """
        B, T = idx.size()
        start = len(caches[0]) if caches else 0
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            n_positions = start + T if positions is None else int(positions.max()) + 1
            if n_positions > self.config.block_size:
                what = (f"sequence of {n_positions} tokens is longer than" if positions is None else
                        f"position {n_positions - 1} (the scratchpad's layout) is beyond")
                raise ValueError(f"{what} block_size {self.config.block_size}; train with a "
                                 f"larger --block_size")
            if positions is None:
                positions = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
            x = x + self.transformer.wpe(positions)  # positions (T,) or (B, T)
        x = self.transformer.drop(x)
        blocks = self.transformer.h
        for depth in range(self.n_layers_for(start + T)):
            # Shared weights cycle through the `thickness` blocks; otherwise block == depth.
            block = blocks[depth % len(blocks)]
            x = block(x, cache=caches[depth] if caches else None, token_ids=idx, depth=depth,
                      groups=groups)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss

    # Settings a GPT-2 checkpoint fixes: its weights' shapes and meaning depend on them.
    PRETRAINED_FIXED = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias", "pos",
                        "norm", "share_weights", "thickness", "adaptive_depth", "min_train_layers",
                        "weight_init")

    @classmethod
    def from_pretrained(cls, model, **overrides):
        """A GPT with the weights of a GPT-2: `model` is a name ("gpt2", "gpt2-medium", ...,
        downloaded by transformers) or a transformers GPT2LMHeadModel already built.

        overrides change what needs no new weights, e.g. attn="chacal", gamma=0.9 (the ChaCAL
        paper's Section 5.3 swaps ChaCAL into GPT-2, then fine-tunes); dropout is 0 unless given.
        Attention is GPT-2's standard one unless overridden, and the result computes GPT-2's
        logits (so does ChaCAL at γ = 0). transformers is needed only here:
        `pip install transformers`.
        """
        try:
            import transformers
        except ImportError:
            raise ImportError("GPT.from_pretrained needs transformers: pip install transformers"
                              ) from None
        if isinstance(model, str):
            model = from_hub(transformers.GPT2LMHeadModel, model)
        if not isinstance(model, transformers.GPT2LMHeadModel):
            raise TypeError(f"GPT.from_pretrained: expected a model name or a GPT2LMHeadModel, "
                            f"got {type(model).__name__}")
        hf = model.config
        # GPT-2's MLP uses gelu_new, GELU's tanh approximation; our exact GELU would move the
        # logits by ~1e-4, so a loaded model switches its GELU (other models keep the exact one).
        gelu = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
        unsupported = [f"{name}={value!r}" for name, value, ok in [
            ("activation_function", hf.activation_function, hf.activation_function in gelu),
            ("layer_norm_epsilon", hf.layer_norm_epsilon, hf.layer_norm_epsilon == 1e-5),
            ("n_inner", hf.n_inner, hf.n_inner in (None, 4 * hf.n_embd)),
            ("scale_attn_weights", hf.scale_attn_weights, hf.scale_attn_weights),
            ("scale_attn_by_inverse_layer_idx", hf.scale_attn_by_inverse_layer_idx,
             not hf.scale_attn_by_inverse_layer_idx)] if not ok]
        if unsupported:
            raise ValueError(f"GPT.from_pretrained: this GPT-2 has {unsupported[0]}, which our "
                             f"GPT does not build")
        settings = dict(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer,
                        n_head=hf.n_head, n_embd=hf.n_embd, bias=True, pos="learned", norm="pre",
                        dropout=0.0, attn="standard", gelu_approximate=gelu[hf.activation_function])
        gpt2 = GPTConfig(**settings)
        for name, value in overrides.items():
            if not hasattr(gpt2, name):
                raise ValueError(f"GPT.from_pretrained: unknown override {name}={value!r}")
            if name in cls.PRETRAINED_FIXED and value != getattr(gpt2, name):
                raise ValueError(f"GPT.from_pretrained: override {name}={value!r} would change "
                                 f"GPT-2's weights ({name} is {getattr(gpt2, name)!r} there)")
        ours = cls(GPTConfig(**{**settings, **overrides}))

        # HF's Conv1D stores (in, out) where nn.Linear stores (out, in); attn.bias and
        # attn.masked_bias are causal-mask buffers (older transformers), not weights.
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                      "mlp.c_proj.weight")
        theirs = {name: w for name, w in model.state_dict().items()
                  if not name.endswith((".attn.bias", ".attn.masked_bias"))}
        if not torch.equal(theirs.pop("lm_head.weight", theirs["transformer.wte.weight"]),
                           theirs["transformer.wte.weight"]):
            raise ValueError("GPT.from_pretrained: this GPT-2's lm_head is not tied to wte; ours is")
        params = dict(ours.named_parameters())  # the tied lm_head.weight appears once, as wte's
        asked = ", ".join(f"{name}={value!r}" for name, value in overrides.items())
        if set(params) != set(theirs):
            extra = sorted(set(params) ^ set(theirs))[0]
            raise ValueError(f"GPT.from_pretrained: override {asked} changes the weights ({extra} "
                             f"is in one model only); use one that needs none, e.g. attn='chacal'")
        with torch.no_grad():
            for name, w in theirs.items():
                w = w.t() if name.endswith(transposed) else w
                if params[name].shape != w.shape:
                    raise ValueError(f"GPT.from_pretrained: override {asked} changes the shape "
                                     f"of {name}; use one that needs no new weights")
                params[name].copy_(w)
        return ours

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
                 generator=None, stop_token=None, prompt_lengths=None):
        """Continue idx (B, T) by max_new_tokens tokens; returns (B, T + new tokens).

        temperature=0 is greedy decoding. With use_cache the prompt is encoded once (for ChaCAL,
        one triangular system) and every new token costs one step against the cache; without it,
        each new token recomputes the whole sequence, which is slower but obviously right.
        Decodes in eval mode (no dropout, the full depth), then restores the mode it found.

        Two options for answering a batch of prompts (boxes):
        - stop_token: stop early once every row has written it;
        - prompt_lengths (B,): row r's prompt is idx[r, :prompt_lengths[r]] (the rest is ignored).
          Decoding starts after the shortest prompt, and a row still inside its own prompt takes
          the prompt's next token instead of a generated one (see forced_prompt_tokens), so each
          row reads its own prompt at its own positions, with no padding inside the attention.
          Row r's answer starts at column prompt_lengths[r]; the longest prompt's row writes
          max_new_tokens tokens, a shorter one's more.
        """
        if not self.config.causal:
            raise ValueError("a bidirectional model (--bidirectional) does not decode left to right")
        prompts, lengths = idx, torch.as_tensor(prompt_lengths if prompt_lengths is not None
                                                else [idx.size(1)] * idx.size(0), device=idx.device)
        if (lengths.shape != (idx.size(0),)
                or not 1 <= lengths.min() <= lengths.max() <= idx.size(1)):
            raise ValueError(f"prompt_lengths {lengths.tolist()} must give each of the "
                             f"{idx.size(0)} rows a length in 1..{idx.size(1)}, the prompts' width")
        idx = idx[:, :int(lengths.min())]
        end = int(lengths.max()) + max_new_tokens
        read = end - 1  # the model never reads the last token it writes
        if self.config.pos == "learned" and read > self.config.block_size:
            raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens "
                             f"({max_new_tokens}) has the model read {read} tokens, more than "
                             f"block_size {self.config.block_size}")
        with evaluating(self):
            caches = self.new_caches() if use_cache else None
            new_tokens = idx  # what the next forward has to read: all of it without a cache
            finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
            while idx.size(1) < end:
                logits, _ = self(new_tokens if use_cache else idx, caches=caches)
                next_token = self.pick_token(logits[:, -1, :], temperature, top_k, generator)
                next_token, in_prompt = forced_prompt_tokens(next_token, prompts, lengths,
                                                             idx.size(1))
                idx = torch.cat([idx, next_token], dim=1)
                new_tokens = next_token
                if stop_token is not None:
                    finished |= (next_token[:, 0] == stop_token) & ~in_prompt
                    if finished.all():
                        break
        return idx

    @staticmethod
    def pick_token(logits, temperature, top_k=None, generator=None):
        """The next token (B, 1) from last-position logits (B, vocab): argmax at temperature 0,
        else a draw from the softmax at that temperature, among the top_k if given (and any tied
        with the k-th, as nanoGPT keeps them)."""
        if not temperature >= 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"temperature {temperature} must be >= 0 and top_k {top_k} at least 1")
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def forced_prompt_tokens(next_token, prompts, lengths, position):
    """Rows still inside their prompt at this position take the prompt's token, not the model's.
    Returns (tokens (B, 1), in_prompt (B,))."""
    in_prompt = position < lengths
    if in_prompt.any():
        next_token = torch.where(in_prompt[:, None], prompts[:, position:position + 1], next_token)
    return next_token, in_prompt

# ----------------------------------------------------------------------------------------------
# The inductive scratchpad (Abbe, Bengio, Lotfi, Sandon, Saremi 2024, "How Far Can Transformers
# Reason? The Globality Barrier and Inductive Scratchpad", Appendix C), for any task whose
# scratchpad is a sequence of states:
#
#     Q : s1 # s2 # ... # sk        Q the question, ":" the start token, "#" closes a state
#
# The model should write state s[i] as if the sequence were only Q : s[i-1] #, so that it learns
# one induction step, applied as often as a test needs. Three pieces, none knowing a task:
#
# - training_form: every closed state twice, Q : s1 # s1 # s2 # s2 # ... sk (the appendix's
#   second training method, the one its code uses);
# - inductive_layout: the attention group and position of every token of that form. Group 0 is
#   Q up to and including ":"; then group 1 = s1 #, group 2 = (s1 #)' s2 #, group 3 = (s2 #)' s3 #,
#   ... A token sees the earlier tokens of its own group and group 0 (attention.group_visibility),
#   and positions restart after Q in every group. The first copy of a state ends its group, the
#   second, as the previous state, opens the next; the task gives the second no loss;
# - generate_inductive: decoding with the same masks and positions, with or without a cache.
#
# With t tokens up to the start token ':' included, a state of two tokens (node, #) and k = 3
# states, the form and its layout:
#
#     token     Q ... :   s1 #    s1 #   s2 #    s2 #   s3
#     group     0 ... 0   1  1    2  2   2  2    3  3   3
#     position  0 ... t-1 t  t+1  t  t+1 t+2 t+3 t  t+1 t+2
#     loss      as Q      1  1    0  0   1  1    0  0   1
#
# GPT.forward takes the positions and groups as arguments; without them a model is unchanged.

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

    t being the number of tokens up to its start token, included. A row without the start token
    is all group 0 with positions 0, 1, 2, ...: the ordinary layout."""
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


class InductiveRows:
    """Where each row of a batch decoded under the inductive scratchpad stands: the group and
    position of its next token, its t (tokens up to the start token, included) once that is
    written, its current state's tokens. step() turns a row's next token into what the model
    must read."""

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
            # from position t (the appendix's first remedy for the cache: compute the keys and
            # values of s[i-1]'s tokens again).
            reread = self.state[r] + [token]
            self.group[r], self.position[r], self.state[r] = group + 1, t + len(reread), []
            return reread, list(range(t, t + len(reread))), [group + 1] * len(reread)
        if t is None and token == self.start_id:  # Q is complete: states start at position t
            self.question[r], self.group[r] = position + 1, 1
        elif t is not None:
            self.state[r].append(token)
        self.position[r] = position + 1
        return [token], [position], [group]


def left_padded(pending, device):
    """(tokens, positions, groups), each (B, L), from the (tokens, positions, groups) each row
    has yet to read: shorter rows padded on the left with entries of group DEAD, which no real
    token sees, so every row's last column is its real last token."""
    width = max(len(tokens) for tokens, _, _ in pending)
    rows = [[[0] * (width - len(tokens)) + tokens,
             [0] * (width - len(tokens)) + positions,
             [DEAD] * (width - len(tokens)) + groups] for tokens, positions, groups in pending]
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
    s[i] # again, as the previous state of the next group at positions t, t+1, ... (the first of
    Appendix C's two remedies for the cache). The cache then forgets group i, which no later
    token can see: it keeps Q and at most two states. Same options as GPT.generate (no
    prompt_lengths). Decoding stops early if a state outgrows the position table (a model that
    has not learned to write # yet).
    """
    B, device = idx.size(0), idx.device
    with evaluating(model):
        rows, caches = InductiveRows(B, start_id, sep_id), model.new_caches() if use_cache else None
        pending = [([], [], []) for _ in range(B)]  # per row, what the model has yet to read
        for r, prompt in enumerate(idx.tolist()):  # the prompt, read as its tokens come
            for token in prompt:
                for whole, part in zip(pending[r], rows.step(r, token)):
                    whole += part
        step_logits = []
        for _ in range(max_new_tokens):
            if use_cache:  # what is new since the last step; a row's last column, its last token
                tokens, positions, groups = left_padded(pending, device)
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
            step_logits.append(logits)
            pending = [rows.step(r, token) for r, token in enumerate(next_token[:, 0].tolist())]
            if stop_token is not None and (idx[:, -len(step_logits):] == stop_token).any(1).all():
                break
    if not return_logits:
        return idx
    no_logits = model.lm_head.weight.new_empty(B, 0, model.config.vocab_size)  # no step was taken
    return idx, torch.stack(step_logits, dim=1) if step_logits else no_logits


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
