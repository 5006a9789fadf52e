"""The GPT: decoding with the cache against the full forward pass, sizes, and bad configs."""

import itertools
import sys

import pytest
import torch

import attention
from model import GPT, GPTConfig, adaptive_levels

ATTENTION_STACKS = ["standard", "chacal", "standard,chacal", "dilated,chacal,dilated", "chacal_diagonal"]
# Beside them, for the cache: two blocks reused over five depths (each depth keeps a cache of its
# own), and Sliding-Dilated-Attention at chunk 3, two layers per dilation (1, 1, 3, 3, 9, 9):
# the last two reach 18 tokens back, past the start of a short cache.
CACHED_STACKS = [(attn, {}) for attn in ATTENTION_STACKS] + [
    ("standard,chacal", dict(share_weights=True, thickness=2, n_layer=5)),
    ("dilated", dict(chunk=3, thickness=2, n_layer=6))]


def small_model(attn, seed=0, **overrides):
    torch.manual_seed(seed)
    options = dict(block_size=40, vocab_size=30, n_layer=len(attn.split(",")), n_head=4,
                   n_embd=32, attn=attn)
    options.update(overrides)
    return GPT(GPTConfig(**options)).double().eval()


def decoded_with_cache(model, idx, prompt_length):
    """Logits of idx read through a cache: a prompt of prompt_length tokens in one call (one
    prefill solve for ChaCAL), then one token per call, as generate() decodes."""
    caches = model.new_caches()
    pieces = [model(idx[:, :prompt_length], caches=caches)[0]]
    pieces += [model(idx[:, t:t + 1], caches=caches)[0] for t in range(prompt_length, idx.size(1))]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("attn, options", CACHED_STACKS)
def test_cached_decoding_equals_full_forward(attn, options):
    model = small_model(attn, **options)
    idx = torch.randint(0, 30, (3, 25), generator=torch.Generator().manual_seed(1))
    full, _ = model(idx)
    torch.testing.assert_close(decoded_with_cache(model, idx, 10), full, rtol=1e-10, atol=1e-10)


def test_post_norm_blocks_decode_with_a_cache_and_normalise_their_output():
    model = small_model("dilated,chacal,standard", norm="post")
    idx = torch.randint(0, 30, (2, 20), generator=torch.Generator().manual_seed(4))
    outputs = []
    hooks = [block.register_forward_hook(lambda mod, inp, out: outputs.append(out))
             for block in model.transformer.h]
    full, _ = model(idx)
    for hook in hooks:
        hook.remove()
    for out in outputs:  # LN(x + MLP(x)) with LayerNorm's initial weight 1 and bias 0
        torch.testing.assert_close(out.mean(dim=-1), torch.zeros(2, 20, dtype=out.dtype))
        torch.testing.assert_close(out.var(dim=-1, unbiased=False), torch.ones(2, 20, dtype=out.dtype),
                                   rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoded_with_cache(model, idx, 7), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_block_computes_the_equations_of_its_docstring(norm):
    block = small_model("standard", norm=norm).transformer.h[0]
    for ln in (block.ln_1, block.ln_2):  # LayerNorm's initial weight 1 and bias 0 would hide an order
        torch.nn.init.normal_(ln.weight), torch.nn.init.normal_(ln.bias)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    attend, ln_1, ln_2, mlp = block.attn, block.ln_1, block.ln_2, block.mlp
    if norm == "pre":  # x + attention(LN(x)), then x + MLP(LN(x))
        h = x + attend(ln_1(x))
        expected = h + mlp(ln_2(h))
    else:  # LN(x + attention(x)), then LN(x + MLP(x))
        h = ln_1(x + attend(x))
        expected = ln_2(h + mlp(h))
    torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("attn", ATTENTION_STACKS)
def test_prefill_then_continue_equals_one_solve(attn, fused):
    model = small_model(attn)
    for block in model.transformer.h:  # False: the readable paths, against a cache too
        block.attn.fused = fused
    idx = torch.randint(0, 30, (2, 30), generator=torch.Generator().manual_seed(2))
    full, _ = model(idx)
    caches = model.new_caches()
    first, _ = model(idx[:, :13], caches=caches)
    rest, _ = model(idx[:, 13:], caches=caches)                  # 17 tokens in one block
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("blocks", [[135], [10, 135]])
def test_cached_decoding_through_the_blocked_chacal_path_equals_full_forward(blocks, monkeypatch):
    # ChaCAL solves block by block from CHACAL_BLOCKED_FROM["cpu"] new tokens on (pinned at 128
    # here, whatever it is tuned to): a prefill that long, or a block that long after a short
    # prefill (the earlier tokens then enter from the cache); then one token at a time up to 150.
    monkeypatch.setitem(attention.CHACAL_BLOCKED_FROM, "cpu", 128)
    continued = []  # for each blocked solve: whether it continued a cache
    apply = attention.BlockedChaCAL.apply
    monkeypatch.setattr(attention.BlockedChaCAL, "apply",
                        lambda *args: continued.append(args[3] is not None) or apply(*args))
    model = small_model("standard,chacal", block_size=200)
    idx = torch.randint(0, 30, (2, 150), generator=torch.Generator().manual_seed(5))
    full, _ = model(idx)
    ends = list(itertools.accumulate(blocks)) + list(range(sum(blocks) + 1, 151))
    caches = model.new_caches()
    cached = torch.cat([model(idx[:, start:end], caches=caches)[0]
                        for start, end in zip([0] + ends, ends)], dim=1)
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)
    assert continued == [False, len(blocks) > 1]  # the full pass's solve, then the cache's


