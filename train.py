"""
Train a GPT with any attention of attention.py on a task, with fresh data every step.

    python train.py --attn chacal --task toy                  # 1 ChaCAL layer: >99% in about a minute on a CPU
    python train.py --attn standard --task toy                # 1 standard layer: stuck near 20%
    python train.py --attn standard --task toy --n_layer 4    # Theorem 1: 4 layers for 15 hops
    python train.py --resume                                  # continue the run in out/ exactly
    python train.py --attn dilated --share_weights --pos none --task parity   # RegularGPT, C = 2

Every evaluation saves out_dir/ckpt.pt (model, optimizer, step, RNG states, all evaluations so
far), then out_dir/metrics.jsonl, each written aside and renamed, so a run killed at any moment
resumes from its last checkpoint. Tasks evaluate themselves: this file knows none by name.
"""

import argparse
import contextlib
import json
import math
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, fields

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while torch loads: stop, no traceback
import torch
from tqdm import tqdm

from attention import ATTENTIONS, NO_GROUPS, mimic
from data import TASKS, task_class, task_flags, task_from_settings, write_whole
from model import GPT, GPTConfig, first_line


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line naming it; --help shows defaults other than None."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=DefaultsShown, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


# --device of train.py, sample.py and bench.py (pick_device)
DEVICES, DEVICE_HELP = ["auto", "cpu", "cuda", "mps"], "auto picks cuda, then mps, then cpu"


