"""
What the lesson notebooks share: their set-up, and running many trainings for a table.

    from common import SCALE, REUSE, DEVICE, OUT, describe_setup, train_many, reuse_if_saved
    from common import steps_to, steps_to_text, trained_model, claim, report  # reading runs, claims
    from common import taken_as_saved  # the runs a lesson took as saved, for its time line
    from common import TOY_TABLE, toy_table_flags, blind_guess  # lessons 00 and 01's toy task

SCALE comes from NANOCHACAL_SCALE: "smoke" (seconds, what the tests run), "cpu" (minutes on a
laptop: the committed outputs) or "gpu" (the papers' sizes; the default where CUDA is present).
NANOCHACAL_REUSE=1 continues the runs an interruption stopped and takes finished ones as they are
(any other value: every run starts over, except the toy-task runs lessons 00 and 01 share, which
either lesson takes as the other saved them). Runs go under out/ (out/gpu, out/smoke at those
scales).
"""

import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts

import torch  # noqa: E402

import train  # noqa: E402
from data import task_from_settings  # noqa: E402

SCALE = os.environ.get("NANOCHACAL_SCALE") or ("gpu" if torch.cuda.is_available() else "cpu")
if SCALE not in ("smoke", "cpu", "gpu"):
    raise SystemExit(f"NANOCHACAL_SCALE={SCALE!r}: use smoke, cpu or gpu")
REUSE = os.environ.get("NANOCHACAL_REUSE") == "1"
DEVICE = train.pick_device("auto")  # where train.py's runs go, so the lessons read them there
# The cores this process may use (a container or taskset may allow fewer than the machine has).
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
DEVICE_NAME = (torch.cuda.get_device_name() if DEVICE == "cuda" else "mps (Apple GPU)"
               if DEVICE == "mps" else f"cpu ({CORES} cores)")
# Where runs go: out/ at the cpu scale (the committed lessons' runs), out/gpu and out/smoke at the
# others, so that no scale ever takes another's saved runs for its own. Relative to the working
# directory (../out from lessons/), so that flags written as one string and split on spaces stay
# whole in a clone whose path has a space.
OUT = os.path.relpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   "out", *([SCALE] if SCALE != "cpu" else [])))


# The paper's toy task (16 blocks of 8: chains of 15 hops), trained with one set of flags for every
# model of Table 1, so that lessons 00 and 01 share their standard runs (saved under out/toy/).
# cpu: train.py's defaults, with which one ChaCAL layer passes 99.9% by step 800 on a laptop CPU.
# gpu: the ChaCAL paper's Table 4 (d 512, 8 heads, lr 3e-4, batch 128, warmup 8k of 24k steps).
TOY_TABLE = {
    "smoke": dict(seeds=[0], layers=[1, 2], flags="--n_blocks 4 --block_len 4 --n_embd 32 "
                  "--n_head 2 --batch_size 8 --max_iters 4 --eval_interval 2 --eval_samples 16"),
    "cpu": dict(seeds=[0, 1], layers=[1, 2, 3], flags="--max_iters 1000 --eval_interval 100"),
    "gpu": dict(seeds=[0, 1, 2, 3], layers=[1, 2, 3, 4, 5],
                flags="--n_embd 512 --n_head 8 --batch_size 128 --lr 3e-4 --warmup_iters 8000 "
                      "--max_iters 24000 --eval_interval 500 --eval_samples 2048"),
}[SCALE]


def toy_table_flags(attn, n_layer, seed):
    """train.py's flags for one model of the toy task's Table 1."""
    return (f"--task toy --attn {attn} --n_layer {n_layer} {TOY_TABLE['flags']} --seed {seed} "
            f"--no-progress --out_dir {OUT}/toy/{attn}_L{n_layer}_seed{seed}").split()


def blind_guess(settings, n=4096):
    """The toy task's score without following a pointer: bet on block 0's most repeated value
    (values are drawn independently, so one often repeats), measured on n fresh sequences of the
    task a run's settings describe."""
    toy = task_from_settings(settings)
    block0 = toy.sample(n, torch.Generator().manual_seed(1))[0][:, :toy.block_len]
    repeats = (block0[:, :, None] == block0[:, None, :]).sum(-1).max(-1).values
    return repeats.float().mean().item() / toy.block_len


def describe_setup():
    """The line every lesson prints first: scale, device, torch."""
    return (f"scale {SCALE}{', reusing saved runs' if REUSE else ''}, device {DEVICE_NAME}, "
            f"torch {torch.__version__}")


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
    return train.load_model(summary["args"]["out_dir"])[0]


def claim(ok, text, numbers=None):
    """A line of a lesson's claims cell: ✓ or ✗ (ok), the claim with its threshold, its numbers."""
    print(f"{'✓' if ok else '✗'} {text}" + ("" if numbers is None else f": {numbers}"))


def report(text, numbers):
    """A claims-cell line for a figure reported with no threshold to pass: `· text: numbers`."""
    print(f"· {text}: {numbers}")


class WorkersKilled(SystemExit):
    """train_many's exit when a worker process was killed: no run is left in progress."""


