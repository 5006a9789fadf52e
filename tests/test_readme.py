"""The README's commands are valid as written: every flag exists and the flags of each command
combine (train.py's start-up checks accept them). Running them all would take hours; a renamed
flag or a combination that became an error shows up here in seconds."""

import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

import data
import train
from conftest import ROOT


def readme_commands(script):
    """Every `python <script> ...` command in the README, in code blocks or inline code, as argv
    lists (line continuations joined, comments dropped, each once). A line with "..." is an
    elision, not a command, and is left out; so is --help, which exits before any check."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    commands = []
    for match in re.finditer(rf"python {re.escape(script)}([^`\n]*)", text):
        words = match.group(1).split("#")[0]
        if "..." not in words and "--help" not in words:
            commands.append(tuple(shlex.split(words)))
    return [list(argv) for argv in dict.fromkeys(commands)]


def test_the_readme_has_commands_to_check():
    assert len(readme_commands("train.py")) >= 8 and readme_commands("sample.py")


@pytest.mark.parametrize("argv", readme_commands("train.py"), ids=" ".join)
def test_readme_train_commands_pass_the_start_up_checks(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes commands write their dataset to ./data_cache...
    generate = data.Boxes._generate  # ...of which a few examples are enough to check the flags
    monkeypatch.setattr(data.Boxes, "_generate", lambda self, n, *rest: generate(self, min(n, 8), *rest))
    if "--resume" in argv:  # it continues a run: the flags alone can be checked
        train.build_parser().parse_args(argv)
    else:
        train.parse_args(argv + ["--device", "cpu"])


@pytest.mark.parametrize("script, section", [("sample.py", None), ("bench.py", "## Speed")])
def test_readme_flags_of_sample_and_bench_exist(script, section):
    # These need a checkpoint (or minutes) to run; their flags, in its commands and in the prose
    # of the section that presents the script (bench.py's), must at least be ones they accept.
    helped = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped.stderr
    summary = importlib.import_module(script.removesuffix(".py")).__doc__.split("\n\n")[0]
    assert " ".join(summary.split()) in " ".join(helped.stdout.split())  # its docstring's start
    flags = {word for argv in readme_commands(script) for word in argv if word.startswith("--")}
    if section:
        with open(os.path.join(ROOT, "README.md")) as f:
            prose = f.read().split(section + "\n")[1].split("\n## ")[0]
        flags |= set(re.findall(r"`(--\w+)`", prose))
    assert flags and flags <= set(re.findall(r"--\w+", helped.stdout))
