"""The same references on a CUDA GPU, where the default path differs from the CPU's (no blocked
ChaCAL unless asked for, bf16 autocast, tensors that must all live on the device). Skipped on a
machine without one: CI has none, so run `python -m pytest tests/test_cuda.py` on a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import attention
import train
from attention import chacal_attention
from conftest import ROOT
from model import generate_inductive
from test_attention import explicit_chacal, random_qkv
from test_model import (ATTENTION_STACKS, BF16_ATTENTIONS, bf16_step_and_decoding,
                        decoded_with_cache, small_model)
from test_scratchpad import ATTENTIONS as GROUP_ATTENTIONS, SEP, START, sep_friendly
from test_scratchpad import small_model as small_group_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocked_from", [None, 8])  # 8: the blocked path, as a "cuda" entry would
def test_chacal_on_the_gpu_equals_the_explicit_inverse(causal, blocked_from, monkeypatch):
    if blocked_from:
        monkeypatch.setitem(attention.CHACAL_BLOCKED_FROM, "cuda", blocked_from)
    q, k, v = random_qkv(T=40)
    if causal:
        expected = explicit_chacal(q, k, v, 0.9)
    else:
        A = torch.softmax(q @ k.transpose(-2, -1) / q.size(-1) ** 0.5, dim=-1)
        off_diagonal = A - torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
        expected = torch.linalg.inv(torch.eye(40, dtype=A.dtype) - 0.9 * off_diagonal) @ (0.1 * A @ v)
    y = chacal_attention(*(x.cuda() for x in (q, k, v)), 0.9, causal=causal)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attn", ATTENTION_STACKS)
def test_cached_decoding_on_the_gpu_equals_full_forward_and_the_cpu(attn):
    model = small_model(attn)
    idx = torch.randint(0, 30, (3, 25), generator=torch.Generator().manual_seed(1))
    on_cpu, _ = model(idx)
    model, idx = model.cuda(), idx.cuda()
    full, _ = model(idx)
    torch.testing.assert_close(decoded_with_cache(model, idx, 10), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full.cpu(), on_cpu, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", GROUP_ATTENTIONS)
def test_cached_inductive_generation_on_the_gpu_equals_uncached(attn):
    model = sep_friendly(small_group_model(attn)).cuda()
    prompts = torch.randint(0, START, (4, 7), generator=torch.Generator().manual_seed(1))
    prompts[:, -1] = START
    prompts[1, 3:] = torch.tensor([START, 2, SEP, 4])
    results = [generate_inductive(model, prompts.cuda(), 30, START, SEP, temperature=1.0,
                                  use_cache=use_cache, return_logits=True,
                                  generator=torch.Generator("cuda").manual_seed(5))
               for use_cache in (True, False)]
    (cached, cached_logits), (plain, plain_logits) = results
    assert torch.equal(cached, plain) and (cached[:, 7:] == SEP).sum() >= 8
    torch.testing.assert_close(cached_logits, plain_logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", BF16_ATTENTIONS)
def test_a_bf16_training_step_and_decoding_on_the_gpu(attn):
    bf16_step_and_decoding(attn, "cuda")


TINY = ["--n_embd", "32", "--n_head", "2", "--batch_size", "8", "--max_iters", "4",
        "--eval_interval", "2", "--eval_samples", "16", "--no-progress", "--device", "cuda"]


@pytest.mark.parametrize("flags", [
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4"],
    ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--attn", "standard",
     "--n_layer", "2", "--share_weights"],
    ["--task", "boxes", "--n_train", "64", "--n_test", "16", "--attn", "standard,chacal", "--n_layer", "2"],
    ["--task", "parity", "--attn", "dilated", "--share_weights", "--pos", "none",
     "--max_train_length", "6", "--max_test_length", "9", "--length_samples", "4"],
    ["--task", "lego", "--n_vars", "4", "--bidirectional", "--attn", "lego_v1"],
    ["--task", "cycles", "--scratchpad", "inductive", "--cycle_n", "3"],
    ["--task", "text", "--data", os.path.join(ROOT, "README.md"), "--context", "16"],
])
def test_every_task_trains_resumes_and_samples_on_the_gpu(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes data cache goes to ./data_cache
    summary = train.main(flags + TINY + ["--out_dir", "run"])
    assert summary["device"] == "cuda" and summary["dtype"] == "bfloat16"
    assert all(0 <= v <= 1 for k, v in summary["final"].items() if k.startswith("eval_") and
               k.endswith("acc"))
    resumed = train.main(["--resume", "--max_iters", "6", "--no-progress", "--out_dir", "run"])
    assert resumed["final"]["step"] == 6
    result = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--out_dir", "run"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
