"""What the lessons share: their set-up, the bookkeeping of their runs, their claims lines.
NANOCHACAL_SCALE: smoke (seconds: the tests), cpu (minutes on a laptop: the committed outputs) or
gpu (the papers' sizes). NANOCHACAL_REUSE=1 continues interrupted runs and takes finished ones as
they are; otherwise every run starts over, but for the toy-task runs lessons 00 and 01 share."""

import concurrent.futures
import contextlib
import multiprocessing
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts

import torch  # noqa: E402

import train  # noqa: E402
from data import task_class, task_from_settings  # noqa: E402

STARTED = time.time()  # the lesson's clock: its first cell imports this module
SCALE = os.environ.get("NANOCHACAL_SCALE") or ("gpu" if torch.cuda.is_available() else "cpu")
if SCALE not in ("smoke", "cpu", "gpu"):
    raise SystemExit(f"NANOCHACAL_SCALE={SCALE!r}: use smoke, cpu or gpu")
REUSE = os.environ.get("NANOCHACAL_REUSE") == "1"
DEVICE = train.pick_device("auto")  # where train.py's runs go, so the lessons read them there
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
DEVICE_NAME = (torch.cuda.get_device_name() if DEVICE == "cuda" else "mps (Apple GPU)"
               if DEVICE == "mps" else f"cpu ({CORES} cores)")
# out/, out/gpu, out/smoke: relative, so that flags split on spaces stay whole in any clone's path.
OUT = os.path.relpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   "out", *([SCALE] if SCALE != "cpu" else [])))
TAKEN = []  # the runs train_plan took as saved: their training time is not this lesson's
SHELL = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None  # a notebook's
if SCALE == "smoke" and SHELL:  # the tests: every plotting call runs, no figure is drawn (seconds each)
    SHELL.run_line_magic("config", "InlineBackend.figure_formats = set()")

# The paper's toy task (chains of 15 hops), one set of flags for every model of Table 1: lessons 00
# and 01 share its standard runs. cpu: train.py's defaults (one ChaCAL layer passes 99.9% by 800).
# gpu: the ChaCAL paper's Table 4 (d 512, 8 heads, lr 3e-4, batch 128, warmup 8k of 24k steps).
TOY_TABLE = {
    "smoke": dict(seeds=[0], layers=[1, 2], flags="--n_blocks 4 --block_len 4 --n_embd 16 "
                  "--n_head 2 --batch_size 4 --max_iters 2 --eval_interval 2 --eval_samples 8"),
    "cpu": dict(seeds=[0, 1], layers=[1, 2, 3], flags="--max_iters 1000 --eval_interval 100"),
    "gpu": dict(seeds=[0, 1, 2, 3], layers=[1, 2, 3, 4, 5],
                flags="--n_embd 512 --n_head 8 --batch_size 128 --lr 3e-4 --warmup_iters 8000 "
                      "--max_iters 24000 --eval_interval 500 --eval_samples 2048"),
}[SCALE]


def toy_table_flags(attn, n_layer, seed, gamma=0.9, extra=""):
    """train.py's flags for one model of the toy task's Table 1, or with another γ or flags (its
    own folder then). The standard runs are shared: a lesson takes them as the other saved them."""
    own = f"--gamma {gamma} {extra}" if (gamma, extra) != (0.9, "") else ""  # then a folder of its own
    out = f"{OUT}/toy/{attn}_L{n_layer}_seed{seed}" + own.replace(" ", "").replace("--", "_")
    argv = (f"--task toy --attn {attn} --n_layer {n_layer} {TOY_TABLE['flags']} --seed {seed} {own} "
            f"--out_dir {out}").split()
    return reuse_if_saved(argv) if attn == "standard" else argv


def blind_guess(settings, n=4096):
    """The toy task's score without following a pointer, on n fresh sequences of a run's task: bet
    on block 0's most repeated value (values are drawn independently, so one often repeats)."""
    toy = task_from_settings(settings)
    block0 = toy.sample(n, torch.Generator().manual_seed(1))[0][:, :toy.block_len]
    repeats = (block0[:, :, None] == block0[:, None, :]).sum(-1).max(-1).values
    return repeats.float().mean().item() / toy.block_len


def describe_setup():
    """The line every lesson prints first: scale, device, torch."""
    return (f"scale {SCALE}{', reusing saved runs' if REUSE else ''}, device {DEVICE_NAME}, "
            f"torch {torch.__version__}")


def folder(*parts):
    """A run's folder: ("lesson03", "BERT, random init") -> OUT/lesson03/BERT_random_init."""
    return "/".join([OUT] + [re.sub("[^A-Za-z0-9]+", "_", str(p)).strip("_") for p in parts])


def train_plan(plan, jobs=1, slowest_first=None):
    """{key: train.py flags (a string or a list)} -> {key: train.main's summary}, in the plan's
    order; trained `jobs` at a time, ordered by slowest_first(key) (the last ones end together)."""
    keys = sorted(plan, key=slowest_first) if slowest_first else list(plan)
    argvs = [[*(plan[k].split() if isinstance(plan[k], str) else plan[k]), "--no-progress"] for k in keys]
    started = time.time()
    runs = dict(zip(keys, train_many(argvs, jobs)))
    TAKEN.extend(run for run in runs.values() if run["resumed_train_time"])  # taken as saved, or continued
    print(f"{len(runs)} runs, {jobs} at a time, in {time.time() - started:.0f} s")
    return {k: runs[k] for k in plan}


