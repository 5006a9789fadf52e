"""The GPT: decoding with the cache against the full forward pass, its blocks against their
equations, sampling against the tempered softmax, depth options, and the paper's sizes."""

import inspect
import sys

import pytest
import torch

from model import GPT, GPTConfig, adaptive_levels

STACKS = ["standard", "chacal", "standard,chacal", "dilated,chacal,dilated", "chacal_diagonal"]
# Beside them, for the cache: two blocks reused over five depths (each depth keeps its own cache);
# Sliding-Dilated-Attention at chunk 3, two layers per dilation (1, 1, 3, 3, 9, 9), reaching 18
# tokens back, past the start of a short cache; and post-LN blocks.
CACHED = [(attn, {}) for attn in STACKS] + [
    ("standard,chacal", dict(share_weights=True, thickness=2, n_layer=5)),
    ("dilated", dict(chunk=3, thickness=2, n_layer=6)),
    ("dilated,chacal,standard", dict(norm="post"))]


def small_model(attn, seed=0, **overrides):
    torch.manual_seed(seed)
    options = dict(block_size=40, vocab_size=30, n_layer=len(attn.split(",")), n_head=4, n_embd=32, attn=attn)
    return GPT(GPTConfig(**{**options, **overrides})).double().eval()


def decoded_with_cache(model, idx, ends):
    """Logits of idx read through a cache in pieces ending at `ends` (a prefill, a block of
    several tokens, then one token per call as generate() decodes)."""
    caches = model.new_caches()
    return torch.cat([model(idx[:, a:b], caches=caches)[0] for a, b in zip([0] + ends, ends)], dim=1)


@pytest.mark.parametrize("attn, options", CACHED)
def test_cached_decoding_equals_the_full_forward_pass(attn, options):
    model = small_model(attn, **options)
    idx = torch.randint(0, 30, (3, 30), generator=torch.Generator().manual_seed(1))
    ends = [10, 27, 28, 29, 30]
    torch.testing.assert_close(decoded_with_cache(model, idx, ends), model(idx)[0], rtol=1e-10, atol=1e-10)


def test_cached_decoding_through_the_blocked_chacal_path_equals_the_full_pass():
    # 150 tokens: on a CPU the full pass takes ChaCAL's blocked solve, the cached pieces the one solve.
    model = small_model("standard,chacal", block_size=200)
    idx = torch.randint(0, 30, (2, 150), generator=torch.Generator().manual_seed(5))
    ends = [10, 145] + list(range(146, 151))
    torch.testing.assert_close(decoded_with_cache(model, idx, ends), model(idx)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_block_computes_the_equations_of_its_docstring(norm):
    block = small_model("standard", norm=norm).transformer.h[0]
    for ln in (block.ln_1, block.ln_2):  # LayerNorm's initial (1, 0) would hide the order
        torch.nn.init.normal_(ln.weight), torch.nn.init.normal_(ln.bias)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if norm == "pre":  # x + attention(LN(x)), then x + MLP(LN(x))
        h = x + block.attn(block.ln_1(x))
        expected = h + block.mlp(block.ln_2(h))
    else:  # LN(x + attention(x)), then LN(x + MLP(x))
        h = block.ln_1(x + block.attn(x))
        expected = block.ln_2(h + block.mlp(h))
    torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attn", STACKS)
def test_generation_with_and_without_the_cache_agrees(attn):
    model = small_model(attn)
    prompt = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(3))
    cached = model.generate(prompt, 20, temperature=0)
    assert cached.shape == (4, 26) and torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, model.generate(prompt, 20, temperature=0, use_cache=False))
    sampled = [model.generate(prompt, 20, top_k=3, use_cache=use_cache, generator=torch.Generator().manual_seed(0))
               for use_cache in (True, False)]
    assert torch.equal(*sampled)
    assert torch.equal(model.generate(prompt, 10, top_k=1), model.generate(prompt, 10, temperature=0))


@pytest.mark.parametrize("attn", ["standard", "chacal"])
def test_prompts_of_different_lengths_decode_together_as_they_would_alone(attn):
    model = small_model(attn)
    lengths = [9, 4, 6]
    padded = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(4))
    padded[1, 4:] = padded[2, 6:] = 0  # padding: never read
    together = model.generate(padded, 12, temperature=0, prompt_lengths=torch.tensor(lengths))
    for row, length in enumerate(lengths):
        alone = model.generate(padded[row:row + 1, :length], 12, temperature=0)
        assert torch.equal(together[row, :length + 12], alone[0])