def build_parser():
    parser = OneLineErrors(prog="train.py", description=__doc__.split("\n\n")[0].strip())
    add = parser.add_argument
    add("--task", default="toy", choices=list(TASKS), metavar="TASK", help="what to learn: "
        + ", ".join(TASKS) + " (a task may change the defaults of some flags: the run says which)")
    add = parser.add_argument_group("attention").add_argument
    add("--attn", default="chacal", help="attention of every layer (" + ", ".join(ATTENTIONS)
        + "), or one per layer: standard,chacal")
    add("--gamma", type=float, default=0.9, help="ChaCAL's γ in [0, 1); 0 is standard attention "
        "(other attentions ignore its value, so one set of flags can serve a sweep over --attn)")
    add("--chunk", type=int, default=2, help="dilated: chunk size C; the base of --n_layer auto")
    add = parser.add_argument_group("model shape").add_argument
    add("--n_layer", type=layer_count, default=None, help="layers run per input, or auto: "
        "thickness x (smallest L with chunk^L >= length), per batch (needs --share_weights); "
        "default auto with --share_weights, else 1")
    add("--share_weights", action="store_true", help="reuse --thickness blocks (ALBERT, RegularGPT)")
    add("--thickness", type=int, default=1, help="K: blocks when sharing; dilated layers per level")
    add("--min_train_layers", type=int, default=0, help="stochastic depth: >0 draws each training "
        "batch's depth from min_train_layers..n_layer (needs --share_weights); tests n_layer")
    add("--bidirectional", action="store_true", help="each token sees all (BERT-like, for lego)")
    add("--pos", default="learned", choices=["learned", "none"], help="learned positions (GPT-2), "
        "or none (RegularGPT: runs at any length)")
    add("--norm", default=None, choices=["pre", "post"], help="LayerNorm before each sublayer "
        "(GPT-2) or after the residual sum (RegularGPT); default post with --n_layer auto, else pre")
    add("--n_head", type=int, default=4, help="attention heads per block")
    add("--n_embd", type=int, default=128, help="width of the residual stream (the MLP is 4x)")
    add("--dropout", type=float, default=0.0, help="dropout on embeddings and residual branches")
    add("--block_size", type=int, help="longest sequence the model accepts; default: the task's")
    add("--weight_init", default="gpt2", choices=["gpt2", "xavier"], help="gpt2: tied embeddings, "
        "N(0, 0.02) weights; xavier: untied N(0, 1) embeddings, Xavier weights (as nn.Embedding "
        "and nn.Transformer draw them), with which small models learn lookups by token identity "
        "sooner")
    # Task options: each task declares its own (data.Task.flags); a flag goes to the task's
    # constructor, whose default (in brackets) applies when it is left unset.
    add = parser.add_argument_group("task options (left unset: the task's default)").add_argument
    for name, flag in task_flags().items():
        add(f"--{name}", **flag)
    add = parser.add_argument_group("optimizer (AdamW; weight decay on matrices only)").add_argument
    add("--batch_size", type=int, default=32, help="sequences per step, sampled fresh each step")
    add("--micro_batches", type=int, default=1, help="train on each batch as N parts, rows of "
        "similar length together, each cut after its last scored token (a model that decodes "
        "with a cache), and add their gradients: the same step with less padding and memory "
        "(evaluation runs whole batches)")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--min_lr", type=float, default=None, help="lr at the end of the decay; default lr/10")
    add("--warmup_iters", type=int, default=100, help="steps of linear warmup")
    add("--lr_decay_iters", type=int, help="cosine decay steps, from 0; default max_iters")
    add("--beta1", type=float, default=0.9, help="Adam β1")
    add("--beta2", type=float, default=0.98, help="Adam β2 (the paper uses 0.98)")
    add("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    add("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this; 0 disables")
    add("--max_iters", type=int, default=1000, help="training steps")
    add("--stop_at_acc", type=accuracy_or_never, help="stop early at the first evaluation whose "
        "test accuracy reaches this (e.g. 1.0), taking the final evaluation there; default: never "
        "(type `never` to go on with a resumed run that stopped)")
    add("--mimic_iters", type=int, default=0, help="LEGO's mimicking initialisation (LEGO §4.2.2): "
        "before training, this many steps fitting each layer's heads 0 and 1 to a local window and "
        "to equal tokens (needs --n_head >= 2 and an --attn whose heads learn their maps); default 0")
    add = parser.add_argument_group("evaluation, output and system").add_argument
    add("--eval_interval", type=int, default=100, help="evaluate and checkpoint every N steps")
    add("--eval_samples", type=int, default=1024, help="test sequences per evaluation (a task "
        "that writes answers: the prompts it answers)")
    add("--out_dir", default="out", type=os.path.expanduser, help="where ckpt.pt and "
        "metrics.jsonl go; a fresh run replaces an earlier one there only when it saves its first "
        "checkpoint")
    add("--resume", action="store_true", help="continue the run in out_dir; typed training flags "
        "override its settings (those that would change its model or task, or act only at a "
        "run's start, are refused)")
    add("--init_from", type=os.path.expanduser, help="start a fresh run from trained weights: a "
        "run directory of ours, or a GPT-2 (gpt2, gpt2-medium, ...; needs transformers), with this "
        "--attn, --gamma, --dropout")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    add("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="autocast dtype; auto: bfloat16 on CUDA GPUs that support it")
    add("--seed", type=int, default=1337, help="seeds the model's init and the data stream")
    return parser


def layer_count(text):
    """--n_layer: a positive count, or auto."""
    if text != "auto" and (not text.isdigit() or int(text) < 1):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive count nor auto")
    return text if text == "auto" else int(text)


def accuracy_or_never(text):
    """--stop_at_acc's value: a number, or "never", which unsets the bar a resumed run saved."""
    try:
        return None if text == "never" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an accuracy nor `never`") from None


def typed_flags(parser, args, argv):
    """The flags given on the command line (not left at their defaults), with their values."""
    typed = {action.dest for action in parser._actions for option in action.option_strings
             if any(arg == option or arg.startswith(option + "=") for arg in argv)}
    return {dest: getattr(args, dest) for dest in typed}


def task_defaults(args, typed):
    """The task's preferred settings (train_defaults) of the flags not typed. With --init_from the
    model's shape (--n_layer, --n_embd) is the weights', so only its training settings."""
    model_fields = {field.name for field in fields(GPTConfig)} if args.init_from else set()
    return {flag: value for flag, value in task_class(args.task).train_defaults.items()
            if flag not in typed and flag not in model_fields}


def with_task_defaults(args, typed):
    """args with the task's preferred settings wherever a flag was not typed (task_defaults)."""
    for flag, value in task_defaults(args, typed).items():
        setattr(args, flag, value)
    return args


def check_seed(seed):
    """--seed as torch.Generator takes it (train.py's and sample.py's), or a ValueError."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"--seed {seed} must lie in [0, 2^63)")


def pick_device(name):
    """The device --device names (one of DEVICES), or a ValueError if this machine lacks it."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name == "auto":
        return next((device for device, ok in available.items() if ok), "cpu")
    if name != "cpu" and not available[name]:
        raise ValueError(f"--device {name}: not available here; use --device auto or cpu")
    return name


def synchronize(device):
    """Wait for the work queued on a GPU, so that a clock read next measures it, not its launch."""
    if device in ("cuda", "mps"):
        getattr(torch, device).synchronize()


def out_of_memory(error):
    """Whether a RuntimeError is PyTorch running out of memory: CUDA's has a class of its own,
    the CPU's and Apple's allocators only a message."""
    return (isinstance(error, torch.OutOfMemoryError)
            or any(words in str(error) for words in ("can't allocate memory", "out of memory")))


def learning_rate(step, args):
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters (as nanoGPT)."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    if step >= args.lr_decay_iters:
        return args.min_lr
    progress = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def parse_args(argv=None):
    """Parse and check every flag, so bad input fails here with a message that names it.
    Returns (args, task, config, checkpoint or None)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    typed = typed_flags(parser, args, argv)
    checkpoint = None
    try:
        if args.resume:  # defaults, then the run's saved settings, then what was typed now
            checkpoint = load_checkpoint(args.out_dir)
            # out_dir stays the one read from, so a copied run goes on in the copy
            settings = {**vars(parser.parse_args([])), **checkpoint["args"], **typed,
                        "out_dir": args.out_dir}
            if settings["task"] != checkpoint["args"]["task"]:
                raise ValueError(f"--task {settings['task']}: the run in {args.out_dir} learned "
                                 f"{checkpoint['args']['task']}; drop --task to continue it")
            args = argparse.Namespace(**settings)
        else:  # the task's preferred settings, unless typed
            args = with_task_defaults(args, typed)
            print("".join(f"task {args.task} sets --{k} {v}\n" for k, v
                          in task_defaults(args, typed).items()), end="")
        # What a checkpoint saves: the settings before anything below resolves them, so a resumed
        # run picks the device of the machine it now runs on, and a new --lr or --max_iters moves
        # min_lr and the end of the decay with it (unless those were typed).
        args.settings = dict(vars(args))
        args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
        args.lr_decay_iters = args.max_iters if args.lr_decay_iters is None else args.lr_decay_iters
        args.n_layer = args.n_layer or ("auto" if args.share_weights else 1)
        args.norm = args.norm or ("post" if args.n_layer == "auto" else "pre")
        check_numbers(args)
        # The command that started a run, with --resume added, continues it (as the Ctrl-C
        # message says); a changed value of one of these is refused, as it would act on nothing.
        fixed_at_start = {"seed": "continues the random streams its checkpoint saved",
                          "mimic_iters": "mimicked, if at all, before its first step",
                          "init_from": "continues from its own checkpoint"}
        for flag, why in fixed_at_start.items():  # settings that act only when a run starts
            if args.resume and flag in typed and typed[flag] != checkpoint["args"].get(flag):
                raise ValueError(f"--{flag}: the run in {args.out_dir} {why}; drop --{flag} "
                                 f"(or start a new --out_dir)")
        if args.resume and args.max_iters < checkpoint["step"]:  # it would train nothing, silently
            raise ValueError(f"--max_iters {args.max_iters}: the run in {args.out_dir} is at step "
                             f"{checkpoint['step']} already; give more steps to go on, or drop "
                             f"--resume to start again")
        if args.init_from is not None and not args.init_from.strip():  # e.g. an empty variable
            raise ValueError("--init_from is empty: give a run directory or a GPT-2 name, or drop it")
        # before building the task (boxes writes a dataset); --init_from's model, whose depth is
        # its own, is checked later
        check_writer(args.task, causal=not args.bidirectional,
                     adaptive=args.n_layer == "auto" and not args.init_from)
        task = task_from_settings(vars(args))
        if args.init_from:  # the model of the weights (resuming, of the run's own checkpoint)
            config, checkpoint = initial_weights(args, task, typed, checkpoint)
        else:
            config = model_config(args, task)
        check_model_for_task(args, task, config)
        if args.resume:
            check_same_model(args, typed, config, checkpoint)
        args.device = pick_device(args.device)
        if args.dtype == "auto":  # bfloat16 on GPUs that support it
            args.dtype = ("bfloat16" if args.device == "cuda" and torch.cuda.is_bf16_supported()
                          else "float32")
        check_memory(args, task, config)
    except ValueError as error:
        parser.error(str(error))
    try:  # a directory this process can write to? Found now rather than at step 100
        os.makedirs(args.out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out_dir).close()
    except OSError as error:
        parser.error(f"--out_dir {args.out_dir}: cannot write there ({error.strerror}); pick "
                     f"another directory")
    return args, task, config, checkpoint


def check_numbers(args):
    """Counts and rates in range, each error naming its one flag."""
    for flag, lowest in dict(max_iters=1, eval_interval=1, batch_size=1, eval_samples=1,
                             lr_decay_iters=1, warmup_iters=0, mimic_iters=0,
                             micro_batches=1).items():
        if getattr(args, flag) < lowest:
            raise ValueError(f"--{flag} {getattr(args, flag)} must be at least {lowest}")
    if args.micro_batches > args.batch_size:
        raise ValueError(f"--micro_batches {args.micro_batches} splits a batch into more parts "
                         f"than its --batch_size {args.batch_size} rows")
    for flag in ("lr", "min_lr", "beta1", "beta2", "weight_decay", "grad_clip", "dropout"):
        value = getattr(args, flag)
        # float32's largest: a rate past it is finite in Python and infinite in the optimizer
        if not value <= torch.finfo(torch.float32).max or value < 0 or (flag == "lr" and value == 0):
            raise ValueError(f"--{flag} {value} must be a finite number "
                             + ("above 0" if flag == "lr" else ">= 0"))
        if flag in ("dropout", "beta1", "beta2") and value >= 1:
            raise ValueError(f"--{flag} {value} must lie in [0, 1)")
    if args.min_lr > args.lr:
        raise ValueError(f"--min_lr {args.min_lr} is above --lr {args.lr}: the schedule decays "
                         f"from lr to min_lr")
    if args.settings["lr_decay_iters"] is not None and args.lr_decay_iters < args.warmup_iters:
        raise ValueError(f"--lr_decay_iters {args.lr_decay_iters} ends the decay before "
                         f"--warmup_iters {args.warmup_iters} ends the warmup")
    if args.stop_at_acc is not None and not 0 < args.stop_at_acc <= 1:
        raise ValueError(f"--stop_at_acc {args.stop_at_acc} must lie in (0, 1]: an accuracy")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block_size {args.block_size} must be at least 1, or left unset")
    check_seed(args.seed)


def model_config(args, task):
    """The GPTConfig of a run, after the checks that need both the model and the task."""
    block_size = args.block_size or task.block_size
    if task.block_size > block_size:
        raise ValueError(f"--block_size {block_size} is shorter than the {task.block_size}-token "
                         f"sequences of task {args.task}; raise it or leave it unset")
    adaptive = args.n_layer == "auto"
    same = ("n_head", "n_embd", "dropout", "attn", "gamma", "pos", "norm", "share_weights",
            "thickness", "chunk", "min_train_layers", "weight_init")  # GPTConfig's fields
    config = GPTConfig(block_size=block_size, vocab_size=task.vocab_size, causal=not
                       args.bidirectional, n_layer=1 if adaptive else args.n_layer,
                       adaptive_depth=adaptive, broadcast_ids=tuple(task.broadcast_ids),
                       **{name: getattr(args, name) for name in same})
    return config


def training_bytes(config, length, batch_size, dtype):
    """(model, activations): a lower bound, in bytes, of what a training step holds. The model:
    16 bytes a parameter (weight, gradient, Adam's two moments). The activations autograd keeps
    for the backward pass, counted for a standard GPT-2 block (tests/test_train.py): 16 vectors
    of width n_embd per token and layer applied (the MLP's 4 * n_embd before and after GELU are
    half of them), and at the top a token's log-probabilities; float32, or at least 2 bytes a
    value under bfloat16 autocast. Attentions that keep more (ChaCAL, T x T maps) need more."""
    with torch.device("meta"):  # counts the parameters without allocating them
        model = GPT(config).eval()  # eval: a stochastic depth's deepest draw, its full depth
    per_token = 16 * config.n_embd * model.n_layers_for(length) + config.vocab_size
    bytes_per_value = 2 if dtype == "bfloat16" else 4
    return 16 * model.num_params(), bytes_per_value * batch_size * length * per_token


def check_memory(args, task, config):
    """A ValueError, at start, for a run that cannot fit in its device's memory by the lower
    bound of training_bytes. A run that passes can still run out; main() then says so."""
    rows = -(-args.batch_size // args.micro_batches)  # a part's, at most
    model_bytes, activation_bytes = training_bytes(config, task.train_length, rows, args.dtype)
    if args.device == "cuda":
        memory, where = torch.cuda.get_device_properties(0).total_memory, "this GPU's memory"
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows): no check
            return
        where = "this machine's memory"  # (Apple's GPUs share it)
    smaller = ("start a new --out_dir with a smaller model" if args.resume
               else f"start from smaller weights than --init_from {args.init_from}" if args.init_from
               else "lower --block_size, --n_embd or --n_layer" if args.block_size
               else "lower --n_embd or --n_layer")
    if model_bytes > memory / 2:  # the rest is for activations, Python and PyTorch
        task_sizes = ("" if args.init_from or args.block_size else f", or the task's sizes (its "
                      f"{config.block_size:,}-token sequences, its vocabulary of {config.vocab_size:,})")
        raise ValueError(f"this model needs about {model_bytes / 2**30:.1f} GiB to train "
                         f"(weights, gradients and Adam's moments), more than half of {where} "
                         f"({memory / 2**30:.0f} GiB): {smaller}{task_sizes}")
    if model_bytes + activation_bytes > memory * 3 / 4:  # a lower bound: the rest is a margin
        given = ", ".join(f"--{flag} {getattr(args, flag)}" for flag in task_class(args.task).flags
                          if getattr(args, flag) is not None) or "its defaults"  # typed or saved
        raise ValueError(f"a training step needs at least {activation_bytes / 2**30:.1f} GiB "
                         f"for the backward pass of {rows} sequences (--batch_size / "
                         f"--micro_batches) of up to {task.train_length} tokens, and "
                         f"{model_bytes / 2**30:.1f} GiB for the model, more than three quarters "
                         f"of {where} ({memory / 2**30:.0f} GiB): raise --micro_batches, lower "
                         f"--batch_size or the length the task's flags give its sequences "
                         f"({given}), or {smaller}")


def check_writer(task_name, causal, adaptive, source=""):
    """A task that writes its answer token by token needs a causal model of fixed depth."""
    if not task_class(task_name).generates_answer:
        return
    if not causal:
        raise ValueError(f"--bidirectional{source}: task {task_name} is scored by generating its "
                         f"answer, and a bidirectional model would read the answer it writes")
    if adaptive:
        fix = "start from a model of fixed depth" if source else "give --n_layer a number"
        raise ValueError(f"--n_layer auto{source}: task {task_name} writes its answer token by "
                         f"token, and adaptive depth would run each written token through fewer "
                         f"layers than training gave it; {fix}")


def check_model_for_task(args, task, config):
    """The checks that need the model as built, whether from typed flags or taken in whole by
    --init_from (whose model brings its own heads, direction and depth)."""
    source = (f" (the model of --init_from {args.init_from})" if args.init_from and not args.resume
              else "")
    check_writer(args.task, config.causal, config.adaptive_depth, source)
    if config.causal and task.labels_from_later:
        fix = ("start from a bidirectional model" if source else "start a new --out_dir with "
               "--bidirectional" if args.resume else "add --bidirectional")
        raise ValueError(f"--bidirectional is missing{source}: task {args.task} labels a token by "
                         f"what is written after it, which a causal model never reads; {fix}")
    if args.mimic_iters and (config.n_head < 2 or not all(
            ATTENTIONS[name].learned_maps for name in config.attention_per_block())):
        raise ValueError(f"--mimic_iters{source} shapes the learned maps of heads 0 and 1 of each "
                         f"layer: it needs --n_head 2 or more, and an --attn whose heads learn "
                         f"their maps")
    if args.micro_batches > 1 and config.min_train_layers:
        raise ValueError(f"--micro_batches {args.micro_batches}{source}: stochastic depth "
                         f"(--min_train_layers) would draw a depth for each part, not one for "
                         f"the step; drop " + ("--micro_batches" if source or args.resume
                                               else "one of the two"))
    if task.grouped and not all(ATTENTIONS[n].takes_groups for n in config.attention_per_block()):
        raise ValueError(NO_GROUPS.format(attn=args.attn))  # now, not at the first step


# GPTConfig fields set by a flag of another name
FIELD_FLAGS = {"adaptive_depth": "n_layer", "causal": "bidirectional"}


def check_same_model(args, typed, config, checkpoint):
    """--resume: a ValueError naming the typed flags that would change the saved model. Without
    positions, block_size bounds nothing learned; without ChaCAL, gamma changes nothing."""
    saved = asdict(GPTConfig(**checkpoint["config"]))  # a field added since: its default
    changed = [k for k, v in asdict(config).items() if saved[k] != v
               and not (k == "block_size" and config.pos == "none")
               and not (k == "gamma" and not config.uses_gamma())]
    # The flags behind the fields; where typed flags explain them, only those (--n_layer auto
    # also changes the norm it implies; a task's flags, its vocabulary or length).
    task_typed = [f for f in task_class(args.task).flags
                  if f in typed and typed[f] != checkpoint["args"].get(f)]
    flags = []
    for field in changed:
        sized_by_task = field in ("vocab_size", "block_size") and task_typed
        behind = task_typed if sized_by_task else [FIELD_FLAGS.get(field, field)]
        flags += [f for f in behind if f not in flags]
    flags = [f for f in flags if f in typed] or flags
    if changed:
        raise ValueError(f"--resume: the run in {args.out_dir} has a different model "
                         f"({', '.join('--' * (f in typed) + f for f in flags)}); drop those "
                         f"flags to continue it")


def as_flag(field, value):
    """A GPTConfig field's value as the flag that sets it, for messages: ("n_embd", 32) ->
    "--n_embd 32", ("causal", False) -> "--bidirectional"."""
    if field == "causal":
        return "no --bidirectional" if value else "--bidirectional"
    if field == "adaptive_depth":
        return "--n_layer auto" if value else "a fixed --n_layer"
    if isinstance(value, bool):
        return f"--{field}" if value else f"no --{field}"
    return f"--{field} {value}"


def initial_weights(args, task, typed, checkpoint=None):
    """--init_from: (config, checkpoint) of a run's model or a GPT-2's, its weights under "model",
    with this command's --attn, --gamma and --dropout; a typed flag changing its shape is an
    error. (Resuming: its own.)"""
    name = args.init_from
    # A path, not a model on the Hugging Face hub ("gpt2", "org/name"): no download is tried.
    looks_local = (os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1
                   or os.path.isdir(os.path.dirname(name)))
    if checkpoint is None and os.path.isfile(name):
        raise ValueError(f"--init_from {name}: a file; give the run directory that holds ckpt.pt"
                         + (f" ({os.path.dirname(name) or '.'})" if name.endswith("ckpt.pt") else ""))
    if checkpoint is None and os.path.exists(os.path.join(name, "ckpt.pt")):
        checkpoint = load_checkpoint(name, flag="--init_from", needs=())
    elif checkpoint is None and looks_local and not os.path.isfile(f"{name}/config.json"):
        raise ValueError(f"--init_from {name}: no ckpt.pt there (a run saves one at its first "
                         f"evaluation), nor a GPT-2 saved by transformers")
    elif checkpoint is None:  # a name, or a directory of transformers' save_pretrained
        try:
            gpt2 = GPT.from_pretrained(args.init_from)
        except (ImportError, OSError) as error:
            raise ValueError(f"--init_from {args.init_from}: not a run directory, nor a GPT-2 "
                             f"that transformers can load ({first_line(error)})") from None
        checkpoint = {"config": asdict(gpt2.config), "model": gpt2.state_dict()}
    swap = dict(attn=args.attn, gamma=args.gamma, dropout=args.dropout)
    if checkpoint["config"].get("pos") == "none":  # no position table: block_size bounds nothing
        swap["block_size"] = max(task.block_size, checkpoint["config"]["block_size"])
    config = GPTConfig(**{**checkpoint["config"], **swap})
    needed = {"vocab_size": task.vocab_size, "block_size": max(task.block_size, config.block_size),
              **{k: v for k, v in typed.items() if k in checkpoint["config"] and k not in swap}}
    if "n_layer" in needed:  # in GPTConfig adaptive depth is a field of its own, checked first:
        n_layer = needed.pop("n_layer")  # an adaptive model's n_layer is a placeholder 1
        needed["adaptive_depth"] = n_layer == "auto"
        if n_layer != "auto":
            needed["n_layer"] = n_layer
    if "bidirectional" in typed:  # the flag's field in GPTConfig is its opposite
        needed["causal"] = not args.bidirectional
    source = f"the run in {args.out_dir}" if args.resume else f"--init_from {args.init_from}"
    for field, value in needed.items():
        if getattr(config, field) == value:
            continue
        if field in ("vocab_size", "block_size"):
            # Sized by a task's flags, typed or default, not by a flag of its own: name those.
            saved = checkpoint.get("args")  # none for a GPT-2
            trained = "" if not saved else " (trained with " + " ".join(
                [f"--task {saved['task']}"] + [f"--{f} {saved[f]}" for f in task_class(
                    saved["task"]).flags if saved.get(f) is not None]) + ")"
            what = ("a vocabulary of {} tokens" if field == "vocab_size" else
                    "positions for {} tokens").format
            raise ValueError(f"{'--resume: ' * args.resume}{source}: its model has "
                             f"{what(getattr(config, field))}{trained}, where this run's task "
                             f"needs {what(value)}; give the task the flags those weights were "
                             f"trained with, or start from other weights")
        fix = "drop the flag" + ("" if args.resume else ", or start from other weights")
        raise ValueError(f"{'--resume: ' * args.resume}{source}: its model has "
                         f"{as_flag(field, getattr(config, field))}, where this run needs "
                         f"{as_flag(field, value)}; {fix}")
    with torch.device("meta"):  # e.g. lego attention has weights standard attention has not
        ours = GPT(config).state_dict().keys()
    theirs = checkpoint["model"].keys()
    lacking, unplaced = sorted(ours - theirs), sorted(theirs - ours)
    if lacking or unplaced:
        what = (f"needs weights that model lacks ({lacking[0]}, ...)" if lacking
                else f"has no place for weights of that model ({unplaced[0]}, ...)")
        raise ValueError(f"--attn {args.attn} {what}; the model of {source} has --attn "
                         f"{checkpoint['config']['attn']}")
    return config, checkpoint


def load_checkpoint(out_dir, flag="--resume", needs=("optimizer", "metrics", "rng")):
    """out_dir/ckpt.pt as a dict, or a ValueError that names the file and what to do. A
    checkpoint holds tensors, numbers and strings only, so loading one runs no code."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no checkpoint at {path}; train a run there first, or point "
                         f"{'--out_dir' if flag == '--resume' else flag} at one")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        if not {"model", "config", "args", "step", *needs} <= checkpoint.keys():
            raise KeyError("a part is missing")
    except Exception:
        raise ValueError(f"{flag}: {path} is not a checkpoint of this train.py (damaged, or "
                         f"from elsewhere); delete it and start the run again") from None
    return checkpoint


def load_model(out_dir, device="cpu"):
    """(model in eval mode on device, checkpoint) of the run in out_dir: for sample.py, lessons."""
    checkpoint = load_checkpoint(out_dir, flag="--out_dir", needs=())
    model = GPT(GPTConfig(**checkpoint["config"])).to(device).eval()
    model.load_state_dict(checkpoint["model"])
    return model, checkpoint


def save_checkpoint(out_dir, model, optimizer, args, step, train_time, rngs, metrics):
    """ckpt.pt, replaced whole: everything --resume needs, the metrics so far included."""
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "config": asdict(model.config), "args": args.settings, "step": step,
                  "train_time": train_time, "metrics": metrics,
                  "rng": {"torch": torch.get_rng_state(), "data": rngs[0].get_state(),
                          "eval": rngs[1].get_state(),
                          "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                          # an Apple GPU draws dropout's masks from a generator of its own
                          "mps": torch.mps.get_rng_state() if args.device == "mps" else None}}
    # written aside and renamed: a kill during the save leaves the old checkpoint whole
    write_whole(os.path.join(out_dir, "ckpt.pt"), lambda temporary: torch.save(checkpoint, temporary))


@contextlib.contextmanager
def interrupts_deferred():
    """A Ctrl-C inside the block raises KeyboardInterrupt at its end, not midway. (Outside the
    main thread, where Python delivers no signals, the block runs as it is.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if caught:
        raise KeyboardInterrupt


def write_metrics(out_dir, metrics):
    """metrics.jsonl, one record per line, replaced whole."""
    text = "".join(json.dumps(m) + "\n" for m in metrics)
    write_whole(os.path.join(out_dir, "metrics.jsonl"),
                lambda temporary: pathlib.Path(temporary).write_text(text))


def set_up(args, config, checkpoint):
    """The model, optimizer and random streams, fresh or as the checkpoint left them."""
    torch.manual_seed(args.seed)
    model = GPT(config).to(args.device)
    optimizer = model.configure_optimizer(args.weight_decay, args.lr, (args.beta1, args.beta2))
    data_rng = torch.Generator().manual_seed(args.seed)      # training batches
    eval_rng = torch.Generator().manual_seed(args.seed + 1)  # test batches, a stream of their own
    state = {"step": 0, "train_time": 0.0, "metrics": []}
    if checkpoint is not None:  # resuming, or starting from the weights of --init_from
        model.load_state_dict(checkpoint["model"])
    if args.resume:
        optimizer.load_state_dict(checkpoint["optimizer"])
        for group in optimizer.param_groups:  # the saved moments, with the betas of this command
            group["betas"] = (args.beta1, args.beta2)
        optimizer.param_groups[0]["weight_decay"] = args.weight_decay
        torch.set_rng_state(checkpoint["rng"]["torch"])
        data_rng.set_state(checkpoint["rng"]["data"])
        eval_rng.set_state(checkpoint["rng"]["eval"])
        if checkpoint["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
        if checkpoint["rng"].get("mps") is not None and args.device == "mps":  # none before
            torch.mps.set_rng_state(checkpoint["rng"]["mps"])
        state.update(step=checkpoint["step"], train_time=checkpoint["train_time"],
                     metrics=list(checkpoint["metrics"]))
    elif os.path.exists(os.path.join(args.out_dir, "ckpt.pt")):
        print(f"{args.out_dir} holds an earlier run, which this run replaces at its first "
              f"checkpoint (step {min(args.eval_interval, args.max_iters)}); --resume continues it")
    return model, optimizer, (data_rng, eval_rng), state


def describe_metrics(record):
    """One line of a record's test numbers: losses and perplexities as they are, the rest as %."""
    shown = {k.removeprefix("eval_").replace("_", " "): v for k, v in record.items()
             if k.startswith(("eval_", "length_")) and isinstance(v, float)}
    return "test " + ", ".join(f"{k} {v:.4f}" if k.endswith(("loss", "perplexity"))
                               else f"{k} {v:.2%}" for k, v in shown.items())


def split_batch(x, y, layout, n, cut):
    """A batch (x, y and its layout) as n parts of rows sorted by where their scored tokens end,
    with each part's share of the batch's scored tokens, so that the parts' losses weighted by
    their shares add up to the batch's. With cut, each part ends after its last scored column:
    for a model whose logits at t read tokens up to t only (one that decodes with a cache),
    later columns change nothing, and the part's short rows carry less padding."""
    scored = y != -1
    ends = torch.where(scored.any(1), y.size(1) - scored.flip(1).int().argmax(1), 0)
    total = int(scored.sum())
    if total == 0:  # the batch's mean loss is 0 / 0: as one part, as without --micro_batches
        yield x, y, layout, 1.0
        return
    for rows in ends.argsort(stable=True).tensor_split(n):
        share = int(scored[rows].sum()) / total  # a float, exact at any precision of the loss
        if share == 0:  # nothing to learn from (its mean loss would be 0 / 0)
            continue
        width = int(ends[rows].max()) if cut else y.size(1)
        yield (x[rows, :width], y[rows, :width], {k: v[rows, :width] for k, v in layout.items()},
               share)


def nothing_left(args, state):
    """Why a resumed run has no step left to train (its flags then change nothing), or None."""
    last = state["metrics"][-1] if state["metrics"] else {}
    if state["step"] >= args.max_iters:
        return f"it is at --max_iters {args.max_iters} already; give more steps to train on"
    if (last.get("stopped_early") and args.stop_at_acc is not None
            and last["eval_acc"] >= args.stop_at_acc):
        return (f"it stopped at step {state['step']} with accuracy {last['eval_acc']:.2%}, which "
                f"reaches --stop_at_acc {args.stop_at_acc:g}; add --stop_at_acc never (or a higher "
                f"bar) to train on")
    return None


def train_loop(args, model, optimizer, task, rngs, state, autocast):
    """Train to max_iters, evaluating and saving every eval_interval steps and at the end; or
    to the first evaluation that reaches --stop_at_acc."""
    if nothing_left(args, state):  # a finished run, resumed: taken as it is
        return
    step, window = state["step"], []
    state["phase"] = "training"
    bar = tqdm(total=args.max_iters, initial=step, disable=not args.progress, dynamic_ncols=True)
    tick = time.perf_counter()
    while step < args.max_iters:
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = (t.to(args.device) for t in task.sample(args.batch_size, rngs[0]))
        layout = task.layout(x)  # {} or, for an inductive scratchpad, positions and groups
        if args.micro_batches == 1:
            with autocast:
                logits, loss = model(x, y, **layout)
            loss.backward()
        else:
            loss = 0.0
            for x_part, y_part, layout_part, share in split_batch(
                    x, y, layout, args.micro_batches, cut=model.can_cache()):
                with autocast:
                    _, part_loss = model(x_part, y_part, **layout_part)
                (part_loss * share).backward()  # the batch's mean: each part by its scored share
                loss = loss + part_loss.detach() * share
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        # The loss stays on the device: reading it (.item()) makes the CPU wait for a GPU, so
        # it is read only every 10 steps, for the bar and to stop a run that has diverged.
        window.append(loss.detach())
        bar.update(1)
        if step % 10 and step % args.eval_interval and step < args.max_iters:
            continue
        mean_loss = torch.stack(window[-10:]).mean().item()
        evaluating = step % args.eval_interval == 0 or step == args.max_iters
        # A diverged run stops here, before a checkpoint of broken weights replaces a good one.
        broken = (f"the training loss became {mean_loss}" if not math.isfinite(mean_loss) else
                  "a weight became inf or nan" if evaluating and not all(
                      p.isfinite().all() for p in model.parameters()) else None)
        if broken:
            bar.close()
            raise SystemExit(f"train.py: error: {broken} by step {step}; the run stops, its "
                             f"checkpoints so far untouched. Lower --lr or --grad_clip")
        bar.set_postfix(loss=f"{mean_loss:.4f}")
        if evaluating:
            synchronize(args.device)
            state["train_time"] += time.perf_counter() - tick  # evaluation is not training time
            record = {"step": step, "train_time": round(state["train_time"], 3), "lr": lr,
                      "train_loss": torch.stack(window).mean().item(), **state.pop("first_record", {})}
            final = step == args.max_iters
            state["phase"] = "evaluating"  # in whole batches: what main() says if memory runs out
            record.update(task.evaluate(model, args.eval_samples, args.batch_size, rngs[1],
                                        args.device, autocast, final=final))
            stop = args.stop_at_acc is not None and record["eval_acc"] >= args.stop_at_acc
            if stop and not final:
                # Stop here. Only the measures a last evaluation adds (e.g. accuracy by test
                # length) are taken from a second pass; the accuracy that stopped the run stays.
                extra = task.evaluate(model, args.eval_samples, args.batch_size, rngs[1],
                                      args.device, autocast, final=True)
                record.update({k: v for k, v in extra.items() if k not in record}, stopped_early=True)
                final = True
            state["phase"] = "training"
            metrics = state["metrics"] + [record]
            with interrupts_deferred():  # what an interrupt names is what ckpt.pt holds
                save_checkpoint(args.out_dir, model, optimizer, args, step, state["train_time"],
                                rngs, metrics)
                state["metrics"] = metrics
                write_metrics(args.out_dir, metrics)
            window = []
            bar.write(f"step {step}: {describe_metrics(record)}")
            if final:
                break
            tick = time.perf_counter()
    bar.close()


def summarize(args, config, n_params, metrics, resumed_train_time=0.0):
    """The run's last record, its history, and one line that says how it went.

    resumed_train_time: the training seconds the checkpoint held when --resume continued it
    (0 for a fresh run), so a caller can tell them from the seconds this command trained."""
    final = metrics[-1]
    first_99 = next((f"at step {m['step']} ({m['train_time']:.0f} s)" for m in metrics
                     if m["eval_acc"] >= 0.99), "never")
    stopped = ""
    if final.get("stopped_early"):  # the bar may be unset since: resumed with `never`, no step left
        bar = "" if args.stop_at_acc is None else f": accuracy >= {100 * args.stop_at_acc:g}%"
        stopped = f" (stopped{bar})"
    line = (f"done: {args.task}, {config.describe()}, {final['step']} steps{stopped} in "
            f"{final['train_time']:.0f} s on {args.device} ({args.dtype}); accuracy >= 99% "
            f"{first_99}; {describe_metrics(final)}; metrics in {args.out_dir}/metrics.jsonl")
    return {"line": line, "final": final, "metrics": metrics, "n_params": n_params,
            "device": args.device, "dtype": args.dtype, "args": vars(args),
            "resumed_train_time": resumed_train_time}


def main(argv=None):
    try:
        args, task, config, checkpoint = parse_args(argv)
        model, optimizer, rngs, state = set_up(args, config, checkpoint)
        resumed_train_time = state["train_time"]
    except KeyboardInterrupt:  # e.g. while a large dataset is drawn, which is cached only whole
        raise SystemExit("interrupted before training began; no checkpoint was written, and any "
                         "earlier run in out_dir is as it was") from None
    autocast = (torch.autocast(device_type=args.device, dtype=torch.bfloat16)
                if args.dtype == "bfloat16" else contextlib.nullcontext())
    resuming = f", resuming at step {state['step']}" if state["step"] else ""
    print(f"{args.task}: {config.describe()}, {model.num_params() / 1e6:.2f}M parameters, "
          f"{args.device} {args.dtype}{resuming}")
    if args.resume and (why := nothing_left(args, state)):
        print(f"nothing left to train in {args.out_dir}: {why}")
    elif args.max_iters < args.warmup_iters:  # a short run's schedule is all warmup
        top = args.lr * args.max_iters / args.warmup_iters  # learning_rate at the last step
        print(f"note: --max_iters {args.max_iters} ends inside --warmup_iters "
              f"{args.warmup_iters}: the learning rate climbs to {top:.3g}, never --lr "
              f"{args.lr:g}, and never decays; lower --warmup_iters for the whole schedule")
    try:
        if args.resume:  # ckpt.pt's metrics, in case a kill came between it and metrics.jsonl
            write_metrics(args.out_dir, state["metrics"])
        if args.mimic_iters and state["step"] == 0:  # LEGO's, on unlabelled sequences of the task
            state["phase"] = "mimicking"
            batches = (task.sample(args.batch_size, rngs[0])[0].to(args.device) for _ in
                       tqdm(range(args.mimic_iters), desc="mimicking", disable=not args.progress))
            losses = mimic(model, batches, args.lr, (args.beta1, args.beta2), autocast)
            print(f"mimicking: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.mimic_iters} steps")
            state["first_record"] = {"mimic_loss": [losses[0], losses[-1]]}  # in the first record
        train_loop(args, model, optimizer, task, rngs, state, autocast)
    except KeyboardInterrupt:
        saved = state["metrics"][-1]["step"] if state["metrics"] else 0
        raise SystemExit(f"interrupted; {args.out_dir}/ckpt.pt holds step {saved}: add --resume "
                         f"to the same command to continue from there" if saved else
                         "interrupted before the first checkpoint; nothing was saved, and any "
                         f"earlier run in {args.out_dir} is as it was") from None
    except RuntimeError as error:  # past check_memory's bound, e.g. an attention's T x T maps
        if not out_of_memory(error):
            raise
        saved = state["metrics"][-1]["step"] if state["metrics"] else 0
        if state.get("phase", "training") == "training":
            what = (f"training on --batch_size {args.batch_size} sequences of up to "
                    f"{task.train_length} tokens in --micro_batches {args.micro_batches}")
            fix, then = ("raise --micro_batches, or lower --batch_size or the task's sequence "
                         "length", "a higher --micro_batches")
        else:  # evaluation and mimicking run whole batches
            what = (f"{state['phase']} whole batches of --batch_size {args.batch_size} sequences "
                    f"of up to {task.block_size} tokens")
            fix, then = "lower --batch_size", "a lower --batch_size"
        kept = (f"{args.out_dir}/ckpt.pt holds step {saved}: add --resume and {then} to "
                f"continue" if saved else "nothing was saved")
        raise SystemExit(f"train.py: error: {args.device} ran out of memory {what}; {fix}; "
                         f"{kept}") from None
    summary = summarize(args, config, model.num_params(), state["metrics"], resumed_train_time)
    print(summary["line"])
    return summary


def run_command(main, interrupted):
    """main() as a command: a Ctrl-C that main lets through ends it with the one line
    `interrupted`, and a reader that stops reading its output early (`python train.py | head`)
    ends it quietly, as it ends Unix tools, rather than with a BrokenPipeError. Each script lets
    a Ctrl-C simply stop it while its imports load (a traceback through torch's imports helps no
    one); from here on, a Ctrl-C is Python's KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(interrupted) from None
    except BrokenPipeError:
        # Python flushes stdout once more at exit; into /dev/null, that cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


if __name__ == "__main__":
    run_command(main, "interrupted; a checkpoint in out_dir is whole, as its last evaluation "
                      "wrote it")
