"""
Train a GPT with standard or ChaCAL attention on a task, with fresh data every step.

    python train.py --attn chacal --task toy                  # 1 ChaCAL layer: >99% in ~2 min on a laptop CPU
    python train.py --attn standard --task toy                # 1 standard layer: stuck near 20%
    python train.py --attn standard --task toy --n_layer 4    # Theorem 1: 4 layers for 15 hops
    python train.py --resume                                  # continue the run in out/ exactly
    python train.py --attn dilated --share_weights --pos none --task parity   # RegularGPT, C = 2

The paper's size and schedule (Table 4 of the ChaCAL paper) for the toy task:

    python train.py --attn chacal --task toy --n_embd 512 --n_head 8 --batch_size 128 \\
        --lr 3e-4 --warmup_iters 8000 --max_iters 24000 --eval_interval 500

Every evaluation appends one JSON line to out_dir/metrics.jsonl and saves out_dir/ckpt.pt
(model, optimizer, config, step, RNG states), so a killed run resumes where it was saved.
Lessons call main([...flags...]), which returns the run's summary and metrics, or
train_many([...], jobs=N) for several runs at once.
"""

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from attention import ATTENTIONS
from data import EOS, REGULAR_LANGUAGES, decode, get_task, until_eos
from model import GPT, GPTConfig


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line naming it, not the whole usage above it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser():
    parser = OneLineErrors(
        prog="train.py", description="Train a GPT with standard or ChaCAL attention on a task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    # what to train
    add("--task", default="toy", help="task to train on: toy (pointer chains), boxes (text), lego "
        "(chains of assignments; with --bidirectional), or a regular language: "
        + ", ".join(REGULAR_LANGUAGES) + "; a regular language changes the defaults of "
        + " ".join(f"--{k} {v}" for k, v in REGULAR_LANGUAGE_DEFAULTS.items()))
    add("--attn", default="chacal", help="attention of every layer (" + ", ".join(ATTENTIONS)
        + "), or one per layer: standard,chacal")
    add("--gamma", type=float, default=0.9, help="ChaCAL's γ in [0, 1); 0 is standard attention "
        "(other attentions ignore it, so one set of flags can serve a sweep over --attn)")
    add("--chunk", type=int, default=2,
        help="dilated: chunk size C (offsets 0, d, .., (C-1)d); also the base of --n_layer auto; "
        "ignored otherwise")
    # model shape
    add("--n_layer", type=layer_count, default=None,
        help="layers run per input, or auto: thickness x (smallest L with chunk^L >= length), "
        "recomputed per batch (needs --share_weights); default auto with --share_weights, else 1")
    add("--share_weights", action="store_true",
        help="reuse --thickness distinct blocks at every depth (ALBERT, RegularGPT)")
    add("--thickness", type=int, default=1,
        help="K: distinct blocks when sharing weights; dilated layers per dilation level")
    add("--min_train_layers", type=int, default=0,
        help="stochastic depth: >0 draws each training batch's depth from min_train_layers.."
        "n_layer (needs --share_weights); evaluation runs n_layer")
    add("--bidirectional", action="store_true",
        help="every token sees every other (BERT-like, for lego); ChaCAL then solves a dense system")
    add("--mimic_iters", type=int, default=0,
        help="before training, this many steps pulling heads 0 and 1 of every layer toward the "
        "manipulation and association maps (LEGO's mimicking) on unlabelled sequences")
    add("--pos", default="learned", choices=["learned", "none"],
        help="learned absolute positions (GPT-2), or none (RegularGPT: runs at unseen lengths)")
    add("--norm", default=None, choices=["pre", "post"],
        help="LayerNorm before each sublayer (GPT-2) or after the residual sum (RegularGPT); "
        "default post with --n_layer auto, whose block runs more times in test than in "
        "training, else pre")
    add("--n_head", type=int, default=4, help="attention heads per block")
    add("--n_embd", type=int, default=128, help="width of the residual stream (MLP is 4x)")
    add("--dropout", type=float, default=0.0, help="dropout on embeddings and residual branches")
    add("--block_size", type=int, default=None,
        help="longest sequence the model accepts; default: the task's sequence length")
    # task options
    add("--n_blocks", type=int, default=16, help="toy: number of blocks (chains are n_blocks-1 deep)")
    add("--block_len", type=int, default=8, help="toy: tokens per block")
    add("--boxes_version", default="default", choices=["default", "advanced"],
        help="boxes: 7 boxes and 32 operations, or 8 boxes and 1-31 implicit moves")
    add("--n_train", type=int, default=2000, help="boxes: training examples (cached in data_cache/)")
    add("--n_test", type=int, default=500, help="boxes: test examples, never sharing an initial state")
    add("--max_train_length", type=int, default=None,
        help="regular languages: train on lengths 1..this (default 40, or 50 for d_n and tomita)")
    add("--max_test_length", type=int, default=None,
        help="regular languages: test every length above training up to this (default 500, or 100)")
    add("--p_one", type=float, default=0.5, help="parity: probability of a 1 (the paper's Table 2)")
    add("--group", default="z2", choices=["z2", "s3"],
        help="lego: Task 1 (+/- on {0, 1}) or Task 2 (the permutations S3 acting on 3 values)")
    add("--n_vars", type=int, default=12, help="lego: clauses (variables) per sentence")
    add("--n_supervised", type=int, default=None,
        help="lego: train on chain positions #0..#n_supervised-1 only (default all); test all")
    add("--supervise_last", action="store_true",
        help="lego: also train on the last chain position (the shortcut experiment)")
    add("--length_samples", type=int, default=128,
        help="regular languages: fresh test sequences per test length at the end (the paper: 512)")
    # optimizer (AdamW; weight decay on matrices only)
    add("--batch_size", type=int, default=32, help="sequences per step, sampled fresh each step")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--min_lr", type=float, default=None, help="learning rate at the end of decay; default lr/10")
    add("--warmup_iters", type=int, default=100, help="steps of linear warmup")
    add("--lr_decay_iters", type=int, default=None,
        help="steps of cosine decay, counted from 0; default max_iters")
    add("--beta1", type=float, default=0.9, help="Adam β1")
    add("--beta2", type=float, default=0.98, help="Adam β2 (the paper uses 0.98)")
    add("--weight_decay", type=float, default=0.0, help="AdamW weight decay (0 for the toy task)")
    add("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this; 0 disables")
    add("--max_iters", type=int, default=1000, help="training steps")
    # evaluation and output
    add("--eval_interval", type=int, default=100, help="evaluate and checkpoint every this many steps")
    add("--eval_samples", type=int, default=1024,
        help="fresh test sequences per evaluation (regular languages: spread evenly over every "
        "training length); boxes: also how many test prompts (the first ones) are answered by "
        "greedy generation and scored by exact match")
    add("--out_dir", default="out", help="where metrics.jsonl and ckpt.pt go")
    add("--resume", action="store_true",
        help="continue the run saved in out_dir; flags you type override its saved settings")
    add("--progress", action=argparse.BooleanOptionalAction, default=True,
        help="show a progress bar")
    # system
    add("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
        help="auto picks cuda, then mps, then cpu")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="autocast dtype; auto is bfloat16 on GPUs that support it, else float32")
    add("--seed", type=int, default=1337, help="seeds the model's init and the data stream")
    add("--seeds", type=int, default=1,
        help="train this many seeds (seed, seed+1, ..) into out_dir/seed_N and report Max/Avg")
    add("--jobs", type=int, default=1,
        help="with --seeds: train this many seeds at once, each in its own process, logging to "
             "out_dir/seed_N/log.txt (small models leave most of a GPU, or of a many-core CPU, idle)")
    return parser