def test_sampling_draws_from_the_tempered_softmax_among_the_top_k():
    model = small_model("standard")
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    with torch.no_grad():  # ln_f puts out ones whatever it reads: the head's first column is the logits
        model.lm_head.weight.zero_()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[:5, 0] = logits
        model.lm_head.weight[5:, 0] = -1e9
    prompt = torch.zeros(20_000, 1, dtype=torch.long)

    def frequencies(**options):
        picks = model.generate(prompt, 1, generator=torch.Generator().manual_seed(0), **options)[:, 1]
        return torch.bincount(picks, minlength=30)[:5].double() / len(picks)

    weights = torch.exp(logits / 2)  # softmax(l / T) by hand; the top 3 renormalised alone
    torch.testing.assert_close(frequencies(temperature=2.0), weights / weights.sum(), atol=0.015, rtol=0)
    top3 = torch.cat([torch.zeros(2, dtype=torch.double), weights[2:] / weights[2:].sum()])
    torch.testing.assert_close(frequencies(temperature=2.0, top_k=3), top3, atol=0.015, rtol=0)


@pytest.mark.parametrize("options", [dict(attn="standard,dilated,chacal"),
                                     dict(attn="lego_v1", causal=False, broadcast_ids=(0,))])
def test_weight_decay_reaches_the_mixing_weights_only(options):
    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=3, n_embd=16, n_head=2, **options))
    groups = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95)).param_groups
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    decayed, kept = (set(map(id, group["params"])) for group in groups)
    mixing = {id(m.weight) for m in model.modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d))}
    assert decayed == mixing and kept == {id(p) for p in model.parameters()} - mixing


BF16 = ["standard", "chacal", "chacal_diagonal", "dilated", "lego_v0", "lego_v1", "standard,chacal"]


def bf16_step_and_decoding(attn, device):
    """A training step and decoding under bf16 autocast on `device`, against float32."""
    options = dict(causal=False, broadcast_ids=(0,)) if attn.startswith("lego") else {}
    model = small_model(attn, weight_init="xavier", **options).float().to(device).train()
    x = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    exact, _ = model(x)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits, loss = model(x, x)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (logits.float() - exact).abs().max() < 0.08  # Xavier's logits reach ~2; bf16 errs ~0.01
    if "cache" in model.config.abilities():  # bf16 rounding keeps cached decoding near the full pass
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            full, cached = model(x)[0], decoded_with_cache(model, x, [4] + list(range(5, 25)))
        difference = (cached.float() - full.float()).abs()
        assert difference.max() < 0.08 and difference.mean() < 0.005


@pytest.mark.parametrize("attn", BF16)
def test_a_training_step_and_decoding_under_bf16_autocast(attn):
    bf16_step_and_decoding(attn, "cpu")  # tests/test_cuda.py: on a GPU


def test_loss_ignores_targets_of_minus_one():
    model = small_model("chacal")
    idx, targets = torch.randint(0, 30, (2, 12)), torch.randint(0, 30, (2, 12))
    targets[:, :5] = -1
    logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, 30),
                                                                       targets[:, 5:].reshape(-1)))


def test_paper_sizes_match_table_1():
    # ChaCAL paper, Table 1: 3.3M, 6.4M, 9.6M, 12.7M, 15.9M for 1..5 layers at d = 512.
    for n_layer, millions in zip(range(1, 6), [3.3, 6.4, 9.6, 12.7, 15.9]):
        model = GPT(GPTConfig(n_layer=n_layer, n_embd=512, n_head=8, attn="standard"))
        assert round(model.num_params() / 1e6, 1) == millions
    assert GPT(GPTConfig(n_layer=1, n_embd=512, n_head=8, attn="chacal")).num_params() == 3_284_480


@pytest.mark.parametrize("length, chunk, levels", [(1, 2, 1), (2, 2, 1), (3, 2, 2), (40, 2, 6), (500, 2, 9),
                                                   (81, 3, 4), (82, 3, 5), (4096, 64, 2)])
def test_adaptive_depth_is_the_smallest_power_covering_the_length(length, chunk, levels):
    assert adaptive_levels(length, chunk) == levels


