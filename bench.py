"""
Speed and memory of ChaCAL, LEGO and Sliding-Dilated attention, mostly as ratios to standard
attention measured in one run.

    python bench.py            # full sizes on a CUDA GPU; small sizes on a CPU or mps
    python bench.py --small    # the small sizes anywhere (2 minutes, 5 GB on a 2-core CPU)

Seven tables:
1. the attention core alone (forward + backward), standard (fused SDPA) vs ChaCAL (its
   automatic path: on a CPU the blocked solve from T = 128), at growing sequence lengths with
   the number of tokens per batch held fixed;
2. a whole one-layer model's training step (forward, backward, AdamW), same lengths;
3. decoding tokens/s: standard with its KV cache, ChaCAL with its mixed-value cache, and ChaCAL
   re-solving the whole prefix for every token (what decoding would cost without the cache);
4. LEGO attention v0 and v1 against standard attention in a bidirectional layer: FLOPs of a
   training step (forward + backward), attention parameters and step time (the comparison of
   the LEGO paper's Figure 9, which counts inference FLOPs on 64 x 512 tokens: the ratios of
   forward alone differ from these by at most 2%);
5. Sliding-Dilated-Attention's training step on its two paths: the fast one, which gathers each
   query's C entries, against the masked T x T map it equals (one level costs the same at any
   dilation, so one layer stands for each of the log_C T levels);
6. long sequences (T = 512 ... 8192, one sequence of the size above): time and peak memory of
   the attention core's forward + backward for fused standard attention, ChaCAL's one solve and
   ChaCAL's blocked solve, then (6b) ChaCAL's automatic choice of path against both paths at
   T = 32 ... 512 (`python bench.py --long_only` prints these tables alone);
7. on a CUDA GPU at full sizes: the seconds one ChaCAL layer at the paper's size takes to reach
   99.9% test accuracy on the toy task.

Peak memory is what a step holds beyond what was resident before it: in tables 1 and 2 on CUDA
only (PyTorch tracks no CPU peak); table 6 measures it on a CPU too, from the peak resident
memory of a fresh process per case. The paths a table compares are timed in turns, so that
other work on the machine, or a GPU's changing clock, slows them alike.

The targets printed beside the figures are this project's; none is a number from the papers. A
ChaCAL training step at most 1.35x a standard one (on a GPU: the ChaCAL paper's Table 2 has a
ChaCAL model train in 1.36x the time of a standard one of the same depth); cached decoding at
least 0.9x as fast as standard's (the mixed-value cache makes a token one attention row, as
standard's KV cache does); at T = 4096 the blocked solve within 2x fused attention's memory and
1/10 of the one solve's (memory linear in T), and on a CPU within 4x fused attention's time (a
GPU keeps the one solve); the automatic path at most 1.1x the one solve at every T of table 6b;
99.9% within 15 s (the toy task is a matter of seconds on a GPU).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while torch loads: stop, no traceback
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import train
from attention import CHACAL_BLOCKED_FROM, CHACAL_ROWS_PER_BLOCK, chacal_attention
from model import GPT, GPTConfig
from train import DEVICE_HELP, DEVICES, OneLineErrors, pick_device, run_command, synchronize


def in_turns(fns, device, repeats):
    """Run the fns that a table compares `repeats` times each, after one warm-up run each; per fn
    (its run times in seconds, sorted; the peak memory a run held beyond what was resident before
    it, in MiB, CUDA only). The fns take turns, so that other work on the machine, or a GPU's
    clock, slows them alike; each round starts one fn later (1 2 3, 2 3 1, ...), as a run right
    after a costly one can be slowed by it (caches, the allocator)."""
    for fn in fns:
        fn()
    runs = [[] for _ in fns]
    peaks = [0.0 if device == "cuda" else float("nan") for _ in fns]
    for turn in range(repeats):
        for i in [(turn + j) % len(fns) for j in range(len(fns))]:
            synchronize(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            start = time.perf_counter()
            fns[i]()
            synchronize(device)
            runs[i].append(time.perf_counter() - start)
            if device == "cuda":
                peaks[i] = max(peaks[i], (torch.cuda.max_memory_allocated() - resident) / 2**20)
    return [(sorted(seconds), peak) for seconds, peak in zip(runs, peaks)]


def median(seconds):
    """The median of sorted timings: the middle one, or the mean of the two middle ones."""
    middle = len(seconds) // 2
    return seconds[middle] if len(seconds) % 2 else (seconds[middle - 1] + seconds[middle]) / 2


def medians_in_turns(fns, device, repeats):
    """(median seconds, peak MiB) of each fn, timed in turns (in_turns)."""
    return [(median(seconds), peak) for seconds, peak in in_turns(fns, device, repeats)]


def bench_core(T, tokens, n_head, head_size, dtype, device, repeats):
    """(median seconds, peak MiB) of forward + backward of fused standard attention and of
    ChaCAL's automatic path, in turns."""
    B = max(1, tokens // T)
    shape = (B, n_head, T, head_size)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def standard():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def chacal():
        chacal_attention(q, k, v, 0.9).sum().backward()

    return medians_in_turns([standard, chacal], device, repeats)


def autocast(device, dtype):
    return torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)


