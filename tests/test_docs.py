"""The docs state today's truth (README.md and docs/*.md).

- Every fenced block is labelled: ``python`` (it runs here), ``shell`` (commands) or ``text``
  (output, listings). A block labelled otherwise that is Python (it imports, or calls ``fxtrain.``)
  fails: code is not hidden from the run by its label.
- Every python block runs, as a module of its own, in a temporary directory, with every
  ``FXTRAIN_*`` variable cleared: the library's defaults, as a user gets them; a warning of fxtrain's
  (a fallback to eager, a budget that does not fit) fails it. Only a block that needs a
  GPU or several processes may be marked ``<!-- not-run: REASON -->`` on the line above it; the
  reason must say which, and such a block must still compile.
- Every ``fxtrain ...`` command (in a shell block, after ``$ `` in a text block, or in an inline code
  span) exists with the flags it shows: its words are parsed by the CLI's own argparse parser, flag by
  flag, and the whole command too where it holds no placeholder (``MODEL``, ``[--plot out.png]``).
  Scripts the docs run (``python bench/x.py``, ``examples/x.py``), the tests they cite
  (``tests/test_x.py::name``), ``make`` targets, relative links and their anchors exist.
- docs/options.md holds exactly the table ``fxtrain options`` prints; the README's common options
  agree with ``fxtrain.Options``.
- The README: at most 150 lines, its set-up exactly ``make demo`` and ``make test``, a quick start of
  at most 10 lines.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import os
import re
import shlex
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LABELS = ("python", "shell", "text")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->$")
# What may keep a block from running here: this suite runs on one CPU process.
NOT_RUN_REASONS = re.compile(r"\b(GPU|CUDA|torchrun|processes|process group|ranks)\b", re.IGNORECASE)

pytestmark = pytest.mark.cpu_only(reason="the docs' code runs as a user runs it, on the CPU")


@dataclasses.dataclass
class Block:
    path: Path
    line: int           # of the opening fence, 1-based
    label: str
    code: str
    not_run: Optional[str]   # the reason of a not-run marker right above the fence

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> Tuple[List[Block], str]:
    """The fenced blocks of ``path`` and its text outside them (fences blanked, lines kept)."""
    blocks, prose = [], []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            prose.append(lines[i])
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        label = stripped[3:].strip()
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: fence never closed"
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        blocks.append(Block(path, start + 1, label, "\n".join(body) + "\n", marker.group(1) if marker else None))
        prose.extend([""] * (i - start + 1))
        i += 1
    return blocks, "\n".join(prose)


BLOCKS: List[Block] = [b for path in DOCS for b in _blocks(path)[0]]
PYTHON = [b for b in BLOCKS if b.label == "python"]


def test_every_block_is_labelled():
    bad = [f"{b.where}: '{b.label}'" for b in BLOCKS if b.label not in LABELS]
    assert not bad, f"fenced blocks must be labelled one of {LABELS}: " + ", ".join(bad)


def _looks_like_python(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fxtrain":
            return True
    return False


def test_no_python_hides_under_another_label():
    hidden = [b.where for b in BLOCKS if b.label != "python" and _looks_like_python(b.code)]
    assert not hidden, f"Python code labelled as something else (label it python so it runs): {hidden}"


def test_not_run_markers_give_a_reason_that_allows_it():
    for path in DOCS:
        blocks, prose = _blocks(path)
        marked = {b.line for b in blocks if b.not_run is not None}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "not-run" in line and "<!--" in line:
                match = NOT_RUN.match(line.strip())
                assert match and match.group(1), f"{path.name}:{number}: write <!-- not-run: REASON -->"
                assert NOT_RUN_REASONS.search(match.group(1)), (
                    f"{path.name}:{number}: only a block that needs a GPU or several processes may be left out "
                    f"of the run, and the reason says which: {match.group(1)!r}")
                following = [b for b in blocks if b.line > number]
                assert following and following[0].label == "python" and following[0].line in marked, (
                    f"{path.name}:{number}: a not-run marker belongs right above a python block")
    for block in PYTHON:
        if block.not_run is not None:
            compile(block.code, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in PYTHON if b.not_run is None], ids=lambda b: b.where)
def test_python_block_runs(block, tmp_path, monkeypatch):
    from conftest import EXECUTOR
    if EXECUTOR:
        pytest.skip("the docs' examples run with the library's defaults, which FXTRAIN_TEST_EXECUTOR replaces")
    for name in list(os.environ):
        if name.startswith("FXTRAIN_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    import torch
    torch.manual_seed(0)
    # A module of its own, as a user's script is: what the block defines is a module attribute, which
    # dynamo's guards and fxtrain's Function routing look up by the module's name.
    name = "docs_block_" + re.sub(r"\W", "_", block.where)
    script = tmp_path / f"{name}.py"
    script.write_text(block.code)
    module = types.ModuleType(name)
    module.__file__ = str(script)
    sys.modules[name] = module
    import fxtrain
    started = time.thread_time()   # CPU time, not wall: a loaded machine (the suite's other worker) is no reason
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fxtrain.FxtrainWarning)
        exec(compile(block.code, str(script), "exec"), module.__dict__)
    ours = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, fxtrain.FxtrainWarning)]
    assert not ours, f"{block.where} warns (an example shows fxtrain working, not falling back): {ours}"
    seconds = time.thread_time() - started
    assert seconds < 30, f"{block.where} took {seconds:.1f} s of CPU: keep doc examples tiny (the suite has a budget)"


# ------------------------------------------------------------------------------- commands

def _shell_lines(block: Block) -> Iterator[str]:
    """The command lines of a shell block, and the ``$ `` lines of a text block (continuations joined)."""
    joined, pending = [], ""
    for line in block.code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    for line in joined:
        line = line.strip()
        if block.label == "text":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        elif line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            yield line


def _inline_spans(prose: str) -> Iterator[str]:
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        yield " ".join(match.group(1).split())


def _commands() -> List[Tuple[str, str]]:
    """(where, command) for every command line the docs show."""
    found = []
    for path in DOCS:
        blocks, prose = _blocks(path)
        for block in blocks:
            if block.label in ("shell", "text"):
                found += [(block.where, line) for line in _shell_lines(block)]
        found += [(str(path.relative_to(ROOT)), span) for span in _inline_spans(prose)]
    return found


def _words(command: str) -> List[str]:
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):   # VAR=value prefixes
        words.pop(0)
    return words


def _fxtrain_words(words: List[str]) -> Optional[List[str]]:
    """The arguments after the program when ``words`` run fxtrain's CLI, else None."""
    if words[:1] == ["fxtrain"]:
        return words[1:]
    if words[:3] == ["python", "-m", "fxtrain.cli"]:
        return words[3:]
    if words[:3] == ["python", "-m", "fxtrain.fuzz"]:
        return ["fuzz"] + words[3:]
    return None


