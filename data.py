"""The tasks of nanoChaCAL, each behind one small interface, the class Task below:

    task = get_task("toy", n_blocks=8)
    x, y = task.sample(batch_size, generator, split="train")  # (B, T) ids; y = -1 where not scored

`python data.py TASK [SEED]` prints a test example of a task with its answer."""

import contextlib
import functools
import hashlib
import inspect
import itertools
import math
import os
import pathlib
import random
import re

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import evaluating


class Task:
    """What every task provides; a task overrides what differs. split "test" is what evaluation
    scores (a task may score only some positions in training, and all in test)."""

    vocab_size = block_size = stop_token = prompt_length = vocab = None  # vocab: a word per id
    flags = {}                 # train.py's flags for the constructor's options: argparse keywords
    train_defaults = {}        # train.py settings this task needs other than train.py's defaults
    broadcast_ids = ()         # token ids that LEGO attention lets every token read
    # Of "causal" or "bidirectional", "groups" (attention groups), "generation" (write an answer
    # after a prompt: a test row's first prompt_length tokens, or up to its first label).
    needs = frozenset()

    def sample(self, batch_size, generator=None, split="train"):
        """(x, y), each (B, T): token ids, and each position's label (-1: not scored)."""
        raise NotImplementedError

    def solve(self, x):
        """The labels of x (B, T) worked out by hand, apart from sample()."""
        return self.labels_and_depths(x)[0]

    def chain_depth(self, x):
        """(B, T): how many references each label of x needs."""
        return self.labels_and_depths(x)[1]

    def labels_and_depths(self, x):
        """(solve(x), chain_depth(x)), where one walk works out both."""
        raise NotImplementedError

    def describe(self, x, y=None, predictions=None):
        """Readable lines about one sequence x (T,), its labels y and a model's predictions."""
        raise NotImplementedError

    def encode(self, text):
        """Token ids (T,) of text written as words of self.vocab with spaces between them."""
        ids = {word: i for i, word in enumerate(self.vocab) if word != "<pad>"}
        unknown = [word for word in text.split() if word not in ids]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a word of this task")
        return torch.tensor([ids[word] for word in text.split()], dtype=torch.long)

    def decode(self, ids):
        """The words of token ids, padding left out."""
        return " ".join(w for w in (self.vocab[int(i)] for i in ids) if w != "<pad>")

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        """Loss and accuracy on n_samples test sequences; final: a run's last, to measure more."""
        batches = (self.sample(min(batch_size, n_samples - start), generator, split="test")
                   for start in range(0, n_samples, batch_size))
        return score_batches(model, batches, self, device, autocast)

    def layout(self, x):
        """Keyword arguments of the model's forward for a batch x (B, T), besides x and y."""
        return {}

    def generate(self, model, idx, max_new_tokens, use_cache=True):
        """The model's greedy continuation of prompts idx (B, T), up to stop_token: (B, T + new)."""
        return model.generate(idx, max_new_tokens, temperature=0, use_cache=use_cache,
                              stop_token=self.stop_token)


def check_ranges(**ranges):
    """Refuse the first flag whose value lies outside its range: flag=(value, low[, high])."""
    for flag, (value, low, *high) in ranges.items():
        if not low <= value <= (high or [value])[0]:
            bound = f"lie in {low}..{high[0]}" if high else f"be at least {low}"
            raise ValueError(f"--{flag} {value} must {bound}")


@torch.no_grad()
def score_batches(model, batches, task, device="cpu", autocast=contextlib.nullcontext()):
    """Loss and accuracy of model on batches of (x, y), overall and by task.chain_depth, and the
    share of sequences with every scored token right (a greedy answer's exact match)."""
    total_loss, hits, counts, whole, n_sequences = 0.0, {}, {}, 0, 0
    with evaluating(model):
        for x, y in batches:
            depth = task.chain_depth(x)
            with autocast:
                logits, loss = model(x.to(device), y.to(device), **task.layout(x.to(device)))
            correct = (logits.argmax(dim=-1).cpu() == y)
            scored = y != -1
            total_loss += loss.item() * scored.sum().item()  # the loss is a mean over scored tokens
            whole += (correct | ~scored).all(dim=1).sum().item()
            n_sequences += x.size(0)
            for d in depth[scored].unique().tolist():
                at_depth = scored & (depth == d)
                hits[d] = hits.get(d, 0) + correct[at_depth].sum().item()
                counts[d] = counts.get(d, 0) + at_depth.sum().item()
    return {"eval_loss": total_loss / sum(counts.values()),
            "eval_acc": sum(hits.values()) / sum(counts.values()),
            "eval_acc_by_depth": {str(d): hits[d] / counts[d] for d in sorted(counts)},
            "eval_whole_sequences": whole / n_sequences}


def answer_lines(task, x, y, predictions, prompt, truth, written):
    """describe()'s lines: the prompt, the truth, the predictions where y scores, or written."""
    lines = [f"prompt: {prompt}", f"truth : {truth}"]
    if predictions is not None:
        y = task.solve(x[None])[0] if y is None else y
        scored = y != -1
        hits, n = (predictions[scored] == y[scored]).sum().item(), scored.sum().item()
        lines.append(f"model : {task.decode(predictions[scored])}  ({hits}/{n} tokens"
                     f"{', exact match' if hits == n else ''})")
    elif written is not None:
        lines.append(f"written: {written}")
    return "\n".join(lines)


