"""The examples of README.md and of the site's pages (docs/*.md) stay true to the code.

- Every fenced ```` ```python ```` block compiles (most are fragments of a training script that
  name the user's own ``model`` or ``loader``, so compiling is what can be checked of them).
- A ```` ```python ```` block right after a ``<!-- run -->`` line (an HTML comment: invisible on
  GitHub and on the site) is self-contained and runs, in a fresh process on the simulated backend
  (``POWERLIB_BACKEND=simulated``, a temporary ``POWERLIB_STATE_DIR``, a temporary working folder).
- Every ``powerlib ...`` command line of a ```` ```bash ````, ```` ```sh ```` or ```` ```console ````
  block (and a systemd unit's ``Exec...=`` line in an ```` ```ini ```` block) parses against the
  real CLI: its subcommands exist (``powerlib <cmd> --help`` would answer) and so does every option
  it names. Nothing is run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- run -->"
SHELL_LANGS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    run: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the ``<!-- run -->`` mark before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        before = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", before == RUN_MARK))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for p in doc_files() for b in fenced_blocks(p)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]
RUNNABLE = [b for b in PYTHON if b.run]


def shell_commands(block: Block) -> list[str]:
    """The command lines of a shell block: a console's prompts, or every line of a script."""
    text = block.text.replace("\\\n", " ")
    if block.lang == "ini":
        return [
            line.split("=", 1)[1]
            for line in text.splitlines()
            if re.match(r"^Exec\w*=", line.strip())
        ]
    if block.lang == "console":
        return [
            line.strip()[2:] for line in text.splitlines() if line.strip().startswith(("$ ", "# "))
        ]
    return [line for line in text.splitlines() if line.strip()]


_SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")"}
_WRAPPERS = {"sudo", "time", "exec", "env", "nohup"}


def powerlib_invocations(command: str) -> list[list[str]]:
    """The argument lists of each ``powerlib`` call in one shell command line."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a shell line (e.g. a console's output)
        return []
    found, segment, redirected = [], [], False
    for tok in [*tokens, ";"]:
        if tok in _SEPARATORS:
            words = segment
            while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in _WRAPPERS):
                words = words[1:]
            if words and (words[0] == "$POWERLIB" or Path(words[0]).name == "powerlib"):
                found.append(words[1:])
            segment, redirected = [], False
        elif set(tok) <= set("<>&"):  # a redirection: the rest of this segment is not arguments
            redirected = True
            if segment and segment[-1].isdigit():
                segment.pop()  # the 2 of 2>&1
        elif not redirected:
            segment.append(tok)
    return found


def parse_cli(args: list[str]) -> list[str]:
    """Parse ``powerlib ARGS`` with click's own parsers, running nothing: the command path.

    Raises click's ``UsageError`` for a subcommand or an option the CLI lacks, or an argument too
    many. Only the command line's shape is parsed: values are not converted and required options
    not demanded, so a documentation line may show a placeholder.
    """
    from powerlib.cli import cli

    command: click.Command = cli
    name, parent, path, rest = "powerlib", None, [], list(args)
    while True:
        ctx = click.Context(command, info_name=name, parent=parent)
        _, rest, _ = command.make_parser(ctx).parse_args(rest)
        if not isinstance(command, click.Group):
            if rest and not ctx.allow_extra_args:
                raise click.UsageError(f"unexpected extra arguments: {' '.join(rest)}", ctx)
            return path
        if not rest:
            return path
        found, sub, rest = command.resolve_command(ctx, rest)
        assert found is not None and sub is not None
        name, parent, command = found, ctx, sub
        path.append(found)


CALLS = [
    (b.where, cmd, args)
    for b in ALL_BLOCKS
    if b.lang in (*SHELL_LANGS, "ini")
    for cmd in shell_commands(b)
    for args in powerlib_invocations(cmd)
]


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_example_compiles(block: Block) -> None:
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_example_runs_on_the_simulated_backend(block: Block, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
    env.update(POWERLIB_BACKEND="simulated", POWERLIB_STATE_DIR=str(tmp_path / "state"))
    script = tmp_path / "example.py"
    script.write_text(block.text, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize(
    ("where", "command", "args"), CALLS, ids=[f"{w}:{' '.join(a[:2])}" for w, _, a in CALLS]
)
def test_powerlib_command_line_parses(where: str, command: str, args: list[str]) -> None:
    try:
        path = parse_cli(args)
    except click.UsageError as err:
        pytest.fail(f"{where}: `{command}` does not parse: {err.format_message()}")
    assert path or args[:1] in ([], ["--help"], ["--version"]), f"{where}: {command}"


def test_the_examples_are_found() -> None:
    """The extraction itself: blocks, run marks and command lines are where the pages put them."""
    where = {b.where for b in RUNNABLE}
    assert any(w.startswith("docs/api.md") for w in where)
    assert any(w.startswith("docs/getting-started.md") for w in where)
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md"]
    assert any(b.lang == "python" for b in readme)
    quick = [args for w, _, args in CALLS if w.startswith("README.md")]
    assert ["demo"] in quick  # the quick start's first command
    assert all(b.lang == "python" for b in ALL_BLOCKS if b.run), (
        "a run mark before a non-Python block"
    )


def test_the_extraction_reads_shell_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n\n<!-- run -->\n```python\nprint(1)\n```\n\n"
        "```console\n$ FOO=1 powerlib --backend simulated devices   # a comment\nIDX ...\n"
        "# powerlib restore\n```\n\n"
        '```bash\n"$POWERLIB" restore --json >>"$LOG" 2>&1 || rc=$?\n'
        "pip install -e . && powerlib plan p.csv \\\n    --stages 8\n```\n\n"
        "  ```ini\n  ExecStart=/usr/bin/powerlib restore --json\n  ```\n",
        encoding="utf-8",
    )
    blocks = fenced_blocks(page)
    assert [(b.lang, b.run) for b in blocks] == [
        ("python", True),
        ("console", False),
        ("bash", False),
        ("ini", False),
    ]
    calls = [
        args for b in blocks[1:] for c in shell_commands(b) for args in powerlib_invocations(c)
    ]
    assert calls == [
        ["--backend", "simulated", "devices"],
        ["restore"],
        ["restore", "--json"],
        ["plan", "p.csv", "--stages", "8"],
        ["restore", "--json"],
    ]
    assert parse_cli(["--backend", "simulated", "devices"]) == ["devices"]
    assert parse_cli(["agent", "grant", "--job", "$JOB"]) == ["agent", "grant"]
    with pytest.raises(click.UsageError):
        parse_cli(["devices", "--no-such-option"])
    with pytest.raises(click.UsageError):
        parse_cli(["no-such-command"])
    with pytest.raises(click.UsageError):
        parse_cli(["devices", "extra-argument"])
    assert parse_cli(["measure", "--json", "--", "python", "train.py", "--lr", "1"]) == ["measure"]
