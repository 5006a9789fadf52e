"""
The tasks of nanoChaCAL, each behind the same small interface:

    task = get_task("toy", **options)
    x, y = task.sample(batch_size, generator=None)  # (B, T) LongTensors; y = -1 where not scored
    task.chain_depth(x)                              # (B, T): how many references each label needs
    task.solve(x)                                    # labels by brute force, for the tests
    task.vocab_size, task.block_size                 # what the model must be built for

`generator` is a torch.Generator (on the CPU), so a seeded run sees the same data every time.
Text tasks (boxes) also give task.prompt_and_answer(i) and task.decode(ids) for exact match.
"""

import functools
import itertools
import math
import os
import random
import re

import torch
from tqdm import tqdm


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


# ----------------------------------------------------------------------------------------------
# Boxes: entity tracking in text (ChaCAL paper Section 5.2, Tables 5 and 6). Generator after Kim &
# Schuster's generate_boxes_data.py (sebschu/entity-tracking-lms), with the paper's changes.

# Kim & Schuster's 100 objects (data/objects_with_bnc_frequency.csv), in file order.
OBJECTS = """book car paper letter game computer picture plant cup machine bill glass note stone fish
drug television card document rock radio ball tea file newspaper branch train cash fig flower bag
boat key painting phone drink engine bus coffee sheet plate magazine egg tape bottle block brain map
crown ring leaf dress fan milk ticket shoe bone gift cross plane mirror coat wheel string ice rose
boot hat suit creature bomb camera bread cake meat beer shirt cigarette jacket apple pipe guitar disk
medicine knife cream clock chemical seed tie watch cheese bowl dish shell wire tissue pot brick
bell""".split()
LETTERS = "ABCDEFGH"
MAX_ITEMS = 3  # per box, at every step
TEMPLATE_WORDS = ("Box Move Put Remove and are contains contents empty from in into is nothing of "
                  "the there to").split()
# One vocabulary for both versions: specials first (PAD = 0 so zero-filled buffers are padding),
# then every word sorted. 4 + 100 objects + 18 template words + 8 letters + 2 punctuation = 132.
SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>"]
VOCAB = SPECIALS + sorted(set(OBJECTS + TEMPLATE_WORDS + list(LETTERS) + [",", "."]))
TOKEN_IDS = {word: i for i, word in enumerate(VOCAB)}
PAD, BOS, SEP, EOS = range(4)


def encode(text):
    """Word-level token ids of a boxes text. Case: only a text's first word can be a capital that
    is not a token ("The", "There"); it is stored in lower case and decode() restores it."""
    words = re.findall(r"\w+|[,.]", text)
    if words and words[0].lower() in TOKEN_IDS:
        words[0] = words[0].lower()
    unknown = [w for w in words if w not in TOKEN_IDS]
    if unknown:
        raise ValueError(f"boxes: words outside the vocabulary: {unknown[:5]}")
    return [TOKEN_IDS[w] for w in words]


def decode(ids):
    """Text of token ids: PAD dropped, other specials shown as <bos> etc., and the first word of
    the text or after a special capitalised, so decode(encode(text)) == text for boxes texts."""
    words = []
    for i in ids:
        if int(i) != PAD:
            word = VOCAB[int(i)]
            words.append(word.capitalize() if not words or words[-1] in SPECIALS else word)
    return " ".join(words).replace(" ,", ",").replace(" .", ".")


def _the(items):
    return " and ".join(f"the {item}" for item in sorted(items))


def render_answer(boxes, with_empty=True):
    """The answer in the standard wording, boxes in letter order: "Box A contains the map and the
    milk, Box B is empty." The advanced version leaves empty boxes out (with_empty=False)."""
    clauses = [f"Box {b} contains {_the(items)}" if items else f"Box {b} is empty"
               for b, items in sorted(boxes.items()) if items or with_empty]
    return ", ".join(clauses) + "."


def _items(text):
    return {thing.removeprefix("the ") for thing in text.split(" and ")}


