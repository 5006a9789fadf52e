"""The same references on a CUDA GPU, where the default path differs from the CPU's (bf16
autocast, tensors that must all live on the device). Skipped without one: CI has none, so run
`python -m pytest tests/test_cuda.py` on a GPU."""

import os

import pytest
import torch

import train
from attention import blocked_chacal_attention, chacal_attention
from conftest import ROOT, command
from data import generate_inductive
from test_attention import explicit_chacal, random_qkv
from test_model import BF16, STACKS, bf16_step_and_decoding, decoded_with_cache, small_model
from test_scratchpad import ATTENTIONS as GROUP_ATTENTIONS, SEP, START
from test_scratchpad import small_model as small_group_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("causal, blocked", [(True, False), (False, False), (True, True)])
def test_chacal_on_the_gpu_equals_the_explicit_inverse(causal, blocked):
    q, k, v = random_qkv(T=40)
    on_gpu = [x.cuda() for x in (q, k, v)]
    y = (blocked_chacal_attention(*on_gpu, 0.9, rows_per_block=8) if blocked
         else chacal_attention(*on_gpu, 0.9, causal=causal))
    torch.testing.assert_close(y.cpu(), explicit_chacal(q, k, v, 0.9, causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attn", STACKS)
def test_cached_decoding_on_the_gpu_equals_full_forward_and_the_cpu(attn):
    model = small_model(attn)
    idx = torch.randint(0, 30, (3, 25), generator=torch.Generator().manual_seed(1))
    on_cpu, _ = model(idx)
    model, idx = model.cuda(), idx.cuda()
    full, _ = model(idx)
    torch.testing.assert_close(decoded_with_cache(model, idx, [10] + list(range(11, 26))), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full.cpu(), on_cpu, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", GROUP_ATTENTIONS)
def test_cached_inductive_generation_on_the_gpu_equals_uncached_and_the_cpu(attn):
    model = small_group_model(attn)
    prompts = torch.randint(0, START, (4, 7), generator=torch.Generator().manual_seed(1))
    prompts[:, -1] = START
    prompts[1, 3:] = torch.tensor([START, 2, SEP, 4])
    on_cpu = generate_inductive(model, prompts, 30, START, SEP)
    model, prompts = model.cuda(), prompts.cuda()
    cached, plain = (generate_inductive(model, prompts, 30, START, SEP, use_cache=use_cache)
                     for use_cache in (True, False))
    assert torch.equal(cached, plain) and torch.equal(cached.cpu(), on_cpu) and (on_cpu[:, 7:] == SEP).sum() >= 8


@pytest.mark.parametrize("attn", BF16)
def test_a_bf16_training_step_and_decoding_on_the_gpu(attn):
    bf16_step_and_decoding(attn, "cuda")


TINY = ["--n_embd", "32", "--n_head", "2", "--batch_size", "8", "--max_iters", "4", "--eval_interval", "2",
        "--eval_samples", "16", "--no-progress", "--device", "cuda"]


@pytest.mark.parametrize("flags", [
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4"],
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--attn", "standard", "--n_layer", "2", "--share_weights"],
    ["--task", "boxes", "--n_train", "64", "--n_test", "16", "--attn", "standard,chacal", "--n_layer", "2"],
    ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none", "--max_train_length", "6",
     "--max_test_length", "9", "--length_samples", "4"],
    ["--task", "lego", "--n_vars", "4", "--bidirectional", "--attn", "lego_v1"],
    ["--task", "cycles", "--scratchpad", "inductive", "--cycle_n", "3"],
    ["--task", "text", "--data", os.path.join(ROOT, "README.md"), "--context", "16"],
])
def test_every_task_trains_resumes_and_samples_on_the_gpu(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes data cache goes to ./data_cache
    summary = train.main(flags + TINY + ["--out_dir", "run"])
    assert summary["device"] == "cuda" and summary["dtype"] == "bfloat16"
    assert train.main(["--resume", "--max_iters", "6", "--no-progress", "--out_dir", "run"])["final"]["step"] == 6
    code, _, err = command("sample.py", "--out_dir", "run")
    assert code == 0, err