def task_of(flags):
    """The task a run's train.py flags describe (a boxes dataset is made and cached now, once)."""
    return train.parse_args(flags.split())[1]


def subset(names, variable):
    """names (a list or a dict), or only those the environment variable lists, comma-separated."""
    listed = os.environ.get(variable) and os.environ[variable].split(",")
    return names if not listed else {k: names[k] for k in listed} if isinstance(names, dict) else listed


def steps_to(run, threshold, key="eval_acc", depth=None):
    """The first evaluated step at which a run (train.main's summary) had metric `key` at or above
    threshold, or None; with depth, the metric's value at that chain depth (key "..._by_depth")."""
    return next((m["step"] for m in run["metrics"]
                 if (m[key] if depth is None else m[key][str(depth)]) >= threshold), None)


def steps_to_text(run, threshold, key="eval_acc", depth=None):
    """steps_to as a claims line prints it: "700", or "never within 1000" (the run's last step)."""
    step = steps_to(run, threshold, key, depth)
    return str(step) if step is not None else f"never within {run['final']['step']}"


def trained_model(summary):
    """The model a run saved, on the CPU, in eval mode."""
    return train.load_model(summary["args"]["out_dir"])[0].eval()


def claim(ok, text, numbers=None):
    """A line of a lesson's claims cell: ✓ or ✗ (ok), the claim with its threshold, its numbers."""
    print(f"{'✓' if ok else '✗'} {text}" + ("" if numbers is None else f": {numbers}"))


def report(text, numbers):
    """A claims-cell line for a figure reported with no threshold to pass: `· text: numbers`."""
    print(f"· {text}: {numbers}")


def lesson_time():
    """The claims cell's last line: the lesson's time, less the runs it took as saved."""
    saved = (f"; {len(TAKEN)} runs taken as saved (their {sum(r['resumed_train_time'] for r in TAKEN) / 60:.1f}"
             f" min of training is not in this time)" if TAKEN else "")
    print(f"\nlesson time: {(time.time() - STARTED) / 60:.1f} min on {describe_setup()}{saved}")


def train_many(argvs, jobs=1, resume_saved=REUSE):
    """train.main(argv) for every argument list, `jobs` at a time; the summaries, in order.
    A small model leaves a GPU (or many cores) mostly idle, so runs go in spawned processes (a
    forked one cannot use CUDA), each on its share of the threads, printing to out_dir/log.txt.
    resume_saved: a run whose out_dir holds a checkpoint continues there (reuse_if_saved)."""
    out_dirs = [os.path.normpath(train.build_parser().parse_known_args(a)[0].out_dir) for a in argvs]
    if len(set(out_dirs)) < len(out_dirs):  # two runs would overwrite each other's checkpoints
        raise ValueError(f"train_many: more than one run writes to one of {sorted(out_dirs)}")
    argvs = [reuse_if_saved(a) if resume_saved else list(a) for a in argvs]
    if jobs == 1 or not argvs:
        return [train.main(argv) for argv in argvs]
    threads = max(1, CORES // min(jobs, len(argvs)))
    logs = [os.path.join(out_dir, "log.txt") for out_dir in out_dirs]
    started = time.time()
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
        running = {pool.submit(main_logged, a, log, threads): log for a, log in zip(argvs, logs)}
        try:  # one line per finished run is the progress report: a bar would interleave with them
            for count, done in enumerate(concurrent.futures.as_completed(running), start=1):
                try:
                    line = done.result()["line"]
                except concurrent.futures.BrokenExecutor:  # killed, not failed: no message left
                    raise SystemExit("a worker process died without an error (most often killed "
                                     "for lack of memory: run fewer at a time)") from None
                except BaseException as error:  # SystemExit too: its message comes with it
                    raise SystemExit(f"a run failed ({type(error).__name__}: {error}); its output "
                                     f"is in {running[done]}") from None
                print(f"[{count}/{len(running)} runs, {jobs} at a time, "
                      f"{time.time() - started:.0f} s] {line}", flush=True)
        except BaseException:  # a failed run or Ctrl-C: the runs not yet started never start
            pool.shutdown(cancel_futures=True)
            raise
        return [run.result() for run in running]


def reuse_if_saved(argv):
    """argv, with --resume if its out_dir holds a run with the same settings (taken as it is, or
    continued); a saved run with other settings stops the lesson: it would report another run."""
    parser = train.build_parser()
    args = parser.parse_args(argv)
    path = os.path.join(args.out_dir, "ckpt.pt")
    if "--resume" in argv or not os.path.exists(path):
        return list(argv)
    saved = torch.load(path, map_location="cpu", weights_only=True)["args"]
    typed = {a.dest for a in parser._actions for o in a.option_strings  # what argv sets, and
             if any(f == o or f.startswith(o + "=") for f in argv)}     # defaults no task changes
    kept = (typed | {k for k, v in vars(args).items() if v not in (None, "auto")} - set(
        task_class(args.task).train_defaults)) - {"out_dir", "resume", "progress"}
    differ = [f"--{k} {saved.get(k)} (now {getattr(args, k)})" for k in sorted(kept)
              if saved.get(k, getattr(args, k)) != getattr(args, k)]
    if differ:
        raise SystemExit(f"{args.out_dir} holds a run with other settings: {', '.join(differ)}; "
                         f"delete that directory to train this run afresh")
    return list(argv) + ["--resume"]


def main_logged(argv, log, threads):
    """train.main(argv) in a worker of train_many: `threads` CPU threads, output to `log`."""
    torch.set_num_threads(threads)
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    with open(log, "a") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        return train.main(list(argv) + ["--no-progress"])