def simulate(prompt):
    """Read a prompt's text alone and return ({letter: set of items} after the last operation,
    {letter: number of operations that changed the box}). Raises ValueError on an impossible step.
    """
    description, *operations = prompt.rstrip(".").split(". ")
    boxes, touched = {}, {}
    for clause in (description[0].lower() + description[1:]).split(", "):
        if m := re.fullmatch(r"there is nothing in Box (\w)", clause):
            boxes[m[1]] = set()
        elif m := re.fullmatch(r"(.+) (?:is|are) in Box (\w)", clause):
            boxes[m[2]] = _items(m[1])
        else:
            raise ValueError(f"boxes: cannot read the description clause {clause!r}")
    for op in operations:
        if m := re.fullmatch(r"Move the contents of Box (\w) to Box (\w)", op):
            source, target, items = m[1], m[2], boxes.get(m[1], set())
        elif m := re.fullmatch(r"Move (.+) from Box (\w) to Box (\w)", op):
            items, source, target = _items(m[1]), m[2], m[3]
        elif m := re.fullmatch(r"Put (.+) into Box (\w)", op):
            items, source, target = _items(m[1]), None, m[2]
            if any(items & box for box in boxes.values()):
                raise ValueError(f"boxes: {op!r} puts an item that is already in a box")
        elif m := re.fullmatch(r"Remove (.+) from Box (\w)", op):
            items, source, target = _items(m[1]), m[2], None
        else:
            raise ValueError(f"boxes: cannot read the operation {op!r}")
        if source is not None:
            if not items or not items <= boxes.get(source, set()):
                raise ValueError(f"boxes: {op!r} takes what is not in Box {source}")
            boxes[source] = boxes[source] - items
            touched[source] = touched.get(source, 0) + 1
        if target is not None:
            boxes[target] = boxes.get(target, set()) | items
            touched[target] = touched.get(target, 0) + 1
    return boxes, {box: touched.get(box, 0) for box in boxes}


def _poisson(rng, mean):
    # Knuth's method: count uniform draws until their product falls below exp(-mean).
    count, product = 0, rng.random()
    while product > math.exp(-mean):
        count, product = count + 1, product * rng.random()
    return count


def _nonempty_subset(rng, items):
    # Kim & Schuster: keep each item with probability 1/2, redraw if nothing is kept.
    while True:
        subset = {item for item in sorted(items) if rng.random() < 0.5}
        if subset:
            return subset


def _void(boxes):
    placed = set().union(*boxes)
    return [o for o in OBJECTS if o not in placed]  # in list order, so a seed gives one draw


def _default_operations(rng, boxes, letters, n_ops):
    """Kim & Schuster's loop: draw an operation and a box uniformly, redraw both if invalid."""
    ops = []
    while len(ops) < n_ops:
        op, b1 = rng.choice(("move", "put", "remove")), rng.randrange(len(boxes))
        source = boxes[b1]
        if op == "move":
            if not source:
                continue
            b2 = rng.choice([b for b in range(len(boxes)) if b != b1])
            moved = _nonempty_subset(rng, source)
            if len(boxes[b2]) + len(moved) > MAX_ITEMS:
                continue
            # The paper's implicit form, exactly when the move empties the box.
            what = "the contents of" if moved == source else f"{_the(moved)} from"
            ops.append(f"Move {what} Box {letters[b1]} to Box {letters[b2]}.")
            source -= moved
            boxes[b2] |= moved
        elif op == "put":
            n_items = _poisson(rng, 1)  # Kim & Schuster: Poisson(max(1, expected // 2)), at least 1
            if n_items < 1 or len(source) + n_items > MAX_ITEMS:
                continue
            put = set(rng.sample(_void(boxes), n_items))
            ops.append(f"Put {_the(put)} into Box {letters[b1]}.")
            source |= put
        else:
            if not source:
                continue
            removed = _nonempty_subset(rng, source)
            ops.append(f"Remove {_the(removed)} from Box {letters[b1]}.")
            source -= removed
    return ops


# Table 6 has 9 moves and 2 put/remove pairs; drawing moves and pairs 1:1 would make that
# unlikely (3%), so we draw a move with probability 3/4 (our choice; the paper is silent).
ADVANCED_MOVE_PROBABILITY = 0.75


def _advanced_operations(rng, boxes, letters, n_ops):
    """Moves of a whole box into an empty box, so 4 boxes stay filled, and put/remove pairs
    that put an item into a filled box and take it out again at once. Both rules are inferred
    from the paper's one example (Table 6); the paper only says moves are all implicit and half
    the boxes hold items."""
    ops = []
    while len(ops) < n_ops:
        filled = [b for b in range(len(boxes)) if boxes[b]]
        b1 = rng.choice(filled)
        if len(ops) == n_ops - 1 or rng.random() < ADVANCED_MOVE_PROBABILITY:
            b2 = rng.choice([b for b in range(len(boxes)) if not boxes[b]])
            ops.append(f"Move the contents of Box {letters[b1]} to Box {letters[b2]}.")
            boxes[b1], boxes[b2] = boxes[b2], boxes[b1]  # b2 is empty: a swap is the move
        else:
            item = rng.choice(_void(boxes))
            ops.append(f"Put the {item} into Box {letters[b1]}.")
            ops.append(f"Remove the {item} from Box {letters[b1]}.")
    return ops


