"""The commands the README and docs/ show are commands that work: every ``python train.py``, ``python
infer.py`` and ``python -m k3jax.*`` line of their ``bash`` / ``sh`` / ``console`` blocks (and of the
code spans of their tables, such as the README's "I want to ..." table) parses, each
``--flag`` through that program's own argparse parser and each ``key=value`` override through the
config loader (a real field, a valid value). A renamed flag or config key fails here, not for a reader.

Each program runs as the shell would start it (``runpy``) until its parser has parsed the line, then
stops: nothing loads, compiles or trains, so the whole check takes seconds."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import pathlib
import re
import runpy
import shlex
import sys
import warnings

import jax
import pytest

from k3jax.aot.plan import rl_job
from k3jax.config import ConfigError, load_config
from k3jax.sharding import parse_mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console)[ \t]*\n(.*?)^```", re.M | re.S)
TABLE_COMMAND = re.compile(r"`((?:[A-Z_]+=\S+ )*python3? [^`]+)`")
SCRIPTS = ("train.py", "infer.py")
# Positional overrides that are model-only (``kda.chunk_size=16`` means ``model.kda.chunk_size=16``).
MODEL_OVERRIDES = {"k3jax.convert"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # page:line
    program: str  # "train.py", "infer.py" or a module, "k3jax.aot"
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {self.program} {shlex.join(self.argv)}"


def shell_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, command line) of each shell block: ``\\`` continuations joined, ``$`` prompts dropped."""
    out = []
    for block in SHELL_BLOCK.finditer(markdown):
        first = markdown.count("\n", 0, block.start(1)) + 1
        pending, start = "", first
        for i, line in enumerate(block.group(1).splitlines()):
            if not pending:
                start, line = first + i, line.removeprefix("$ ")
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
    return out


def table_commands(markdown: str) -> list[tuple[int, str]]:
    """(line number, command) of each ``python ...`` code span in a table row outside the code blocks
    (the README's "I want to ..." table)."""
    prose = re.sub(r"^```.*?^```", lambda block: "\n" * block.group(0).count("\n"), markdown, flags=re.M | re.S)
    return [(i, span) for i, line in enumerate(prose.splitlines(), 1) if line.startswith("|")
            for span in TABLE_COMMAND.findall(line)]


def commands(markdown: str, page: str) -> list[Command]:
    """The k3jax commands of a page, one per ``&&`` / ``;`` / ``|`` / ``&`` separated part of a line."""
    out = []
    for line_no, line in shell_lines(markdown) + table_commands(markdown):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        part: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                if command := _k3jax_command(part, f"{page}:{line_no}"):
                    out.append(command)
                part = []
            else:
                part.append(token)
    return out