def one_layer_model(attn, T, size, **options):
    """The model tables 2-5 measure: one block of `attn`, seeded so runs build the same weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=T, vocab_size=128, n_layer=1, attn=attn, **size, **options))


def training_step(attn, T, tokens, size, dtype, device, fused=True, **options):
    """A function that takes one training step of a one-layer model on `tokens` tokens;
    fused=False takes the attention's readable path."""
    B = max(1, tokens // T)
    model = one_layer_model(attn, T, size, **options).to(device)
    model.transformer.h[0].attn.fused = fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 128, (B, T), device=device)

    def step():
        with autocast(device, dtype):
            _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def count_step(attn, T, tokens, size, **options):
    """FLOPs of one forward + backward of a one-layer model, and its attention's parameters.
    Counted on the CPU in float32, through the readable attention path: the counter sees the
    matmuls of A = softmax(QKᵀ) and AV there, but counts the fused SDPA kernel as 0 FLOPs."""
    model = one_layer_model(attn, T, size, **options)
    model.transformer.h[0].attn.fused = False
    x = torch.randint(0, 128, (max(1, tokens // T), T))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops(), sum(p.numel() for p in model.transformer.h[0].attn.parameters())


DECODE_REPEATS = 3  # decoding a whole sequence is one long measurement; fewer repeats suffice


def bench_decode(ways, T, batch, size, dtype, device, repeats):
    """Tokens/s of each (attn, use_cache) way of generating T - 1 tokens after a 1-token prompt
    with a one-layer model, in turns (at most DECODE_REPEATS times)."""
    def decoding(attn, use_cache):
        model = one_layer_model(attn, T, size).to(device).eval()
        prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)

        def decode():
            with autocast(device, dtype):
                model.generate(prompt, T - 1, temperature=0, use_cache=use_cache)
        return decode

    runs = in_turns([decoding(attn, use_cache) for attn, use_cache in ways], device,
                    min(repeats, DECODE_REPEATS))
    return [batch * (T - 1) / median(seconds) for seconds, _ in runs]


LONG_PATHS = ["fused", "one-solve", "blocked"]


def long_core_inputs(T, n_head, head_size, dtype, device):
    """q, k, v of one sequence, (1, nh, T, hs), that collect gradients."""
    torch.manual_seed(0)
    return [torch.randn(1, n_head, T, head_size, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)]


def long_core_step(path, q, k, v):
    """Forward + backward of one attention core: fused standard attention or a ChaCAL path."""
    if path == "fused":
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # rows_per_block 0 is the one-solve path
        y = chacal_attention(q, k, v, 0.9, rows_per_block=CHACAL_ROWS_PER_BLOCK if path == "blocked" else 0)
    y.sum().backward()


def proc_status_kib(field):
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1])


