"""
The tasks of nanoChaCAL, each behind the same small interface:

    task = get_task("toy", **options)
    x, y = task.sample(batch_size, generator=None)  # (B, T) LongTensors; y = -1 where not scored
    task.chain_depth(x)                              # (B, T): how many references each label needs
    task.solve(x)                                    # labels by brute force, for the tests
    task.vocab_size, task.block_size                 # what the model must be built for

`generator` is a torch.Generator (on the CPU), so a seeded run sees the same data every time.
"""

import torch


class PointerChains:
    """The toy task of the ChaCAL paper (Section 5.1): follow a chain of pointers to its end.

    A sequence of n_blocks blocks of block_len tokens (16 x 8 = 128 by default). Block 0 holds
    random values in [0, vocab_size). Each later block holds a random permutation of the absolute
    positions of the block before it, so every token points at a distinct token one block back.
    The label of a token in block b is the block-0 value its chain of b pointers ends at; its
    chain depth is b. Block 0 is not scored.

    Worked example with 4 blocks of 2 tokens (positions 0..7, vocabulary 10):

        position   0  1 | 2  3 | 4  5 | 6  7
        x          9  4 | 1  0 | 3  2 | 4  5
        y          -  - | 4  9 | 9  4 | 9  4
        depth      -  - | 1  1 | 2  2 | 3  3

    Position 7 holds 5, so it points at position 5; that holds 2, pointing at position 2; that
    holds 1, pointing at position 1 in block 0, whose value is 4. So y[7] = 4, after 3 hops.

    By Theorem 1 a standard transformer needs ⌈log2(b+1)⌉ layers to resolve depth b, so with 16
    blocks it needs 4 layers; one ChaCAL layer resolves every depth.
    """

    def __init__(self, n_blocks=16, block_len=8, vocab_size=None):
        if n_blocks < 2 or block_len < 1:
            raise ValueError(f"--n_blocks {n_blocks} must be >= 2 and --block_len {block_len} >= 1")
        self.n_blocks, self.block_len = n_blocks, block_len
        self.block_size = n_blocks * block_len
        # Pointers are absolute positions, so the vocabulary must hold every position.
        self.vocab_size = vocab_size or self.block_size
        if self.vocab_size < self.block_size:
            raise ValueError(f"vocab_size {self.vocab_size} cannot hold the {self.block_size} "
                             f"positions that pointers name; leave it unset")

    def sample(self, batch_size, generator=None):
        n, k = self.n_blocks, self.block_len
        values = torch.randint(0, self.vocab_size, (batch_size, k), generator=generator)
        # A uniform random permutation of 0..k-1 per block: argsort of uniform noise.
        perms = torch.rand(batch_size, n - 1, k, generator=generator).argsort(dim=-1)
        previous_block_start = torch.arange(n - 1).view(1, n - 1, 1) * k
        pointers = (previous_block_start + perms).view(batch_size, -1)  # blocks 1..n-1
        x = torch.cat([values, pointers], dim=1)                        # (B, T)

        # Resolve block by block: a token's answer is the answer of the token it points at.
        answer = x.clone()
        for b in range(1, n):
            block = slice(b * k, (b + 1) * k)
            answer[:, block] = answer.gather(1, x[:, block])
        y = answer.clone()
        y[:, :k] = -1
        return x, y

    def chain_depth(self, x):
        depth = torch.arange(self.block_size, device=x.device) // self.block_len
        return depth.expand_as(x)

    def solve(self, x):
        """Follow every pointer by hand, one token at a time: the reference for the labels."""
        y = torch.full_like(x, -1)
        for row, seq in enumerate(x.tolist()):
            for pos in range(self.block_len, self.block_size):
                target = seq[pos]
                while target >= self.block_len:  # still outside block 0: keep following
                    target = seq[target]
                y[row, pos] = seq[target]
        return y

    def validate(self, x):
        """Raise ValueError, saying what is wrong, unless x (1, T) is a sequence of this task."""
        if x.dim() != 2 or x.size(1) != self.block_size:
            raise ValueError(f"expected {self.block_size} tokens ({self.n_blocks} blocks of "
                             f"{self.block_len}), got {x.size(-1)}")
        if x.min() < 0 or x.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        k = self.block_len
        for b in range(1, self.n_blocks):
            block = x[:, b * k:(b + 1) * k]
            if (block < (b - 1) * k).any() or (block >= b * k).any():
                raise ValueError(f"block {b} must point into block {b - 1}, i.e. hold positions "
                                 f"{(b - 1) * k}..{b * k - 1}; it holds {block[0].tolist()}")

    def describe(self, x, y=None, predictions=None):
        """A few readable lines about one sequence x (T,): blocks, and answers beside the truth."""
        k = self.block_len
        lines = [f"block  0 values  : {x[:k].tolist()}"]
        for b in range(1, self.n_blocks):
            block = slice(b * k, (b + 1) * k)
            line = f"block {b:2d} pointers: {x[block].tolist()}"
            if y is not None:
                line += f"  truth {y[block].tolist()}"
            if predictions is not None:
                hits = (predictions[block] == y[block]).sum().item() if y is not None else "?"
                line += f"  model {predictions[block].tolist()} ({hits}/{k})"
            lines.append(line)
        return "\n".join(lines)


# The --task name of each task.
TASKS = {
    "toy": PointerChains,
}


def get_task(name, **options):
    """The task called `name`, built with its options (e.g. get_task("toy", n_blocks=8))."""
    if name not in TASKS:
        raise ValueError(f"--task: unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name](**options)


if __name__ == "__main__":
    task = get_task("toy", n_blocks=4, block_len=2, vocab_size=10)
    x, y = task.sample(1, torch.Generator().manual_seed(0))
    print(task.describe(x[0], y[0]))
