"""Train a GPT with any attention of attention.py on a task, with fresh data every step.

    python train.py --attn chacal --task toy    # one ChaCAL layer: over 99% accuracy
    python train.py --resume                    # continue the run in out/ exactly
"""

import argparse
import contextlib
import fcntl
import inspect
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import asdict, fields

import torch
from tqdm import tqdm

from attention import mimic
from data import TASKS, task_class, task_flags, task_from_settings, write_whole
from model import GPT, GPTConfig

DEVICES, DEVICE_HELP = ["auto", "cpu", "cuda", "mps"], "auto picks cuda, then mps, then cpu"
ABILITY_FIXES = {"causal": "drop --bidirectional", "bidirectional": "add --bidirectional",
                 "groups": "an --attn with group masks", "mimic": "--n_head >= 2, learned maps"}


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line naming it, and --help shows the defaults."""
    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(kind, low, high=float(torch.finfo(torch.float32).max), word=None):
    """An argparse type: a `kind` in [low, high] (past float32's largest: infinite), or `word`."""
    def parse(text):
        if text == word:
            return word
        value = kind(text)
        if not low <= value <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"{value} is outside [{low:g}, {high:g}]")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse


def build_parser():
    parser = OneLineErrors(prog="train.py", description=__doc__.split("\n\n")[0].strip())
    add = parser.add_argument_group("task (options unset: the task's default)").add_argument
    add("--task", default="toy", choices=list(TASKS), metavar="TASK", help=", ".join(TASKS))
    for name, flag in task_flags().items():
        add(f"--{name}", **flag)
    add = parser.add_argument_group("model").add_argument
    add("--attn", default="chacal", help="every layer's attention, or each one's: standard,chacal")
    add("--gamma", type=float, default=0.9, help="ChaCAL's γ in [0, 1); 0 is standard attention")
    add("--chunk", type=int, default=2, help="dilated: chunk size C; the base of --n_layer auto")
    add("--n_layer", type=number(int, 1, word="auto"), help="layers, or auto: chunk^L >= T")
    add("--share_weights", action="store_true", help="reuse --thickness blocks; n_layer auto")
    add("--thickness", type=int, default=1, help="K: blocks when sharing; dilated layers per level")
    add("--min_train_layers", type=int, default=0, help="stochastic depth: >0 draws the depth")
    add("--bidirectional", action="store_true", help="each token sees all (BERT-like, for lego)")
    add("--pos", default="learned", choices=["learned", "none"], help="none: runs at any length")
    add("--norm", choices=["pre", "post"], help="LayerNorm before sublayers or after sums (auto)")
    add("--n_head", type=int, default=4, help="attention heads per block")
    add("--n_embd", type=int, default=128, help="width of the residual stream (the MLP is 4x)")
    add("--dropout", type=number(float, 0, 0.99), default=0.0, help="on embeddings and branches")
    add("--block_size", type=number(int, 1), help="longest sequence read; default: the task's")
    add("--weight_init", default="gpt2", choices=["gpt2", "xavier"], help="xavier: untied lm_head")
    add = parser.add_argument_group("optimizer (AdamW; weight decay on matrices only)").add_argument
    add("--batch_size", type=number(int, 1), default=32, help="sequences per step, fresh each step")
    add("--micro_batches", type=number(int, 1), default=1, help="sum the gradients of N parts")
    add("--lr", type=number(float, 1e-9), default=3e-3, help="peak learning rate")
    add("--min_lr", type=number(float, 0), help="lr at the end of the decay; default lr/10")
    add("--warmup_iters", type=number(int, 0), default=100, help="steps of linear warmup")
    add("--lr_decay_iters", type=number(int, 1), help="cosine decay steps; default max_iters")
    add("--beta1", type=number(float, 0, 0.9999), default=0.9, help="Adam β1")
    add("--beta2", type=number(float, 0, 0.9999), default=0.98, help="Adam β2 (the paper's 0.98)")
    add("--weight_decay", type=number(float, 0), default=0.0, help="AdamW weight decay")
    add("--grad_clip", type=number(float, 0), default=1.0, help="max gradient norm; 0: no clip")
    add("--max_iters", type=number(int, 1), default=1000, help="training steps")
    add("--stop_at_acc", type=number(float, 1e-9, 1), help="stop at an evaluation this accurate")
    add("--mimic_iters", type=number(int, 0), default=0, help="steps of LEGO's mimicking init")
    add = parser.add_argument_group("evaluation, output and system").add_argument
    add("--eval_interval", type=number(int, 1), default=100, help="evaluate and save every N steps")
    add("--eval_samples", type=number(int, 1), default=1024, help="test sequences per evaluation")
    add("--out_dir", default="out", type=os.path.expanduser,
        help="ckpt.pt (latest evaluation), best.pt (lowest test loss: a climbing loss never "
        "replaces it), metrics.jsonl; one run holds it at a time (a lock)")
    add("--resume", action="store_true", help="continue the run in out_dir, its model and task")
    add("--init_from", type=os.path.expanduser, help="a run directory or GPT-2 name to start from")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    add("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="bf16 on a GPU")
    add("--seed", type=number(int, 0, 2**63 - 1), default=1337, help="seeds the init and the data")
    return parser


def refuse_changes(typed, flags, source, config, saved=None):
    """Refuse the first of `flags` typed unlike the run: saved, else its config or task default."""
    options = inspect.signature(TASKS.get((saved or {}).get("task"), lambda: 0)).parameters
    used = {**{name: option.default for name, option in options.items()}, **config}
    used.update({flag: value for flag, value in (saved or {}).items() if value is not None})
    for flag in sorted(flag for flag in flags if flag in typed and typed[flag] != used.get(flag)):
        had = f"no --{flag}" if used.get(flag) is None else f"--{flag} {used[flag]}"
        raise ValueError(f"--{flag} {typed[flag]}: {source} has {had}; drop it, or a new --out_dir")


def parse_args(argv=None):
    """Parse and check every flag. Returns (args, task, config, checkpoint or None)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, defaults = parser.parse_args(argv), vars(parser.parse_args([]))
    config_flags = {field.name for field in fields(GPTConfig)} & set(defaults)
    fixed = {*config_flags, *task_flags(), "bidirectional", "task", "seed", "init_from",
             "mimic_iters"}  # what a --resume or --init_from may not change
    typed = {action.dest: getattr(args, action.dest) for action in parser._actions  # not defaults
             if any(arg.split("=")[0] in action.option_strings for arg in argv)}
    checkpoint = None
    if args.resume:  # defaults, then the run's saved settings, then what was typed now
        checkpoint = load_checkpoint(args.out_dir, needs=("optimizer", "metrics", "rng"))
        refuse_changes(typed, fixed, f"the run in {args.out_dir}", checkpoint["config"],
                       checkpoint["args"])
        saved = {**defaults, **checkpoint["args"]}
        args = argparse.Namespace(**{**saved, **typed, "out_dir": args.out_dir})
    else:  # the task's train_defaults where not typed (--init_from: the weights give the model)
        for flag, value in task_class(args.task).train_defaults.items():
            if flag not in typed and not (args.init_from and flag in config_flags):
                setattr(args, flag, value)
    args.n_layer = args.n_layer or ("auto" if args.share_weights else 1)
    args.norm = args.norm or ("post" if args.n_layer == "auto" else "pre")
    args.settings = dict(vars(args))  # what a checkpoint saves: min_lr and the decay stay unset,
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr  # to follow a new --lr
    args.lr_decay_iters = args.max_iters if args.lr_decay_iters is None else args.lr_decay_iters
    task = task_from_settings(vars(args))
    if args.resume:
        config = GPTConfig(**checkpoint["config"])
    elif args.init_from:  # a run's model, or a GPT-2 (a name, or a save_pretrained directory)
        if os.path.isdir(args.init_from) and not os.path.isfile(f"{args.init_from}/config.json"):
            checkpoint = load_checkpoint(args.init_from)
        else:
            gpt2 = GPT.from_pretrained(args.init_from)
            checkpoint = {"model": gpt2.state_dict(), "config": asdict(gpt2.config)}
        swap = dict(attn=args.attn, gamma=args.gamma, dropout=args.dropout)  # the rest: weights'
        if checkpoint["config"]["pos"] == "none":  # no position table: the length is free
            swap["block_size"] = max(task.block_size, checkpoint["config"]["block_size"])
        config = GPTConfig(**{**checkpoint["config"], **swap})
        refuse_changes(typed, config_flags - set(swap), "--init_from's model", asdict(config))
    else:
        auto = args.n_layer == "auto"  # adaptive depth: one block, repeated as the length needs
        given = {k: getattr(args, k) for k in config_flags - {"block_size", "n_layer"}}
        config = GPTConfig(**given, n_layer=1 if auto else args.n_layer, adaptive_depth=auto,
                           block_size=args.block_size or task.block_size,
                           vocab_size=task.vocab_size, causal=not args.bidirectional,
                           broadcast_ids=tuple(task.broadcast_ids))
    short = config.pos == "learned" and config.block_size < task.block_size  # the one fit check
    if config.vocab_size != task.vocab_size or short:
        raise ValueError(f"the model reads {config.vocab_size} token ids and {config.block_size} "
                         f"positions; task {args.task} has {task.vocab_size} and {task.block_size}")
    needs = {"causal" if need == "generation" else need for need in task.needs}  # writing: causal
    lacking = sorted((needs | ({"mimic"} if args.mimic_iters else set())) - config.abilities())
    if lacking:
        flag = "--mimic_iters" if lacking[0] == "mimic" else f"--task {args.task}"
        raise ValueError(f"{flag}: the model lacks {lacking[0]!r}; {ABILITY_FIXES[lacking[0]]}")
    args.device = pick_device(args.device)
    bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()  # auto: bf16 where it can
    args.dtype = ("bfloat16" if bf16 else "float32") if args.dtype == "auto" else args.dtype
    return args, task, config, checkpoint


@contextlib.contextmanager
def restoring(path):
    """The block, a file that does not load or fit (a weight missing, misshapen) as a ValueError."""
    try:
        yield
    except Exception as error:
        reason = " ".join(str(error).split())[:160]
        raise ValueError(f"{path} is not a checkpoint of this model ({reason})") from None


def load_checkpoint(out_dir, needs=(), name="ckpt.pt"):
    """out_dir/ckpt.pt (or name) as a dict of tensors, numbers and strings: loading runs no code."""
    path = os.path.join(out_dir, name)
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path}; train a run there first, or point to one")
    with restoring(path):
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        GPTConfig(**checkpoint["config"])  # a config that is not a GPTConfig's fails here
        missing = sorted({"model", "step", "args", *needs} - set(checkpoint))
        if missing or not isinstance(checkpoint["args"], dict):
            raise ValueError(f"no {missing[0]!r}" if missing else "args is not a mapping")
    return checkpoint


def load_model(out_dir, device="cpu", name="ckpt.pt"):
    """(model in eval mode on device, checkpoint) of the run in out_dir: for sample.py, lessons."""
    checkpoint = load_checkpoint(out_dir, name=name)
    model = GPT(GPTConfig(**checkpoint["config"])).to(device).eval()
    with restoring(os.path.join(out_dir, name)):
        model.load_state_dict(checkpoint["model"])
    return model, checkpoint


def save(out_dir, metrics, checkpoint, names):
    """The checkpoint as each of names, then metrics.jsonl, each written aside and renamed."""
    lines = "".join(json.dumps(m) + "\n" for m in metrics)
    writes = {name: lambda temporary: torch.save(checkpoint, temporary) for name in names}
    writes["metrics.jsonl"] = lambda temporary: pathlib.Path(temporary).write_text(lines)
    for name, write in writes.items():
        try:
            write_whole(os.path.join(out_dir, name), write)
        except (OSError, RuntimeError) as error:  # a full disk (torch.save's is a RuntimeError)
            reason = getattr(error, "strerror", None) or "is the disk full?"
            raise OSError(f"{out_dir}/{name} could not be written ({reason}); the file there "
                          f"before is as it was") from None


def pick_device(name):
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name == "auto":
        return next((device for device, ok in available.items() if ok), "cpu")
    if not available.get(name, True):
        raise ValueError(f"--device {name}: not available here; use --device auto or cpu")
    return name


def synchronize(device):
    if device in ("cuda", "mps"):  # wait for the GPU's queue: a clock read next measures the work
        getattr(torch, device).synchronize()


def learning_rate(step, args):
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    if step >= args.lr_decay_iters:
        return args.min_lr
    progress = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def split_batch(x, y, layout, n, cut):
    """The batch in n parts, rows sorted by their last scored token (cut: ending there); shares."""
    scored = y != -1
    if n == 1 or (total := int(scored.sum())) == 0:  # one part (0 / 0 as a mean loss: too)
        yield x, y, layout, 1.0
        return
    ends = torch.where(scored.any(1), y.size(1) - scored.flip(1).int().argmax(1), 0)
    for rows in ends.argsort(stable=True).tensor_split(n):
        share = int(scored[rows].sum()) / total  # a float, exact at any precision of the loss
        if share > 0:  # else nothing to learn from (its mean loss would be 0 / 0)
            width = int(ends[rows].max()) if cut else y.size(1)
            part_layout = {k: v[rows, :width] for k, v in layout.items()}
            yield x[rows, :width], y[rows, :width], part_layout, share


def describe_metrics(record):
    """One line of a record's test numbers: losses and perplexities as they are, the rest as %."""
    shown = {k.removeprefix("eval_").replace("_", " "): v for k, v in record.items()
             if k.startswith(("eval_", "length_")) and isinstance(v, float)}
    return "test " + ", ".join(f"{k} {v:.4f}" if k.endswith(("loss", "perplexity")) else
                               f"{k} {v:.2%}" for k, v in shown.items())


def main(argv=None):
    args, task, config, checkpoint = parse_args(argv)
    goal = math.inf if args.stop_at_acc is None else args.stop_at_acc
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "lock"), "w") as lock:  # out_dir is this run's till closed
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on close, even by a kill
        except BlockingIOError:
            raise ValueError(f"--out_dir {args.out_dir}: another run is using it") from None
        torch.manual_seed(args.seed)
        torch.set_flush_denormal(True)  # a run whose activations shrink to subnormal floats runs ~3x slower on a CPU
        model = GPT(config).to(args.device)
        optimizer = model.configure_optimizer(args.weight_decay, args.lr, (args.beta1, args.beta2))
        data_rng = torch.Generator().manual_seed(args.seed)      # training batches
        eval_rng = torch.Generator().manual_seed(args.seed + 1)  # test batches, a stream of its own
        generators = {"torch": torch.default_generator, "data": data_rng, "eval": eval_rng}
        step, train_time, metrics = 0, 0.0, []
        with restoring(f"{args.out_dir}/ckpt.pt" if args.resume else args.init_from):
            if checkpoint is not None:  # resuming, or starting from the weights of --init_from
                model.load_state_dict(checkpoint["model"])
            if args.resume:  # the optimizer's moments (with this command's betas), RNGs, metrics
                optimizer.load_state_dict(checkpoint["optimizer"])
                for group in optimizer.param_groups:
                    group["betas"] = (args.beta1, args.beta2)
                optimizer.param_groups[0]["weight_decay"] = args.weight_decay
                rng = checkpoint["rng"]
                for name, generator in generators.items():
                    generator.set_state(rng[name])
                if rng["cuda"] is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state_all(rng["cuda"])
                if rng.get("mps") is not None and args.device == "mps":
                    torch.mps.set_rng_state(rng["mps"])
                step, train_time = checkpoint["step"], checkpoint["train_time"]
                metrics = checkpoint["metrics"]
        resumed_train_time = train_time
        autocast = torch.autocast(args.device, torch.bfloat16) if args.dtype == "bfloat16" else contextlib.nullcontext()
        print(f"{args.task}: {config.describe()}, {model.num_params() / 1e6:.2f}M parameters, "
              f"{args.device} {args.dtype}" + (f", resuming at step {step}" if step else ""))
        first_record = {}
        if args.mimic_iters and step == 0:  # LEGO's, on unlabelled sequences of the task
            batches = (task.sample(args.batch_size, data_rng)[0].to(args.device) for _ in
                       tqdm(range(args.mimic_iters), desc="mimicking", disable=not args.progress))
            losses = mimic(model, batches, args.lr, (args.beta1, args.beta2), autocast)
            print(f"mimicking: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {args.mimic_iters} steps")
            first_record = {"mimic_loss": [losses[0], losses[-1]]}

        # The loop: to max_iters, or to the first evaluation that reaches --stop_at_acc.
        done = any(m.get("stopped_early") and m["eval_acc"] >= goal for m in metrics[-1:])
        best = min((m["eval_loss"] for m in metrics), default=math.inf)
        evaluation = (model, args.eval_samples, args.batch_size, eval_rng, args.device, autocast)
        window, tick = [], time.perf_counter()
        bar = tqdm(total=args.max_iters, initial=step, disable=not args.progress)
        while step < args.max_iters and not done:
            lr = learning_rate(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = (t.to(args.device) for t in task.sample(args.batch_size, data_rng))
            layout = task.layout(x)  # {} or, for an inductive scratchpad, positions and groups
            loss = 0.0  # the batch's mean: the sum of each part's by its share (one part: 1.0)
            parts = split_batch(x, y, layout, args.micro_batches, "cache" in config.abilities())
            for x_part, y_part, layout_part, share in parts:
                with autocast:
                    _, part_loss = model(x_part, y_part, **layout_part)
                (part_loss * share).backward()
                loss = loss + part_loss.detach() * share
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window.append(loss.detach())  # on the device (.item() waits): read every 10 steps
            bar.update(1)
            if step % 10 and step % args.eval_interval and step < args.max_iters:
                continue
            mean_loss = torch.stack(window[-10:]).mean().item()
            evaluating = step % args.eval_interval == 0 or step == args.max_iters
            weights_ok = not evaluating or all(p.isfinite().all() for p in model.parameters())
            if not (math.isfinite(mean_loss) and weights_ok):  # the NaN guard: stop, not save
                raise ValueError(f"step {step}: loss {mean_loss} or weights not finite; lower --lr")
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            if not evaluating:
                continue
            synchronize(args.device)  # evaluate (not training time), then save
            train_time += time.perf_counter() - tick
            record = {"step": step, "train_time": round(train_time, 3), "lr": lr,
                      "train_loss": torch.stack(window).mean().item(), **first_record}
            first_record, done = {}, step == args.max_iters
            record.update(task.evaluate(*evaluation, final=done))
            if record["eval_acc"] >= goal and not done:  # stop, with a last evaluation's extras
                extras = {k: v for k, v in task.evaluate(*evaluation, final=True).items()
                          if k not in record}
                record.update(extras, stopped_early=True)
                done = True
            metrics = metrics + [record]
            rng = {name: generator.get_state() for name, generator in generators.items()}
            rng.update(cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                       mps=torch.mps.get_rng_state() if args.device == "mps" else None)
            checkpoint = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                              config=asdict(config), args=args.settings, step=step,
                              train_time=train_time, metrics=metrics, rng=rng)
            names = ("ckpt.pt", "best.pt") if record["eval_loss"] < best else ("ckpt.pt",)
            save(args.out_dir, metrics, checkpoint, names)
            bar.write(f"step {step}: {describe_metrics(record)}")
            best, window, tick = min(best, record["eval_loss"]), [], time.perf_counter()
        bar.close()

    final, best = metrics[-1], min(metrics, key=lambda m: m["eval_loss"])
    first_99 = next((f"at step {m['step']}" for m in metrics if m["eval_acc"] >= 0.99), "never")
    stopped = " (stopped early)" if final.get("stopped_early") else ""
    line = (f"done: {args.task}, {config.describe()}, {final['step']} steps{stopped} in "
            f"{final['train_time']:.0f} s on {args.device} ({args.dtype}); accuracy >= 99% "
            f"{first_99}; {describe_metrics(final)}; best.pt: step {best['step']}; metrics in "
            f"{args.out_dir}/metrics.jsonl")
    print(line)
    return {"line": line, "final": final, "metrics": metrics, "n_params": model.num_params(),
            "device": args.device, "dtype": args.dtype, "args": vars(args),
            "resumed_train_time": resumed_train_time}


def run(main):
    """The one top-level handler: main(), a ValueError, OSError or Ctrl-C as one line, exit 1."""
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(f"{os.path.basename(sys.argv[0])}: interrupted; the files it saved are whole")
    except (ValueError, OSError) as error:  # a flag, a file, a full disk
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {error}")


if __name__ == "__main__":
    run(main)
