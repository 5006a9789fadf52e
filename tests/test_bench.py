"""bench.py: what its tables measure and how it judges them. Its timings are printed figures,
never a test; these check the sizes, streams and arithmetic behind them, at tiny sizes."""

import os
import subprocess
import time

import pytest
import torch
import torch.nn.functional as F

import bench
import train
from data import get_task
from model import GPT

SIZE = dict(n_embd=16, n_head=2)
TINY_SIZES = dict(T=[16], tokens=32, size=SIZE, decode_T=[8], decode_batch=2, lego_T=16,
                  dilated_T=[8], long_T=[16], short_T=[16])  # each table at its smallest


def test_measures_every_section_at_a_tiny_size(capsys, monkeypatch):
    (t_std, _), (t_cha, _) = bench.bench_core(16, 32, 2, 8, torch.float32, "cpu", repeats=1)
    (step, _), = bench.medians_in_turns([bench.training_step("chacal", 16, 32, SIZE, torch.float32,
                                                             "cpu")], "cpu", repeats=1)
    cached, recomputed = bench.bench_decode([("chacal", True), ("chacal", False)], 8, 2, SIZE,
                                            torch.float32, "cpu", repeats=1)
    assert t_std > 0 and t_cha > 0 and step > 0 and cached > 0 and recomputed > 0
    # Softmax attention's FLOPs are counted (a fused kernel would count 0): at a fixed number of
    # tokens, a longer sequence costs more in QKᵀ and AV and the same in every other layer.
    lego, heads = dict(causal=False, broadcast_ids=(0, 1)), dict(n_embd=32, n_head=4)
    assert bench.count_step("standard", 32, 32, heads, **lego)[0] > bench.count_step(
        "standard", 16, 32, heads, **lego)[0]
    # The whole script, every table, at tiny sizes
    monkeypatch.setitem(bench.SIZES, "small", TINY_SIZES)
    capsys.readouterr()
    bench.main(["--device", "cpu", "--repeats", "1"])
    printed = capsys.readouterr().out
    tables = [line.split(".")[0] for line in printed.splitlines() if line[:1].isdigit() and ". " in line[:4]]
    assert tables == ["1", "2", "3", "4", "5", "6", "6b"], printed


@pytest.mark.parametrize("scale", ["full", "small"])
def test_each_scale_measures_the_lengths_its_docstring_names(scale):
    sizes = bench.SIZES[scale]
    assert sizes["T"][0] == get_task("toy").block_size  # the "toy size" of table 2's target
    parity = get_task("parity")  # table 5: parity's training and longest test lengths
    assert sizes["dilated_T"][:2] == [parity.train_length, parity.block_size]
    assert 4096 in sizes["long_T"]  # where table 6's targets are judged
    assert min(sizes["short_T"]) < bench.CHACAL_BLOCKED_FROM["cpu"] <= max(sizes["short_T"])  # 6b
    defaults = train.build_parser().parse_args([])
    if scale == "small":  # train.py's laptop default
        assert sizes["size"] == dict(n_embd=defaults.n_embd, n_head=defaults.n_head)


