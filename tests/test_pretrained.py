"""GPT.from_pretrained against transformers' own GPT-2, on a tiny random one built here (no
download): the same logits, with standard attention and with ChaCAL at γ = 0."""

import types

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="GPT.from_pretrained is optional: pip install transformers")

import data  # noqa: E402
from model import GPT, from_hub  # noqa: E402  (after the skip: model.py itself does not need transformers)

VOCAB = 100


@pytest.fixture(scope="module")
def gpt2():
    """A random GPT-2 of 2 layers, 2 heads, width 32, in eval mode (its dropout off)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64,
                                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():  # GPT-2 starts its LayerNorms at (1, 0) and biases at 0: perturb
        for p in model.parameters():  # them, so that a weight loaded wrongly shows in the logits
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))


def their_logits(gpt2, ids):
    with torch.no_grad():
        return gpt2(ids).logits


def our_logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids)[0]


def test_loaded_gpt2_gives_the_same_logits(gpt2, ids):
    model = GPT.from_pretrained(gpt2)
    assert model.config.attn == "standard" and model.config.gelu_approximate == "tanh"
    assert (our_logits(model, ids) - their_logits(gpt2, ids)).abs().max() < 1e-5
    assert model.config.dropout == 0  # fine-tuning adds no dropout unless asked
    assert GPT.from_pretrained(gpt2, dropout=0.1).config.dropout == 0.1


def test_chacal_at_gamma_0_gives_the_same_logits(gpt2, ids):
    model = GPT.from_pretrained(gpt2, attn="chacal", gamma=0.0)
    assert type(model.transformer.h[0].attn).__name__ == "ChaCALAttention"
    assert (our_logits(model, ids) - their_logits(gpt2, ids)).abs().max() < 1e-5


def test_chacal_at_gamma_09_changes_the_logits(gpt2, ids):
    logits = our_logits(GPT.from_pretrained(gpt2, attn="chacal", gamma=0.9), ids)
    assert torch.isfinite(logits).all()
    assert (logits - their_logits(gpt2, ids)).abs().max() > 1e-2


def test_exact_gelu_would_not_match(gpt2, ids):
    # Why gelu_approximate exists: GPT-2 was trained with GELU's tanh approximation.
    model = GPT.from_pretrained(gpt2, gelu_approximate="none")
    assert (our_logits(model, ids) - their_logits(gpt2, ids)).abs().max() > 1e-5


@pytest.mark.parametrize("override, named", [
    (dict(n_embd=64), "n_embd=64"),
    (dict(block_size=128), "block_size=128"),
    (dict(n_head=4), "n_head=4"),
    (dict(attn="dilated"),  # the first weight (sorted) found in one model only is named
     "attn='dilated' changes the weights (transformer.h.0.attn.offset_bias is in one model only)"),
    (dict(attn="lego_v1"), "attn='lego_v1'"),
    (dict(depth=3), "depth=3"),
])
def test_an_override_that_changes_the_weights_fails_in_one_line(gpt2, override, named):
    with pytest.raises(ValueError) as error:
        GPT.from_pretrained(gpt2, **override)
    message = str(error.value)
    assert named in message and "\n" not in message


def test_loaded_model_decodes_the_same_with_and_without_cache(gpt2):
    for attn in ["standard", "chacal"]:
        model = GPT.from_pretrained(gpt2, attn=attn).eval()
        prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
        cached = model.generate(prompt, 20, temperature=0)
        uncached = model.generate(prompt, 20, temperature=0, use_cache=False)
        assert torch.equal(cached, uncached)


def test_a_gpt2_our_gpt_cannot_build_fails_in_one_line():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=16,
                                     vocab_size=VOCAB, layer_norm_epsilon=1e-6,
                                     bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=r"^[^\n]*layer_norm_epsilon=1e-06[^\n]*$"):
        GPT.from_pretrained(transformers.GPT2LMHeadModel(config))


def offline_and_not_cached(monkeypatch, loader):
    """loader.from_pretrained finds nothing in transformers' cache, and the hub cannot be reached.
    Returns the list that collects each try's local_files_only."""
    tries = []

    def from_pretrained(name, local_files_only=False):
        tries.append(local_files_only)
        raise OSError(f"{name} not found")  # transformers' answer when the cache lacks it

    def unreachable(address, timeout):
        raise OSError("Name or service not known")

    monkeypatch.setattr(loader, "from_pretrained", from_pretrained)
    monkeypatch.setattr("socket.create_connection", unreachable)
    return tries


def test_a_name_offline_and_not_cached_fails_at_once(monkeypatch):
    tries = offline_and_not_cached(monkeypatch, transformers.GPT2LMHeadModel)
    with pytest.raises(OSError, match=r"^gpt2 is not in transformers' cache and \S+ cannot be reached"):
        GPT.from_pretrained("gpt2")
    assert tries == [True]  # the download, which retries for half a minute, was never tried


@pytest.mark.parametrize("endpoint, address", [
    ("https://huggingface.co", ("huggingface.co", 443)), ("http://mirror.lan", ("mirror.lan", 80)),
    ("http://mirror.lan:8080", ("mirror.lan", 8080))])
def test_the_hub_is_probed_at_its_own_port(endpoint, address, monkeypatch):
    # HF_ENDPOINT may name a plain-http mirror: its default port is 80, not https' 443.
    from huggingface_hub import constants
    probed = []

    def not_cached(name, local_files_only=False):
        if local_files_only:
            raise OSError(f"{name} not found")
        return "downloaded"

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr("socket.create_connection", lambda where, timeout: probed.append(where)
                        or types.SimpleNamespace(close=lambda: None))
    assert from_hub(types.SimpleNamespace(from_pretrained=not_cached), "gpt2") == "downloaded"
    assert probed == [address]


def test_gpt2_tokenizer_offline_and_not_cached_fails_at_once_saying_why(monkeypatch):
    tries = offline_and_not_cached(monkeypatch, transformers.AutoTokenizer)
    with pytest.raises(ValueError, match=r"GPT-2's tokenizer .*: gpt2 is not in transformers' cache "
                                         r"and \S+ cannot be reached"):
        data.gpt2_tokenizer()
    assert tries == [True]


def test_a_cached_name_is_read_without_the_network(monkeypatch):
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=VOCAB)
    built, tries = transformers.GPT2LMHeadModel(config), []

    def from_pretrained(name, local_files_only=False):
        tries.append(local_files_only)
        return built

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", from_pretrained)
    assert GPT.from_pretrained("gpt2").config.n_embd == 32 and tries == [True]