def layer_count(text):
    """--n_layer: a positive count, or auto."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive count nor auto")
    return int(text)


def typed_flags(parser, args, argv):
    """The flags given on the command line (not left at their defaults), with their values."""
    typed = {action.dest for action in parser._actions for option in action.option_strings
             if any(arg == option or arg.startswith(option + "=") for arg in argv)}
    return {dest: getattr(args, dest) for dest in typed}


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available here; use --device auto or cpu")
    return name


def synchronize(device):
    """Wait for the work queued on a GPU, so that a clock read next measures it, not its launch."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def pick_dtype(name, device):
    if name == "auto":
        use_bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        return "bfloat16" if use_bf16 else "float32"
    return name


def learning_rate(step, args):
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters (as nanoGPT)."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    if step >= args.lr_decay_iters:
        return args.min_lr
    progress = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def evaluation_batches(task, n_samples, batch_size):
    """(size, length) of every evaluation batch, n_samples in all. A task with training lengths
    (the regular languages) draws one length per batch, so a few batches would cover a few of its
    lengths, and the score would swing with which ones: its samples are spread evenly over every
    training length instead. Other tasks: batches of batch_size, length None."""
    lengths = getattr(task, "train_lengths", [None])
    batches = []
    for i, length in enumerate(lengths):
        # n_samples // len(lengths) each, the remainder spread over evenly spaced lengths
        share = n_samples * (i + 1) // len(lengths) - n_samples * i // len(lengths)
        batches += [(min(batch_size, share - start), length) for start in range(0, share, batch_size)]
    return batches