class PointerChains(Task):
    """The toy task of the ChaCAL paper (Section 5.1): follow a chain of pointers to its end.

    n_blocks blocks of block_len tokens (16 x 8 = 128). Block 0 holds random values; each later
    block a random permutation of the positions of the block before it. The label of a token in
    block b is the block-0 value its chain of b pointers ends at (chain depth b); block 0 is not
    scored (the chain's end as the label is our reading of the paper). 4 blocks of 2, vocabulary 8:

        position   0  1 | 2  3 | 4  5 | 6  7
        x          7  4 | 1  0 | 3  2 | 4  5
        y          -  - | 4  7 | 7  4 | 7  4
        depth      -  - | 1  1 | 2  2 | 3  3

    Position 7 holds 5, which holds 2, which holds 1: y[7] = x[1] = 4, after 3 hops.
    """

    flags = {"n_blocks": dict(type=int, help="toy: number of blocks, chains n_blocks-1 deep (16)"),
             "block_len": dict(type=int, help="toy: tokens per block (8)")}

    def __init__(self, n_blocks=16, block_len=8):
        check_ranges(n_blocks=(n_blocks, 2), block_len=(block_len, 1))
        self.n_blocks, self.block_len = n_blocks, block_len
        self.block_size = self.vocab_size = n_blocks * block_len  # pointers are positions
        self.vocab = [str(i) for i in range(self.vocab_size)]  # text: the ids as numbers

    def sample(self, batch_size, generator=None, split="train"):
        n, k = self.n_blocks, self.block_len
        values = torch.randint(0, self.vocab_size, (batch_size, k), generator=generator)
        # A uniform random permutation of 0..k-1 per block: argsort of uniform noise.
        perms = torch.rand(batch_size, n - 1, k, generator=generator).argsort(dim=-1)
        pointers = perms + torch.arange(n - 1)[:, None] * k  # into the block before: (B, n-1, k)
        x = torch.cat([values, pointers.view(batch_size, -1)], dim=1)  # (B, T)
        # Resolve block by block: a token's answer is the answer of the token it points at.
        y = x.clone()
        for b in range(1, n):
            y[:, b * k:(b + 1) * k] = y.gather(1, x[:, b * k:(b + 1) * k])
        y[:, :k] = -1
        return x, y

    def chain_depth(self, x):
        return (torch.arange(x.size(1), device=x.device) // self.block_len).expand_as(x)

    def solve(self, x):
        y = torch.full_like(x, -1)
        for row, seq in enumerate(x.tolist()):
            for pos in range(self.block_len, len(seq)):
                at = pos
                while at >= self.block_len:  # still outside block 0: follow the pointer back
                    if seq[at] >= at:
                        raise ValueError(f"toy: position {at} points at {seq[at]}, not back")
                    at = seq[at]
                y[row, pos] = seq[at]
        return y

    def describe(self, x, y=None, predictions=None):
        y, k = self.solve(x[None])[0] if y is None else y, self.block_len
        lines = [f"block  0 values  : {x[:k].tolist()}"]
        for b in range(1, x.size(0) // k):
            block = slice(b * k, (b + 1) * k)
            line = f"block {b:2d} pointers: {x[block].tolist()}  truth {y[block].tolist()}"
            if predictions is not None:
                hits = (predictions[block] == y[block]).sum().item()
                line += f"  model {predictions[block].tolist()} ({hits}/{k})"
            lines.append(line)
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Boxes (ChaCAL paper Section 5.2): Kim & Schuster's generator (sebschu/entity-tracking-lms,
# generate_boxes_data.py) with the paper's changes; their objects_with_bnc_frequency.csv's 100:
OBJECTS = """book car paper letter game computer picture plant cup machine bill glass note stone
fish drug television card document rock radio ball tea file newspaper branch train cash fig flower
bag boat key painting phone drink engine bus coffee sheet plate magazine egg tape bottle block
brain map crown ring leaf dress fan milk ticket shoe bone gift cross plane mirror coat wheel string
ice rose boot hat suit creature bomb camera bread cake meat beer shirt cigarette jacket apple pipe
guitar disk medicine knife cream clock chemical seed tie watch cheese bowl dish shell wire tissue
pot brick bell""".split()
LETTERS = "ABCDEFGH"
MAX_ITEMS = 3  # per box, at every step
TEMPLATE_WORDS = ("Box Move Put Remove and are contains contents empty from in into is nothing of "
                  "the there to").split()
# Specials first (PAD = 0: zero-filled buffers are padding), then every word sorted: 132 words,
# the advanced version's size in the paper's Table 4 (one list for both versions).
SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>"]
VOCAB = SPECIALS + sorted(set(OBJECTS + TEMPLATE_WORDS + list(LETTERS) + [",", "."]))
TOKEN_IDS = {word: i for i, word in enumerate(VOCAB)}
PAD, BOS, SEP, EOS = range(4)


def encode(text):
    """Word-level token ids of a boxes text, specials included; decode()'s capitals read lower."""
    words = [w if w in TOKEN_IDS else w.lower() for w in re.findall(r"<\w+>|\w+|[,.]", text)]
    unknown = [w for w in words if w not in TOKEN_IDS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a word of this task")
    return [TOKEN_IDS[w] for w in words]


def decode(ids, written=False):
    """Text of token ids, PAD dropped, sentences capitalised: decode(encode(text)) == text.
    written: a model's answer, read up to its <eos>, in which a PAD is a wrong word."""
    ids, words = [int(i) for i in ids], []
    for i in ids[:ids.index(EOS)] if written and EOS in ids else ids:
        if i != PAD or written:
            word = VOCAB[i]
            words.append(word.capitalize() if not words or words[-1] in SPECIALS else word)
    return " ".join(words).replace(" ,", ",").replace(" .", ".")


def _the(items):
    """{"cup", "map"} -> "the cup and the map"."""
    return " and ".join(f"the {item}" for item in sorted(items))


def render_answer(boxes, with_empty=True):
    """The answer text "Box A contains the map and the milk, Box B is empty." (boxes in letter
    order; with_empty=False leaves empty boxes out, as the advanced version does)."""
    clauses = [f"Box {b} contains {_the(items)}" if items else f"Box {b} is empty"
               for b, items in sorted(boxes.items()) if items or with_empty]
    return ", ".join(clauses) + "."


def _items(text):
    """The inverse of _the: "the cup and the map" -> {"cup", "map"}."""
    return {thing.removeprefix("the ") for thing in text.split(" and ")}


def simulate(prompt):
    """({letter: set of items} after the last operation, {letter: reference depth of the box})
    read from a prompt's text alone. A box's depth is the most implicit moves ("Move the contents
    of Box X", which does not name what moves) one of its items rode along since it was named."""
    description, *operations = prompt.rstrip(".").split(". ")
    boxes, hops = {}, {}  # hops: implicit moves each item rode along with since it was named
    for clause in (description[:1].lower() + description[1:]).split(", "):
        if not (m := re.fullmatch(r"(?:there is nothing|(.+) (?:is|are)) in Box (\w)", clause)):
            raise ValueError(f"boxes: cannot read the description clause {clause!r}")
        boxes[m[2]] = _items(m[1]) if m[1] else set()
        hops.update(dict.fromkeys(boxes[m[2]], 0))
    for op in operations:
        if m := re.fullmatch(r"Move the contents of Box (\w) to Box (\w)", op):
            source, target, items = m[1], m[2], boxes.get(m[1], set())
        elif m := re.fullmatch(r"Move (.+) from Box (\w) to Box (\w)", op):
            items, source, target = _items(m[1]), m[2], m[3]
        elif m := re.fullmatch(r"Put (.+) into Box (\w)", op):
            items, source, target = _items(m[1]), None, m[2]
        elif m := re.fullmatch(r"Remove (.+) from Box (\w)", op):
            items, source, target = _items(m[1]), m[2], None
        else:
            raise ValueError(f"boxes: cannot read the operation {op!r}")
        if source is not None:
            if not items or not items <= boxes.get(source, set()):
                raise ValueError(f"boxes: {op!r} takes what is not in Box {source}")
            boxes[source] = boxes[source] - items
        if target is not None:
            boxes[target] = boxes.get(target, set()) | items
            implicit = op.startswith("Move the contents")  # else the sentence names the items
            hops.update({item: hops[item] + 1 if implicit else 0 for item in items})
    return boxes, {box: max((hops[item] for item in items), default=0)
                   for box, items in boxes.items()}


def parse_answer(text):
    """{letter: set of items} an answer text states; clauses that do not parse are skipped."""
    boxes = {}
    for clause in text.rstrip(".").split(", "):
        if m := re.fullmatch(r"Box (\w) contains (.+)", clause):
            boxes[m[1]] = _items(m[2])
        elif m := re.fullmatch(r"Box (\w) is empty", clause):
            boxes[m[1]] = set()
    return boxes


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


def _void(boxes, objects):
    placed = set().union(*boxes)
    return [o for o in objects if o not in placed]  # in list order, so a seed gives one draw


def _default_operations(rng, boxes, letters, n_ops, objects):
    """Kim & Schuster's loop: draw an operation and a box uniformly, redraw both if invalid."""
    ops = []
    while len(ops) < n_ops:
        op, b1 = rng.choice(("move", "put", "remove")), rng.randrange(len(boxes))
        source = boxes[b1]
        if op != "put" and not source:  # nothing to move or remove
            continue
        if op == "move":
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
            # Kim & Schuster's Poisson(max(1, expected // 2)), with their 2 items expected per box
            n_items = _poisson(rng, 1)
            void = _void(boxes, objects)
            if n_items < 1 or len(source) + n_items > MAX_ITEMS or n_items > len(void):
                continue
            put = set(rng.sample(void, n_items))
            ops.append(f"Put {_the(put)} into Box {letters[b1]}.")
            source |= put
        else:
            removed = _nonempty_subset(rng, source)
            ops.append(f"Remove {_the(removed)} from Box {letters[b1]}.")
            source -= removed
    return ops


# Table 6 has 9 moves and 2 put/remove pairs in 13 operations, unlikely if drawn 1:1 (5%): we
# draw a move with probability 3/4 (the paper is silent). A lone last operation is a move.
ADVANCED_MOVE_PROBABILITY = 0.75


def _advanced_operations(rng, boxes, letters, n_ops, objects):
    """Whole-box moves into an empty box, and put/remove pairs: as the paper's Table 6 shows."""
    ops = []
    while len(ops) < n_ops:
        b1 = rng.choice([b for b in range(len(boxes)) if boxes[b]])  # a filled box
        if len(ops) == n_ops - 1 or rng.random() < ADVANCED_MOVE_PROBABILITY:
            b2 = rng.choice([b for b in range(len(boxes)) if not boxes[b]])
            ops.append(f"Move the contents of Box {letters[b1]} to Box {letters[b2]}.")
            boxes[b1], boxes[b2] = boxes[b2], boxes[b1]  # b2 is empty: a swap is the move
        else:
            item = rng.choice(_void(boxes, objects))
            ops.append(f"Put the {item} into Box {letters[b1]}.")
            ops.append(f"Remove the {item} from Box {letters[b1]}.")
    return ops


# Each version's sizes in the paper (Section 5.2, Tables 5, 6); flags change sizes, not rules.
PAPER_SIZES = {
    "default": dict(n_boxes=7, n_filled=None, n_objects=100, min_ops=32, max_ops=32),
    "advanced": dict(n_boxes=8, n_filled=4, n_objects=100, min_ops=1, max_ops=31),
}


def box_sizes(version="default", **sizes):
    """The version's PAPER_SIZES with the sizes given (None: the paper's), checked."""
    if version == "default" and sizes.get("n_filled") is not None:
        raise ValueError("--n_filled sets the advanced version's filled boxes, not the default's")
    s = {**PAPER_SIZES[version], **{k: v for k, v in sizes.items() if v is not None}}
    advanced = version == "advanced"  # a move needs an empty box; the default fills up to 3 each
    check_ranges(n_boxes=(s["n_boxes"], 2, len(LETTERS)),
                 n_filled=(s["n_filled"], 1, s["n_boxes"] - 1) if advanced else (0, 0),
                 n_objects=(s["n_objects"], s["n_filled"] + 1 if advanced
                            else MAX_ITEMS * s["n_boxes"], len(OBJECTS)),
                 min_ops=(s["min_ops"], 1, s["max_ops"]))
    return s


def generate_example(rng, version="default", signatures=None, **sizes):
    """(prompt, answer) texts drawn with rng, the initial state's signature (items per box) in
    `signatures` (None: any)."""
    advanced = version == "advanced"
    sizes = box_sizes(version, **sizes)
    letters, objects = LETTERS[:sizes["n_boxes"]], OBJECTS[:sizes["n_objects"]]
    while True:  # redraw until the state is in the split (over a sixth of the draws' mass)
        if advanced:  # n_filled boxes hold one item each (paper: 4 of 8, as in Table 6)
            filled = rng.sample(range(len(letters)), sizes["n_filled"])
            counts = [int(b in filled) for b in range(len(letters))]
        else:  # Poisson(2) items per box, clipped to 3 (box_sizes leaves 3 objects per box)
            counts = [min(_poisson(rng, 2), MAX_ITEMS) for _ in letters]
        if signatures is None or tuple(counts) in signatures:
            break
    items = iter(rng.sample(objects, sum(counts)))
    boxes = [{next(items) for _ in range(c)} for c in counts]
    # Log-uniform on min..max: floor(min * ((max+1)/min)^u), u uniform in [0, 1).
    low, high = sizes["min_ops"], sizes["max_ops"]
    n_ops = low if low == high else int(low * ((high + 1) / low) ** rng.random())
    clauses = [f"{_the(box)} {'is' if len(box) == 1 else 'are'} in Box {letter}" if box
               else f"there is nothing in Box {letter}" for box, letter in zip(boxes, letters)]
    if advanced:  # only the filled boxes, in letter order as in Table 6
        clauses = [c for c, n in zip(clauses, counts, strict=True) if n]
        ops = _advanced_operations(rng, boxes, letters, n_ops, objects)
    else:  # every box, in shuffled order as in Table 5
        rng.shuffle(clauses)
        ops = _default_operations(rng, boxes, letters, n_ops, objects)
    description = ", ".join(clauses)
    prompt = description[0].upper() + description[1:] + ". " + " ".join(ops)
    answer = render_answer(dict(zip(letters, boxes, strict=True)), with_empty=not advanced)
    return prompt, answer


def signature_split(version, seed, **sizes):
    """(train, test) sets of initial-state signatures (items per box), a seeded half each."""
    sizes = box_sizes(version, **sizes)
    n = sizes["n_boxes"]
    if version == "advanced":
        signatures = [tuple(int(b in f) for b in range(n))
                      for f in itertools.combinations(range(n), sizes["n_filled"])]
    else:
        signatures = list(itertools.product(range(MAX_ITEMS + 1), repeat=n))
    random.Random(seed).shuffle(signatures)
    half = len(signatures) // 2
    return set(signatures[:half]), set(signatures[half:])


def write_whole(path, write):
    """write(a temporary path of this process's own), then rename it to path: never a half file."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):  # the write failed: no temporary file left behind
            os.remove(temporary)


@functools.lru_cache(maxsize=4)
def read_dataset(path, modified):
    """A boxes dataset file, read once per version (its mtime) and checked: two tables of token
    ids as wide (only tensors are unpickled), each row <bos> ... <sep> ... <eos>."""
    try:
        data = torch.load(path, weights_only=True)
        splits = [data["train"], data["test"]]
        whole = splits[0].size(1) == splits[1].size(1) and all(
            r.dtype == torch.uint8 and r.dim() == 2 and r.numel() and int(r.max()) < len(VOCAB)
            and (r[:, 0] == BOS).all() and ((r == SEP).sum(1) == 1).all()
            and ((r == EOS).sum(1) == 1).all()
            and ((r == SEP).int().argmax(1) < (r == EOS).int().argmax(1)).all() for r in splits)
    except Exception:  # not a dict of two tables
        whole = False
    if not whole:
        raise ValueError(f"{path} is not a whole boxes dataset of this vocabulary (damaged, or "
                         "from elsewhere); delete it and it will be generated again")
    return data


def share_right(scores, by_depth=False):
    """The share of (depth, right) pairs that are right, or {depth: share} in depth order."""
    if by_depth:
        return {str(d): share_right([s for s in scores if s[0] == d]) for d in sorted(dict(scores))}
    return sum(right for _, right in scores) / len(scores)


class Boxes(Task):
    """Entity tracking in text (ChaCAL paper Section 5.2, Tables 5-6): a prompt describes boxes,
    operations change them, and after <sep> the model writes their final contents:

        prompt  The cup is in Box B, there is nothing in Box A, the key and the map are in Box C.
                Move the key from Box C to Box A. Move the contents of Box B to Box C.
        answer  Box A contains the key, Box B is empty, Box C contains the cup and the map.

    Only the answer and <eos> are scored, each token at the depth of the box its clause names
    (simulate()): Box C's is 1, as the cup came by "Move the contents", which does not name it.
    "advanced" describes and answers only the filled boxes (one item each), every move implicit.
    Examples are generated once and cached; test prompts start from unseen initial states.
    """

    needs = frozenset({"causal", "generation"})
    stop_token = EOS
    decode = staticmethod(decode)  # the module's decode(ids) above
    flags = {"boxes_version": dict(choices=["default", "advanced"], help="boxes: 7 boxes, 32 "
                                   "operations (default), or 8 boxes, 1-31 implicit moves"),
             "n_train": dict(type=int, help="boxes: training examples (2000), in data_cache/"),
             "n_test": dict(type=int, help="boxes: test examples, of unseen initial states (500)"),
             "n_boxes": dict(type=int, help="boxes: boxes A.., 2-8 (7 default, 8 advanced)"),
             "n_filled": dict(type=int, help="boxes advanced: boxes holding an item at first (4)"),
             "n_objects": dict(type=int, help="boxes: objects that may appear (100)"),
             "min_ops": dict(type=int, help="boxes: fewest operations (default 32, advanced 1)"),
             "max_ops": dict(type=int, help="boxes: most operations (default 32, advanced 31)")}

    def __init__(self, boxes_version="default", n_train=2000, n_test=500, data_seed=0,
                 cache_dir="data_cache", n_boxes=None, n_filled=None, n_objects=None,
                 min_ops=None, max_ops=None):
        version, seed = boxes_version, data_seed  # seed: of the examples, not of a run
        self.sizes = s = box_sizes(version, n_boxes=n_boxes, n_filled=n_filled,
                                   n_objects=n_objects, min_ops=min_ops, max_ops=max_ops)
        check_ranges(n_train=(n_train, 1), n_test=(n_test, 1))
        self.version, self.vocab_size = version, len(VOCAB)
        sizes = (f"{s['n_boxes']}boxes-" + (f"{s['n_filled']}filled-" if s["n_filled"] else "")
                 + f"{s['n_objects']}objects-{s['min_ops']}to{s['max_ops']}ops")
        # The constants that shape an example, hashed into the name: edit one, get a new file.
        rules = repr((OBJECTS, LETTERS, VOCAB, MAX_ITEMS, ADVANCED_MOVE_PROBABILITY)).encode()
        filename = (f"boxes-{version}-{sizes}-seed{seed}-{n_train}+{n_test}-"
                    f"{hashlib.sha256(rules).hexdigest()[:8]}.pt")
        self.path = path = os.path.join(cache_dir, filename) if cache_dir else None
        if path and os.path.exists(path):
            data = read_dataset(path, os.path.getmtime(path))
        else:
            train_signatures, test_signatures = signature_split(version, seed, **self.sizes)
            data = {"train": self._generate(n_train, train_signatures, f"{seed}-train"),
                    "test": self._generate(n_test, test_signatures, f"{seed}-test")}
            # Rounded up to 64: other --n_train or --data_seed then mostly share a block_size.
            width = -(-max(rows.size(1) for rows in data.values()) // 64) * 64
            data = {name: F.pad(rows, (0, width - rows.size(1))) for name, rows in data.items()}
            if path:
                os.makedirs(cache_dir, exist_ok=True)
                write_whole(path, lambda temporary: torch.save(data, temporary))
        self.rows = data  # {split: (N, block_size) uint8 token ids}
        self.block_size = data["train"].size(1)

    def _generate(self, n, signatures, stream):
        rng, rows = random.Random(f"boxes-{self.version}-{stream}"), []
        for _ in tqdm(range(n), desc=f"boxes {self.version} {stream}",
                      disable=True if n < 10_000 else None):  # None: only on a terminal
            prompt, answer = generate_example(rng, self.version, signatures, **self.sizes)
            rows.append(torch.tensor([BOS, *encode(prompt), SEP, *encode(answer), EOS],
                                     dtype=torch.uint8))
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    def sample(self, batch_size, generator=None, split="train"):
        index = torch.randint(len(self.rows[split]), (batch_size,), generator=generator)
        return self.batch(split, index)

    def batch(self, split, index):
        """(x, y) of a split's rows at index (ids or a slice), cut to the longest of them."""
        x = self.rows[split][index].long()
        x = x[:, :int((x != PAD).sum(1).max())]  # padding every row shares: it scores the same
        positions = torch.arange(x.size(1))
        sep = (x == SEP).int().argmax(1, keepdim=True)
        eos = (x == EOS).int().argmax(1, keepdim=True)
        answer = (positions >= sep) & (positions < eos)  # predicting the answer and <eos>
        y = torch.where(answer, x.roll(-1, dims=1), -1)
        return x, y

    def labels_and_depths(self, x):
        """(B, T) each: along each row's answer the simulator's answer ids and depths, else -1."""
        y, depth = torch.full_like(x, -1), torch.full_like(x, -1)
        for r, row in enumerate(x.tolist()):
            sep = row.index(SEP)
            boxes, depths = simulate(decode(row[1:sep]))
            answer = encode(render_answer(boxes, self.version == "default")) + [EOS]
            for k, token in enumerate(answer[:x.size(1) - sep]):  # a clause's tokens, and <eos>,
                if token == TOKEN_IDS["Box"]:                     # belong to its box
                    box = VOCAB[answer[k + 1]]
                y[r, sep + k], depth[r, sep + k] = token, depths[box]
        return y, depth

    def prompt_and_answer(self, i, split="test"):
        """Row i of a split as (prompt ids <bos>...<sep>, expected answer text)."""
        row = self.rows[split][i].long()
        sep, eos = row.tolist().index(SEP), row.tolist().index(EOS)
        return row[:sep + 1], decode(row[sep + 1:eos])

    def write_answers(self, model, n, batch_size, device="cpu", autocast=contextlib.nullcontext()):
        """The model's greedy answers to the first n test prompts, as texts."""
        answers = []
        for first in range(0, n, batch_size):
            prompts = [self.prompt_and_answer(i)[0] for i in range(first, n)[:batch_size]]
            lengths = torch.tensor([len(p) for p in prompts])
            padded = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(device)
            with autocast:
                out = model.generate(padded, model.config.block_size - int(lengths.max()),
                                     temperature=0, use_cache="cache" in model.config.abilities(),
                                     stop_token=EOS, prompt_lengths=lengths).cpu()
            answers += [decode(row[length:], written=True)
                        for length, row in zip(lengths.tolist(), out.tolist())]
        return answers

    def score_answers(self, answers):
        """Exact match of the answers to the first test prompts, and boxes right, by depth."""
        answer_scores, box_scores = [], []  # (depth, right) of every answer, of every box
        for i, text in enumerate(answers):
            prompt, expected = self.prompt_and_answer(i)
            truth, depths = simulate(decode(prompt[1:-1]))
            stated = parse_answer(text)
            boxes = [(depths[box], stated.get(box) == items) for box, items in
                     sorted(truth.items()) if items or self.version == "default"]
            answer_scores.append((max((depth for depth, _ in boxes), default=0), text == expected))
            box_scores += boxes
        return {"eval_exact_match": share_right(answer_scores),
                "eval_exact_match_by_depth": share_right(answer_scores, by_depth=True),
                "eval_box_acc": share_right(box_scores),
                "eval_box_acc_by_depth": share_right(box_scores, by_depth=True)}

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        """Loss and accuracy on the first n_samples test rows, then their written answers'."""
        n = min(n_samples, len(self.rows["test"]))
        batches = [self.batch("test", slice(start, min(start + batch_size, n)))
                   for start in range(0, n, batch_size)]
        metrics = score_batches(model, batches, self, device, autocast)
        answers = self.write_answers(model, n, batch_size, device, autocast)
        return {**metrics, **self.score_answers(answers)}

    def encode(self, text):
        """Token ids (T,) of a boxes text; one without specials is framed <bos> text <sep>."""
        ids = encode(text)
        return torch.tensor(ids if "<" in text else [BOS, *ids, SEP], dtype=torch.long)

    def describe(self, x, y=None, predictions=None):
        ids, sep = x.tolist(), x.tolist().index(SEP)
        truth = render_answer(simulate(decode(ids[1:sep]))[0], self.version == "default")
        written = decode(ids[sep + 1:], written=True) if len(ids) > sep + 1 else None
        return answer_lines(self, x, y, predictions, decode(ids[1:sep]), truth, written)


class BoxClauses(Boxes):
    """The advanced boxes version with one token per clause (lesson 04's miniature): a filled box
    described as `item@X`, a move as `S>D`, then a query `X?` per filled box, in letter order.
    Each move is labelled with the item D now holds, each query with X's item, at its depth:
    the implicit moves that item has ridden since it was named (as simulate()). Put/remove pairs
    change no box and are left out. The words' prompt and clauses:

        The cup is in Box B, the key is in Box E. Move the contents of Box B to Box A. ...
        tokens  <bos>  cup@B  key@E  B>A  A>C  E>B  B?   C?
        label     -      -      -    cup  cup  key  key  cup
        depth     -      -      -     1    2    1    1    2
    """

    needs = frozenset()  # read, not written: every label is scored where its clause stands
    flags = {name: flag for name, flag in Boxes.flags.items() if name != "boxes_version"}
    train_defaults = {"n_layer": 2, "weight_init": "xavier", "batch_size": 64, "lr": 1e-3}
    encode, decode = Task.encode, Task.decode

    def __init__(self, n_train=2000, n_test=500, data_seed=0, cache_dir="data_cache",
                 n_boxes=None, n_filled=3, n_objects=None, min_ops=None, max_ops=None):
        super().__init__("advanced", n_train, n_test, data_seed, cache_dir, n_boxes, n_filled,
                         n_objects, min_ops, max_ops)
        letters, objects = LETTERS[:self.sizes["n_boxes"]], OBJECTS[:self.sizes["n_objects"]]
        self.vocab = ["<pad>", "<bos>", *objects, *[f"{o}@{b}" for o in objects for b in letters],
                      *[f"{a}>{b}" for a in letters for b in letters if a != b],
                      *[f"{b}?" for b in letters]]
        self.vocab_size, self.ids = len(self.vocab), {word: i for i, word in enumerate(self.vocab)}
        self.block_size = 1 + 2 * self.sizes["n_filled"] + self.sizes["max_ops"]
        self.is_query = torch.tensor([word.endswith("?") for word in self.vocab])
        vocab_hash = hashlib.md5(str(self.vocab).encode()).hexdigest()[:8]
        path = self.path and self.path.replace(".pt", f"-clauses-{vocab_hash}.pt")
        try:  # split -> (x, y): the word rows' prompts in clauses, parsed once, then from a file
            self.clause_rows = torch.load(path, weights_only=True)
        except Exception:  # no file yet, or not one that torch reads: parsed again
            x = {s: torch.stack([self.clauses(decode(r[1:r.index(SEP)])) for r in rows.tolist()])
                 for s, rows in self.rows.items()}
            self.clause_rows = {s: (x[s], self.solve(x[s])) for s in x}
            if path:
                write_whole(path, lambda temporary: torch.save(self.clause_rows, temporary))

    def clauses(self, prompt):
        """Token ids (block_size,) of a prompt: <bos>, description, moves, queries, padding."""
        described = re.findall(r"[Tt]he (\w+) is in Box (\w)", prompt.split(". ")[0])
        moves = re.findall(r"Move the contents of Box (\w) to Box (\w)", prompt)
        filled = sorted(box for box, items in simulate(prompt)[0].items() if items)
        ids = [self.ids[word] for word in ["<bos>"] + [f"{item}@{box}" for item, box in described]
               + [f"{a}>{b}" for a, b in moves] + [f"{box}?" for box in filled]]
        return torch.tensor(ids + [0] * (self.block_size - len(ids)))

    def labels_and_depths(self, x):
        """(B, T) each: the labels and depths of clause ids x, by following the moves; else -1."""
        y, depth = torch.full_like(x, -1), torch.full_like(x, -1)
        for r, row in enumerate(x.tolist()):
            boxes = {}  # letter -> (item id, implicit moves the item has ridden)
            for t, word in enumerate(self.vocab[i] for i in row):
                if "@" in word:
                    item, box = word.split("@")
                    boxes[box] = (self.ids[item], 0)
                elif word[1:2] in (">", "?"):  # a move S>D, or a query S?
                    source, target = word[0], word[2:]
                    if source not in boxes or target in boxes:
                        raise ValueError(f"box_clauses: {word} at {t} reads an empty box or "
                                         "fills a full one")
                    item, hops = boxes.pop(source) if target else boxes[source]
                    y[r, t], depth[r, t] = boxes[target or source] = item, hops + bool(target)
        return y, depth

    def batch(self, split, index):
        return tuple(rows[index] for rows in self.clause_rows[split])

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        """Loss and accuracy on the first n_samples test rows; exact match: every query right."""
        x, y = (t[:n_samples] for t in self.clause_rows["test"])
        batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        queries = [(xb, yb.where(self.is_query[xb], -1)) for xb, yb in batches]  # only queries
        exact = score_batches(model, queries, self, device, autocast)["eval_whole_sequences"]
        return {**score_batches(model, batches, self, device, autocast), "eval_exact_match": exact}

    def describe(self, x, y=None, predictions=None):
        truth, depth = (t[0].tolist() for t in self.labels_and_depths(x[None]))
        truth = "  ".join(f"{self.vocab[i]}({d})" for i, d in zip(truth, depth) if i != -1)
        return answer_lines(self, x, y, predictions, self.decode(x), truth, None)


# ----------------------------------------------------------------------------------------------
# Regular languages: the twelve length-generalisation tasks of RegularGPT (Chi et al. 2023,
# Table 1), from Deletang et al.'s Chomsky-hierarchy suite and Bhattamishra et al.'s D_n and Tomita.


class LabelAtEnd(Task):
    """What the twelve regular-language tasks share: one label per sequence, at its last token.

    The vocabulary is the input symbols, then the class tokens, so the LM head reads the label
    out: parity's x = 0 1 1 0 1 has y = -1 -1 -1 -1 3 (3: "odd", after 0, 1, even). A batch has
    one length. A subclass labels a batch in _draw (torch) and one string in answer() (solve())."""

    name, symbols, classes = None, [], []
    default_lengths = (40, 500)  # (longest training length, longest test length)
    # Parity sits on a plateau near 50% first: with these RegularGPT learns it in every seed tried.
    train_defaults = {"n_embd": 64, "batch_size": 64, "lr": 1e-3, "max_iters": 5000}
    flags = {"max_train_length": dict(type=int, help="regular: train on lengths 1..this (40, 50)"),
             "max_test_length": dict(type=int, help="regular: at the end, test up to this (500)"),
             "length_samples": dict(type=int, help="regular: strings per test length (128)")}

    def __init__(self, max_train_length=None, max_test_length=None, length_samples=128):
        train_max = self.default_lengths[0] if max_train_length is None else max_train_length
        test_max = self.default_lengths[1] if max_test_length is None else max_test_length
        check_ranges(max_train_length=(train_max, 1), max_test_length=(test_max, train_max + 1),
                     length_samples=(length_samples, 1))
        self.length_samples, self.train_lengths = length_samples, range(1, train_max + 1)
        self.test_lengths, self.block_size = range(train_max + 1, test_max + 1), test_max
        self.vocab = list(self.symbols) + list(self.classes)
        self.vocab_size = len(self.vocab)

    def sample(self, batch_size, generator=None, split="train", length=None):
        if length is None:  # drawn with the data's generator, so a seeded run repeats
            pick = torch.randint(len(self.train_lengths), (1,), generator=generator).item()
            length = self.train_lengths[pick]
        x, labels = self._draw(batch_size, length, generator)
        y = torch.full_like(x, -1)
        y[:, -1] = labels + len(self.symbols)  # class k is token len(symbols) + k
        return x, y

    def chain_depth(self, x):
        # One state update per token: accuracy by depth is accuracy by length.
        return torch.full_like(x, x.size(1))

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        """n_samples spread over every training length; at the end, accuracy by test length."""
        def batches(lengths, n, size):
            for i, length in enumerate(lengths):
                # n // len(lengths) each, the remainder spread over evenly spaced lengths
                share = n * (i + 1) // len(lengths) - n * i // len(lengths)
                for start in range(0, share, size):
                    yield self.sample(min(size, share - start), generator, length=length)

        metrics = score_batches(model, batches(self.train_lengths, n_samples, batch_size), self,
                                device, autocast)
        if final:
            by_length = {}
            for n in tqdm(self.test_lengths, desc="test lengths", disable=None, leave=False):
                size = max(1, min(self.length_samples, 2 ** 16 // n))  # 2^16 tokens a batch
                by_length[str(n)] = score_batches(model, batches([n], self.length_samples, size),
                                                  self, device, autocast)["eval_whole_sequences"]
            metrics.update(length_acc=by_length,
                           length_score=sum(by_length.values()) / len(by_length))
        return metrics

    def solve(self, x):
        y = torch.full_like(x, -1)
        for row, ids in enumerate(x.tolist()):
            y[row, -1] = self.vocab.index(self.answer([self.vocab[i] for i in ids]))
        return y

    def describe(self, x, y=None, predictions=None):
        words = [self.vocab[i] for i in x.tolist()]
        words = words[:28] + ["…"] + words[-28:] if len(words) > 60 else words
        glue = "" if all(len(s) == 1 for s in self.symbols) else " "
        truth = self.vocab[int(self.solve(x[None])[0, -1] if y is None else y[-1])]
        line = f"{self.name}, length {x.size(0)}: {glue.join(words)}\ntruth {truth}"
        if predictions is not None:
            guess = self.vocab[int(predictions[-1])]
            line += f", model {guess} ({'right' if guess == truth else 'wrong'})"
        return line


class EvenPairs(LabelAtEnd):
    """Even pairs: is the number of neighbouring bits that differ even or odd (uniform bits)?
    even_pairs: 0 1 1 0 1 -> odd (01, 11, 10, 01 differ: three); odd when the ends differ."""

    name, symbols, classes = "even_pairs", ["0", "1"], ["even", "odd"]

    def _draw(self, batch_size, length, generator):
        bits = torch.randint(0, 2, (batch_size, length), generator=generator)
        return bits, (bits[:, 0] != bits[:, -1]).long()

    def answer(self, symbols):
        return self.classes[sum(a != b for a, b in itertools.pairwise(symbols)) % 2]


class Parity(LabelAtEnd):
    """Parity check: is the number of 1s even or odd? parity: 0 1 1 0 1 -> odd. Each bit is 1 with
    probability p_one (0.5; the paper's Table 2 tries 0.1..0.9, in both splits)."""

    name, symbols, classes = "parity", ["0", "1"], ["even", "odd"]
    flags = {**LabelAtEnd.flags, "p_one": dict(type=float, help="parity: chance of a 1 (0.5)")}

    def __init__(self, p_one=0.5, max_train_length=None, max_test_length=None, length_samples=128):
        check_ranges(p_one=(p_one, 0, 1))
        super().__init__(max_train_length, max_test_length, length_samples)
        self.p_one = p_one

    def _draw(self, batch_size, length, generator):
        bits = (torch.rand(batch_size, length, generator=generator) < self.p_one).long()
        return bits, bits.sum(1) % 2

    def answer(self, symbols):
        return self.classes["".join(symbols).count("1") % 2]


class CycleNavigation(LabelAtEnd):
    """Cycle navigation: walk on a cycle of 5 positions from 0 by uniform moves; where do you
    end? cycle_navigation: left left stay right left -> =3 (-2 mod 5)."""

    name, symbols = "cycle_navigation", ["left", "stay", "right"]
    classes = [f"={k}" for k in range(5)]

    def _draw(self, batch_size, length, generator):
        moves = torch.randint(0, 3, (batch_size, length), generator=generator)
        return moves, (moves - 1).sum(1) % 5  # token id - 1 is the move; torch's % is >= 0

    def answer(self, symbols):
        return f"={(symbols.count('right') - symbols.count('left')) % 5}"


class ModularArithmetic(LabelAtEnd):
    """Modular arithmetic: the value, mod 5, of uniform digits 0..4 and operators + - * (* binds
    first): modular_arithmetic: 3 - 4 * 2 + 1 -> =1 (-4 mod 5). An odd length is n0 op n1 ...
    op nk, as DeepMind's task; an even length gets a leading +."""

    name = "modular_arithmetic"
    symbols = ["0", "1", "2", "3", "4", "+", "-", "*"]
    classes = [f"={k}" for k in range(5)]
    PLUS, MINUS, TIMES = 5, 6, 7  # token ids of the operators

    def _draw(self, batch_size, length, generator):
        n_digits, leading_plus = (length + 1) // 2, length % 2 == 0
        digits = torch.randint(0, 5, (batch_size, n_digits), generator=generator)
        ops = torch.randint(self.PLUS, self.TIMES + 1, (batch_size, n_digits), generator=generator)
        ops[:, 0] = self.PLUS  # the first digit is always added, whether or not a + is shown
        pairs = torch.stack([ops, digits], dim=2).view(batch_size, 2 * n_digits)  # op, digit, ...
        x = pairs if leading_plus else pairs[:, 1:]
        # Left to right: `total` holds the finished terms, `term` the product being built.
        # + and - close the term and open a new one with their sign; * extends it.
        total = term = torch.zeros(batch_size, dtype=torch.long)
        for k in range(n_digits):
            times = ops[:, k] == self.TIMES
            total = torch.where(times, total, total + term) % 5
            signed = torch.where(ops[:, k] == self.MINUS, -digits[:, k], digits[:, k])
            term = torch.where(times, term * digits[:, k], signed) % 5
        return x, (total + term) % 5

    def answer(self, symbols):
        """By precedence: the signed terms between + and -, each the product of its digits."""
        terms = re.findall(r"([+-]?)((?:[0-4]\*)*[0-4])", "".join(symbols))
        total = sum((-1 if sign == "-" else 1) * math.prod(map(int, product.split("*")))
                    for sign, product in terms)
        return f"={total % 5}"


class DFARecognition(LabelAtEnd):
    """Recognition of a regular language given by a DFA: label yes (a member) or no. Batches are
    half members, half not (where the length has both), each uniform among the strings of its
    kind and length (a symbol drawn in proportion to the strings completing it)."""

    classes = ["no", "yes"]
    default_lengths = (50, 100)

    def __init__(self, transitions, accepting, max_train_length=None, max_test_length=None,
                 length_samples=128):
        super().__init__(max_train_length, max_test_length, length_samples)
        self.transitions = torch.tensor(transitions)  # (states, symbols): next state; start is 0
        accepts = torch.isin(torch.arange(len(transitions)), torch.tensor(accepting))
        # _counts[want][r][q] ~ the strings of length r from state q to acceptance (or not).
        self._counts = {True: [accepts.double()], False: [(~accepts).double()]}

    def _count_table(self, want, length):
        """_counts[want], grown to hold every length up to this one."""
        table = self._counts[want]
        while len(table) <= length:
            # A string of length r from q is a symbol s, then a string of length r-1 from δ(q, s).
            counts = table[-1][self.transitions].sum(1)
            table.append(counts / counts.max())  # rescaled (only ratios matter): no overflow
        return table

    def _walk(self, n, length, want, generator):
        """n strings of this length, uniform among members (want=True) or non-members."""
        counts = self._count_table(want, length)
        x, state = torch.zeros(n, length, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        for t in range(length):
            weights = counts[length - t - 1][self.transitions[state]]  # (n, symbols)
            x[:, t] = torch.multinomial(weights, 1, generator=generator).squeeze(1)
            state = self.transitions[state, x[:, t]]
        return x

    def _draw(self, batch_size, length, generator):
        has = {want: self._count_table(want, length)[length][0] > 0 for want in (True, False)}
        # Half members; an odd batch's odd row by a coin flip (a batch of one, sample.py's, either).
        n_yes = (batch_size + int(torch.randint(2, (1,), generator=generator))) // 2
        if not (has[True] and has[False]):  # a length with members only, or none
            n_yes = batch_size * int(has[True])
        x = torch.cat([self._walk(n_yes, length, True, generator),
                       self._walk(batch_size - n_yes, length, False, generator)])
        labels = (torch.arange(batch_size) < n_yes).long()
        order = torch.randperm(batch_size, generator=generator)
        return x[order], labels[order]

    def answer(self, symbols):
        return "yes" if self.is_member("".join(symbols)) else "no"


class BoundedDyck(DFARecognition):
    """D_n: balanced brackets never nested deeper than n (Bhattamishra et al.; d2, d3, d4, d12),
    a opening and b closing: d2: a a b a b b a b -> yes. The DFA's states: depths 0..n, dead."""

    symbols = ["a", "b"]

    def __init__(self, max_depth, max_train_length=None, max_test_length=None, length_samples=128):
        self.name, self.max_depth, dead = f"d{max_depth}", max_depth, max_depth + 1
        transitions = [[depth + 1 if depth < max_depth else dead, depth - 1 if depth > 0 else dead]
                       for depth in range(max_depth + 1)] + [[dead, dead]]
        super().__init__(transitions, [0], max_train_length, max_test_length, length_samples)

    def is_member(self, text):
        depths = [0, *itertools.accumulate(1 if bracket == "a" else -1 for bracket in text)]
        return depths[-1] == 0 and all(0 <= depth <= self.max_depth for depth in depths)


class Tomita(DFARecognition):
    """Tomita grammars 3 to 6 over 0 1 (Bhattamishra et al.). T3: no odd-length run of 1s directly
    followed by an odd-length run of 0s (tomita3: 1 1 1 0 0 1 1 -> yes). T4: no 000
    (tomita4: 1 0 0 0 1 -> no). T5: even numbers of 0s and of 1s (tomita5: 0 1 1 0 -> yes).
    T6: the 0s minus the 1s divisible by 3 (tomita6: 0 1 1 -> no)."""

    symbols = ["0", "1"]
    # (transitions, accepting): row q lists the next state after reading 0 and after 1.
    DFAS = {
        # 0 fine, 1 in an odd run of 1s, 2/3 an even/odd run of 0s after one, 4 dead.
        3: ([[0, 1], [3, 0], [3, 1], [2, 4], [4, 4]], [0, 1, 2]),
        # the number of 0s just read, 0..2; 3 dead.
        4: ([[1, 0], [2, 0], [3, 0], [3, 3]], [0, 1, 2]),
        # 2 * (odd number of 0s) + (odd number of 1s).
        5: ([[2, 1], [3, 0], [0, 3], [1, 2]], [0]),
        # (number of 0s - number of 1s) mod 3.
        6: ([[1, 2], [2, 0], [0, 1]], [0]),
    }

    def __init__(self, number, max_train_length=None, max_test_length=None, length_samples=128):
        self.name, self.number = f"tomita{number}", number
        super().__init__(*self.DFAS[number], max_train_length, max_test_length, length_samples)

    def is_member(self, text):
        if self.number == 3:  # a whole odd run of 1s, then a whole odd run of 0s
            return not re.search(r"(?<!1)1(11)*0(00)*(?!0)", text)
        if self.number == 4:
            return "000" not in text
        zeros, ones = text.count("0"), text.count("1")
        if self.number == 5:
            return zeros % 2 == 0 and ones % 2 == 0
        return (zeros - ones) % 3 == 0


# ----------------------------------------------------------------------------------------------
# LEGO, Learning Equality and Group Operations (Zhang et al. 2022, Sections 2-4).
# Each group: (op tokens, value tokens, images), images[g][v] the value op g sends value v to.
# S3 acts on itself: a value is written as its images (120 sends 0 to 1, 1 to 2, 2 to 0), an op
# is the same with a p (p012 is the identity), and op g sends value x to g·x.
S3 = list(itertools.permutations(range(3)))  # (p(0), p(1), p(2)) for each permutation p
LEGO_GROUPS = {
    "z2": (["+", "-"], ["0", "1"], [[0, 1], [1, 0]]),
    "s3": (["p" + "".join(map(str, g)) for g in S3], ["".join(map(str, x)) for x in S3],
           [[S3.index(tuple(g[i] for i in x)) for x in S3] for g in S3]),  # g·x = g∘x
}
LEGO_WORDS = ["[CLS]", "[SEP]", "=", ","] + list("abcdefghijklmnopqrstuvwxyz")
LEGO_CLS, LEGO_SEP, LEGO_EQUALS, LEGO_COMMA, LEGO_FIRST_VARIABLE = range(5)


class LEGO(Task):
    """LEGO (Zhang et al. 2022): resolve a chain of n assignments written in shuffled order.

    n clauses (n_vars, 12) `var = op arg ,` of distinct letters, between [CLS] and [SEP]. The
    root applies the identity to a uniform value (`b = + 1 ,`), each other clause an op to the
    variable before it in the chain (`c = - b ,`). z2 (Task 1): + keeps and - flips 0 and 1;
    s3 (Task 2): S3 acting on itself (`y = p021 x ,`: x, then p021). z2, n = 3:

        position  0        1  2  3  4  5  6  7  8  9 10 11 12 13 14 15  16
        token     [CLS]    a  =  -  c  ,  b  =  +  1  ,  c  =  -  b  ,  [SEP]
        y         -        1  -  -  -  -  1  -  -  -  -  0  -  -  -  -  -
        chain     -        2  -  -  -  -  0  -  -  -  -  1  -  -  -  -  -

    A label sits on its clause's variable: a's needs c, written after it (a bidirectional model).
    Training scores the chain positions of --n_supervised and --supervise_last; the test all.
    """

    needs = frozenset({"bidirectional"})
    flags = {"group": dict(choices=["z2", "s3"], help="lego: Task 1 (+/- on 0, 1) or 2 (S3) (z2)"),
             "n_vars": dict(type=int, help="lego: clauses (variables) per sentence (12)"),
             "n_supervised": dict(type=int, help="lego: train on chain positions #0..this-1 (all)"),
             "supervise_last": dict(action="store_const", const=True,
                                    help="lego: also train on the last chain position")}

    def __init__(self, group="z2", n_vars=12, n_supervised=None, supervise_last=False):
        check_ranges(n_vars=(n_vars, 1, 26),
                     n_supervised=(n_vars if n_supervised is None else n_supervised, 1, n_vars))
        if supervise_last and (n_supervised or n_vars) >= n_vars - 1:
            raise ValueError(f"--supervise_last adds the last chain position after a gap: it "
                             f"needs --n_supervised below {n_vars - 1} (--n_vars {n_vars} - 1)")
        self.group, self.n_vars = group, n_vars
        self.ops, self.value_words, images = LEGO_GROUPS[group]
        self.images = torch.tensor(images)                     # (ops, values)
        self.vocab = LEGO_WORDS + self.ops + self.value_words
        self.vocab_size, self.block_size = len(self.vocab), 5 * n_vars + 2
        self.first_op, self.first_value = len(LEGO_WORDS), len(LEGO_WORDS) + len(self.ops)
        self.broadcast_ids = (LEGO_CLS, LEGO_SEP)
        self.supervised = torch.arange(n_vars) < (n_supervised or n_vars)
        self.supervised[-1] |= bool(supervise_last)

    def sample(self, batch_size, generator=None, split="train"):
        B, n = batch_size, self.n_vars
        n_ops, n_values = self.images.shape
        # The chain: distinct variables, an op per clause, the value the root's op acts on.
        variables = torch.rand(B, 26, generator=generator).argsort(dim=1)[:, :n]   # (B, n)
        ops = torch.randint(n_ops, (B, n), generator=generator)
        ops[:, 0] = 0  # the root's op is the identity (+, p012): #0 reads its value directly
        root_value = torch.randint(n_values, (B,), generator=generator)
        values = torch.empty(B, n, dtype=torch.long)
        for i in range(n):  # walk the chain: clause i's op acts on the value before it
            values[:, i] = self.images[ops[:, i], values[:, i - 1] if i else root_value]

        # Clause i in tokens; its argument is the root's value, or the previous variable.
        variable_ids = variables + LEGO_FIRST_VARIABLE
        args = torch.cat([root_value[:, None] + self.first_value, variable_ids[:, :-1]], dim=1)
        equals, comma = torch.full((B, n), LEGO_EQUALS), torch.full((B, n), LEGO_COMMA)
        clauses = torch.stack([variable_ids, equals, ops + self.first_op, args, comma],
                              dim=2)                                            # (B, n, 5)
        # Training scores the supervised chain positions; the test scores every one.
        supervised = self.supervised if split == "train" else torch.ones(n, dtype=torch.bool)
        labels = torch.where(supervised, values + self.first_value, -1)         # (B, n)

        # Shuffle: slot s of the sentence holds chain clause order[:, s].
        order = torch.rand(B, n, generator=generator).argsort(dim=1)
        clauses = clauses.gather(1, order[:, :, None].expand(B, n, 5))
        x = torch.cat([torch.full((B, 1), LEGO_CLS), clauses.view(B, 5 * n),
                       torch.full((B, 1), LEGO_SEP)], dim=1)                    # (B, 5n + 2)
        y = torch.full_like(x, -1)
        y[:, 1:-1:5] = labels.gather(1, order)  # on each clause's left-hand variable
        return x, y

    @staticmethod
    def apply(op, value):
        """The value (a word) op gives value: + keeps, - flips; pABC·XYZ sends i to ABC[XYZ[i]]."""
        if op in "+-":
            return value if op == "+" else str(1 - int(value))
        return "".join(op[1 + int(digit)] for digit in value)

    def labels_and_depths(self, x):
        if x.size(1) != self.block_size:
            raise ValueError(f"lego: {x.size(1)} tokens, not the {self.block_size} of a sequence")
        y, depth = torch.full_like(x, -1), torch.full_like(x, -1)
        for row, ids in enumerate(x.tolist()):
            clauses = [[self.vocab[i] for i in ids[s:s + 5]] for s in range(1, len(ids) - 1, 5)]
            known = {}  # variable -> (value, chain position)
            for _ in clauses:  # a pass resolves one more link of the chain at least
                for variable, _, op, argument, _ in clauses:
                    if argument in self.value_words or argument in known:
                        value, position = known.get(argument, (argument, -1))
                        known[variable] = (self.apply(op, value), position + 1)
            if len(known) < len(clauses):
                raise ValueError(f"lego: row {row} is not one chain: {self.decode(ids)}")
            for s, (variable, *_) in enumerate(clauses):
                value, position = known[variable]
                y[row, 1 + 5 * s], depth[row, 1 + 5 * s] = self.vocab.index(value), position
        return y, depth

    def describe(self, x, y=None, predictions=None):
        truth, depth = (t[0] for t in self.labels_and_depths(x[None]))
        slots = sorted(range(1, x.size(0) - 1, 5), key=lambda t: int(depth[t]))  # chain order

        def chain(labels):
            return "  ".join(f"#{k} {self.vocab[int(x[t])]}={self.vocab[int(labels[t])]}"
                             for k, t in enumerate(slots))

        lines = [f"sentence: {self.decode(x)}", f"truth   : {chain(truth)}"]
        if predictions is not None:
            scored = [t for t in slots if y is None or y[t] != -1]
            hits = sum(int(predictions[t] == truth[t]) for t in scored)
            lines.append(f"model   : {chain(predictions)}  ({hits}/{len(scored)} scored right)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The inductive scratchpad (Abbe et al. 2024, "How Far Can Transformers Reason?", Appendix C):
# states Q : s1 # s2 # ... # sk (Q the question, ":" starts, "#" closes a state). The model
# writes s[i] as if the sequence were only Q : s[i-1] #, so it learns one induction step. In
# training every closed state is read twice, the copy without loss; a token sees its own group
# and group 0 (Q), and positions restart after Q (t tokens) in every group (forward's groups=,
# positions=):
#
#     token     Q ... :   s1 #    s1 #   s2 #    s2 #   s3
#     group     0 ... 0   1  1    2  2   2  2    3  3   3
#     position  0 ... t-1 t  t+1  t  t+1 t+2 t+3 t  t+1 t+2
#     loss      as Q      1  1    0  0   1  1    0  0   1

DEAD = -1  # the group of padding: no real token has it, so no real token sees these entries


def training_form(ids, start_id, sep_id):
    """Q : s1 # s2 # ... sk -> Q : s1 # s1 # s2 # s2 # ... sk (lists of ids)."""
    if start_id not in ids:
        return list(ids)
    cut = ids.index(start_id) + 1
    form, state = list(ids[:cut]), []
    for token in ids[cut:]:
        state.append(token)
        if token == sep_id:
            form += state + state
            state = []
    return form + state


def segments(idx, start_id, sep_id):
    """(B, T): -1 up to the start token, then j on the form's j-th state and # (odd j: copies)."""
    is_start = (idx == start_id).long()
    started = is_start.cumsum(1) - is_start > 0        # a start token strictly before
    closes = ((idx == sep_id) & started).long()
    return torch.where(started, closes.cumsum(1) - closes, -1)


def inductive_layout(idx, start_id, sep_id):
    """(positions, groups), each (B, T), of rows in the training form: on Q group 0, positions
    0, 1, ...; on segment j group 1 + ⌈j / 2⌉, positions t + (index in the group)."""
    segment = segments(idx, start_id, sep_id)
    groups = torch.where(segment < 0, 0, 1 + (segment + 1) // 2)
    index = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
    begins = torch.ones_like(groups, dtype=torch.bool)
    begins[:, 1:] = groups[:, 1:] != groups[:, :-1]
    first = torch.where(begins, index, 0).cummax(dim=1).values  # each group's first token
    question = (segment < 0).sum(dim=1, keepdim=True)           # t, per row
    return torch.where(segment < 0, index, question + index - first), groups


def copies(idx, start_id, sep_id):
    """(B, T) True on the second copy of every state: the tokens that carry no loss."""
    segment = segments(idx, start_id, sep_id)
    return (segment > 0) & (segment % 2 == 1)


@torch.no_grad()
def generate_inductive(model, idx, max_new_tokens, start_id, sep_id, use_cache=True,
                       stop_token=None):
    """Continue idx (B, T) greedily by max_new_tokens tokens under the inductive layout: (B, T +
    new) in the plain form Q : s1 # s2 # .... Each step lays out the training form so far (with a
    cache, what it has not read); it stops once all wrote stop_token or positions run out."""
    B, T, device = *idx.shape, idx.device
    with evaluating(model):
        caches = model.new_caches() if use_cache else None
        read = torch.zeros(B, dtype=torch.long, device=device)  # form tokens the cache has seen
        for _ in range(max_new_tokens):
            forms = [torch.tensor(training_form(row, start_id, sep_id)) for row in idx.tolist()]
            last = torch.tensor([len(form) - 1 for form in forms], device=device)
            tokens = torch.nn.utils.rnn.pad_sequence(forms, batch_first=True).to(device)
            positions, groups = inductive_layout(tokens, start_id, sep_id)
            # Padding on the right is unseen by the real tokens (causal): positions kept in range.
            pad = torch.arange(tokens.size(1), device=device) > last[:, None]
            positions, groups = positions.masked_fill(pad, 0), groups.masked_fill(pad, DEAD)
            current = groups[torch.arange(B), last]  # each row's group: what the cache keeps
            if use_cache:  # the form not read yet, but a state's closing #: its copy is read
                segment = segments(tokens, start_id, sep_id)
                column = torch.arange(tokens.size(1), device=device)
                closing = (tokens == sep_id) & (segment >= 0) & (segment % 2 == 0)
                new = (column >= read[:, None]) & (column <= last[:, None]) & ~closing
                # The new tokens moved to the right end, padded on the left in group DEAD.
                width = int(new.sum(1).max())
                order = new.long().argsort(dim=1, stable=True)[:, -width:]
                pad = ~new.gather(1, order)
                tokens, positions, groups = (t.gather(1, order).masked_fill(pad, fill) for t, fill
                                             in ((tokens, 0), (positions, 0), (groups, DEAD)))
                read, last = last + 1, torch.full((B,), width - 1, device=device)
            if model.config.pos == "learned" and int(positions.max()) >= model.config.block_size:
                break
            logits = model(tokens, caches=caches, positions=positions, groups=groups)[0]
            if use_cache:  # forget what no row sees any more: all but group 0 and its group
                seen = caches[0].groups                                          # (B, T_seen)
                columns = ((seen == 0) | (seen == current[:, None])).any(dim=0)
                if not columns.all():
                    for cache in caches:
                        cache.keep(columns)
            idx = torch.cat([idx, logits[torch.arange(B), last].argmax(-1, keepdim=True)], dim=1)
            if stop_token is not None and (idx[:, T:] == stop_token).any(1).all():
                break
    return idx


# ----------------------------------------------------------------------------------------------
# Cycles (Abbe et al. 2024, Section 3.2): one 2n-cycle and two n-cycles look alike locally, so a
# model must walk the graph; the inductive scratchpad lets it learn one step, and walk further.

CYCLE_WORDS = ["<pad>", ">", ";", "?", ":", "#", "0", "1", "."]
(CYCLE_PAD, CYCLE_EDGE, CYCLE_END, CYCLE_QUERY, CYCLE_START, CYCLE_SEP, CYCLE_NO, CYCLE_YES,
 CYCLE_STOP) = range(len(CYCLE_WORDS))


class Cycles(Task):
    """Is B reachable from A? One directed cycle of 2n nodes, or two (Abbe et al. 2024).

    The edges `vX > vY ;` in shuffled order, then the query `vA ? vB ;`. B is d = `distance`
    steps ahead of A on one 2n-cycle, or heads the other cycle when A's has d nodes (two n-cycles
    by default): both labels walk d steps, so a test at a larger d tests longer walks (the
    paper's out-of-distribution protocol). The answer `1 .` or `0 .`, balanced; names fresh:

        prompt     v46 > v39 ; v77 > v46 ; v39 > v28 ; v28 > v54 ; v58 > v77 ; v54 > v58 ;
                   v39 ? v58 ;
        none       1 .
        full       v39 > v28 > v54 > v58 ; 1 .
        inductive  : v39 # v28 # v54 # v58 ; 1 .

    "full" writes the walk first, each step with every earlier one in view; "inductive" writes
    one state per node, A first and `;` after the last, as the paper's public code does: the
    first step is then like every other (a node in, its successor out), and the stop is a token
    decided from the state just written (copies unscored; layout(x) gives positions and groups).
    """

    needs = frozenset({"causal", "generation"})
    stop_token = CYCLE_STOP
    flags = {"cycle_n": dict(type=int, help="cycles: nodes per cycle n (5)"),
             "cycle_distance": dict(type=int, help="cycles: walk length d, 1..2n-1 (n)"),
             "test_cycle_n": dict(type=int, help="cycles: n of the test split (cycle_n)"),
             "test_cycle_distance": dict(type=int, help="cycles: the test split's distance"),
             "scratchpad": dict(choices=["none", "full", "inductive"], help="cycles: the answer "
                                "alone (none), the walk first (full), or inductive states (none)"),
             "cycle_names": dict(type=int, help="cycles: node names to draw from (100, or 2n)"),
             "score_question": dict(action="store_const", const=True,
                                    help="cycles: also train on the question's tokens")}
    train_defaults = {"n_layer": 2, "batch_size": 64, "max_iters": 2000}
    start = []  # what opens the states after the prompt: ":" for the inductive scratchpad

    def __init__(self, cycle_n=5, cycle_distance=None, test_cycle_n=None,
                 test_cycle_distance=None, scratchpad="none", cycle_names=None,
                 score_question=False):
        if test_cycle_distance is None and test_cycle_n in (None, cycle_n):
            test_cycle_distance = cycle_distance  # the same graphs as training, unless told
        test_cycle_n = cycle_n if test_cycle_n is None else test_cycle_n
        self.sizes = {}  # split -> (n, distance)
        for split, flag, n, distance in (("train", "", cycle_n, cycle_distance),
                                         ("test", "test_", test_cycle_n, test_cycle_distance)):
            distance = n if distance is None else distance
            check_ranges(**{f"{flag}cycle_n": (n, 2),
                            f"{flag}cycle_distance": (distance, 1, 2 * n - 1)})
            self.sizes[split] = (n, distance)
        self.scratchpad, self.score_question = scratchpad, bool(score_question)
        if scratchpad == "inductive":
            self.start, self.needs = [CYCLE_START], self.needs | {"groups"}
        largest = max(cycle_n, test_cycle_n)
        self.n_names = max(100, 2 * largest) if cycle_names is None else cycle_names
        check_ranges(cycle_names=(self.n_names, 2 * largest))  # a name per node
        self.vocab = CYCLE_WORDS + [f"v{i}" for i in range(self.n_names)]
        self.vocab_size = len(self.vocab)
        self.block_size = max(self._length(*size) for size in self.sizes.values())

    def _length(self, n, distance):
        """The longest row of a split: 2n edges, the query, ":", the longest walk, the answer."""
        return 8 * n + 4 + len(self.start) + {"none": 2, "full": 2 * distance + 4,
                                              "inductive": 4 * distance + 4}[self.scratchpad]

    def _prompt(self, n, distance, connected, generator):
        """Token ids of one graph and its query (and ":" for the inductive scratchpad)."""
        names = torch.randperm(self.n_names, generator=generator)[:2 * n] + len(CYCLE_WORDS)
        names = names.tolist()  # A is names[0] and B names[distance], on A's cycle or not
        sizes = [2 * n] if connected else [distance, 2 * n - distance]
        successor = {names[c + i]: names[c + (i + 1) % size]
                     for c, size in zip([0, sizes[0]], sizes) for i in range(size)}
        order = torch.randperm(2 * n, generator=generator).tolist()
        edges = [token for i in order
                 for token in (names[i], CYCLE_EDGE, successor[names[i]], CYCLE_END)]
        return edges + [names[0], CYCLE_QUERY, names[distance], CYCLE_END] + self.start

    @staticmethod
    def graph_and_query(prompt):
        """(each node's successor, A, B) of a prompt's token ids."""
        query = prompt.index(CYCLE_QUERY)
        successor = {prompt[i]: prompt[i + 2] for i in range(0, query - 1, 4)}
        return successor, prompt[query - 1], prompt[query + 1]

    @staticmethod
    def walk(prompt):
        """(nodes after A, connected): follow the edges from A until B or A again."""
        successor, a, b = Cycles.graph_and_query(prompt)
        nodes = [successor.get(a)]
        while nodes[-1] not in (a, b):
            if nodes[-1] not in successor or len(nodes) > len(successor):  # a typed prompt
                raise ValueError("cycles: the walk from A leaves the graph, or never ends")
            nodes.append(successor[nodes[-1]])
        return nodes, nodes[-1] == b

    def completion(self, prompt):
        """The token ids that follow a prompt: the scratchpad of --scratchpad, then the answer."""
        nodes, connected = self.walk(prompt)
        answer = [CYCLE_YES if connected else CYCLE_NO, CYCLE_STOP]
        if self.scratchpad == "none":
            return answer
        states = [prompt[prompt.index(CYCLE_QUERY) - 1]] + nodes  # A, then each step's node
        sep = CYCLE_EDGE if self.scratchpad == "full" else CYCLE_SEP  # `>` or `#` between them
        return [token for node in states[:-1] for token in (node, sep)] + [
            states[-1], CYCLE_END] + answer

    def _rows(self, prompts, score_question=False):
        """(x, y) of prompts completed (in the training form if inductive), padded on the right."""
        # A row without ":" (no inductive scratchpad) is its own training form, with no copies.
        rows = [training_form(prompt + self.completion(prompt), CYCLE_START, CYCLE_SEP)
                for prompt in prompts]
        x = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in rows], batch_first=True)
        y = torch.full_like(x, -1)
        # The first scored target: the prompt's second token, or what follows the prompt.
        start = 0 if score_question else len(prompts[0]) - 1
        y[:, start:-1] = x[:, start + 1:]
        unscored = (x == CYCLE_PAD) | copies(x, CYCLE_START, CYCLE_SEP)
        y[:, :-1] = y[:, :-1].masked_fill(unscored[:, 1:], -1)
        return x, y

    def sample(self, batch_size, generator=None, split="train"):
        n, distance = self.sizes["test" if split == "test" else "train"]
        # Balanced: half the rows connected, in random order (an odd batch's extra row either).
        offset = torch.randint(2, (), generator=generator)
        connected = ((torch.randperm(batch_size, generator=generator) + offset) % 2).tolist()
        return self._rows([self._prompt(n, distance, c, generator) for c in connected],
                          score_question=self.score_question and split == "train")

    def prompts(self, x):
        """Each row's prompt (a list of ids): the edges, the query, and ":" if inductive."""
        return [ids[:ids.index(CYCLE_QUERY) + 3] + self.start for ids in x.tolist()]

    def labels_and_depths(self, x):
        prompts = self.prompts(x)
        y = self._rows(prompts)[1][:, :x.size(1)]
        steps = torch.tensor([len(self.walk(prompt)[0]) for prompt in prompts])
        return y, torch.where(y != -1, steps[:, None], -1)

    def layout(self, x):
        if self.scratchpad != "inductive":
            return {}
        return dict(zip(("positions", "groups"), inductive_layout(x, CYCLE_START, CYCLE_SEP)))

    def generate(self, model, idx, max_new_tokens, use_cache=True):
        if self.scratchpad == "inductive":
            return generate_inductive(model, idx, max_new_tokens, CYCLE_START, CYCLE_SEP,
                                      use_cache, CYCLE_STOP)
        return super().generate(model, idx, max_new_tokens, use_cache)

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        """Task.evaluate's scores, and eval_answer_acc: greedy answers (before the ".") right."""
        batches = [self.sample(min(batch_size, n_samples - start), generator, split="test")
                   for start in range(0, n_samples, batch_size)]
        metrics = score_batches(model, batches, self, device, autocast)
        right, use_cache = 0, "cache" in model.config.abilities()
        for x, _ in batches:
            prompts = self.prompts(x)
            room = self._length(*self.sizes["test"]) - len(prompts[0])
            with autocast:
                out = self.generate(model, torch.tensor(prompts, device=device), room, use_cache)
            for prompt, row in zip(prompts, out.tolist()):
                written = row[len(prompt):]
                stop = written.index(CYCLE_STOP) if CYCLE_STOP in written else 0
                right += stop > 0 and written[stop - 1] == self.completion(prompt)[-2]
        return {**metrics, "eval_answer_acc": right / n_samples}

    def encode(self, text):
        """Token ids (T,) of a cycles text; a prompt ending with the query gets ":" if inductive."""
        ids = super().encode(text)
        if len(ids) >= 3 and ids[-3] == CYCLE_QUERY and ids[-1] == CYCLE_END:
            ids = torch.cat([ids, torch.tensor(self.start, dtype=torch.long)])
        return ids

    def describe(self, x, y=None, predictions=None):
        prompt = self.prompts(x[None])[0]
        written = x.tolist()[len(prompt):]
        end = written.index(CYCLE_STOP) + 1 if CYCLE_STOP in written else len(written)
        return answer_lines(self, x, y, predictions, self.decode(prompt),
                            self.decode(self.completion(prompt)),
                            self.decode(written[:end]) if written else None)


# ----------------------------------------------------------------------------------------------
# Text: language modelling on a file, the ChaCAL paper's Section 5.3 at a size a laptop trains.

GPT2_VOCAB = 50257  # GPT-2's BPE tokens: what a .bin file holds, and what GPT-2's weights read


def python_docs_corpus(cache_dir="data_cache"):
    """Path of the default corpus, English that ships with Python: pydoc_data's help topics by
    name, then every docstring of 200 characters or more in the standard library's top-level
    modules (files by name, ast.walk's order). The same Python gives the same bytes."""
    import ast
    import platform
    import sysconfig
    from pydoc_data.topics import topics
    path = os.path.join(cache_dir, f"python{platform.python_version()}-docs.txt")
    if os.path.exists(path):
        return path
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = [topics[name] for name in sorted(topics)] + [
        doc for file in files for node in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
        if isinstance(node, kinds) and len(doc := ast.get_docstring(node) or "") >= 200]
    corpus = "\n\n".join(docs).encode("utf-8")
    os.makedirs(cache_dir, exist_ok=True)
    write_whole(path, lambda temporary: pathlib.Path(temporary).write_bytes(corpus))
    return path


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer():
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained("gpt2")  # from transformers' cache when offline
    except Exception as error:  # not installed, or not downloaded and offline
        raise ValueError(f"text: GPT-2 tokens need GPT-2's tokenizer (pip install transformers, "
                         f"and a network once): {type(error).__name__}") from None


class Text(Task):
    """Language modelling: predict every next token of a file, its first 90% for training, the
    last 10% for validation: bytes (vocabulary 256), or in a .bin GPT-2 token ids (uint16, as
    nanoGPT's prepare.py writes them; --init_from gpt2). A batch is random windows of context + 1
    tokens, x without the last, y without the first. With context 8, "Tom's cat sat." gives:

        text    T    o    m    '    s         c    a    t
        x      84  111  109   39  115   32   99   97         (UTF-8 bytes)
        y     111  109   39  115   32   99   97  116         (x moved left by one)

    evaluate() scores consecutive validation windows and adds the perplexity."""

    needs = frozenset({"causal", "generation"})  # sample.py continues a prompt
    train_defaults = {"n_layer": 4, "lr": 1e-3, "eval_samples": 256}
    flags = {"data": dict(help="text: a file of bytes, or a .bin of GPT-2 token ids (default: "
                               "Python's docs, built in data_cache/)"),
             "context": dict(type=int, help="text: tokens per training window (128)")}

    def __init__(self, data=None, context=128, cache_dir="data_cache"):
        path = python_docs_corpus(cache_dir) if data is None else data
        self.gpt2_tokens = path.endswith(".bin")
        try:  # a missing file is an OSError, an empty or odd-sized one a ValueError
            self.ids = np.memmap(path, dtype=np.uint16 if self.gpt2_tokens else np.uint8, mode="r")
        except ValueError as error:
            raise ValueError(f"--data {path}: {error}") from None
        # Another file shows ids past GPT-2's vocabulary at once: its ends are checked.
        if self.gpt2_tokens and max(int(self.ids[:1 << 20].max()),
                                    int(self.ids[-(1 << 20):].max())) >= GPT2_VOCAB:
            raise ValueError(f"--data {path}: holds ids of {GPT2_VOCAB} or more: not GPT-2 tokens")
        self.vocab_size = GPT2_VOCAB if self.gpt2_tokens else 256
        self.split_at = len(self.ids) - len(self.ids) // 10  # validation: the last 10%
        n_test = len(self.ids) - self.split_at
        check_ranges(context=(context, 1, n_test - 1))  # a window of context + 1 in validation
        self.block_size, self.prompt_length = context, max(1, context // 4)
        # What was trained on, in one line: the default corpus differs between Pythons.
        unit = "GPT-2 tokens" if self.gpt2_tokens else "bytes"
        digest = "" if data is not None else f", sha256 {hashlib.sha256(self.ids).hexdigest()[:16]}"
        print(f"text: {path}, {len(self.ids):,} {unit}{digest}; the last {n_test:,} for validation")

    def windows(self, starts):
        """(x, y) (B, context) of the windows starting at `starts` (a list)."""
        rows = self.ids[np.asarray(starts)[:, None] + np.arange(self.block_size + 1)]
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def sample(self, batch_size, generator=None, split="train"):
        first, end = (0, self.split_at) if split == "train" else (self.split_at, len(self.ids))
        starts = torch.randint(first, end - self.block_size, (batch_size,), generator=generator)
        return self.windows(starts.tolist())

    def evaluate(self, model, n_samples, batch_size, generator, device="cpu",
                 autocast=contextlib.nullcontext(), final=False):
        starts = range(self.split_at, len(self.ids) - self.block_size, self.block_size)[:n_samples]
        batches = (self.windows(list(starts[k:k + batch_size]))
                   for k in range(0, len(starts), batch_size))
        metrics = score_batches(model, batches, self, device, autocast)
        loss = metrics["eval_loss"]  # math.exp overflows past 709, as a diverging run's loss may
        return {**metrics, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf")}

    def chain_depth(self, x):
        return torch.zeros_like(x)

    def solve(self, x):
        """The labels of windows x: their tokens after where each first occurs in the file."""
        corpus, width, starts = self.ids.tobytes(), self.ids.itemsize, []
        for ids in x.tolist():
            needle = np.asarray(ids, dtype=self.ids.dtype).tobytes()
            at = corpus.find(needle)
            while at > 0 and at % width:  # a match must start at a token, not inside one
                at = corpus.find(needle, at + 1)
            starts.append(at // width)
        return self.windows(starts)[1]

    def encode(self, text):
        ids = gpt2_tokenizer().encode(text) if self.gpt2_tokens else list(text.encode("utf-8"))
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids):
        ids = [int(i) for i in ids]
        return (gpt2_tokenizer().decode(ids) if self.gpt2_tokens
                else bytes(ids).decode("utf-8", errors="replace"))

    def describe(self, x, y=None, predictions=None):
        lines = [f"--- text ({x.size(0)} tokens) ---", self.decode(x)]
        if predictions is not None:
            lines += ["--- the model's next-token guesses ---", self.decode(predictions)]
        return "\n".join(lines)


TASKS = {
    "toy": PointerChains,
    "boxes": Boxes,
    "box_clauses": BoxClauses,
    "even_pairs": EvenPairs,
    "parity": Parity,
    "cycle_navigation": CycleNavigation,
    "modular_arithmetic": ModularArithmetic,
    **{f"d{n}": functools.partial(BoundedDyck, n) for n in (2, 3, 4, 12)},
    **{f"tomita{n}": functools.partial(Tomita, n) for n in (3, 4, 5, 6)},
    "lego": LEGO,
    "cycles": Cycles,
    "text": Text,
}
# The tasks of the RegularGPT paper's Table 1: one label at the end, tested at unseen lengths.
REGULAR_LANGUAGES = ["even_pairs", "parity", "cycle_navigation", "modular_arithmetic",
                     "d2", "d3", "d4", "d12", "tomita3", "tomita4", "tomita5", "tomita6"]


def get_task(name, **options):
    """The task called `name`, built with its options (e.g. get_task("toy", n_blocks=8))."""
    if name not in TASKS:
        raise ValueError(f"--task: unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name](**options)


def task_class(name):
    """The class behind --task name (d2 .. tomita6 are one class each, with an argument bound)."""
    return getattr(TASKS[name], "func", TASKS[name])


def task_flags():
    """Every task's train.py flags by option name; tasks that share an option share its flag."""
    return {name: flag for task in TASKS for name, flag in task_class(task).flags.items()}


def task_from_settings(settings):
    """The task of a run's settings (train.py's flags, e.g. a checkpoint's "args"): the options
    it takes, where set; a task flag set for a task that does not take it is an error."""
    name = settings["task"]
    options = inspect.signature(TASKS[name]).parameters if name in TASKS else task_flags()
    stray = [f for f in task_flags() if f not in options and settings.get(f) is not None]
    if stray:
        raise ValueError(f"--{stray[0]} is not an option of --task {name}; drop it")
    return get_task(name, **{k: settings[k] for k in options if settings.get(k) is not None})


if __name__ == "__main__":  # python data.py TASK [SEED]: a test example of TASK with its answer
    import sys
    if len(sys.argv) > 1 and sys.argv[1] not in TASKS:
        raise SystemExit(f"data.py: {sys.argv[1]!r} is no task; choose from {', '.join(TASKS)}")
    task = get_task(sys.argv[1] if len(sys.argv) > 1 else "toy")
    x, y = task.sample(1, torch.Generator().manual_seed(int(sys.argv[2:3] and sys.argv[2] or 0)),
                       split="test")
    print(task.describe(x[0], y[0]))