@pytest.mark.parametrize("attn", ATTENTION_STACKS)
def test_greedy_generation_with_and_without_cache_agree(attn):
    model = small_model(attn)
    prompt = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(3))
    cached = model.generate(prompt, 20, temperature=0)
    recomputed = model.generate(prompt, 20, temperature=0, use_cache=False)
    assert cached.shape == (4, 26)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:, :6], prompt)


@pytest.mark.parametrize("attn", ATTENTION_STACKS)
def test_prompts_of_different_lengths_decode_together_as_they_would_alone(attn):
    model = small_model(attn)
    lengths = [9, 4, 6]
    padded = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(4))
    padded[1, 4:] = padded[2, 6:] = 0  # padding: must never be read
    together = model.generate(padded, 12, temperature=0, prompt_lengths=torch.tensor(lengths))
    for row, length in enumerate(lengths):
        alone = model.generate(padded[row:row + 1, :length], 12, temperature=0)
        assert torch.equal(together[row, :length + 12], alone[0])
    # The batch stops at the column where the last row writes the stop token (a stop token
    # inside a prompt does not count), and is the same as decoding on up to there.
    stop = int(together[1, 4])  # row 1's first generated token
    early = model.generate(padded, 12, temperature=0, prompt_lengths=torch.tensor(lengths),
                           stop_token=stop)
    first_stops = [next((t for t in range(length, together.size(1)) if together[row, t] == stop),
                        together.size(1) - 1) for row, length in enumerate(lengths)]
    assert torch.equal(early, together[:, :max(first_stops) + 1])


def test_a_stop_token_inside_a_longer_prompt_does_not_stop_its_row():
    model = small_model("standard")
    model.pick_token = lambda logits, *options: torch.full((logits.size(0), 1), 7)  # always 7
    prompts = torch.tensor([[1, 2, 3, 4, 5, 7, 6, 5, 4], [1, 2, 3, 4, 0, 0, 0, 0, 0]])
    out = model.generate(prompts, 10, temperature=0, prompt_lengths=torch.tensor([9, 4]), stop_token=7)
    # Row 1 writes 7 at column 4; row 0 reads its prompt's 7 at column 5 and writes one at 9.
    assert out.size(1) == 10 and torch.equal(out[0], torch.tensor([1, 2, 3, 4, 5, 7, 6, 5, 4, 7]))


def test_sampling_is_reproducible_with_a_generator_and_respects_top_k():
    model = small_model("chacal")
    prompt = torch.zeros(2, 1, dtype=torch.long)
    a = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    # With top_k=1 sampling can only take the argmax: it must equal greedy decoding.
    assert torch.equal(model.generate(prompt, 10, top_k=1), model.generate(prompt, 10, temperature=0))
    # The default temperature is 1: the model's own distribution.
    assert torch.equal(model.generate(prompt, 10, generator=torch.Generator().manual_seed(0)),
                       model.generate(prompt, 10, temperature=1.0,
                                      generator=torch.Generator().manual_seed(0)))