@torch.no_grad()
def evaluate(model, task, n_samples, batch_size, generator, device, autocast):
    """Loss and accuracy on fresh samples, overall and per chain depth, and the share of
    sequences with every scored token right. For an answer decoded greedily that share is its
    exact match: each greedy step then sees the same prefix as here, so it writes the same token.
    """
    model.eval()
    total_loss, hits, counts, whole, n_sequences = 0.0, {}, {}, 0, 0
    for size, length in evaluation_batches(task, n_samples, batch_size):
        x, y = (task.sample(size, generator) if length is None
                else task.sample(size, generator, length=length))
        depth = task.chain_depth(x)
        x, y = x.to(device), y.to(device)
        with autocast:
            logits, loss = model(x, y)
        correct = (logits.argmax(dim=-1) == y).cpu()
        scored = (y != -1).cpu()
        total_loss += loss.item() * scored.sum().item()  # the loss is a mean over scored tokens
        whole += (correct | ~scored).all(dim=1).sum().item()
        n_sequences += x.size(0)
        for d in depth[scored].unique().tolist():
            at_depth = scored & (depth == d)
            hits[d] = hits.get(d, 0) + correct[at_depth].sum().item()
            counts[d] = counts.get(d, 0) + at_depth.sum().item()
    model.train()
    return {
        "eval_loss": total_loss / sum(counts.values()),
        "eval_acc": sum(hits.values()) / sum(counts.values()),
        "eval_acc_by_depth": {str(d): hits[d] / counts[d] for d in sorted(counts)},
        "eval_whole_sequences": whole / n_sequences,
    }


@torch.no_grad()
def evaluate_answers(model, task, n_examples, batch_size, device, autocast):
    """Write the answers to the first n_examples test prompts (the same ones at every
    evaluation) by greedy generation, as a user of the model would get them, and score them
    against the simulator: exact match of the whole answer, and the share of boxes whose
    contents are stated exactly, overall and by the box's chain depth. Decoding uses the cache
    where the model can (GPT.can_cache)."""
    model.eval()
    n = min(n_examples, len(task.rows))
    exact, hits, counts = 0, {}, {}
    for start in range(0, n, batch_size):
        prompts = [task.prompt_and_answer(i)[0] for i in range(start, min(n, start + batch_size))]
        lengths = torch.tensor([len(p) for p in prompts])
        padded = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(device)
        with autocast:
            out = model.generate(padded, model.config.block_size - int(lengths.max()),
                                 temperature=0, use_cache=model.can_cache(),
                                 stop_token=EOS, prompt_lengths=lengths).cpu()
        for prompt, length, row in zip(prompts, lengths.tolist(), out.tolist()):
            right, boxes = task.score_answer(prompt, decode(until_eos(row[length:])))
            exact += right
            for depth, box_right in boxes:
                hits[depth] = hits.get(depth, 0) + box_right
                counts[depth] = counts.get(depth, 0) + 1
    model.train()
    return {"eval_exact_match": exact / n,
            "eval_box_acc": sum(hits.values()) / sum(counts.values()),
            "eval_box_acc_by_depth": {str(d): hits[d] / counts[d] for d in sorted(counts)}}


def smoothed(maps, causal):
    """Add 1e-3 to every weight a query may give, then renormalise rows, as LEGO's mimicking
    does, so that the KL below stays finite."""
    maps = maps + 1e-3
    if causal:
        maps = maps.tril()
    return maps / maps.sum(dim=-1, keepdim=True)


def mimicking_targets(token_ids, causal):
    """The two maps LEGO's mimicking copies from a pretrained BERT (Zhang et al. 2022, Section 4.3):
    manipulation, weights 1, 2, 4, 2, 1 on the tokens from two before to two after, whatever
    they are; and association, every *other* token equal to this one. Each (B, T, T)."""
    B, T = token_ids.shape
    offset = torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)  # key minus query position
    manipulation = torch.zeros(T, T)
    for distance, weight in {-2: 1, -1: 2, 0: 4, 1: 2, 2: 1}.items():
        manipulation[offset == distance] = weight
    association = (token_ids.view(B, T, 1) == token_ids.view(B, 1, T)).float()
    association = association * (1 - torch.eye(T))  # the diagonal is not an association
    return (smoothed(manipulation.expand(B, T, T).to(token_ids.device), causal),
            smoothed(association, causal))


def mimicking_loss(model, token_ids):
    """Σ over layers of KL(head 0 ‖ manipulation) + KL(head 1 ‖ association), the model's map
    first (a reverse KL, as the LEGO code), averaged over sequences and queries."""
    causal = model.config.causal
    manipulation, association = mimicking_targets(token_ids, causal)
    loss = 0.0
    for maps in model.attention_maps(token_ids):                       # (B, nh, T, T) per layer
        for head, target in ((0, manipulation), (1, association)):
            p = smoothed(maps[:, head].float(), causal)
            # A causal map is 0 on the future in both p and the target. The clamp makes those
            # terms 0·log(tiny) = 0 with a finite gradient, where log 0 would give NaN.
            log_ratio = p.clamp_min(1e-30).log() - target.clamp_min(1e-30).log()
            loss = loss + (p * log_ratio).sum(dim=-1).mean()
    return loss