def _placeholder(word: str) -> bool:
    return bool(re.search(r"[\[\]|<>]|\.\.\.", word)) or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*(:[a-z]+)?", word))


def _alternatives(words: List[str]) -> List[List[str]]:
    """``cache ls|clear`` names two commands."""
    for i, word in enumerate(words):
        if re.fullmatch(r"[a-z-]+(\|[a-z-]+)+", word):
            return [w for choice in word.split("|") for w in _alternatives(words[:i] + [choice] + words[i + 1:])]
    return [words]


def _subparsers(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _check_fxtrain(where: str, args: List[str], parser: argparse.ArgumentParser) -> Optional[str]:
    """What is wrong with ``fxtrain ARGS`` (None: nothing)."""
    shown = f"{where}: `fxtrain {' '.join(args)}`"
    commands = _subparsers(parser)
    top = {s for a in parser._actions for s in a.option_strings}
    rest = [a for a in args if a not in top]
    if not rest:                                   # `fxtrain --help`
        return None
    if _placeholder(rest[0]):                      # `fxtrain COMMAND --help`: a flag some command has
        flags = {s for p in commands.values() for a in p._actions for s in a.option_strings} | top
    elif rest[0] not in commands:
        return f"{shown}: no such command (of {sorted(commands)})"
    else:
        flags = {s for a in commands[rest[0]]._actions for s in a.option_strings} | top
    for word in args:
        flag = word.strip("[]").split("=")[0]
        if flag.startswith("-") and flag not in flags:
            return f"{shown}: {rest[0]} has no flag {flag}"
    if len(args) > 1 and not any(_placeholder(w) for w in args):   # `fxtrain profile` alone names the command
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parser.parse_args(args)
            except SystemExit:
                return f"{shown} does not parse: {err.getvalue().strip().splitlines()[-1]}"
    return None


def test_fxtrain_commands_exist_with_their_flags():
    from fxtrain.cli import build_parser
    parser = build_parser()
    checked, wrong = 0, []
    for where, command in _commands():
        try:
            words = _words(command)
        except ValueError:
            continue
        args = _fxtrain_words(words)
        if args is None or not args:
            continue
        for choice in _alternatives(args):
            wrong.append(_check_fxtrain(where, choice, parser))
            checked += 1
    wrong = [w for w in wrong if w]
    assert not wrong, "\n".join(wrong)
    assert checked > 20


def _makefile_targets() -> set:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_scripts_tests_and_make_targets_named_exist():
    targets = _makefile_targets()
    missing = []
    for where, command in _commands():
        try:
            words = _words(command)
        except ValueError:
            continue
        if words[:1] == ["make"]:
            for word in words[1:]:
                if "=" in word:
                    name, value = word.split("=", 1)
                    if name == "TORCH" and not (ROOT / "constraints" / f"torch-{value}.txt").exists():
                        missing.append(f"{where}: make {word}: no constraints/torch-{value}.txt")
                elif word not in targets:
                    missing.append(f"{where}: no make target {word}")
        for word in words:
            if re.fullmatch(r"(bench|examples)/[\w/.-]+\.(py|sh)", word) and not (ROOT / word).exists():
                missing.append(f"{where}: {word}")
    for path in DOCS:
        text = path.read_text()
        for test_file, names in re.findall(r"\b(tests/test_\w+\.py)((?:::[\w*\[\]-]+)*)", text):
            file = ROOT / test_file
            if not file.exists():
                missing.append(f"{path.name}: {test_file}")
                continue
            source = file.read_text()
            for name in filter(None, names.split("::")):
                prefix = name.split("[")[0].rstrip("*")
                if not re.search(rf"\b(def|class) {re.escape(prefix)}", source):
                    missing.append(f"{path.name}: {test_file}::{name}")
    assert not missing, "named in the docs, not in the tree: " + "; ".join(missing)


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    _, prose = _blocks(path)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose, re.MULTILINE)}


