import contextlib
import io
import os
import runpy
import signal
import sys

import pytest

# Tests import the top-level scripts (model.py, attention.py, ...) the way lessons do.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["HF_HUB_OFFLINE"] = "1"  # the tests never reach the network (transformers reads this at import)

# The smallest toy run: a few steps of it take well under a second on a CPU.
TINY = ["--task", "toy", "--n_blocks", "4", "--block_len", "4", "--n_embd", "32", "--n_head", "2",
        "--batch_size", "8", "--eval_samples", "16", "--no-progress", "--device", "cpu"]


def command(script, *argv):
    """`python script *argv` as the shell sees it (exit code, stdout, stderr), run in this process
    through the script's own `if __name__ == "__main__":` line, so without the second a new
    Python spends importing torch. An exception that escapes it is what the user would see as a
    traceback: it fails the test that ran it."""
    out, err, code, argv0 = io.StringIO(), io.StringIO(), 0, sys.argv
    sys.argv = [script, *map(str, argv)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
            except SystemExit as stop:  # as Python exits: a message is printed, then status 1
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
                code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        sys.argv = argv0
    return code, out.getvalue(), err.getvalue()


def assert_one_line(result):
    """A refusal as a user should meet it: a non-zero exit and one line on stderr, no traceback."""
    code, out, err = result
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
    return err.strip()


needs_posix_signals = pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals (kill -9)")


@pytest.fixture(autouse=True)
def fail_a_test_that_hangs():
    """A test that runs past 180 s is stuck in a loop: it fails, named, instead of holding the suite."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def hung(signum, frame):
        raise TimeoutError("ran past 180 s (tests/conftest.py): a loop that never ends?")

    handler = signal.signal(signal.SIGALRM, hung)
    signal.alarm(180)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, handler)