def generate_example(rng, version="default", signatures=None):
    """One (prompt, answer) pair of texts drawn with rng (a random.Random). The initial state is
    redrawn until its signature (items per box) is in `signatures` (None: any)."""
    advanced = version == "advanced"
    letters = LETTERS[:8] if advanced else LETTERS[:7]
    while True:
        if advanced:  # 4 of the 8 boxes hold one item each, as in Table 6
            filled = rng.sample(range(8), 4)
            counts = [int(b in filled) for b in range(8)]
        else:  # Poisson(2) items per box, redrawn if there are not enough objects, clipped to 3
            counts = [_poisson(rng, 2) for _ in letters]
            if sum(counts) > len(OBJECTS):
                continue
            counts = [min(c, MAX_ITEMS) for c in counts]
        if signatures is None or tuple(counts) in signatures:
            break
    items = iter(rng.sample(OBJECTS, sum(counts)))
    boxes = [{next(items) for _ in range(c)} for c in counts]

    clauses = [(f"{_the(boxes[b])} {'is' if len(boxes[b]) == 1 else 'are'} in Box {letters[b]}"
                if boxes[b] else f"there is nothing in Box {letters[b]}") for b in range(len(letters))]
    if advanced:  # only the filled boxes, in letter order as in Table 6
        clauses = [c for c, n in zip(clauses, counts, strict=True) if n]
        # Log-uniform on 1..31: floor(32^u), u uniform in [0, 1), so P(n) = log2((n+1)/n) / 5.
        ops = _advanced_operations(rng, boxes, letters, n_ops=int(32 ** rng.random()))
    else:  # every box, in shuffled order as in Table 5
        rng.shuffle(clauses)
        ops = _default_operations(rng, boxes, letters, n_ops=32)
    description = ", ".join(clauses)
    prompt = description[0].upper() + description[1:] + ". " + " ".join(ops)
    answer = render_answer(dict(zip(letters, boxes, strict=True)), with_empty=not advanced)
    return prompt, answer


def signature_split(version, seed):
    """(train, test) sets of initial-state signatures (items per box), a seeded half each, so no
    initial count configuration is in both splits (Kim & Schuster split the same way, 45/10/45)."""
    if version == "advanced":
        signatures = [tuple(int(b in f) for b in range(8)) for f in itertools.combinations(range(8), 4)]
    else:
        signatures = list(itertools.product(range(MAX_ITEMS + 1), repeat=7))
    random.Random(seed).shuffle(signatures)
    half = len(signatures) // 2
    return set(signatures[:half]), set(signatures[half:])


@functools.lru_cache(maxsize=4)
def _read_dataset(path, modified):
    # A run builds one Boxes per split from the same file; read it once (keyed by its mtime too,
    # so a file written anew is read anew).
    return torch.load(path)