def blocks_run(model, length):
    """The block calls of one forward pass, in order (a shared block once per use)."""
    ran = []
    hooks = [block.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, block in enumerate(model.transformer.h)]
    model(torch.zeros(1, length, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    return ran


def test_shared_blocks_take_turns_are_told_their_depth_and_add_no_weights():
    model = small_model("dilated", share_weights=True, thickness=2, n_layer=5)
    assert len(model.transformer.h) == 2 and blocks_run(model, 8) == [0, 1, 0, 1, 0]
    depths = []  # dilation follows the depth a block runs at, not its index among the blocks
    model.transformer.h[0].attn.register_forward_pre_hook(lambda module, args, kwargs: depths.append(
        inspect.signature(module.forward).bind(*args, **kwargs).arguments["depth"]), with_kwargs=True)
    model(torch.zeros(1, 8, dtype=torch.long))
    assert depths == [0, 2, 4]
    sizes = {small_model("standard", share_weights=True, n_layer=n).num_params() for n in (1, 4, 12)}
    assert len(sizes) == 1 and small_model("standard", n_layer=4).num_params() > sizes.pop()


def test_adaptive_depth_follows_each_batch_and_runs_past_block_size_without_positions():
    model = small_model("dilated", share_weights=True, adaptive_depth=True, thickness=2, pos="none", chunk=2, n_layer=1)
    assert [len(blocks_run(model, T)) for T in (1, 2, 3, 40, 100)] == [2, 2, 4, 12, 14]  # block_size 40
    assert not any("wpe" in name for name, _ in model.named_parameters())


def test_stochastic_depth_and_dropout_act_in_training_only():
    model = small_model("standard", share_weights=True, n_layer=6, min_train_layers=3, dropout=0.5)
    x = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    assert {len(blocks_run(model, 5)) for _ in range(10)} == {6} and torch.equal(model(x)[0], model(x)[0])
    model.train()
    torch.manual_seed(0)
    assert {len(blocks_run(model, 5)) for _ in range(60)} == {3, 4, 5, 6}
    assert not torch.equal(model(x)[0], model(x)[0])


def test_generate_decodes_in_eval_mode_and_restores_the_mode():
    model = small_model("standard", dropout=0.5, share_weights=True, n_layer=4, min_train_layers=1)
    prompt = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(4))
    in_eval = model.generate(prompt, 10, temperature=0)
    model.train()
    assert torch.equal(model.generate(prompt, 10, temperature=0), in_eval) and model.training


@pytest.mark.parametrize("attn, options, cache", [
    ("standard", {}, True), ("standard,chacal", {}, True), ("standard", dict(causal=False), False),
    ("dilated", dict(share_weights=True, adaptive_depth=True, pos="none", n_layer=1), False),
    ("standard,lego_v0", {}, False)])
def test_abilities_say_which_models_decode_with_a_cache(attn, options, cache):
    model = small_model(attn, **options)
    assert ("cache" in model.config.abilities()) == cache
    assert ("causal" in model.config.abilities()) == options.get("causal", True)
    if cache or "causal" in model.config.abilities():  # without a cache, by recomputing the prefix
        assert model.generate(torch.zeros(1, 4, dtype=torch.long), 2, use_cache=False).shape == (1, 6)


def test_gpt2_init_and_xavier_init():
    torch.manual_seed(0)
    config = dict(vocab_size=50, block_size=64, n_layer=12, n_head=4, n_embd=64)
    gpt2, xavier = GPT(GPTConfig(**config)), GPT(GPTConfig(**config, weight_init="xavier"))
    for block in gpt2.transformer.h:  # GPT-2: N(0, 0.02), residual projections / √(2 · n_layer)
        for projection in (block.attn.c_proj, block.mlp.c_proj):
            assert projection.weight.std().item() == pytest.approx(0.02 / 24 ** 0.5, rel=0.05)
    assert gpt2.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied; Xavier's head is its own
    assert xavier.num_params() == gpt2.num_params() + 50 * 64
    assert xavier.transformer.wte.weight.std().item() == pytest.approx(1.0, rel=0.1)  # N(0, 1)
    fc = xavier.transformer.h[0].mlp.c_fc.weight  # U(±√(6 / (fan_in + fan_out)))
    assert fc.abs().max().item() <= (6 / sum(fc.shape)) ** 0.5


def test_without_transformers_from_pretrained_fails_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now fails
    with pytest.raises((ImportError, ValueError), match=r"^[^\n]*transformers[^\n]*$"):
        GPT.from_pretrained("gpt2")
