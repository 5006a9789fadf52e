"""Speed and memory of ChaCAL, LEGO and Sliding-Dilated attention as ratios to standard attention,
measured in one run, each beside this project's target (none of them is a number from a paper).

    python bench.py [--small] [--long_only]  # full sizes on CUDA, else (or --small) small ones
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median  # of timings: lesson 05 imports it from here

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attention import ATTENTIONS, CHACAL_ROWS_PER_BLOCK, blocked_chacal_attention, chacal_attention
from model import GPT, GPTConfig
from train import DEVICE_HELP, DEVICES, number, pick_device, run, synchronize


def memory_mib(device):
    """(MiB held now, MiB at the peak since the last call), then the peak restarts: CUDA's, or on
    a CPU this process's resident size (Linux; NaN elsewhere), which is what a run holds only in a
    fresh process where glibc unmaps each freed block of 4 KiB or more at once (table 6)."""
    if device == "cuda":
        now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return now / 2**20, peak / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return float("nan"), float("nan")
    status = Path("/proc/self/status").read_text()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size (VmHWM) := VmRSS
    return tuple(int(status.split(f"{name}:")[1].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))


def in_turns(fns, device, repeats):
    """Run each of fns `repeats` times after a warm-up run, in turns: other work on the machine, or
    a GPU's clock, slows them alike; each round starts one fn later (1 2 3, 2 3 1, ...), as a run
    right after a costly one can be slowed. Per fn: (sorted seconds of its runs, their peak MiB)."""
    for fn in fns:
        fn()
    runs = [[] for _ in fns]  # per fn, (seconds, peak MiB) of each run
    for turn in range(repeats):
        for i in [(turn + j) % len(fns) for j in range(len(fns))]:
            synchronize(device)
            resident, _ = memory_mib(device)
            start = time.perf_counter()
            fns[i]()
            synchronize(device)
            runs[i].append((time.perf_counter() - start, memory_mib(device)[1] - resident))
    return [(sorted(seconds for seconds, _ in run), max(mib for _, mib in run)) for run in runs]


def show(title, header, rows):
    """Print a table: its title, then each row right-aligned under the header; a cell (a, b): a / b."""
    def text(value):
        if isinstance(value, tuple):
            value = value[0] / value[1] if value[1] else float("nan")
            return "-" if value != value else f"{value:.2f}x"
        return (value if isinstance(value, str) else f"{value:,}" if isinstance(value, int)
                else "-" if value != value else f"{value:,.{2 if abs(value) < 100 else 0}f}")
    print(f"\n{title}")
    for row in [header] + rows:
        print(" ".join(f"{text(value):>{max(len(name), 7)}}" for value, name in zip(row, header)))


def target(what, measured, relation, goal, judged_here=True):
    """One line: the project's target for a figure, what was measured, and whether it is met."""
    met = measured <= goal if relation == "<=" else measured >= goal
    verdict = ("not measured on this device" if measured != measured else
               "not judged on this device" if not judged_here else "met" if met else "MISSED")
    print(f"   target: {what} {relation} {goal}: measured {measured:.2f}, {verdict}")


def compare(title, lengths, ways, make, ratios, device, repeats, stat=median, rate=None, mib=None):
    """A table of timings: make(way, T) for every way, in turns, at each T; a row per T of each
    way's ms (or tokens/s, rate(T, seconds)), the ratios {label: (a, b)} of those figures, and each
    way's peak MiB on CUDA (or mib(way, T), where given). Returns {T: {way: (seconds, MiB)}}."""
    cuda = mib is not None or device == "cuda"
    results, rows = {}, []
    for T in lengths:
        runs = in_turns([make(way, T) for way in ways], device, repeats)
        results[T] = {way: (stat(seconds), mib(way, T) if mib else peak)
                      for way, (seconds, peak) in zip(ways, runs)}
        got = {way: rate(T, seconds) if rate else seconds * 1e3 for way, (seconds, _) in results[T].items()}
        rows.append([T, *got.values(), *((got[a], got[b]) for a, b in ratios.values()),
                     *([mib for _, mib in results[T].values()] if cuda else [])])
    show(title, ["T", *(f"{way} {'tok/s' if rate else 'ms'}" for way in ways), *ratios,
                 *([f"{way} MiB" for way in ways] if cuda else [])], rows)
    return results


CORES = {  # the attention cores of tables 1, 6 and 6b; "auto": the path a ChaCAL layer takes
    "standard": lambda chacal, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "auto": lambda chacal, q, k, v: chacal.solve(q, k, v),
    "one-solve": lambda chacal, q, k, v: chacal_attention(q, k, v, chacal.gamma),
    "blocked": lambda chacal, q, k, v: blocked_chacal_attention(q, k, v, chacal.gamma),
}
LONG_PATHS = ["standard", "one-solve", "blocked"]