def train_many(argvs, jobs=1, resume_saved=REUSE):
    """train.main(argv) for every argument list, `jobs` at a time; the summaries, in order.

    A small model's training step is mostly Python launching kernels, so one run leaves a GPU
    (or a many-core CPU) mostly idle; runs in separate processes overlap that work. Each process
    is spawned (a forked one cannot use CUDA), gets its share of the CPU threads, and writes
    what it would print to out_dir/log.txt; the summary lines are printed here.

    resume_saved: a run whose out_dir holds a checkpoint gets --resume, so a lesson executed
    again continues the runs an interruption stopped and takes the finished ones as they are.
    """
    parser = train.build_parser()
    out_dirs = [parser.parse_known_args(argv)[0].out_dir for argv in argvs]
    folders = [os.path.normpath(d) for d in out_dirs]  # run and ./run/ are one folder
    twice = sorted({d for d in folders if folders.count(d) > 1})
    if twice:  # two runs would overwrite each other's checkpoints
        raise ValueError(f"train_many: more than one run writes to {', '.join(twice)}")
    if resume_saved:
        argvs = [reuse_if_saved(argv) for argv in argvs]
    if jobs == 1 or not argvs:
        return [train.main(argv) for argv in argvs]
    context = multiprocessing.get_context("spawn")
    threads = max(1, CORES // min(jobs, len(argvs)))
    logs = [os.path.join(out_dir, "log.txt") for out_dir in out_dirs]
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        running = {pool.submit(main_logged, argv, log, threads): log for argv, log in zip(argvs, logs)}
        try:
            # One line per finished run is the progress report: a bar would interleave with them.
            for count, finished in enumerate(concurrent.futures.as_completed(running), start=1):
                try:
                    line = finished.result()["line"]
                except concurrent.futures.BrokenExecutor:  # a worker was killed, not failed
                    # Every unfinished run fails so at once, in no telling order. Runs start
                    # in the order given, `jobs` at a time: the first `jobs` unfinished ones
                    # were in progress, the rest had not started.
                    broken = [log for run, log in running.items() if run.done() and not run.cancelled()
                              and isinstance(run.exception(), concurrent.futures.BrokenExecutor)]
                    raise WorkersKilled(f"a worker process died without an error (most often "
                                        f"killed for lack of memory: run fewer at a time); what "
                                        f"the runs in progress printed is in "
                                        f"{', '.join(broken[:jobs])}")
                except BaseException as error:  # SystemExit too: its message comes with it
                    raise SystemExit(f"a run failed ({type(error).__name__}: {error}); its "
                                     f"output is in {running[finished]}")
                print(f"[{count}/{len(running)} runs, {jobs} at a time, "
                      f"{time.perf_counter() - started:.0f} s] {line}", flush=True)
        except BaseException as error:  # a failed run or Ctrl-C: runs not yet started never start
            # Ctrl-C stops the workers too, and a killed worker has stopped them all.
            if not isinstance(error, (KeyboardInterrupt, WorkersKilled)):
                print(f"{error}\nthe runs in progress finish first; the others never start", flush=True)
            pool.shutdown(cancel_futures=True)
            raise
        return [run.result() for run in running]


def reuse_if_saved(argv):
    """argv, with --resume if its out_dir holds a checkpoint of a run with the same settings: a
    finished run is then taken as it is, an interrupted one continued. Lessons 00 and 01 share
    their toy-task runs so. A saved run with other settings (flags edited since) stops the lesson:
    taking it would report a different run as this one."""
    parser = train.build_parser()
    args = parser.parse_args(argv)
    path = os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return list(argv)
    try:
        saved = train.load_checkpoint(args.out_dir)["args"]
    except ValueError as error:
        raise SystemExit(str(error))
    wanted = vars(train.with_task_defaults(args, train.typed_flags(parser, args, argv)))
    differ = [f"--{k} {saved.get(k)} (now {v})" for k, v in wanted.items()
              if k not in ("out_dir", "resume", "progress") and saved.get(k, v) != v]
    if differ:
        raise SystemExit(f"{args.out_dir} holds a run with other settings: {', '.join(differ)}; "
                         f"delete that directory to train this run afresh")
    return list(argv) + ["--resume"]


def taken_as_saved(argvs, runs, lesson, jobs):
    """What a lesson adds to its time about the runs train_many took as `lesson` saved them
    (reuse_if_saved gave their argv --resume), or "" when it trained every run itself: that
    training happened in the other lesson, so this lesson's time leaves it out. A run `lesson`
    left unfinished was continued here: only the time its checkpoint held is the other lesson's."""
    taken = [run for argv, run in zip(argvs, runs) if "--resume" in argv]
    if not taken:
        return ""
    minutes = sum(run["resumed_train_time"] for run in taken) / 60
    return (f"; {len(taken)} runs taken as {lesson} saved them (their {minutes:.1f} min of training, "
            f"{jobs} at a time, is not in this time)")


def main_logged(argv, log, threads):
    """train.main(argv) in a worker of train_many: `threads` CPU threads, output to `log`."""
    torch.set_num_threads(threads)
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    with open(log, "a") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        return train.main(list(argv) + ["--no-progress"])