def test_sampling_draws_from_the_tempered_softmax_among_the_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).expand(40_000, 5)
    generator = torch.Generator().manual_seed(0)
    def frequencies(**options):
        picks = GPT.pick_token(logits, generator=generator, **options)[:, 0]
        return torch.bincount(picks, minlength=5).double() / len(picks)
    # softmax(logits / T) by hand: exp(l / T) / Σ exp(l / T); the top 3 renormalised among themselves
    weights = torch.exp(torch.tensor([0.0, 1, 2, 3, 4], dtype=torch.double) / 2)
    torch.testing.assert_close(frequencies(temperature=2.0), weights / weights.sum(), atol=0.01, rtol=0)
    top3 = torch.cat([torch.zeros(2, dtype=torch.double), weights[2:] / weights[2:].sum()])
    torch.testing.assert_close(frequencies(temperature=2.0, top_k=3), top3, atol=0.01, rtol=0)
    for k in (1, 2, 5, 9):  # exactly the k largest are ever drawn (all of them when k >= vocab)
        picks = GPT.pick_token(logits, temperature=100.0, top_k=k, generator=generator)
        assert set(picks[:, 0].tolist()) == set(range(5 - min(k, 5), 5))
    assert (GPT.pick_token(logits[:2], temperature=0) == 4).all()
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=1.0, top_k=0)):
        with pytest.raises(ValueError, match="temperature .* top_k"):
            GPT.pick_token(logits[:2], **bad)


@pytest.mark.parametrize("options", [dict(attn="standard,dilated,chacal"),
                                     dict(attn="lego_v1", causal=False, broadcast_ids=(0,))])
def test_weight_decay_reaches_the_mixing_weights_only(options):
    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=3, n_embd=16, n_head=2, **options))
    groups = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95)).param_groups
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    decayed, kept = (set(map(id, group["params"])) for group in groups)
    mixing = {id(m.weight) for m in model.modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d))}
    assert decayed == mixing  # the linear maps, the embeddings, LEGO's convolution
    assert kept == {id(p) for p in model.parameters()} - mixing  # biases, gains, pad, offsets
    assert {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)} <= kept


BF16_ATTENTIONS = ["standard", "chacal", "chacal_diagonal", "dilated", "lego_v0", "lego_v1",
                   "standard,chacal"]


def bf16_step_and_decoding(attn, device):
    """A training step and greedy decoding under bf16 autocast on `device`, against float32."""
    options = dict(causal=False, broadcast_ids=(0,)) if attn.startswith("lego") else {}
    model = small_model(attn, **options).float().to(device).train()
    x = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    exact, _ = model(x)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits, loss = model(x, x)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (logits.float() - exact).abs().max() < 0.02  # logits up to ~0.6; bf16 errs ~0.002
    if model.can_cache():
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model.eval().generate(x[:, :4], 8, temperature=0)
        assert out.shape == (2, 12) and torch.equal(out[:, :4], x[:, :4])


@pytest.mark.parametrize("attn", BF16_ATTENTIONS)
def test_a_training_step_and_decoding_under_bf16_autocast(attn):
    # The GPU default: bf16 autocast (ChaCAL solves in float32). Checked here on the CPU's bf16
    # (tests/test_cuda.py: on a GPU).
    bf16_step_and_decoding(attn, "cpu")


@pytest.mark.parametrize("attn", [attn for attn in BF16_ATTENTIONS if not attn.startswith("lego")])
def test_cached_decoding_under_bf16_autocast_stays_near_the_full_forward(attn):
    # Xavier's N(0, 1) embeddings give logits up to ~2 that follow the attention (GPT-2's init
    # gives ~0.6, nearly blind to it). bf16 rounding puts the two apart by 0.016 at most and
    # 0.001 on average; a cache that left γy_t out of ChaCAL's m_t, by 0.007 on average.
    model = small_model(attn, weight_init="xavier").float()
    idx = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, _ = model(idx)
        cached = decoded_with_cache(model, idx, 4)
    difference = (cached.float() - full.float()).abs()
    assert cached.dtype == full.dtype == torch.bfloat16
    assert difference.max() < 0.08 and difference.mean() < 0.005