def measure_peak(path, T, n_head, head_size, dtype_name, device):
    """MiB that one forward + backward holds at its peak beyond what existed before it (the
    inputs), their gradients included. Called in a fresh process by peak_memory: see there."""
    q, k, v = long_core_inputs(T, n_head, head_size, getattr(torch, dtype_name), device)
    long_core_step(path, q, k, v)  # a warm-up: one-time initialisations are not the step's
    for x in (q, k, v):
        x.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        long_core_step(path, q, k, v)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return float("nan")  # not Linux: no way to reset the process's peak
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets the peak resident size (VmHWM) to the current one
    before = proc_status_kib("VmRSS")
    long_core_step(path, q, k, v)
    return (proc_status_kib("VmHWM") - before) / 1024


def peak_memory(path, T, n_head, head_size, dtype, device):
    """measure_peak in a fresh Python process, so that no earlier case's memory counts. On a CPU
    the process's resident memory is what the step costs only if freed memory goes back to the
    system at once: MALLOC_MMAP_THRESHOLD_ makes glibc map every block of a page (4 KiB) or more
    on its own and unmap it when freed, where by default it may keep freed memory for later reuse.
    At 64 KiB, the blocked path's small blocks at T = 256 (32 rows) reused the heap the warm-up
    had grown, and read 0.0 MiB in one process out of two."""
    code = (f"import bench; print(bench.measure_peak({path!r}, {T}, {n_head}, {head_size}, "
            f"{str(dtype).split('.')[-1]!r}, {device!r}))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="4096", OMP_NUM_THREADS=str(torch.get_num_threads()))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    if result.returncode:  # a negative code is a signal: SIGKILL (-9) is most often the OOM killer
        last = result.stderr.strip().splitlines()[-1:] or [f"killed by signal {-result.returncode}"]
        raise SystemExit(f"table 6: measuring {path} at T = {T} failed ({last[0]}); out of "
                         f"memory? run with --long_only on a machine with more")
    return float(result.stdout.split()[-1])


def long_sequences(lengths, size, dtype, device, repeats):
    """Table 6: time and peak memory of forward + backward for the three paths at each length;
    returns {T: {path: (seconds, MiB)}}."""
    n_head, head_size = size["n_head"], size["n_embd"] // size["n_head"]
    long_repeats = min(repeats, 3)  # beyond T = 2048 one case takes seconds
    print(f"\n6. long sequences, attention core forward + backward, one sequence, {n_head} heads of "
          f"{head_size} (fused = standard SDPA; blocked ChaCAL: blocks of {CHACAL_ROWS_PER_BLOCK} rows; "
          f"fastest of {repeats} runs in turns up to T = 2048, of {long_repeats} beyond; peak MiB "
          f"beyond the inputs)")
    print(f"{'T':>6}" + "".join(f" {path + ' ms':>13} {path + ' MiB':>14}" for path in LONG_PATHS)
          + f" {'blocked/fused ms, MiB':>22} {'blocked/one-solve ms, MiB':>26}")
    results = {}
    for T in lengths:
        q, k, v = long_core_inputs(T, n_head, head_size, dtype, device)
        runs = in_turns([lambda path=path: long_core_step(path, q, k, v) for path in LONG_PATHS],
                        device, repeats if T <= 2048 else long_repeats)
        results[T] = {path: (seconds[0], peak_memory(path, T, n_head, head_size, dtype, device))
                      for path, (seconds, _) in zip(LONG_PATHS, runs)}
        (t_f, m_f), (t_o, m_o), (t_b, m_b) = (results[T][path] for path in LONG_PATHS)
        print(f"{T:>6}" + "".join(f" {t * 1e3:>13.1f} {m:>14.1f}" for t, m in results[T].values())
              + f" {t_b / t_f:>10.2f}x {times(m_b, m_f):>10} {t_b / t_o:>12.2f}x {times(m_b, m_o):>12}")
    if 4096 in results:
        (t_f, m_f), (t_o, m_o), (t_b, m_b) = (results[4096][path] for path in LONG_PATHS)
        target("blocked ChaCAL peak memory / fused standard at T = 4096", m_b / m_f, "<=", 2)
        target("blocked ChaCAL peak memory / one-solve ChaCAL at T = 4096", m_b / m_o, "<=", 0.1)
        target("blocked ChaCAL time / fused standard at T = 4096 (a CPU target)", t_b / t_f, "<=", 4,
               judged_here=torch.device(device).type == "cpu")
    return results


def times(a, b):
    """a / b as text, "1.25x", or "-" where b is 0 (a short sequence whose peak stayed within a
    memory page)."""
    return f"{a / b:.2f}x" if b else "-"


def short_sequences(lengths, tokens, size, dtype, device, repeats):
    """Table 6b: where chacal_attention's automatic choice switches paths (CHACAL_BLOCKED_FROM),
    and that it costs at most 1.1x the one-solve path at every T: forward + backward at the
    model's batch of `tokens` tokens."""
    n_head, head_size = size["n_head"], size["n_embd"] // size["n_head"]
    blocked_from = CHACAL_BLOCKED_FROM.get(torch.device(device).type)
    switch = f"switches to blocked from T = {blocked_from}" if blocked_from else "one solve at every T here"
    print(f"\n6b. ChaCAL's automatic path vs its two paths, forward + backward, {tokens} tokens per "
          f"batch, fastest of {repeats} runs in turns ({switch})")
    print(f"{'T':>6} {'one-solve ms':>13} {'blocked ms':>11} {'auto ms':>9} {'auto/one-solve':>15}")
    worst = 0.0
    for T in lengths:
        shape = (max(1, tokens // T), n_head, T, head_size)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        one_solve, blocked, auto = (seconds[0] for seconds, _ in in_turns(
            [lambda rows=rows: chacal_attention(q, k, v, 0.9, rows_per_block=rows).sum().backward()
             for rows in (0, CHACAL_ROWS_PER_BLOCK, None)], device, repeats))
        print(f"{T:>6} {one_solve * 1e3:>13.1f} {blocked * 1e3:>11.1f} {auto * 1e3:>9.1f} "
              f"{auto / one_solve:>14.2f}x")
        worst = max(worst, auto / one_solve)
    if blocked_from is None:  # the automatic path is the one solve: no choice to check
        print("   target: ChaCAL automatic path / one-solve path: not judged, the same path here")
    else:
        target(f"ChaCAL automatic path time / one-solve path, worst of T = {lengths[0]} to {lengths[-1]}",
               worst, "<=", 1.1)


def target(what, measured, relation, goal, judged_here=True):
    """One line: the project's target for a figure, what was measured, and whether it is met."""
    if measured != measured:  # NaN: this device cannot measure it (no /proc, say)
        verdict = "not measured on this device"
    elif not judged_here:
        verdict = "not judged on this device"
    else:
        met = measured <= goal if relation == "<=" else measured >= goal
        verdict = "met" if met else "MISSED"
    print(f"   target: {what} {relation} {goal}: measured {measured:.2f}, {verdict}")


# What each table measures at: "full" (a CUDA GPU; the ChaCAL paper's toy size, d 512, 8 heads,
# batch 128 x 128 tokens, and longer) and "small" (train.py's laptop default, d 128). T: lengths
# of tables 1-2; decode_T, decode_batch: table 3; lego_T: table 4; dilated_T: table 5 (40 and
# 500, parity's training and longest test lengths); long_T, short_T: tables 6 and 6b.
SIZES = {
    "full": dict(T=[128, 512, 1024, 2048, 4096], tokens=128 * 128, size=dict(n_embd=512, n_head=8),
                 decode_T=[128, 512, 1024, 2048], decode_batch=8, lego_T=512,
                 dilated_T=[40, 500, 2048], long_T=[512, 1024, 2048, 4096, 8192],
                 short_T=[32, 64, 128, 192, 256, 512]),
    "small": dict(T=[128, 256, 512], tokens=64 * 128, size=dict(n_embd=128, n_head=4),
                  decode_T=[128, 256], decode_batch=4, lego_T=128, dilated_T=[40, 500],
                  long_T=[512, 1024, 2048, 4096, 8192], short_T=[32, 64, 128, 192, 256, 512]),
}


def main(argv=None):
    parser = OneLineErrors(prog="bench.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--small", action="store_true", help="small sizes even on a GPU")
    parser.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement "
                        "(decoding, and table 6 beyond T = 2048: at most 3)")
    parser.add_argument("--long_only", action="store_true",
                        help="only tables 6 and 6b: long sequences (fused, one-solve and blocked "
                        "ChaCAL), then ChaCAL's automatic path at short ones")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1")
    try:
        device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    full = device == "cuda" and not args.small
    sizes = SIZES["full" if full else "small"]
    lengths, tokens, size = sizes["T"], sizes["tokens"], sizes["size"]
    dtype = torch.bfloat16 if full and torch.cuda.is_bf16_supported() else torch.float32
    head_size = size["n_embd"] // size["n_head"]
    name = (torch.cuda.get_device_name() if device == "cuda" else
            f"{device}, {torch.get_num_threads()} threads" if device == "cpu" else device)
    print(f"device {name}, torch {torch.__version__}, {str(dtype).split('.')[-1]}, "
          f"d {size['n_embd']}, {size['n_head']} heads, {tokens} tokens per batch, "
          f"median of {args.repeats} runs (decoding: {min(args.repeats, DECODE_REPEATS)}; tables 6 "
          f"and 6b: fastest)")
    if args.long_only:
        long_sequences(sizes["long_T"], size, dtype, device, args.repeats)
        short_sequences(sizes["short_T"], tokens, size, dtype, device, args.repeats)
        return

    def row(T, std, cha):
        (t_std, m_std), (t_cha, m_cha) = std, cha
        memory = (f" {m_std:>10.0f} {m_cha:>10.0f} {m_cha / m_std:>7.2f}x" if device == "cuda"
                  else f" {'-':>10} {'-':>10} {'-':>8}")
        return f"{T:>6} {t_std * 1e3:>10.2f} {t_cha * 1e3:>10.2f} {t_cha / t_std:>7.2f}x" + memory

    header = f"{'T':>6} {'std ms':>10} {'chacal ms':>10} {'cha/std':>8} {'std MiB':>10} {'cha MiB':>10} {'cha/std':>8}"
    print(f"\n1. attention core, forward + backward (standard = fused SDPA in {str(dtype).split('.')[-1]}; "
          f"ChaCAL's automatic path, in fp32)")
    print(header)
    for T in lengths:
        print(row(T, *bench_core(T, tokens, size["n_head"], head_size, dtype, device, args.repeats)))
    print("\n2. one-layer model, full training step (forward, backward, AdamW)")
    print(header)
    step_ratios = []
    for T in lengths:
        std, cha = medians_in_turns([training_step(attn, T, tokens, size, dtype, device)
                                     for attn in ["standard", "chacal"]], device, args.repeats)
        print(row(T, std, cha))
        step_ratios.append(cha[0] / std[0])
    target(f"ChaCAL training step / standard step at T = {lengths[0]}, the toy size"
           + ("" if full else " (a GPU target, at d 512 in bf16)"), step_ratios[0], "<=", 1.35,
           judged_here=full)
    decode_batch = sizes["decode_batch"]
    print(f"\n3. decoding, tokens/s at batch {decode_batch} (one layer, after a 1-token prompt)")
    print(f"{'T':>6} {'std cache':>12} {'chacal cache':>13} {'cha/std':>7} {'chacal re-solve':>16} {'res/std':>7}")
    decode_ratios = []
    for T in sizes["decode_T"]:
        std, cha, resolve = bench_decode([("standard", True), ("chacal", True), ("chacal", False)],
                                         T, decode_batch, size, dtype, device, args.repeats)
        print(f"{T:>6} {std:>12.0f} {cha:>13.0f} {cha / std:>6.2f}x {resolve:>16.0f} {resolve / std:>6.2f}x")
        decode_ratios.append(cha / std)
    target("ChaCAL cached decoding tokens/s / standard (worst length)", min(decode_ratios), ">=", 0.9)

    lego_T = sizes["lego_T"]
    print(f"\n4. LEGO attention, one bidirectional layer, training step at T = {lego_T} "
          f"({tokens} tokens; [CLS], [SEP] = ids 0, 1; GFLOPs counted on the readable path without "
          f"AdamW's, ms timed on the fused path with it)")
    print(f"{'attention':<10} {'GFLOPs':>9} {'/std':>7} {'attn params':>12} {'/std':>7} {'ms':>9} {'/std':>7}")
    lego = dict(causal=False, broadcast_ids=(0, 1))
    lego_attns = ["standard", "lego_v0", "lego_v1"]
    steps = medians_in_turns([training_step(attn, lego_T, tokens, size, dtype, device, **lego)
                              for attn in lego_attns], device, args.repeats)
    baseline = None
    for attn, (seconds, _) in zip(lego_attns, steps):
        flops, params = count_step(attn, lego_T, tokens, size, **lego)
        baseline = baseline or (flops, params, seconds)
        print(f"{attn:<10} {flops / 1e9:>9.2f} {flops / baseline[0]:>6.2f}x {params:>12,} "
              f"{params / baseline[1]:>6.2f}x {seconds * 1e3:>9.2f} {seconds / baseline[2]:>6.2f}x")

    print("\n5. Sliding-Dilated-Attention (C = 2), one layer, training step: the masked T x T map "
          "vs the fast path")
    print(f"{'T':>6} {'map ms':>10} {'fast ms':>10} {'fast/map':>8}")
    for T in sizes["dilated_T"]:
        (masked, _), (fast, _) = medians_in_turns(
            [training_step("dilated", T, tokens, size, dtype, device, fused=fused)
             for fused in (False, True)], device, args.repeats)
        print(f"{T:>6} {masked * 1e3:>10.2f} {fast * 1e3:>10.2f} {fast / masked:>7.2f}x")

    long_sequences(sizes["long_T"], size, dtype, device, args.repeats)
    short_sequences(sizes["short_T"], tokens, size, dtype, device, args.repeats)

    if full:
        print("\n7. time to 99.9% test accuracy, one ChaCAL layer at the paper's size (lr 1e-3)")
        with tempfile.TemporaryDirectory() as out_dir:
            run = train.main(f"--attn chacal --task toy --n_embd 512 --n_head 8 --batch_size 128 "
                             f"--lr 1e-3 --warmup_iters 100 --max_iters 1500 --eval_interval 50 "
                             f"--eval_samples 2048 --no-progress --device cuda --out_dir {out_dir}".split())
        solved = next((m for m in run["metrics"] if m["eval_acc"] >= 0.999), None)
        seconds = solved["train_time"] if solved else float("inf")
        print(f"reached 99.9% at step {solved['step'] if solved else 'never'}")
        target("seconds of training to 99.9% on the toy task", seconds, "<=", 15)


if __name__ == "__main__":
    run_command(main, "interrupted; the figures printed so far stand, the rest were not measured")