def _k3jax_command(tokens: list[str], where: str) -> Command | None:
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):  # K3JAX_HOST_MEMORY=keep python train.py ...
        tokens = tokens[1:]
    if len(tokens) < 2 or tokens[0] not in ("python", "python3"):
        return None
    if tokens[1] in SCRIPTS:
        return Command(where, tokens[1], tuple(tokens[2:]))
    if tokens[1] == "-m" and len(tokens) > 2 and tokens[2].split(".")[0] == "k3jax":
        return Command(where, tokens[2], tuple(tokens[3:]))
    return None


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing():
    """Every ArgumentParser parses as usual, then raises :class:`_Parsed` with what it parsed (so a
    program's ``main`` goes no further than its command line)."""
    originals = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_intermixed_args")}

    def stopping(original):
        def parse(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))
        return parse

    for name, original in originals.items():
        setattr(argparse.ArgumentParser, name, stopping(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)


def parse(command: Command) -> argparse.Namespace:
    """``command``'s arguments as its program parses them; SystemExit (argparse's error) names a bad one."""
    argv0 = str(ROOT / command.program) if command.program in SCRIPTS else command.program
    saved_argv, optimizations = sys.argv, jax.config.read("jax_disable_most_optimizations")  # a main() may set it
    sys.argv = [argv0, *command.argv]
    try:
        with _stop_after_parsing(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported already)
            if command.program in SCRIPTS:
                runpy.run_path(argv0, run_name="__main__")
            else:
                runpy.run_module(command.program, run_name="__main__", alter_sys=True)
    except _Parsed as parsed:
        return parsed.namespace
    finally:
        sys.argv = saved_argv
        jax.config.update("jax_disable_most_optimizations", optimizations)
    raise AssertionError(f"{command}: the program finished without parsing a command line")


def _overrides(command: Command, namespace: argparse.Namespace) -> list[str]:
    overrides = list(getattr(namespace, "overrides", None) or [])
    if command.program == "train.py":  # run_dir=... is train.py's alias of train.out_dir=...
        overrides = [o.replace("run_dir=", "train.out_dir=", 1) if o.startswith("run_dir=") else o for o in overrides]
    if command.program in MODEL_OVERRIDES:
        overrides = [f"model.{o}" for o in overrides]
    return overrides


def problem(command: Command) -> str | None:
    """Why ``command`` would not start as written (an unknown flag, a bad config key or value), or None."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parse(command)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    overrides = _overrides(command, namespace)
    if getattr(namespace, "config", None) is None and not overrides:
        return None
    try:
        _load(command, namespace, overrides)
    except ConfigError as e:
        return f"config: {e}"
    return None


def _load(command: Command, namespace: argparse.Namespace, overrides: list[str]):
    """The config ``command``'s program builds from its arguments."""
    if command.program == "k3jax.aot" and namespace.mode == "rl" and namespace.config:  # rows from train.rl
        return rl_job(namespace.config, namespace.slice, parse_mesh(namespace.mesh), namespace.seq_len,
                      tuple(overrides)).load()
    config = getattr(namespace, "config", None)
    if config is None or _placeholder_directory(config):  # the aot PLAN, or /path/Kimi-K3: the keys checked on tiny
        config = "tiny"
    return load_config(config, overrides)


def _placeholder_directory(config: str) -> bool:
    """A model directory or bucket that only the reader has (``--config /path/Kimi-Linear-48B``, ``gs://...``,
    a run the docs trained earlier, such as ``runs/default``): its model section cannot be read here."""
    return "://" in config or ("/" in config and not config.endswith((".yaml", ".yml")))


def documented_commands() -> list[Command]:
    return [c for page in PAGES for c in commands(page.read_text(), str(page.relative_to(ROOT)))]


def test_the_documented_commands_parse():
    found = documented_commands()
    assert len(found) > 30, f"only {len(found)} commands found: is the block parser broken?"
    assert {"train.py", "infer.py", "k3jax.aot"} <= {c.program for c in found}
    problems = [f"{c}\n    {why}" for c in found if (why := problem(c))]
    assert not problems, "documented commands that do not parse:\n" + "\n".join(problems)


BROKEN_PAGE = """\
Text, then a block whose second command renamed a key and whose third a flag:

```bash
python train.py --config tiny train.steps=5 \\
    run_dir=runs/x && python train.py --config tiny train.stepz=5
python infer.py --checkpoint runs/x --max-tokens 5 --prompt "And"   # the flag is --max-new-tokens
python -m k3jax.params k3 model.moe.top_k=not-a-number
```

```python
python train.py never=checked  # not a shell block
```

| I want to ... | command |
|---|---|
| pre-train | `python train.py --config tiny train.batch=4` |
"""


def test_a_renamed_key_or_flag_fails():
    found = commands(BROKEN_PAGE, "page.md")
    assert [(c.where, c.program) for c in found] == [("page.md:4", "train.py"), ("page.md:4", "train.py"),
                                                    ("page.md:6", "infer.py"), ("page.md:7", "k3jax.params"),
                                                    ("page.md:16", "train.py")]
    assert found[0].argv == ("--config", "tiny", "train.steps=5", "run_dir=runs/x")
    why = [problem(c) for c in found]
    assert why[0] is None
    assert "train.stepz: unknown key; did you mean train.steps?" in why[1]
    assert "unrecognized arguments: --max-tokens" in why[2]
    assert "model.moe.top_k: expected an integer" in why[3]
    assert "train.batch: unknown key; did you mean train.batch_size?" in why[4]


@pytest.mark.parametrize("line, program, argv", [
    ("K3JAX_HOST_MEMORY=keep python train.py --config small", "train.py", ("--config", "small")),
    ("pip install -e . && python -m k3jax.aot --config k3 --mode decode", "k3jax.aot",
     ("--config", "k3", "--mode", "decode")),
    ("python infer.py --serve --port 8000 &", "infer.py", ("--serve", "--port", "8000")),
    ("python bench/serve.py --shared-prefix", None, None),
])
def test_command_lines_are_split_as_the_shell_does(line, program, argv):
    found = commands(f"```bash\n{line}\n```\n", "p.md")
    assert [(c.program, c.argv) for c in found] == ([(program, argv)] if program else [])
