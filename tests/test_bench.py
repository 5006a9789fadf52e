"""bench.py: its timings are printed figures, never a test; these check that every table runs at a
tiny size, the turns its measurements take, and the counts behind the LEGO table."""

import pytest

import bench

TINY_SIZES = dict(T=[16], tokens=32, size=dict(n_embd=16, n_head=2), decode_T=[8], decode_batch=2, lego_T=16,
                  dilated_T=[8], long_T=[16], short_T=[16, 32], repeats=1)


def test_every_table_runs_at_a_tiny_size(capsys, monkeypatch):
    monkeypatch.setitem(bench.SIZES, "small", TINY_SIZES)
    bench.main(["--device", "cpu", "--repeats", "1"])
    printed = capsys.readouterr().out
    tables = [line.split(".")[0] for line in printed.splitlines() if line[:1].isdigit() and ". " in line[:4]]
    assert tables == ["1", "2", "3", "4", "5", "6", "6b"], printed


def test_the_ways_a_table_compares_take_turns():
    calls = []
    runs = bench.in_turns([lambda i=i: calls.append(i) for i in range(3)], "cpu", repeats=3)
    assert calls == [0, 1, 2] + [0, 1, 2] + [1, 2, 0] + [2, 0, 1]  # a warm-up, then rotating turns
    assert all(len(seconds) == 3 and seconds == sorted(seconds) for seconds, _ in runs)
    assert bench.median([1.0, 2.0, 3.0, 4.0]) == 2.5 and bench.median([1.0, 2.0, 9.0]) == 2.0


@pytest.mark.parametrize("n_embd, n_head", [(128, 4), (32, 2)])
def test_lego_attention_has_fewer_parameters_and_flops_than_standard(n_embd, n_head):
    # The LEGO paper's claim, on bench.py's counter: one bidirectional layer, forward + backward.
    lego, size = dict(causal=False, broadcast_ids=(0, 1)), dict(n_embd=n_embd, n_head=n_head)
    (flops, params), *lego_counts = [bench.count_step(attn, 64, 128, size, **lego)
                                     for attn in ["standard", "lego_v0", "lego_v1"]]
    assert all(lego_params < params and lego_flops < flops for lego_flops, lego_params in lego_counts)
