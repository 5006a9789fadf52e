"""The text task (language modelling on a file, bytes or GPT-2 tokens), and train.py's
--init_from, which starts a run from trained weights (ours, or a GPT-2's) with ChaCAL swapped in."""

import math
import random
import time
import types

import numpy as np
import pytest
import torch

import data
import sample
import train
from conftest import assert_tokens_per_second_possible
from data import Text, get_task, python_docs_corpus
from model import GPT, GPTConfig

TINY = ["--task", "text", "--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--context", "16",
        "--batch_size", "8", "--eval_samples", "16", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 20,000-byte text of random words: every 16-byte window occurs once, so solve() can find it."""
    rng = random.Random(0)
    words = ["tom", "cat", "sat", "on", "the", "mat", "and", "a", "box", "moved", "key", "in"]
    text = " ".join(rng.choice(words) + rng.choice(["", "", ",", "."]) for _ in range(5000))
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_bytes(text.encode()[:20_000])
    return path


def test_the_default_corpus_is_the_same_bytes_every_time(tmp_path, capsys):
    first = open(python_docs_corpus(tmp_path / "a"), "rb").read()
    second = open(python_docs_corpus(tmp_path / "b"), "rb").read()
    assert first == second and len(first) > 500_000
    assert "help topics" in capsys.readouterr().out
    python_docs_corpus(tmp_path / "a")  # cached: not built again
    assert capsys.readouterr().out == ""
    hashes = []
    for cache in ("a", "b"):
        task = Text(cache_dir=tmp_path / cache)
        hashes.append(capsys.readouterr().out.split("sha256 ")[1].split(";")[0])
    assert hashes[0] == hashes[1] and len(hashes[0]) == 16
    assert task.vocab_size == 256 and task.block_size == 128
    assert len(first.decode("utf-8")) > 0.99 * len(first)  # English, nearly all ASCII


def test_the_last_tenth_is_validation_and_windows_stay_on_their_side(corpus):
    task = get_task("text", data=str(corpus), context=16)
    assert len(task.ids) == 20_000 and task.split_at == 18_000
    text = corpus.read_bytes()
    # find() gives -1 for a window that is not in the text
    for split, inside in (("train", lambda at: 0 <= at and at + 17 <= 18_000),
                          ("test", lambda at: at >= 18_000)):
        x, _ = task.sample(64, torch.Generator().manual_seed(0), split=split)
        assert all(inside(text.find(bytes(row))) for row in x.tolist())
    starts = [text.find(bytes(x[0].tolist())) for x, _ in task.evaluation_batches(300, 32, None)]
    assert starts == [18_000 + 16 * 32 * k for k in range(4)]  # consecutive windows, 124 of them
    assert sum(len(x) for x, _ in task.evaluation_batches(300, 32, None)) == (2000 - 1) // 16  # each needs 17
    assert sum(len(x) for x, _ in task.evaluation_batches(100, 32, None)) == 100  # as many as asked


def test_the_last_training_window_ends_just_before_validation(corpus, monkeypatch):
    task = get_task("text", data=str(corpus), context=16)
    last = lambda low, high, size, generator=None: torch.full(size, high - 1)  # the latest start
    monkeypatch.setattr(torch, "randint", last)
    for split, end in (("train", 18_000), ("test", 20_000)):
        x, y = task.sample(1, split=split)
        assert torch.equal(y[0], torch.from_numpy(task.ids[end - 16:end].astype("int64")))


def test_labels_are_the_next_bytes_against_the_brute_force_solver(corpus):
    task = get_task("text", data=str(corpus), context=16)
    x, y = task.sample(32, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (32, 16) and torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, task.solve(x))  # every position scored, the last one included
    assert (task.chain_depth(x) == 0).all()
    with pytest.raises(ValueError, match="row 0 of x does not occur"):
        task.solve(torch.full((1, 16), 255))  # not ASCII: in no window of the corpus


def test_the_worked_example_of_the_docstring(tmp_path):
    path = tmp_path / "tom.txt"
    path.write_text("Tom's cat sat." * 10)
    task = get_task("text", data=str(path), context=8)
    x, y = task.windows([0])
    assert x.tolist() == [[84, 111, 109, 39, 115, 32, 99, 97]]
    assert y.tolist() == [[111, 109, 39, 115, 32, 99, 97, 116]]
    assert task.decode(x[0]) == "Tom's ca" and task.decode([0xE2, 0x9C]) == "\ufffd"
    assert torch.equal(task.solve(x), y)  # a window at the very start of the file is found


def test_gpt2_token_files_are_read_as_uint16(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    task = get_task("text", data=str(tmp_path / "tokens.bin"), context=32)
    assert task.vocab_size == 50257 and len(task.ids) == 3000
    x, y = task.sample(8, torch.Generator().manual_seed(0))
    assert x.max() < 50257 and torch.equal(y, task.solve(x))
    with pytest.raises(ValueError, match="does not occur"):  # two-byte tokens: the search ends too
        task.solve(torch.zeros(1, 32, dtype=torch.long))
    # The bytes of tokens (A, B) = (0x0201, 0x0403) first occur straddling three other tokens
    # (09 01 | 02 03 | 04 0A, little-endian); only the aligned (A, B) is followed by C = 0x0505.
    straddled = np.array([0x0109, 0x0302, 0x0A04, 0x0201, 0x0403, 0x0505] + [7] * 200, dtype=np.uint16)
    straddled.tofile(tmp_path / "straddled.bin")
    task = get_task("text", data=str(tmp_path / "straddled.bin"), context=2)
    assert task.solve(torch.tensor([[0x0201, 0x0403]])).tolist() == [[0x0403, 0x0505]]


def test_a_bin_file_that_is_not_gpt2_token_ids_is_refused_naming_data(tmp_path):
    np.full(3000, 60000, dtype=np.uint16).tofile(tmp_path / "bytes.bin")  # ids past 50,256
    with pytest.raises(ValueError, match="--data .*not GPT-2 token ids"):
        get_task("text", data=str(tmp_path / "bytes.bin"), context=32)
    with pytest.raises(ValueError, match="--data .*a directory; name a file in it"):
        get_task("text", data=str(tmp_path), context=32)
    (tmp_path / "odd.bin").write_bytes(bytes(3001))
    with pytest.raises(ValueError, match="--data .*odd number of bytes"):
        get_task("text", data=str(tmp_path / "odd.bin"), context=32)
    ids = np.full(3000, 50256, dtype=np.uint16)  # GPT-2's last id, <|endoftext|>: accepted
    ids.tofile(tmp_path / "gpt2.bin")
    assert get_task("text", data=str(tmp_path / "gpt2.bin"), context=32).vocab_size == 50257
    ids[-1] = 50257  # one past it
    ids.tofile(tmp_path / "one_past.bin")
    with pytest.raises(ValueError, match="--data .*not GPT-2 token ids"):
        get_task("text", data=str(tmp_path / "one_past.bin"), context=32)
    ids = np.zeros((1 << 20) + 16, dtype=np.uint16)  # past the first million checked, the end is
    ids[-1] = 60000
    ids.tofile(tmp_path / "bad_end.bin")
    with pytest.raises(ValueError, match="--data .*not GPT-2 token ids"):
        get_task("text", data=str(tmp_path / "bad_end.bin"), context=32)


def test_perplexity_is_exp_of_the_validation_loss(corpus):
    task = get_task("text", data=str(corpus), context=16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16))
    metrics = task.evaluate(model, 64, 16, torch.Generator())
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert 200 < metrics["eval_perplexity"] < 330  # an untrained model: near 256, uniform
    assert metrics == task.evaluate(model, 64, 16, torch.Generator().manual_seed(5))  # fixed windows
    # A diverging run's loss past 709 overflows math.exp: its perplexity is infinite, not an error.
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    metrics = task.evaluate(model, 64, 16, torch.Generator())
    assert metrics["eval_loss"] > 709 and metrics["eval_perplexity"] == math.inf


@pytest.mark.parametrize("flags, named", [
    (["--data", "no/such/file.txt"], "--data"),
    (["--data", "EMPTY"], "--data"),
    (["--data", "SHORT"], "--context"),
    (["--context", "0"], "--context"),
    (["--task", "toy", "--data", "SHORT"], "--data"),
    (["--data", "WORDS", "--init_from", "EMPTYDIR"], "--init_from"),  # no ckpt.pt, nor a GPT-2
])
def test_bad_input_fails_at_start_with_one_line_naming_the_flag(flags, named, corpus, tmp_path,
                                                                capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_text("ten bytes!" * 10)  # validation: 10 bytes < context + 1
    (tmp_path / "nothing").mkdir()
    names = {"EMPTY": str(tmp_path / "empty.txt"), "SHORT": str(tmp_path / "short.txt"),
             "EMPTYDIR": str(tmp_path / "nothing"), "WORDS": str(corpus)}
    flags = [names.get(flag, flag) for flag in flags]
    with pytest.raises(SystemExit):
        train.main(TINY + flags + ["--out_dir", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and named in error[0], error


def test_a_tiny_run_writes_the_same_text_with_and_without_the_cache(corpus, tmp_path, capsys):
    summary = train.main(TINY + ["--data", str(corpus), "--max_iters", "30", "--lr", "3e-3",
                                 "--out_dir", str(tmp_path)])
    final = summary["final"]
    assert final["eval_perplexity"] == pytest.approx(math.exp(final["eval_loss"]))
    assert final["eval_loss"] < math.log(256)  # it learned something of the words
    capsys.readouterr()
    texts = []
    for extra in ([], ["--no-cache"]):
        started = time.perf_counter()
        sample.main(["--out_dir", str(tmp_path), "--prompt", "the cat", "--device", "cpu"] + extra)
        out = capsys.readouterr().out
        assert_tokens_per_second_possible(out, time.perf_counter() - started)
        assert "--- prompt (7 tokens) ---\nthe cat\n--- continuation (9 tokens) ---" in out
        assert "\n9 tokens written after the prompt" in out
        texts.append(out.split("--- continuation (9 tokens) ---\n")[1].splitlines()[0])
    assert texts[0] == texts[1]
    sample.main(["--out_dir", str(tmp_path), "--device", "cpu"])  # a validation window's start
    assert "--- prompt (4 tokens) ---" in capsys.readouterr().out
    sample.main(["--out_dir", str(tmp_path), "--prompt", "x" * 15, "--device", "cpu"])  # room: 1
    assert "\n1 token written after the prompt" in capsys.readouterr().out
    for prompt, why in (("x" * 16, "16 tokens leave no room"), ("x" * 20, "learned positions")):
        with pytest.raises(SystemExit):  # one line naming the flag typed, before any output
            sample.main(["--out_dir", str(tmp_path), "--prompt", prompt, "--device", "cpu"])
        out, err = capsys.readouterr()
        assert "step 30:" not in out and len(err.splitlines()) == 1  # no header before it
        assert "--prompt" in err and why in err and err.strip().endswith("; shorten it"), err
        assert "--pos none" not in err  # a model that writes stops at block_size even so


def test_an_empty_prompt_is_refused_naming_the_flag(corpus):
    task = get_task("text", data=str(corpus), context=16)
    with pytest.raises(ValueError, match="^--prompt is empty"):
        task.example(None, prompt="")


def test_describe_shows_the_prompt_its_continuation_and_the_next_token_guesses(corpus):
    task = get_task("text", data=str(corpus), context=16)
    x, _ = task.example(None, prompt="the cat")  # describe() reads the prompt's length from here
    text = task.describe(torch.cat([x[0], task.encode(" sat")]), predictions=task.encode("he cat sat"))
    assert text == ("--- prompt (7 tokens) ---\nthe cat\n--- continuation (4 tokens) ---\n sat\n"
                    "--- the model's next-token guesses ---\nhe cat sat")
    assert task.describe(x[0]) == "--- prompt (7 tokens) ---\nthe cat"  # nothing written yet


def test_describe_before_any_prompt_shows_the_whole_row_as_the_prompt(corpus):
    task = get_task("text", data=str(corpus), context=16)
    x, _ = task.sample(1, torch.Generator().manual_seed(0))
    assert task.describe(x[0]) == f"--- prompt (16 tokens) ---\n{task.decode(x[0])}"


@pytest.mark.parametrize("context, prompt_length", [(16, 4), (9, 2), (3, 1)])
def test_a_drawn_prompt_is_the_first_quarter_of_a_validation_window(corpus, context, prompt_length):
    task = get_task("text", data=str(corpus), context=context)
    x, n = task.example(torch.Generator().manual_seed(0))
    window, _ = task.sample(1, torch.Generator().manual_seed(0), split="test")
    assert x.shape == (1, prompt_length) and n == prompt_length  # at least one token
    assert torch.equal(x[0], window[0, :prompt_length])


def test_sample_says_a_one_token_context_cannot_continue_any_prompt(corpus, tmp_path, capsys):
    train.main(TINY + ["--data", str(corpus), "--context", "1", "--max_iters", "1",
                       "--eval_interval", "1", "--out_dir", str(tmp_path)])
    capsys.readouterr()
    for typed in ([], ["--prompt", "the cat"]):  # no prompt to shorten, and none short enough
        with pytest.raises(SystemExit):
            sample.main(["--out_dir", str(tmp_path), "--device", "cpu"] + typed)
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "shorten" not in err, err
        assert err.strip().endswith("cannot continue any prompt: it reads one token at most"), err
        assert typed or "the run's test example: 1 token leaves no room" in err
    train.main(TINY + ["--data", str(corpus), "--context", "2", "--max_iters", "1",
                       "--eval_interval", "1", "--out_dir", str(tmp_path / "two")])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # two tokens can continue a prompt of one
        sample.main(["--out_dir", str(tmp_path / "two"), "--device", "cpu", "--prompt", "ab"])
    assert capsys.readouterr().err.strip().endswith("2 tokens leave no room to answer within "
                                                     "block_size 2; shorten it")


def test_sample_says_when_the_runs_text_is_gone(corpus, tmp_path, capsys):
    data = tmp_path / "moved.txt"  # --data is the run's flag, not sample.py's: the error says so
    data.write_bytes(corpus.read_bytes())
    train.main(TINY + ["--data", str(data), "--max_iters", "1", "--eval_interval", "1",
                       "--out_dir", str(tmp_path / "run")])
    data.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        sample.main(["--out_dir", str(tmp_path / "run"), "--device", "cpu"])
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and "cannot rebuild its task" in error and "moved.txt" in error


def test_sample_of_gpt2_ids_without_a_tokenizer_fails_before_the_model_runs(tmp_path, capsys,
                                                                            monkeypatch):
    np.random.default_rng(0).integers(0, 50257, 2000).astype(np.uint16).tofile(tmp_path / "t.bin")
    train.main(TINY[:4] + ["--data", str(tmp_path / "t.bin"), "--n_embd", "16", "--n_head", "2",
                           "--context", "8", "--batch_size", "4", "--eval_samples", "8",
                           "--max_iters", "1", "--eval_interval", "1", "--no-progress",
                           "--device", "cpu", "--out_dir", str(tmp_path / "run")])
    def no_tokenizer():
        raise ValueError("text: GPT-2 tokens need GPT-2's tokenizer (offline, say)")
    monkeypatch.setattr(data, "gpt2_tokenizer", no_tokenizer)
    monkeypatch.setattr(GPT, "generate", lambda *args, **kwargs: pytest.fail("the model ran"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        sample.main(["--out_dir", str(tmp_path / "run"), "--device", "cpu"])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "GPT-2's tokenizer" in error[0]


def first_step(argv):
    return train.main(argv + ["--max_iters", "1", "--eval_interval", "1"])["final"]["train_loss"]


def test_init_from_our_run_with_chacal_at_gamma_0_trains_as_standard_attention(corpus, tmp_path):
    flags = TINY + ["--data", str(corpus), "--attn", "standard"]
    train.main(flags + ["--max_iters", "4", "--out_dir", str(tmp_path / "pre")])
    start = ["--init_from", str(tmp_path / "pre"), "--seed", "7"]
    standard = first_step(flags + start + ["--out_dir", str(tmp_path / "standard")])
    chacal = first_step(flags + start + ["--attn", "chacal", "--gamma", "0",
                                         "--out_dir", str(tmp_path / "chacal")])
    fresh = first_step(flags + ["--seed", "7", "--out_dir", str(tmp_path / "fresh")])
    assert chacal == pytest.approx(standard, abs=1e-5) and abs(fresh - standard) > 1e-3
    saved = torch.load(tmp_path / "chacal" / "ckpt.pt", weights_only=True)
    assert saved["config"]["attn"] == "chacal" and saved["step"] == 1
    # It continues as any run does, from its own checkpoint (the run it started from aside).
    resumed = train.main(["--resume", "--max_iters", "2", "--no-progress", "--out_dir",
                          str(tmp_path / "chacal")])
    assert [m["step"] for m in resumed["metrics"]] == [1, 2]


def test_init_from_keeps_the_weights_shape_and_says_nothing_of_the_task_s(corpus, tmp_path, capsys):
    # Text prefers 4 layers (train_defaults); a fine-tune of a 1-layer run has 1, and neither
    # its log nor its saved settings may claim 4.
    untyped = TINY[:2] + TINY[4:]  # TINY without its --n_layer 2
    train.main(untyped + ["--data", str(corpus), "--n_layer", "1", "--max_iters", "1",
                          "--out_dir", str(tmp_path / "pre")])
    capsys.readouterr()
    train.main(untyped + ["--data", str(corpus), "--max_iters", "1", "--init_from",
                          str(tmp_path / "pre"), "--out_dir", str(tmp_path / "tuned")])
    out = capsys.readouterr().out
    assert "sets --n_layer" not in out and "sets --lr 0.001" in out and "1 layer(s)" in out
    saved = torch.load(tmp_path / "tuned" / "ckpt.pt", weights_only=True)
    assert saved["config"]["n_layer"] == 1 and saved["args"]["n_layer"] is None


@pytest.mark.parametrize("flags, named", [
    (["--n_embd", "64"], "n_embd 32"),
    (["--context", "32"], "has positions for 16 tokens (trained with --task text --data"),
    (["--data", "TOKENS"], "has a vocabulary of 256 tokens"),  # GPT-2 tokens, where the model read bytes
    (["--attn", "lego_v0"], "--attn lego_v0"),
])
def test_init_from_a_model_of_another_shape_fails_with_one_line(flags, named, corpus, tmp_path,
                                                                capsys):
    train.main(TINY + ["--data", str(corpus), "--max_iters", "2", "--out_dir", str(tmp_path / "pre")])
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    flags = [str(tmp_path / "tokens.bin") if flag == "TOKENS" else flag for flag in flags]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(TINY + ["--data", str(corpus)] + flags
                   + ["--init_from", str(tmp_path / "pre"), "--out_dir", str(tmp_path / "b")])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and named in error[0] and ("--init_from" in error[0]
                                                      or "--attn" in error[0]), error


def test_init_from_a_gpt2_swaps_chacal_in(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2-tiny")
    np.random.default_rng(0).integers(0, 50257, 2000).astype(np.uint16).tofile(tmp_path / "t.bin")
    flags = TINY[:1] + ["text", "--data", str(tmp_path / "t.bin"), "--context", "16",
                        "--batch_size", "4", "--eval_samples", "8", "--no-progress", "--device",
                        "cpu", "--init_from", str(tmp_path / "gpt2-tiny")]
    standard = first_step(flags + ["--attn", "standard", "--out_dir", str(tmp_path / "s")])
    chacal = first_step(flags + ["--attn", "chacal", "--gamma", "0", "--out_dir", str(tmp_path / "c")])
    assert chacal == pytest.approx(standard, abs=1e-5)
    assert abs(standard - math.log(50257)) < 0.5  # a random GPT-2: about uniform


def test_init_from_a_gpt2_that_cannot_be_loaded_says_why_in_one_line(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def offline(name, local_files_only=False):
        raise OSError(f"We couldn't connect to load {name}.\nCheck your connection.")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", offline)
    reachable = types.SimpleNamespace(close=lambda: None)  # a connected socket, as far as we need
    monkeypatch.setattr("socket.create_connection", lambda address, timeout: reachable)
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(TINY[:1] + ["text", "--data", str(tmp_path / "t.bin"), "--context", "16",
                               "--init_from", "gpt2", "--out_dir", str(tmp_path / "o")])
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["train.py: error: --init_from gpt2: not a run directory, nor a GPT-2 that "
                     "transformers can load (We couldn't connect to load gpt2.)"], error


def test_a_validation_part_of_exactly_context_tokens_is_refused_by_name(tmp_path):
    # A window needs context + 1 tokens (inputs and the next token); 10 validation bytes hold none.
    path = tmp_path / "ten.txt"
    path.write_bytes(b"a" * 100)  # its last tenth: 10 bytes
    with pytest.raises(ValueError, match="--context"):
        get_task("text", data=str(path), context=10)
    task = get_task("text", data=str(path), context=9)  # one window of 9 + 1: it builds
    x, y = task.sample(2, torch.Generator().manual_seed(0), split="test")
    assert x.shape == y.shape == (2, 9)