def test_loss_ignores_targets_of_minus_one():
    model = small_model("chacal")
    idx = torch.randint(0, 30, (2, 12))
    targets = torch.randint(0, 30, (2, 12))
    targets[:, :5] = -1
    logits, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, 30), targets[:, 5:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_paper_sizes_match_table_1():
    # ChaCAL paper, Table 1: 3.3M, 6.4M, 9.6M, 12.7M, 15.9M for 1..5 layers at d=512.
    for n_layer, millions in zip(range(1, 6), [3.3, 6.4, 9.6, 12.7, 15.9]):
        model = GPT(GPTConfig(n_layer=n_layer, n_embd=512, n_head=8, attn="standard"))
        assert round(model.num_params() / 1e6, 1) == millions
    assert GPT(GPTConfig(n_layer=1, n_embd=512, n_head=8, attn="chacal")).num_params() == 3_284_480


def test_gpt2_parameter_names():
    names = set(dict(small_model("standard,chacal").named_parameters()))
    for name in ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                 "transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_proj.bias",
                 "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight",
                 "transformer.ln_f.weight"]:
        assert name in names


def test_mixed_stack_builds_each_attention_per_layer():
    model = small_model("standard,chacal")
    kinds = [type(block.attn).__name__ for block in model.transformer.h]
    assert kinds == ["StandardAttention", "ChaCALAttention"]


@pytest.mark.parametrize("options, flag", [
    (dict(attn="flash"), "--attn"),
    (dict(attn="standard,chacal", n_layer=3), "--attn"),
    (dict(gamma=1.0), "--gamma"),
    (dict(gamma=-0.5), "--gamma"),
    (dict(n_embd=30, n_head=4), "--n_embd"),
    (dict(attn="dilated", chunk=1), "--chunk"),
    (dict(norm="middle"), "--norm"),
    (dict(pos="sinusoidal"), "--pos"),
    (dict(adaptive_depth=True), "--share_weights"),
    (dict(thickness=2), "--thickness"),
    (dict(thickness=2, n_layer=4), "--thickness 2 only means something with --share_weights"),
    (dict(share_weights=True, thickness=0), "--thickness"),
    (dict(n_layer=0), "--n_layer"),
    (dict(share_weights=True, adaptive_depth=True, min_train_layers=1), "--min_train_layers"),
    (dict(share_weights=True, n_layer=4, min_train_layers=5), "--min_train_layers"),
    (dict(n_layer=4, min_train_layers=2), "--min_train_layers"),
    (dict(attn="dilated", causal=False), "--bidirectional"),
    (dict(attn="standard,chacal", share_weights=True, thickness=3), "--thickness"),
    (dict(share_weights=True, thickness=3, n_layer=2), "--thickness 3 exceeds --n_layer 2: 1 shared "
                                                       "block would never run"),  # idle blocks
    (dict(attn="dilated", thickness=3, n_layer=2), "--thickness 3 exceeds --n_layer 2"),  # as thickness 2
])
def test_bad_configs_fail_at_construction_naming_the_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        GPTConfig(**options)


@pytest.mark.parametrize("options", [dict(n_embd=1, n_head=1), dict(share_weights=True, n_layer=4,
                                     min_train_layers=4), dict(share_weights=True, n_layer=4, thickness=4)])
def test_configs_at_the_edge_of_what_is_allowed_build(options):  # each check's boundary, inside
    GPTConfig(**options)


def test_sequences_longer_than_block_size_are_refused():
    model = small_model("chacal")
    with pytest.raises(ValueError, match="sequence of 41 tokens is longer than block_size 40"):
        model(torch.zeros(1, 41, dtype=torch.long))
    # A scratchpad's layout restarts positions, so its error names the position, not a length.
    tokens, positions = torch.zeros(1, 5, dtype=torch.long), torch.tensor([[0, 1, 2, 40, 3]])
    with pytest.raises(ValueError, match="position 40 .* is beyond block_size 40"):
        model(tokens, positions=positions, groups=torch.zeros_like(positions))
    model(tokens, positions=positions.clamp(max=39), groups=torch.zeros_like(positions))  # fits
    caches = model.new_caches()  # cached: the tokens in the cache count too
    model(torch.zeros(1, 30, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match="sequence of 41 tokens is longer than block_size 40"):
        model(torch.zeros(1, 11, dtype=torch.long), caches=caches)
    # generate refuses at start, before a token is written, naming both lengths.
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_new_tokens \(12\) has "
                                         r"the model read 41 tokens, more than block_size 40"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 12)
    # The last token written is never read: 30 + 11 tokens fit a block of 40.
    assert model.generate(torch.zeros(1, 30, dtype=torch.long), 11).shape == (1, 41)
    # Without a position table (--pos none) there is no limit to refuse.
    unbounded = small_model("chacal", pos="none")
    assert unbounded.generate(torch.zeros(1, 30, dtype=torch.long), 30).shape == (1, 60)


