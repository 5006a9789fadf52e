"""The README's commands are valid as written: every flag exists and the flags of each command
combine (train.py's start-up checks accept them). Running them all would take hours; a renamed
flag or a combination that became an error shows up here in seconds."""

import os
import re
import shlex

import pytest

import data
import train
from conftest import ROOT, command


def readme_commands(script):
    """Every `python <script> ...` command in the README, as argv lists (continuations joined,
    comments dropped, each once); a line with "..." is an elision, and --help exits before any check."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    found = re.finditer(rf"python {re.escape(script)}([^`\n]*)", text)
    commands = [tuple(shlex.split(match.group(1).split("#")[0])) for match in found]
    return [list(argv) for argv in dict.fromkeys(commands) if "..." not in argv and "--help" not in argv]


@pytest.mark.parametrize("argv", readme_commands("train.py"), ids=" ".join)
def test_readme_train_commands_pass_the_start_up_checks(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the boxes commands write their dataset to ./data_cache, of which
    generate = data.Boxes._generate  # a few examples are enough to check the flags
    monkeypatch.setattr(data.Boxes, "_generate", lambda self, n, *rest: generate(self, min(n, 8), *rest))
    corpus = tmp_path / "docs.txt"  # and a small text stands in for the Python docs' corpus
    corpus.write_text("the cat sat on the mat. " * 400)
    monkeypatch.setattr(data, "python_docs_corpus", lambda *args, **kwargs: str(corpus))
    if "--resume" in argv:  # it continues a run: the flags alone can be checked
        train.build_parser().parse_args(argv)
    else:
        train.parse_args(argv + ["--device", "cpu"])


@pytest.mark.parametrize("script", ["sample.py", "bench.py"])
def test_readme_flags_of_sample_and_bench_exist(script):
    code, helped, err = command(script, "--help")
    assert code == 0 and helped.startswith("usage:"), err
    flags = {word for argv in readme_commands(script) for word in argv if word.startswith("--")}
    assert len(readme_commands("train.py")) >= 8 and flags <= set(re.findall(r"--\w+", helped))
