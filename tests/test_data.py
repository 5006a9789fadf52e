"""Tasks: labels against a brute-force solver, and the structure each task promises."""

import pytest
import torch

from data import get_task


@pytest.mark.parametrize("options", [{}, dict(n_blocks=4, block_len=2), dict(n_blocks=9, block_len=5)])
def test_toy_labels_equal_the_brute_force_solver(options):
    task = get_task("toy", **options)
    x, y = task.sample(64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, task.block_size)
    assert torch.equal(y, task.solve(x))


def test_toy_worked_example_from_the_docstring():
    task = get_task("toy", n_blocks=4, block_len=2, vocab_size=10)
    x = torch.tensor([[9, 4, 1, 0, 3, 2, 4, 5]])
    assert task.solve(x).tolist() == [[-1, -1, 4, 9, 9, 4, 9, 4]]


def test_toy_blocks_permute_the_previous_block_positions():
    task = get_task("toy")
    x, y = task.sample(32, torch.Generator().manual_seed(1))
    k = task.block_len
    for b in range(1, task.n_blocks):
        pointers = x[:, b * k:(b + 1) * k].sort(dim=1).values
        assert torch.equal(pointers, torch.arange((b - 1) * k, b * k).expand(32, k))
    assert (y[:, :k] == -1).all() and (y[:, k:] >= 0).all()
    assert x.max() < task.vocab_size


def test_toy_chain_depth_is_the_block_number():
    task = get_task("toy")
    x, _ = task.sample(2)
    depth = task.chain_depth(x)
    assert depth.shape == x.shape
    assert depth[0, :8].eq(0).all() and depth[0, 8:16].eq(1).all() and depth[0, -1] == 15


def test_toy_sampling_is_deterministic_given_a_generator():
    task = get_task("toy")
    a = task.sample(4, torch.Generator().manual_seed(5))
    b = task.sample(4, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unknown_task_names_the_flag():
    with pytest.raises(ValueError, match="--task"):
        get_task("chess")


@pytest.mark.parametrize("options, flag", [(dict(n_blocks=1), "--n_blocks"),
                                           (dict(block_len=0), "--block_len")])
def test_toy_sizes_out_of_range_name_their_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        get_task("toy", **options)