def core_step(path, T, tokens, size, dtype, device):
    """A function running forward + backward of CORES[path] on (tokens // T or 1, nh, T, hs)."""
    chacal = ATTENTIONS["chacal"](GPTConfig(block_size=T, attn="chacal", **size))
    shape = (max(1, tokens // T), size["n_head"], T, size["n_embd"] // size["n_head"])
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return lambda: CORES[path](chacal, q, k, v).sum().backward()


def one_layer_model(attn, T, size, **options):
    """The model tables 2-5 measure: one block of `attn`, seeded so runs build the same weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=T, vocab_size=128, n_layer=1, attn=attn, **size, **options))


def training_step(attn, T, tokens, size, dtype, device, fused=True, **options):
    """A function that takes one training step of a one-layer model (fused=False: readable path)."""
    model = one_layer_model(attn, T, size, **options).to(device)
    model.transformer.h[0].attn.fused = fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 128, (max(1, tokens // T), T), device=device)
    def step():
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def decoding(attn, T, batch, size, dtype, device, use_cache=True):
    """A function that greedily generates T - 1 tokens after a 1-token prompt, one layer of attn."""
    model = one_layer_model(attn, T, size).to(device).eval()
    prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
    def decode():
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            model.generate(prompt, T - 1, temperature=0, use_cache=use_cache)
    return decode


def count_step(attn, T, tokens, size, **options):
    """FLOPs of a one-layer model's training step on the CPU in float32, readable attention path
    (the counter counts fused SDPA and AdamW's updates as 0 FLOPs), and its attention parameters."""
    with FlopCounterMode(display=False) as counter:
        training_step(attn, T, tokens, size, torch.float32, "cpu", fused=False, **options)()
    attention = one_layer_model(attn, T, size, **options).transformer.h[0].attn
    return counter.get_total_flops(), sum(p.numel() for p in attention.parameters())


def long_sequences(lengths, size, dtype, device, repeats, fresh=True):
    """Table 6, {T: {path: (seconds, MiB)}}: the fastest of `repeats` forward + backward runs
    of each of LONG_PATHS on one sequence, its peak MiB in a fresh process (fresh=False: this one)."""
    def fresh_peak(path, T):  # in_turns' peak in a process where no earlier case's memory counts
        code = (f"import bench, torch; print(bench.in_turns([bench.core_step({path!r}, {T}, 1, "
                f"{size}, torch.{str(dtype)[6:]}, {device!r})], {device!r}, 1)[0][1])")
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="4096"),
                               cwd=Path(__file__).parent)
        if child.returncode:  # -9 (SIGKILL): most often the out-of-memory killer
            last = child.stderr.strip().split("\n")[-1]
            raise ValueError(f"table 6, {path} at T = {T}: exit status {child.returncode}: {last}")
        return float(child.stdout.split()[-1])
    results = compare(f"6. long sequences, attention core forward + backward, one sequence, "
                      f"fastest run (blocked: {CHACAL_ROWS_PER_BLOCK} rows a block)", lengths,
                      LONG_PATHS, lambda path, T: core_step(path, T, 1, size, dtype, device),
                      {"blk/std": ("blocked", "standard"), "blk/one": ("blocked", "one-solve")},
                      device, repeats, stat=min, mib=fresh_peak if fresh else None)
    if 4096 in results:
        (t_std, m_std), _, (t_blk, m_blk) = results[4096].values()
        target("blocked ChaCAL peak memory / standard at T = 4096", m_blk / m_std, "<=", 1.3)
        target("blocked ChaCAL time / standard at T = 4096 (CPU)", t_blk / t_std, "<=", 1.6, device == "cpu")
    if 8192 in results and device == "cuda":  # the blocked path's loop of small solves on a GPU
        (_, _), (t_one, _), (t_blk, _) = results[8192].values()
        target("blocked / one-solve ChaCAL time at T = 8192", t_blk / t_one, "<=", 1.5)
    return results


# "full" (CUDA): the ChaCAL paper's toy size (d 512, 8 heads, 128 x 128 tokens); "small": train.py's d 128.
SIZES = {
    "full": dict(T=[128, 512, 1024, 2048, 4096], tokens=128 * 128, size=dict(n_embd=512, n_head=8),
                 decode_T=[128, 512, 1024, 2048], decode_batch=8, lego_T=512, dilated_T=[40, 500, 2048],
                 long_T=[512, 1024, 2048, 4096, 8192], short_T=[32, 64, 128, 192, 256, 512], repeats=10),
    "small": dict(T=[128, 256, 512], tokens=64 * 128, size=dict(n_embd=128, n_head=4),
                  decode_T=[128, 256], decode_batch=4, lego_T=128, dilated_T=[40, 500],
                  long_T=[512, 1024, 2048, 4096], short_T=[32, 64, 128, 192, 256, 512], repeats=5),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    parser.add_argument("--small", action="store_true", help="the small sizes even on a GPU")
    parser.add_argument("--repeats", type=number(int, 1), help="timed runs per figure (default: 10 "
                        "full, 5 small), of which a table shows the fastest (tables 4-5: the median)")
    parser.add_argument("--long_only", action="store_true", help="only tables 6 and 6b")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    full = device == "cuda" and not args.small
    s = SIZES["full" if full else "small"]
    repeats = args.repeats or s["repeats"]
    tokens, size, lengths, B = s["tokens"], s["size"], s["T"], s["decode_batch"]
    dtype = torch.bfloat16 if full and torch.cuda.is_bf16_supported() else torch.float32
    on = dict(tokens=tokens, size=size, dtype=dtype, device=device)  # what every measurement runs on
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else device}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, {str(dtype)[6:]}, d {size['n_embd']}, {size['n_head']} heads "
          f"of {size['n_embd'] // size['n_head']}, {tokens} tokens per batch, {repeats} runs per figure")
    core = lambda path, T: core_step(path, T, **on)
    if not args.long_only:
        compare(f"1. attention core, forward + backward, fastest run (standard: fused SDPA in {str(dtype)[6:]}; auto: "
                "ChaCAL's automatic path)", lengths, ["standard", "auto"], core,
                {"auto/std": ("auto", "standard")}, device, repeats, stat=min)
        steps = compare("2. one-layer model, training step (forward, backward, AdamW; fastest run)", lengths,
                        ["standard", "chacal"], lambda attn, T: training_step(attn, T, **on),
                        {"cha/std": ("chacal", "standard")}, device, repeats, stat=min)
        for T, goal in [(lengths[0], 1.20)] if full else [(lengths[0], 1.25), (lengths[-1], 1.20)]:
            target(f"ChaCAL training step / standard at T = {T}", steps[T]["chacal"][0] / steps[T]["standard"][0],
                   "<=", goal)
        decoded = compare(f"3. decoding at batch {B}, one layer, after a 1-token prompt (fastest run)",
                          s["decode_T"], ["standard", "chacal", "re-solve"], lambda way, T: decoding(
                              way.replace("re-solve", "chacal"), T, B, size, dtype, device, way != "re-solve"),
                          {"cha/std": ("chacal", "standard"), "res/std": ("re-solve", "standard")},
                          device, repeats, stat=min, rate=lambda T, seconds: B * (T - 1) / seconds)
        worst = min(row["standard"][0] / row["chacal"][0] for row in decoded.values())
        target("ChaCAL cached decoding tokens/s / standard (worst length)", worst, ">=", 0.97)
        T, lego, attns = s["lego_T"], dict(causal=False, broadcast_ids=(0, 1)), ["standard", "lego_v0", "lego_v1"]
        runs = in_turns([training_step(attn, T, **on, **lego) for attn in attns], device, repeats)
        got = [(*count_step(attn, T, tokens, size, **lego), median(seconds)) for attn, (seconds, _) in zip(attns, runs)]
        show(f"4. LEGO attention, one bidirectional layer, training step at T = {T} (GFLOPs of the "
             "readable path without AdamW's; ms of the fused path with it)",
             ["attention", "GFLOPs", "/std", "attn params", "/std", "ms", "/std"],
             [[attn, flops / 1e9, (flops, got[0][0]), params, (params, got[0][1]), seconds * 1e3,
               (seconds, got[0][2])] for attn, (flops, params, seconds) in zip(attns, got)])
        compare("5. Sliding-Dilated attention (C = 2), one layer, training step: masked T x T map vs "
                "fast path", s["dilated_T"], ["map", "fast"],
                lambda way, T: training_step("dilated", T, **on, fused=way == "fast"),
                {"fast/map": ("fast", "map")}, device, repeats)

    long_sequences(s["long_T"], size, dtype, device, repeats)
    auto = compare("6b. ChaCAL's automatic path vs its two paths, forward + backward (fastest run)",
                   s["short_T"], ["one-solve", "blocked", "auto"], core,
                   {"auto/one": ("auto", "one-solve"), "auto/blk": ("auto", "blocked")}, device, 3 * repeats, stat=min)
    worst = max(row["auto"][0] / min(row["one-solve"][0], row["blocked"][0]) for row in auto.values())
    target("ChaCAL automatic path time / the faster of its paths (worst T)", worst, "<=", 1.1)


if __name__ == "__main__":
    run(main)
