"""GPT.from_pretrained against transformers' own GPT-2, on a tiny random one built here (no
download): the same logits with standard attention and with ChaCAL at γ = 0."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="GPT.from_pretrained is optional: pip install transformers")

import train  # noqa: E402
from model import GPT  # noqa: E402

VOCAB = 100


@pytest.fixture(scope="module")
def gpt2():
    """A random GPT-2 of 2 layers, 2 heads, width 32, its weights perturbed off their initial
    values (LayerNorms at (1, 0), biases at 0), so that a weight loaded wrongly shows."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=VOCAB,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))


def difference(model, gpt2, ids):
    with torch.no_grad():
        return (model.eval()(ids)[0] - gpt2(ids).logits).abs().max()


def test_loaded_gpt2_and_chacal_at_gamma_0_give_the_same_logits(gpt2, ids):
    assert difference(GPT.from_pretrained(gpt2), gpt2, ids) < 1e-5
    chacal = GPT.from_pretrained(gpt2, attn="chacal", gamma=0.0)
    assert type(chacal.transformer.h[0].attn).__name__ == "ChaCALAttention"
    assert difference(chacal, gpt2, ids) < 1e-5
    assert difference(GPT.from_pretrained(gpt2, attn="chacal", gamma=0.9), gpt2, ids) > 1e-2


def test_a_loaded_model_decodes_the_same_with_and_without_the_cache(gpt2):
    for attn in ["standard", "chacal"]:
        model = GPT.from_pretrained(gpt2, attn=attn).eval()
        prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
        assert torch.equal(model.generate(prompt, 20, temperature=0),
                           model.generate(prompt, 20, temperature=0, use_cache=False))


@pytest.mark.parametrize("override", [dict(n_embd=64), dict(attn="dilated")])
def test_an_override_that_changes_the_weights_fails_in_one_line(gpt2, override):
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        GPT.from_pretrained(gpt2, **override)


def test_init_from_a_gpt2_directory_swaps_chacal_in(tmp_path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32)
                                 ).save_pretrained(tmp_path / "gpt2-tiny")
    np.random.default_rng(0).integers(0, 50257, 2000).astype(np.uint16).tofile(tmp_path / "t.bin")
    flags = ["--task", "text", "--data", str(tmp_path / "t.bin"), "--context", "16", "--batch_size", "4",
             "--eval_samples", "8", "--max_iters", "1", "--eval_interval", "1", "--no-progress", "--device", "cpu",
             "--init_from", str(tmp_path / "gpt2-tiny")]
    loss = lambda *typed: train.main(flags + list(typed))["final"]["train_loss"]
    standard = loss("--attn", "standard", "--out_dir", str(tmp_path / "s"))
    chacal = loss("--attn", "chacal", "--gamma", "0", "--out_dir", str(tmp_path / "c"))
    assert chacal == pytest.approx(standard, abs=1e-5)