def test_the_script_feeds_each_table_its_runs_and_targets(monkeypatch, capsys):
    # main() with its measurements replaced by fixed figures: which runs each table asks for,
    # and the ratios its targets judge. The i-th fn a table compares takes 2 + i / 2 seconds.
    monkeypatch.setitem(bench.SIZES, "small", TINY_SIZES)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(bench, "bench_core", lambda *args, **kwargs: [(1.0, float("nan"))] * 2)
    monkeypatch.setattr(bench, "medians_in_turns", lambda fns, device, repeats: [
        (2.0 + i / 2, float("nan")) for i in range(len(fns))])
    steps, ways = [], []
    monkeypatch.setattr(bench, "training_step", lambda attn, *args, fused=True, **options:
                        steps.append((attn, fused, options)))
    monkeypatch.setattr(bench, "bench_decode", lambda asked, *args: ways.extend(asked) or [
        100.0, 95.0, 10.0])
    monkeypatch.setattr(bench, "count_step", lambda *args, **kwargs: (1e9, 1000))
    for table in ("long_sequences", "short_sequences"):  # (their own tests below)
        monkeypatch.setattr(bench, table, lambda *args: None)
    capsys.readouterr()
    bench.main(["--device", "cpu", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert printed.startswith("device cpu") and "float32" in printed.splitlines()[0]  # bf16: full sizes only
    lego = dict(causal=False, broadcast_ids=(0, 1))
    assert steps == [("standard", True, {}), ("chacal", True, {}), ("standard", True, lego),
                     ("lego_v0", True, lego), ("lego_v1", True, lego), ("dilated", False, {}),
                     ("dilated", True, {})]  # table 5: the masked map, then the fast path
    assert ways == [("standard", True), ("chacal", True), ("chacal", False)]
    row = next(line for line in printed.splitlines() if line.split()[:1] == ["16"])
    assert row.split()[-3:] == ["-", "-", "-"]  # no memory columns without CUDA's peak
    targets = [line.split("target: ")[1] for line in printed.splitlines() if "target:" in line]
    assert targets == ["ChaCAL training step / standard step at T = 16, the toy size (a GPU target, "
                       "at d 512 in bf16) <= 1.35: measured 1.25, not judged on this device",
                       "ChaCAL cached decoding tokens/s / standard (worst length) >= 0.9: "
                       "measured 0.95, met"]


# bench.py resets the process's peak resident size through /proc/self/clear_refs: Linux only.
measures_peak_memory = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                          reason="bench.py measures a CPU's peak memory on Linux only")


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert bench.median([1.0, 2.0, 3.0, 4.0]) == 2.5 and bench.median([1.0, 2.0, 9.0]) == 2.0


@measures_peak_memory
def test_memory_grows_with_the_one_solves_maps_only():
    T, n_head = 512, 2
    memory = {path: bench.peak_memory(path, T, n_head, 8, torch.float32, "cpu") for path in bench.LONG_PATHS}
    # The one solve holds T x T maps (one alone: 2 MiB here); blocked and fused hold far less
    one_map = T * T * n_head * 4 / 2**20
    assert one_map <= memory["one-solve"] < 10 * one_map, memory  # in MiB: a few maps, not 1024x
    assert 4 * max(memory["blocked"], memory["fused"]) < memory["one-solve"], memory


@measures_peak_memory
def test_memory_counts_the_blocked_paths_small_blocks():
    # At T = 256 the blocked path allocates blocks of 32 rows, well under 64 KiB; in a fresh process
    # each time, the step must still count at least the input gradients it creates (3 x 128 KiB).
    peaks = [bench.peak_memory("blocked", 256, 4, 32, torch.float32, "cpu") for _ in range(3)]
    assert min(peaks) >= 3 * 256 * 4 * 32 * 4 / 2**20, peaks


def test_takes_turns_and_gives_its_verdicts(capsys):
    calls = []
    runs = bench.in_turns([lambda i=i: calls.append(i) for i in range(3)], "cpu", repeats=3)
    assert calls == [0, 1, 2] + [0, 1, 2] + [1, 2, 0] + [2, 0, 1]  # a warm-up, then rotating turns
    assert all(len(seconds) == 3 and seconds == sorted(seconds) for seconds, _ in runs)
    capsys.readouterr()
    bench.target("x", 1.2, "<=", 1.1)
    bench.target("x", 1.0, "<=", 1.1)
    bench.target("x", float("nan"), "<=", 1.1)
    bench.target("x", 2.0, "<=", 1.1, judged_here=False)
    bench.target("x", 0.9, ">=", 0.9)  # a target's bound is met
    bench.target("x", 0.8, ">=", 0.9)
    verdicts = [line.rsplit(", ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert verdicts == ["MISSED", "met", "not measured on this device", "not judged on this device",
                        "met", "MISSED"]


def test_timings_are_each_run_s_seconds_and_a_cpu_s_peak_is_not_tracked():
    (seconds, peak), = bench.in_turns([lambda: time.sleep(0.02)], "cpu", repeats=2)
    assert all(0.02 <= s < 1 for s in seconds) and peak != peak  # NaN: PyTorch tracks CUDA's only


def test_autocast_only_for_a_half_precision_dtype():
    with bench.autocast("cpu", torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
    with bench.autocast("cpu", torch.float32):
        assert not torch.is_autocast_enabled("cpu")


def test_tables_1_to_4_measure_the_shapes_their_headers_state(monkeypatch):
    # Table 1: causal standard attention and ChaCAL on tokens // T sequences of T.
    sdpa, solve, forward = F.scaled_dot_product_attention, bench.chacal_attention, GPT.forward
    seen = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kwargs: seen.append(
        ("fused", tuple(q.shape), kwargs.get("is_causal"))) or sdpa(q, k, v, **kwargs))
    monkeypatch.setattr(bench, "chacal_attention", lambda q, *rest, **kwargs: seen.append(
        ("chacal", tuple(q.shape))) or solve(q, *rest, **kwargs))
    bench.bench_core(16, 64, 2, 8, torch.float32, "cpu", repeats=1)
    assert set(seen) == {("fused", (4, 2, 16, 8), True), ("chacal", (4, 2, 16, 8))}
    seen.clear()
    bench.bench_core(16, 8, 2, 8, torch.float32, "cpu", repeats=1)  # fewer tokens than T: one
    assert set(seen) == {("fused", (1, 2, 16, 8), True), ("chacal", (1, 2, 16, 8))}
    # Tables 2 and 4: a one-layer model on its fused path, tokens // T sequences of T.
    built, inputs = [], []
    build = bench.one_layer_model
    monkeypatch.setattr(bench, "one_layer_model", lambda *args, **kwargs: built.append(
        build(*args, **kwargs)) or built[-1])
    monkeypatch.setattr(GPT, "forward", lambda model, idx, *args, **kwargs: inputs.append(
        tuple(idx.shape)) or forward(model, idx, *args, **kwargs))
    bench.training_step("chacal", 16, 64, SIZE, torch.float32, "cpu")()
    bench.training_step("chacal", 16, 8, SIZE, torch.float32, "cpu")()  # fewer tokens than T: one
    assert inputs == [(4, 16), (1, 16)] and len(built[0].transformer.h) == 1
    assert built[0].transformer.h[0].attn.fused
    inputs.clear()
    bench.count_step("standard", 16, 64, SIZE)
    bench.count_step("standard", 16, 8, SIZE)
    assert inputs == [(4, 16), (1, 16)]
    # Table 3: greedy decoding of T - 1 tokens after a 1-token prompt, in tokens/s of the median.
    generated, repeats = [], []
    monkeypatch.setattr(GPT, "generate", lambda model, prompt, n, **kwargs: generated.append(
        (tuple(prompt.shape), n, kwargs)))
    monkeypatch.setattr(bench, "in_turns", lambda fns, device, n: repeats.append(n) or [
        fn() or ([2.0, 4.0], float("nan")) for fn in fns])
    rates = bench.bench_decode([("chacal", True), ("standard", False)], 8, 2, SIZE, torch.float32,
                               "cpu", repeats=10)
    assert rates == [2 * 7 / 3.0] * 2 and repeats == [bench.DECODE_REPEATS]
    assert generated == [((2, 1), 7, dict(temperature=0, use_cache=use_cache))
                         for use_cache in (True, False)]


def test_table_6_times_one_sequence_and_judges_t_4096(monkeypatch, capsys):
    made, repeats = [], []
    make = bench.long_core_inputs
    monkeypatch.setattr(bench, "long_core_inputs", lambda *args: made.append(args[:3]) or make(*args))
    seconds = {"fused": [0.5, 5.0], "one-solve": [3.0, 9.0], "blocked": [2.0, 4.0]}  # fastest first
    monkeypatch.setattr(bench, "in_turns", lambda fns, device, n: repeats.append(n) or [
        (seconds[path], float("nan")) for path in bench.LONG_PATHS])
    peaks = {"fused": 10.0, "one-solve": 100.0, "blocked": 15.0}
    monkeypatch.setattr(bench, "peak_memory", lambda path, *args: peaks[path])
    results = bench.long_sequences([2048, 4096], SIZE, torch.float32, "cpu", repeats=10)
    assert made == [(2048, 2, 8), (4096, 2, 8)] and repeats == [10, 3]  # at most 3 beyond 2048
    assert results[4096] == {path: (seconds[path][0], peaks[path]) for path in bench.LONG_PATHS}
    targets = [line for line in capsys.readouterr().out.splitlines() if "target:" in line]
    assert [line.split(": ", 2)[2] for line in targets] == [
        "measured 1.50, met", "measured 0.15, MISSED", "measured 4.00, met"]
    assert [line.split(": ")[1].rsplit(" ", 2)[1:] for line in targets] == [
        ["<=", "2"], ["<=", "0.1"], ["<=", "4"]]
    q, k, v = make(16, 2, 8, torch.float32, "cpu")
    assert q.shape == (1, 2, 16, 8) and q.requires_grad
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *args, **kwargs: calls.append(
        kwargs) or q)
    bench.long_core_step("fused", q, k, v)
    assert calls == [dict(is_causal=True)]


def test_table_6b_judges_the_automatic_path_by_its_worst_length(monkeypatch, capsys):
    solve, shapes = bench.chacal_attention, []
    monkeypatch.setattr(bench, "chacal_attention", lambda q, *args, **kwargs: shapes.append(
        (tuple(q.shape), kwargs["rows_per_block"])) or solve(q, *args, **kwargs))
    fastest = iter([[4.0, 5.0], [1.0, 9.0], [4.4, 6.0],    # T = 32: auto / one solve = 1.1
                    [2.0, 3.0], [1.0, 9.0], [2.0, 2.5]])   # T = 64: 1.0 (sorted, as in_turns)
    monkeypatch.setattr(bench, "in_turns", lambda fns, device, n: [
        fn() or (next(fastest), float("nan")) for fn in fns])
    bench.short_sequences([32, 64], 64, SIZE, torch.float32, "cpu", repeats=1)
    paths = [0, bench.CHACAL_ROWS_PER_BLOCK, None]  # the one solve, blocks, the automatic choice
    assert shapes == [((2, 2, 32, 8), rows) for rows in paths] + [((1, 2, 64, 8), rows) for rows in paths]
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "worst of T = 32 to 64 <= 1.1: measured 1.10, met")
    monkeypatch.setattr(bench, "CHACAL_BLOCKED_FROM", {})  # a device whose automatic path is one
    fastest = iter([[1.0], [1.0], [1.0]])
    bench.short_sequences([32], 32, SIZE, torch.float32, "cpu", repeats=1)
    assert "not judged, the same path here" in capsys.readouterr().out


@pytest.mark.parametrize("stderr, said", [("Traceback ...\nMemoryError\n", "(MemoryError)"),
                                          ("", "(killed by signal 9)")])
def test_a_failed_memory_measurement_is_one_line(monkeypatch, stderr, said):
    monkeypatch.setattr(bench.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args, -9, stdout="", stderr=stderr))
    with pytest.raises(SystemExit) as stopped:
        bench.peak_memory("one-solve", 8192, 2, 8, torch.float32, "cpu")
    assert f"table 6: measuring one-solve at T = 8192 failed {said}; out of memory?" in str(
        stopped.value)