@pytest.mark.parametrize("length, chunk, levels", [
    (1, 2, 1), (2, 2, 1), (3, 2, 2), (40, 2, 6), (500, 2, 9), (81, 3, 4), (82, 3, 5),
    (125, 5, 3), (126, 5, 4), (4096, 64, 2)])
def test_adaptive_depth_is_the_smallest_power_covering_the_length(length, chunk, levels):
    assert adaptive_levels(length, chunk) == levels


def layers_run(model, length):
    """Count block calls (shared blocks are called once per use) in one forward pass."""
    calls = []
    hooks = [block.register_forward_hook(lambda *_: calls.append(1)) for block in model.transformer.h]
    model(torch.zeros(1, length, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    return len(calls)


def test_adaptive_depth_follows_the_length_of_each_batch():
    model = small_model("dilated", share_weights=True, adaptive_depth=True, thickness=2,
                        pos="none", chunk=2, n_layer=1)
    assert len(model.transformer.h) == 2
    assert [layers_run(model, T) for T in (1, 2, 3, 40, 100)] == [2, 2, 4, 12, 14]


def test_shared_weights_do_not_grow_with_depth():
    sizes = {n_layer: small_model("standard", share_weights=True, n_layer=n_layer).num_params()
             for n_layer in (1, 4, 12)}
    assert len(set(sizes.values())) == 1
    assert small_model("standard", n_layer=4).num_params() > sizes[4]


def test_stochastic_depth_draws_depth_in_training_only():
    model = small_model("standard", share_weights=True, n_layer=6, min_train_layers=3)
    assert {layers_run(model, 5) for _ in range(10)} == {6}   # eval: always the test depth
    model.train()
    torch.manual_seed(0)
    drawn = {layers_run(model, 5) for _ in range(60)}
    assert drawn == {3, 4, 5, 6}


def test_without_positions_the_model_runs_past_block_size():
    model = small_model("dilated", share_weights=True, adaptive_depth=True, pos="none", n_layer=1)
    assert not any("wpe" in name for name, _ in model.named_parameters())
    logits, _ = model(torch.zeros(2, 100, dtype=torch.long))  # block_size is 40
    assert logits.shape == (2, 100, 30)


def test_bidirectional_and_adaptive_models_refuse_to_decode_with_a_cache():
    prompt = torch.zeros(1, 4, dtype=torch.long)
    bidirectional = small_model("standard", causal=False)
    with pytest.raises(ValueError, match="bidirectional"):
        bidirectional.generate(prompt, 2)
    assert not bidirectional.can_cache()  # sample.py and evaluation read it in one pass
    adaptive = small_model("dilated", share_weights=True, adaptive_depth=True, pos="none", n_layer=1)
    with pytest.raises(ValueError, match="use_cache=False"):
        adaptive.generate(prompt, 2)
    assert adaptive.generate(prompt, 2, temperature=0, use_cache=False).shape == (1, 6)
    mixed = small_model("standard,lego_v0")  # one layer without a cache is enough
    assert not mixed.can_cache()
    assert mixed.generate(prompt, 2, temperature=0, use_cache=False).shape == (1, 6)


@pytest.mark.parametrize("lengths", [[3, 5], [0, 2], [2], [[2, 2]]])
def test_generate_refuses_prompt_lengths_outside_its_prompts(lengths):
    with pytest.raises(ValueError, match="prompt_lengths"):
        small_model("standard").generate(torch.zeros(2, 4, dtype=torch.long), 2,
                                         prompt_lengths=lengths)


def test_generate_decodes_in_eval_mode_and_restores_the_mode():
    # Dropout and stochastic depth would make every token's forward pass different in training
    # mode; generate() switches them off, then leaves the model as it found it.
    model = small_model("standard", dropout=0.5, share_weights=True, n_layer=4, min_train_layers=1)
    prompt = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(4))
    in_eval = model.generate(prompt, 10, temperature=0)
    model.train()
    assert torch.equal(model.generate(prompt, 10, temperature=0), in_eval)
    assert model.training
    with pytest.raises(ValueError, match="temperature -1"):  # also when decoding fails
        model.generate(prompt, 10, temperature=-1)
    assert model.training
    assert model.can_cache() and not small_model("lego_v0").can_cache()


@pytest.mark.parametrize("options", [dict(attn="standard,chacal"), dict(attn="dilated"),
                                     dict(attn="lego_v1", causal=False, broadcast_ids=(0,))])
def test_dropout_acts_in_training_only(options):
    x = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    model, plain = small_model(dropout=0.5, **options), small_model(dropout=0.0, **options)
    assert torch.equal(model(x)[0], model(x)[0]) and torch.equal(model(x)[0], plain(x)[0])
    model.train()
    assert not torch.equal(model(x)[0], plain(x)[0])


def test_shared_blocks_take_turns_in_order():
    model = small_model("standard", share_weights=True, thickness=2, n_layer=5)
    ran = []
    for index, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda module, args, out, index=index: ran.append(index))
    model(torch.zeros(1, 8, dtype=torch.long))
    assert len(model.transformer.h) == 2 and ran == [0, 1, 0, 1, 0]