def test_relative_links_and_anchors_exist():
    broken = []
    for path in DOCS:
        _, prose = _blocks(path)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file) if file else path
            if not resolved.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


# ------------------------------------------------------------------------------- options

GENERATED = re.compile(r"<!-- begin: generated by `fxtrain options` -->\n(.*?)\n<!-- end: generated by `fxtrain options` -->",
                       re.DOTALL)


def test_options_doc_holds_exactly_the_generated_table():
    from fxtrain.options import options_table
    match = GENERATED.search((ROOT / "docs" / "options.md").read_text())
    assert match, "docs/options.md: the generated table's begin/end markers are missing"
    assert match.group(1).strip() == options_table().strip(), (
        "docs/options.md is not `fxtrain options`' table: replace the lines between its markers with the "
        "output of `python -m fxtrain.cli options`")


def test_readme_common_options_agree_with_options():
    import fxtrain
    fields = {f.name: f for f in dataclasses.fields(fxtrain.Options)}
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `([^`]*)` \|", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert len(rows) >= 5
    for name, env, default in rows:
        assert name in fields, f"README names an option fxtrain.Options lacks: {name}"
        assert env == f"FXTRAIN_{name.upper()}", f"README: {name}'s variable is FXTRAIN_{name.upper()}"
        assert default == repr(fields[name].default), f"README: {name}'s default is {fields[name].default!r}"


# ------------------------------------------------------------------------------- README

def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_readme_is_short_and_its_set_up_is_make_demo_and_make_test():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    setup = re.findall(r"```shell\n(.*?)```", _readme_section("Set-up"), re.DOTALL)
    assert len(setup) == 1, "README's Set-up shows one block of commands"
    commands = [shlex.split(line, comments=True) for line in setup[0].splitlines()]
    assert [c for c in commands if c] == [["make", "demo"], ["make", "test"]]
    assert {"demo", "test", "test-long"} <= _makefile_targets()


def test_readme_quick_start_is_at_most_ten_lines_and_runs():
    blocks = re.findall(r"```python\n(.*?)```", _readme_section("Quick start"), re.DOTALL)
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 10
    assert any(b.path.name == "README.md" and b.code == blocks[0] and b.not_run is None for b in PYTHON)