def mimic(model, task, args, generator, device, autocast):
    """LEGO's mimicking initialisation: train the attention maps alone, on unlabelled
    sequences of the task, before the usual training starts from the weights it leaves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                                  weight_decay=0.0)
    losses = []
    for _ in tqdm(range(args.mimic_iters), desc="mimicking", disable=not args.progress,
                  dynamic_ncols=True):
        x, _ = task.sample(args.batch_size, generator)
        with autocast:
            loss = mimicking_loss(model, x.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"mimicking: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.mimic_iters} steps")
    return losses


def save_checkpoint(path, model, optimizer, args, step, train_time, data_rng, eval_rng):
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": asdict(model.config),
        "args": args.settings,
        "step": step,
        "train_time": train_time,
        "rng": {"torch": torch.get_rng_state(), "data": data_rng.get_state(),
                "eval": eval_rng.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)  # a kill during the save leaves the old checkpoint whole


def load_model(out_dir, device="cpu"):
    """The model a run saved in out_dir/ckpt.pt, in eval mode on device, and the checkpoint it came
    from (its "args" are the run's flags, its "step" how far it trained). sample.py and the lessons
    load trained models with it."""
    # A checkpoint holds tensors, numbers and strings only, so loading one, even someone else's, runs no code.
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device, weights_only=True)
    model = GPT(GPTConfig(**checkpoint["config"])).to(device).eval()
    model.load_state_dict(checkpoint["model"])
    return model, checkpoint


# Where the regular languages differ from the toy task's defaults. With the toy's (d 128, batch 32,
# lr 3e-3, 1,000 steps) RegularGPT (C = 2) was still at 53% on parity when it stopped. With these,
# on a 2-core CPU, it passed 99% at step 1,600, 3,800, 1,900 and 2,100 (seeds 1337, 1, 2, 3), then
# scored 100% on lengths 41..100. Parity sits on a plateau near 50% first, and when a run leaves
# it is chaotic: with 3,000 steps (a faster cosine decay) seed 1337 learned it on two CPUs, and
# stayed at 52% once Sliding-Dilated-Attention's fast path changed its rounding.
REGULAR_LANGUAGE_DEFAULTS = {"n_embd": 64, "batch_size": 64, "lr": 1e-3, "max_iters": 5000}


def parse_args(argv=None):
    """Parse and check every flag, so bad input fails here with a message that names it."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    typed = typed_flags(parser, args, argv)
    checkpoint = None
    if args.resume and args.seeds > 1:  # each seed resumes its own run (train_seeds)
        if not os.path.exists(os.path.join(args.out_dir, "seeds.json")):
            parser.error(f"--resume --seeds {args.seeds}: {args.out_dir} holds no run of several "
                         f"seeds (no seeds.json); drop --seeds to continue a single run")
    elif args.resume:
        path = os.path.join(args.out_dir, "ckpt.pt")
        if not os.path.exists(path):
            parser.error(f"--resume: no checkpoint at {path}; start the run without --resume "
                         f"first, or point --out_dir at the run to continue")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        # Defaults, then the run's saved settings, then what was typed now: so a flag added to
        # train.py after the checkpoint was written still has a value.
        settings = vars(parser.parse_args([]))
        settings.update(checkpoint["args"])
        settings.update(typed)
        args = argparse.Namespace(**settings)
    elif args.task in REGULAR_LANGUAGES:
        for flag, value in REGULAR_LANGUAGE_DEFAULTS.items():
            if flag not in typed:
                setattr(args, flag, value)
    # What a checkpoint saves: the settings before anything below resolves them, so a resumed
    # run picks the device and dtype of the machine it now runs on, and a new --lr or
    # --max_iters moves min_lr and the end of the decay with it (unless those were typed).
    args.settings = dict(vars(args))
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.lr_decay_iters = args.max_iters if args.lr_decay_iters is None else args.lr_decay_iters
    try:
        for flag in ("max_iters", "eval_interval", "batch_size", "eval_samples", "lr_decay_iters",
                     "seeds", "jobs", "length_samples"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag} {getattr(args, flag)} must be at least 1")
        for flag in ("warmup_iters", "mimic_iters"):
            if getattr(args, flag) < 0:
                raise ValueError(f"--{flag} {getattr(args, flag)} must be at least 0")
        if args.lr <= 0:
            raise ValueError(f"--lr {args.lr} must be above 0")
        if not 0 <= args.min_lr <= args.lr:
            raise ValueError(f"--min_lr {args.min_lr} must lie in [0, --lr {args.lr}]: the "
                             f"schedule decays from lr to min_lr")
        for flag in ("dropout", "beta1", "beta2"):
            if not 0 <= getattr(args, flag) < 1:
                raise ValueError(f"--{flag} {getattr(args, flag)} must lie in [0, 1)")
        if args.weight_decay < 0 or args.grad_clip < 0:
            raise ValueError("--weight_decay and --grad_clip must be >= 0 (--grad_clip 0 disables "
                             "clipping)")
        if args.block_size is not None and args.block_size < 1:
            raise ValueError(f"--block_size {args.block_size} must be at least 1, or left unset")
        if args.n_layer is None:
            args.n_layer = "auto" if args.share_weights else 1
        if args.norm is None:
            args.norm = "post" if args.n_layer == "auto" else "pre"
        options = task_options(args)
        stray = TASK_FLAGS.keys() & typed.keys() - options.keys()
        if stray:
            flag = sorted(stray)[0]
            raise ValueError(f"--{flag} is an option of {TASK_FLAGS[flag]}, not of --task "
                             f"{args.task}; drop it")
        task = make_task(args)
        block_size = args.block_size or task.block_size
        if task.block_size > block_size:
            raise ValueError(f"--block_size {block_size} is shorter than the {task.block_size}-token "
                             f"sequences of task {args.task}; raise it or leave it unset")
        adaptive = args.n_layer == "auto"
        config = GPTConfig(block_size=block_size, vocab_size=task.vocab_size,
                           n_layer=1 if adaptive else args.n_layer, n_head=args.n_head,
                           n_embd=args.n_embd, dropout=args.dropout, attn=args.attn,
                           gamma=args.gamma, causal=not args.bidirectional, pos=args.pos,
                           norm=args.norm, broadcast_ids=tuple(getattr(task, "broadcast_ids", ())),
                           share_weights=args.share_weights, thickness=args.thickness,
                           chunk=args.chunk, adaptive_depth=adaptive,
                           min_train_layers=args.min_train_layers)
        if args.bidirectional and args.task == "boxes":
            raise ValueError("--bidirectional: boxes is scored by generating its answer, and a "
                             "bidirectional model would read the answer it has to write")
        if args.jobs > args.seeds:
            raise ValueError(f"--jobs {args.jobs} runs seeds at once, and --seeds is {args.seeds}: "
                             f"raise --seeds or lower --jobs")
        if args.mimic_iters and any(name.startswith("lego") for name in config.attention_per_layer()):
            raise ValueError("--mimic_iters shapes the learned maps of heads 0 and 1; LEGO "
                             "attention's maps are fixed: mimic with --attn standard or chacal")
        if args.mimic_iters and config.n_head < 2:
            raise ValueError(f"--mimic_iters needs 2 heads per layer (heads 0 and 1 mimic); "
                             f"--n_head is {config.n_head}")
        if checkpoint is not None:
            # Without positions, block_size bounds nothing the model learned: a resumed run may
            # test longer sequences (--max_test_length).
            ignored = {"block_size"} if config.pos == "none" else set()
            changed = [k for k, v in asdict(config).items()
                       if k not in ignored and checkpoint["config"].get(k) != v]
            if changed:
                raise ValueError(f"--resume: the run in {args.out_dir} has a different model "
                                 f"({', '.join(changed)}); drop those flags to continue it")
        args.device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    args.dtype = pick_dtype(args.dtype, args.device)
    return args, task, config, checkpoint


# Task flags, and the tasks they belong to: a task flag typed for another task is an error.
TASK_FLAGS = {"n_blocks": "toy", "block_len": "toy", "boxes_version": "boxes", "n_train": "boxes",
              "n_test": "boxes", "max_train_length": "the regular languages",
              "max_test_length": "the regular languages", "p_one": "parity", "group": "lego",
              "n_vars": "lego", "n_supervised": "lego", "supervise_last": "lego"}
TASK_ARGUMENT = {"boxes_version": "version"}  # where a get_task option is named unlike its flag


def task_options(args, split="train"):
    """The task flags of a run, by flag name; toy and the regular languages sample fresh
    sequences, so only boxes has splits."""
    if args.task == "toy":
        return {"n_blocks": args.n_blocks, "block_len": args.block_len}
    if args.task == "boxes":
        return {"boxes_version": args.boxes_version, "n_train": args.n_train,
                "n_test": args.n_test, "split": split}
    if args.task in REGULAR_LANGUAGES:
        options = {"max_train_length": args.max_train_length,
                   "max_test_length": args.max_test_length}
        if args.task == "parity":
            options["p_one"] = args.p_one
        return options
    if args.task == "lego":  # the test scores every chain position, trained on or not
        return {"group": args.group, "n_vars": args.n_vars,
                "n_supervised": args.n_supervised if split == "train" else None,
                "supervise_last": args.supervise_last and split == "train"}
    return {}


def make_task(args, split="train"):
    """The task a run trains (split "train") or tests (split "test") on."""
    options = task_options(args, split)
    return get_task(args.task, **{TASK_ARGUMENT.get(k, k): v for k, v in options.items()})


@torch.no_grad()
def evaluate_lengths(model, task, n_per_length, generator, device, autocast, progress=True):
    """Accuracy at every test length (longer than any seen in training) on fresh sequences:
    the share of sequences whose label is right. Batches hold up to 2^16 tokens."""
    model.eval()
    accuracy = {}
    for length in tqdm(task.test_lengths, desc="test lengths", disable=not progress, leave=False):
        per_batch = max(1, min(n_per_length, 2 ** 16 // length))
        hits = 0
        for start in range(0, n_per_length, per_batch):
            x, y = task.sample(min(per_batch, n_per_length - start), generator, length=length)
            with autocast:
                logits, _ = model(x.to(device))
            right = (logits.argmax(dim=-1).cpu() == y) | (y == -1)
            hits += right.all(dim=1).sum().item()
        accuracy[str(length)] = hits / n_per_length
    model.train()
    return accuracy


def main(argv=None):
    argv = with_seeds_command(sys.argv[1:] if argv is None else list(argv))
    args, task, config, checkpoint = parse_args(argv)
    if args.seeds > 1:
        return train_seeds(args, argv)
    torch.manual_seed(args.seed)
    device = args.device
    model = GPT(config).to(device)
    # Weight decay pulls the weights of linear maps, embeddings and convolutions toward 0, as in
    # GPT-2. Biases, LayerNorm gains, the pad vector and the dilated attention's score bias r
    # (a matrix, but of offsets) set levels rather than mix inputs, so they are left alone.
    decayed = {name: p.dim() >= 2 and not name.endswith("offset_bias")
               for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(
        [{"params": [p for name, p in model.named_parameters() if decayed[name]],
          "weight_decay": args.weight_decay},
         {"params": [p for name, p in model.named_parameters() if not decayed[name]],
          "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2))
    test_task = make_task(args, split="test")
    data_rng = torch.Generator().manual_seed(args.seed)      # training batches
    eval_rng = torch.Generator().manual_seed(args.seed + 1)  # test batches, never seen in training
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16)
                if args.dtype == "bfloat16" else contextlib.nullcontext())

    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    step, train_time, metrics = 0, 0.0, []
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        for group in optimizer.param_groups:  # the saved moments, with the betas of this command
            group["betas"] = (args.beta1, args.beta2)
        optimizer.param_groups[0]["weight_decay"] = args.weight_decay
        step, train_time = checkpoint["step"], checkpoint["train_time"]
        torch.set_rng_state(checkpoint["rng"]["torch"])
        data_rng.set_state(checkpoint["rng"]["data"])
        eval_rng.set_state(checkpoint["rng"]["eval"])
        if checkpoint["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
        if os.path.exists(metrics_path):  # forget lines written after the checkpoint we resume
            with open(metrics_path) as f:
                metrics = [m for m in map(json.loads, f) if m["step"] <= step]
    elif os.path.exists(ckpt_path):
        # A fresh run in the directory of an earlier one: its metrics are rewritten below, so its
        # checkpoint goes too, or a later --resume would continue the earlier run.
        print(f"{ckpt_path} of an earlier run removed: this run starts over (--resume would "
              f"have continued it)")
        os.remove(ckpt_path)
    write_metrics(metrics_path, metrics)
    saved_step = step  # the step ckpt_path holds, if any

    depth = "adaptive depth" if config.adaptive_depth else f"{config.n_layer} layer(s)"
    shared = f", {config.thickness} shared block(s)" if config.share_weights else ""
    norm = ", post-LayerNorm" if config.norm == "post" else ""
    print(f"{args.task}: {depth} of {config.attn}{shared}{norm}"
          f"{f' (gamma {config.gamma})' if 'chacal' in config.attn else ''}, "
          f"{model.num_params() / 1e6:.2f}M parameters, {device} {args.dtype}"
          f"{f', resuming at step {step}' if step else ''}")
    mimic_losses = None
    if args.mimic_iters and step == 0:
        mimic_losses = mimic(model, task, args, data_rng, device, autocast)
    window_loss, window_hits, window_count, window_steps = 0.0, 0, 0, 0
    bar = tqdm(total=args.max_iters, initial=step, disable=not args.progress, dynamic_ncols=True)
    tick = time.perf_counter()
    try:
        while step < args.max_iters:
            lr = learning_rate(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = task.sample(args.batch_size, data_rng)
            x, y = x.to(device), y.to(device)
            with autocast:
                logits, loss = model(x, y)
            loss.backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Running sums stay on the device: reading them (.item()) would make the CPU wait
            # for the GPU every step, so it is done only when the bar refreshes.
            scored = y != -1
            window_hits += ((logits.argmax(dim=-1) == y) & scored).sum()
            window_count += scored.sum()
            window_loss += loss.detach()
            window_steps += 1
            bar.update(1)
            if args.progress and step % 10 == 0:
                bar.set_postfix(loss=f"{window_loss.item() / window_steps:.4f}",
                                acc=f"{window_hits.item() / window_count.item():.3f}")

            if step % args.eval_interval == 0 or step == args.max_iters:
                synchronize(device)
                train_time += time.perf_counter() - tick  # evaluation time is not training time
                record = {"step": step, "train_time": round(train_time, 3), "lr": lr,
                          "train_loss": window_loss.item() / window_steps,
                          "train_acc": window_hits.item() / window_count.item()}
                if mimic_losses:  # the first record keeps what mimicking did
                    record["mimic_loss"] = [mimic_losses[0], mimic_losses[-1]]
                    mimic_losses = None
                record.update(evaluate(model, test_task, args.eval_samples, args.batch_size,
                                       eval_rng, device, autocast))
                if hasattr(test_task, "score_answer"):  # boxes: answers written, then scored
                    record.update(evaluate_answers(model, test_task, args.eval_samples,
                                                   args.batch_size, device, autocast))
                metrics.append(record)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                save_checkpoint(ckpt_path, model, optimizer, args, step, train_time,
                                data_rng, eval_rng)
                saved_step = step
                answers = (f", exact match by generation {record['eval_exact_match']:.2%}, "
                           f"boxes right {record['eval_box_acc']:.2%}"
                           if "eval_exact_match" in record else "")
                bar.write(f"step {step}: test loss {record['eval_loss']:.4f}, "
                          f"test accuracy {record['eval_acc']:.2%}, "
                          f"whole sequences right {record['eval_whole_sequences']:.2%}{answers}")
                window_loss, window_hits, window_count, window_steps = 0.0, 0, 0, 0
                tick = time.perf_counter()
    except KeyboardInterrupt:
        bar.close()
        if saved_step:
            print(f"interrupted at step {step}; {ckpt_path} holds step {saved_step}: "
                  f"add --resume to the same command to continue from there")
        else:
            print(f"interrupted at step {step}, before the first checkpoint (step "
                  f"{args.eval_interval}); nothing was saved")
        raise SystemExit(130)
    bar.close()

    if hasattr(task, "test_lengths") and "length_score" not in metrics[-1]:
        by_length = evaluate_lengths(model, test_task, args.length_samples, eval_rng, device,
                                     autocast, args.progress)
        metrics[-1].update(length_acc=by_length,
                           length_score=sum(by_length.values()) / len(by_length))
        write_metrics(metrics_path, metrics)
    summary = summarize(args, config, model.num_params(), metrics)
    print(summary["line"])
    return summary


def write_metrics(path, metrics):
    with open(path, "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)


def summarize(args, config, n_params, metrics):
    final = metrics[-1]
    first_99 = next((m for m in metrics if m["eval_acc"] >= 0.99), None)
    reached = (f"first >= 99% at step {first_99['step']} ({first_99['train_time']:.0f} s)"
               if first_99 else "never reached 99%")
    if "eval_exact_match" in final:
        reached += (f"; generated answers: exact match {final['eval_exact_match']:.2%}, "
                    f"boxes right {final['eval_box_acc']:.2%}")
    if "length_score" in final:
        lengths = list(final["length_acc"])
        reached += (f"; lengths {lengths[0]}..{lengths[-1]} (never trained on): "
                    f"{final['length_score']:.2%}")
    depth = "auto" if config.adaptive_depth else config.n_layer
    line = (f"done: {args.task}, {depth} x {config.attn}, {final['step']} steps in "
            f"{final['train_time']:.0f} s on {args.device} ({args.dtype}); test accuracy "
            f"{final['eval_acc']:.2%}, loss {final['eval_loss']:.4f}; {reached}; "
            f"metrics in {os.path.join(args.out_dir, 'metrics.jsonl')}")
    return {"line": line, "final": final, "metrics": metrics, "n_params": n_params,
            "device": args.device, "dtype": args.dtype, "args": vars(args)}


def train_seeds(args, argv):
    """Train seeds seed .. seed+seeds-1, each in out_dir/seed_N, and report their Max and Avg
    as the RegularGPT paper does: on the test lengths where a task has them, else accuracy.

    The command is saved in out_dir/seeds.json, so that `--resume --out_dir out_dir` alone
    continues every seed (see with_seeds_command): from its checkpoint, or from the start if it
    was stopped before its first one."""
    command = [arg for arg in argv if arg != "--resume"]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "seeds.json"), "w") as f:
        json.dump({"argv": command}, f)
    argvs = []
    for seed in range(args.seed, args.seed + args.seeds):
        out_dir = os.path.join(args.out_dir, f"seed_{seed}")
        resume = args.resume and os.path.exists(os.path.join(out_dir, "ckpt.pt"))
        argvs.append(command + ["--resume"] * resume + ["--seeds", "1", "--jobs", "1",
                                                        "--seed", str(seed), "--out_dir", out_dir])
    summaries = train_many(argvs, jobs=args.jobs)
    key = "length_score" if "length_score" in summaries[0]["final"] else "eval_acc"
    scores = [summary["final"][key] for summary in summaries]
    line = (f"{args.seeds} seeds, {key}: Max {max(scores):.2%}, Avg {sum(scores) / len(scores):.2%} "
            f"(each: {', '.join(f'{s:.2%}' for s in scores)})")
    print(line)
    return {"line": line, "max": max(scores), "avg": sum(scores) / len(scores), "scores": scores,
            "runs": summaries}


def with_seeds_command(argv):
    """argv, or for `--resume` of a run of several seeds (an out_dir with seeds.json and no
    ckpt.pt of its own) the command that started it followed by argv: argparse keeps the last
    value of a flag, so what is typed now overrides the saved command."""
    known = build_parser().parse_known_args(argv)[0]
    saved = os.path.join(known.out_dir, "seeds.json")
    if not known.resume or not os.path.exists(saved) or os.path.exists(
            os.path.join(known.out_dir, "ckpt.pt")):
        return argv
    with open(saved) as f:
        return json.load(f)["argv"] + argv


def train_many(argvs, jobs=1, resume_saved=False):
    """main(argv) for every argument list, `jobs` of them at a time; the summaries, in order.

    A small model's training step is mostly Python launching kernels, so one run leaves a GPU
    (or a many-core CPU) mostly idle; runs in separate processes overlap that work. Each
    process is spawned (a forked one cannot use CUDA), gets its share of the CPU threads, and
    writes what it would print to out_dir/log.txt; the summary lines are printed here.

    resume_saved: a run whose out_dir holds a checkpoint gets --resume, so a lesson executed
    again continues the runs an interruption stopped and takes the finished ones as they are
    (a finished run returns its summary without training). Off by default: after a change to
    the code, every run should train anew.
    """
    parser = build_parser()
    out_dirs = [parser.parse_known_args(argv)[0].out_dir for argv in argvs]
    if resume_saved:
        argvs = [list(argv) + ["--resume"] * os.path.exists(os.path.join(out_dir, "ckpt.pt"))
                 for argv, out_dir in zip(argvs, out_dirs)]
    if jobs == 1:
        return [main(argv) for argv in argvs]
    context = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    logs = [os.path.join(out_dir, "log.txt") for out_dir in out_dirs]
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        running = {pool.submit(main_logged, argv, log, threads): log
                   for argv, log in zip(argvs, logs)}
        try:
            # One line per finished run is the progress report: a bar would interleave with them.
            for count, finished in enumerate(concurrent.futures.as_completed(running), start=1):
                try:
                    line = finished.result()["line"]
                except concurrent.futures.BrokenExecutor:  # the worker was killed, not failed
                    raise SystemExit(f"a worker process died without an error (most often "
                                     f"killed for lack of memory: run fewer at a time, with "
                                     f"--jobs or a lesson's JOBS); what the run printed is in "
                                     f"{running[finished]}")
                except BaseException as error:  # SystemExit too: its message went to the log
                    raise SystemExit(f"a run failed ({type(error).__name__}: {error}); its "
                                     f"output is in {running[finished]}")
                print(f"[{count}/{len(running)} runs, {jobs} at a time, "
                      f"{time.perf_counter() - started:.0f} s] {line}", flush=True)
        except BaseException:  # a failed run or Ctrl-C: runs not yet started never start
            pool.shutdown(cancel_futures=True)
            raise
        return [run.result() for run in running]


def main_logged(argv, log, threads):
    """main(argv) in a worker of train_many: `threads` CPU threads, output to the file `log`."""
    torch.set_num_threads(threads)
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    with open(log, "w") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        return main(list(argv) + ["--no-progress"])


if __name__ == "__main__":
    main()