def test_a_shared_block_is_told_the_depth_it_runs_at():
    # Sliding-Dilated-Attention picks its dilation from the depth: one block reused at four
    # depths must be told 0, 1, 2, 3, not its own index among the blocks.
    model = small_model("dilated", share_weights=True, n_layer=4)
    seen = []
    model.transformer.h[0].attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["depth"]), with_kwargs=True)
    model(torch.zeros(1, 8, dtype=torch.long))
    assert seen == [0, 1, 2, 3]


def test_gpt2_init_scales_the_residual_projections_by_depth():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=12, n_head=4, n_embd=128))
    for block in model.transformer.h:  # GPT-2: 0.02 / √(2 · n_layer), one per residual branch
        for projection in (block.attn.c_proj, block.mlp.c_proj):
            assert projection.weight.std().item() == pytest.approx(0.02 / 24 ** 0.5, rel=0.05)


def test_dilated_attention_starts_its_score_bias_and_pad_at_gpt2s_scale():
    torch.manual_seed(0)  # r (heads x chunk) and p (n_embd): N(0, 0.02), as GPT-2's weights
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_head=8, n_embd=512, attn="dilated",
                          chunk=64, pos="none"))
    for weight in (model.transformer.h[0].attn.offset_bias, model.transformer.h[0].attn.pad):
        assert weight.numel() == 512 and abs(weight.mean().item()) < 0.003
        assert weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_weight_init_gpt2_ties_the_embeddings_and_xavier_follows_pytorchs_defaults():
    torch.manual_seed(0)
    config = dict(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_embd=64, attn="standard")
    gpt2, xavier = GPT(GPTConfig(**config)), GPT(GPTConfig(**config, weight_init="xavier"))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert xavier.lm_head.weight is not xavier.transformer.wte.weight
    for weight in (gpt2.transformer.wte.weight, gpt2.transformer.h[0].mlp.c_fc.weight):  # N(0, 0.02)
        assert weight.std().item() == pytest.approx(0.02, rel=0.1) and abs(weight.mean().item()) < 0.002
    for embedding in (xavier.transformer.wte, xavier.transformer.wpe):  # N(0, 1)
        assert embedding.weight.std().item() == pytest.approx(1.0, rel=0.1)
        assert abs(embedding.weight.mean().item()) < 0.1
    fc = xavier.transformer.h[0].mlp.c_fc.weight  # Xavier-uniform: U(±√(6 / (fan_in + fan_out)))
    bound = (6 / sum(fc.shape)) ** 0.5
    assert fc.abs().max().item() <= bound and fc.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.1)
    head = xavier.lm_head.weight  # nn.Linear's own: U(±1/√fan_in), not N(0, 0.02)
    assert head.abs().max().item() <= 1 / 64 ** 0.5
    assert head.std().item() == pytest.approx(1 / 64 ** 0.5 / 3 ** 0.5, rel=0.1)
    assert xavier.num_params() == gpt2.num_params() + 50 * 64  # the head is a matrix of its own
    with pytest.raises(ValueError, match="--weight_init"):
        GPTConfig(**config, weight_init="normal")


def test_without_transformers_from_pretrained_says_how_to_install_it(monkeypatch):
    # here, not in test_pretrained.py, which is skipped where transformers is missing
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now fails
    with pytest.raises(ImportError, match=r"^[^\n]*pip install transformers$"):
        GPT.from_pretrained("gpt2")