class Boxes:
    """Entity tracking in text, the boxes dataset of the ChaCAL paper (Section 5.2, Tables 5-6).

    A prompt describes what is in each box, then operations (Put, Remove, Move) change it; the
    model writes the final contents of the boxes. A 3-box, 2-operation example:

        prompt  The cup is in Box B, there is nothing in Box A, the key and the map are in Box C.
                Move the key from Box C to Box A. Move the contents of Box B to Box C.
        answer  Box A contains the key, Box B is empty, Box C contains the cup and the map.

    "Move the contents" is the implicit form: the model must know what was in the box.
    version="default": 7 boxes A-G, 32 operations, every box described and answered.
    version="advanced": 8 boxes A-H, 4 holding one item, 1-31 operations (log-uniform), every
    move implicit, only filled boxes described and answered: chains of up to 31 moves.

    Vocabulary (132 words, VOCAB): <pad> <bos> <sep> <eos>, punctuation, letters, template words,
    the 100 objects; word-level, see encode(). A row and its labels (-1 is not scored):

        x       <bos> the cup ... Box C  .  <sep> Box A        contains ... map .     <eos> <pad>
        y       -1    -1  -1  ... -1  -1 -1 Box   A   contains the      ... .   <eos> -1    -1
        depth   -1    -1  -1  ... -1  -1 -1 1     1   1        1        ... 2   2     -1    -1

    so y[t] = x[t+1] while x[t+1] is an answer token or <eos>: only the answer is scored. Its
    chain depth is the number of operations that changed the box its clause names (A 1, B 1, C 2).

    Examples are generated once per (version, seed, n_train, n_test), both splits together (train
    and test never share an initial signature), and cached in cache_dir (None: no cache). The
    split's token ids are task.rows (N, block_size); prompt_and_answer(i) serves exact match.
    """

    def __init__(self, version="default", n_train=2000, n_test=500, seed=0, split="train",
                 cache_dir="data_cache"):
        if version not in ("default", "advanced") or split not in ("train", "test"):
            raise ValueError(f"boxes: version must be 'default' or 'advanced' (got {version!r}) "
                             f"and split 'train' or 'test' (got {split!r})")
        self.version, self.split, self.vocab_size = version, split, len(VOCAB)
        filename = f"boxes-{version}-seed{seed}-{n_train}+{n_test}.pt"
        path = os.path.join(cache_dir, filename) if cache_dir else None
        if path and os.path.exists(path):
            data = _read_dataset(path, os.path.getmtime(path))
        else:
            train_signatures, test_signatures = signature_split(version, seed)
            data = {"train": self._generate(n_train, train_signatures, f"{seed}-train"),
                    "test": self._generate(n_test, test_signatures, f"{seed}-test")}
            longest = max(int((rows != PAD).sum(1).max()) for rows in data.values())
            block_size = -(-longest // 64) * 64  # the longest example, rounded up to 64
            data = {name: rows[:, :block_size].clone() for name, rows in data.items()}
            if path:  # written under a temporary name first, so an interrupted run leaves no half file
                os.makedirs(cache_dir, exist_ok=True)
                torch.save(data, path + ".tmp")
                os.replace(path + ".tmp", path)
        self.rows = data[split]  # (N, block_size) uint8 token ids
        self.block_size = self.rows.size(1)

    def _generate(self, n, signatures, stream):
        rng = random.Random(f"boxes-{self.version}-{stream}")
        # Room for any example: <= 13 tokens per described box, per answered box and per
        # operation, plus 3 specials; trimmed to the longest example afterwards.
        rows = torch.zeros(n, 3 + 2 * 13 * 8 + 13 * 32, dtype=torch.uint8)
        for i in tqdm(range(n), desc=f"boxes {self.version} {stream}", disable=n < 10_000):
            prompt, answer = generate_example(rng, self.version, signatures)
            ids = [BOS, *encode(prompt), SEP, *encode(answer), EOS]
            rows[i, :len(ids)] = torch.tensor(ids, dtype=torch.uint8)
        return rows

    def sample(self, batch_size, generator=None):
        x = self.rows[torch.randint(len(self.rows), (batch_size,), generator=generator)].long()
        positions = torch.arange(x.size(1))
        sep = (x == SEP).int().argmax(1, keepdim=True)
        eos = (x == EOS).int().argmax(1, keepdim=True)
        answer = (positions >= sep) & (positions < eos)  # predicting the answer and <eos>
        y = torch.where(answer, x.roll(-1, dims=1), -1)
        return x, y

    def _read(self, row):
        """(position of <sep>, answer token ids with <eos>, depth of each) from a row's prompt."""
        row = row.tolist()
        sep = row.index(SEP)
        boxes, touched = simulate(decode(row[1:sep]))
        answer = encode(render_answer(boxes, with_empty=self.version == "default")) + [EOS]
        depth = []
        for k, token in enumerate(answer):  # a clause's tokens, and <eos>, belong to its box
            if token == TOKEN_IDS["Box"]:
                box = VOCAB[answer[k + 1]]
            depth.append(touched[box])
        return sep, answer, depth

    def _along_answers(self, x, want_depth):
        """(B, T): -1 outside each row's answer, and along it the answer ids or their depths."""
        out = torch.full_like(x, -1)
        for r in range(x.size(0)):
            sep, answer, depth = self._read(x[r])
            values = depth if want_depth else answer
            n = min(len(values), x.size(1) - sep)
            out[r, sep:sep + n] = torch.tensor(values[:n])
        return out

    def solve(self, x):
        """Labels recomputed from each prompt's text by the simulator: the tests' reference."""
        return self._along_answers(x, want_depth=False)

    def chain_depth(self, x):
        return self._along_answers(x, want_depth=True)

    def prompt_and_answer(self, i):
        """Row i of the split as (prompt ids <bos>...<sep>, expected answer text), for exact match:
        generate after the prompt until <eos> and compare decode() of it with the answer."""
        row = self.rows[i].long()
        sep, eos = row.tolist().index(SEP), row.tolist().index(EOS)
        return row[:sep + 1], decode(row[sep + 1:eos])

    def decode(self, ids):
        return decode(ids)

    def describe(self, x, y=None, predictions=None):
        """Readable lines about one row x (T,): the prompt, the answer, and the model's answer."""
        y = self.solve(x[None])[0] if y is None else y
        scored = y != -1
        lines = [f"prompt: {decode(x[1:x.tolist().index(SEP)])}", f"truth : {decode(y[scored])}"]
        if predictions is not None:
            hits, n = (predictions[scored] == y[scored]).sum().item(), scored.sum().item()
            lines.append(f"model : {decode(predictions[scored])}  ({hits}/{n} tokens"
                         f"{', exact match' if hits == n else ''})")
        return "\n".join(lines)


# The --task name of each task.
TASKS = {
    "toy": PointerChains,
    "boxes": Boxes,
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
