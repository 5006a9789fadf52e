import contextlib
import inspect
import io
import os
import re
import signal
import subprocess
import sys
import time
import traceback

import pytest

# Tests import the top-level scripts (model.py, attention.py, ...) the way lessons do.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The slowest test (a lesson at the smoke scale) takes about 20 s on a 2-core CPU. A test that
# runs far past that is stuck in a loop: it fails, named, instead of holding the suite forever.
TEST_TIME_LIMIT = 180  # seconds


def run_in_process(main, script, *args):
    """main(args) of a script in this process, as subprocess.run would report `python script
    *args` (exit code, printed text), without the second or so a new Python spends importing
    torch. A test of each script still runs it once as a command."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as stop:  # argparse's error (2) or a message (1), as Python exits
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except Exception:  # what the command would end in: a traceback and exit code 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def docstring_lines(obj):
    """obj's docstring, line by line, with its common indentation stripped: Python 3.13 strips it
    when it compiles a docstring and older versions keep it, so a test that reads a worked example
    out of a docstring reads the same lines on every version."""
    return inspect.cleandoc(obj.__doc__).splitlines()


def assert_tokens_per_second_possible(out, wall_seconds):
    """sample.py's speed line, "N token(s) ...: R tokens/s ...", against the wall time of the call
    that printed it: the timed part lies inside that call, so R >= N / wall_seconds."""
    n, rate = re.search(r"^(\d+) tokens? .*: (\d+) tokens/s", out, re.MULTILINE).groups()
    assert int(rate) >= int(n) / wall_seconds - 0.5, (out, wall_seconds)


class OpensAFileWhenUnpickled:
    """Put in a pickle, unpickling it opens (creates) path: how a file from elsewhere could run
    code. Loading with weights_only=True must refuse it before that."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


# For tests that send a process a POSIX signal (SIGINT as a Ctrl-C, SIGKILL as kill -9): Windows
# has no such delivery (its os.kill with SIGINT ends the process outright, the test runner with it).
needs_posix_signals = pytest.mark.skipif(os.name != "posix",
                                         reason="sends a process POSIX signals (Ctrl-C, kill -9)")


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in the main thread once `seconds` have passed (no limit on Windows,
    which has no SIGALRM). An enclosing limit resumes, less the time spent, on the way out."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def hung(signum, frame):
        raise TimeoutError(f"ran past {seconds} s (tests/conftest.py): a loop that never ends?")

    handler = signal.signal(signal.SIGALRM, hung)
    started, enclosing = time.monotonic(), signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, handler)
        if enclosing:
            signal.alarm(max(1, enclosing - round(time.monotonic() - started)))


@pytest.fixture(autouse=True)
def fail_a_test_that_hangs():
    with time_limit(TEST_TIME_LIMIT):
        yield
