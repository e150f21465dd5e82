"""Read what the docs tell a user to run: fenced blocks, inline code spans, the simple commands
of shell blocks and of systemd units' ExecStart lines, and the Helm values examples.

The docs are README.md, docs/*.md and helm/loraplex/README.md. tests/project/test_docs.py and
tests/project/test_docs_metrics.py hold what these name (flags, variables, values keys, metrics) to the
code, so the docs cannot drift from it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGS = ("bash", "sh", "shell", "console")
UNIT_LANGS = ("ini", "systemd")
# Tokens that end a simple command, and redirections (which take the next token with them).
_SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")", ";;", "|&"}
_REDIRECTS = {"<", ">", ">>", ">&", "<&", "&>", ">|", "<<<"}
_PREFIXES = {"export", "env", "sudo", "exec", "nohup", "time", "command"}
_ASSIGNMENT = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*=")
_HEREDOC = re.compile(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
# `python -m <module>` forms of the console scripts.
_MODULES = {"loraplex.inference_server.main": "loraplex-server", "loraplex.adapter_store.main": "loraplex-store",
            "loraplex.clients.cli": "loraplex"}
PROGRAMS = ("loraplex", "loraplex-server", "loraplex-store", "helm")


def doc_files() -> list[Path]:
    """Every document a user follows."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "helm" / "loraplex" / "README.md"]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@dataclass(frozen=True)
class Block:
    """One fenced block: its file, first line (1-based), language tag and text (dedented)."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One simple command: the program (basename) and its arguments, where it is written."""

    where: str
    program: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join((self.program, *self.args))}"


def fenced_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for m in _FENCE.finditer(text):
        indent = len(m["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line
                       for line in m["body"].splitlines(keepends=True))
        blocks.append(Block(path, text.count("\n", 0, m.start()) + 2, m["lang"].lower(), body))
    return blocks


def prose(path: Path) -> str:
    """The text outside fenced blocks (each block replaced by as many empty lines)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())


def inline_spans(path: Path) -> list[tuple[str, str]]:
    """(where, text) of every inline code span outside fenced blocks, whitespace collapsed."""
    text = prose(path)
    return [(f"{rel(path)}:{text.count(chr(10), 0, m.start()) + 1}", " ".join(m[1].split()))
            for m in _INLINE.finditer(text)]


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """(line, logical line) of a shell block: continuations joined, heredoc bodies and console
    prompts left out."""
    out: list[tuple[int, str]] = []
    lines = block.text.splitlines()
    i, pending, start, heredoc = 0, "", 0, None
    while i < len(lines):
        line = lines[i]
        i += 1
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not pending:
            start = block.line + i - 1
            line = line[2:] if line.startswith("$ ") else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical, pending = pending + line, ""
        m = _HEREDOC.search(logical)
        if m is not None:
            heredoc = m[1]
        out.append((start, logical))
    return out


def unit_lines(block: Block) -> list[tuple[int, str]]:
    """(line, command) of every Exec*= line of a systemd unit block (continuations joined)."""
    out = []
    for n, line in shell_lines(block):
        m = re.match(r"\s*Exec(?:Start|StartPre|StartPost|Reload|Stop|StopPost)=[-@+!:]*(.*)", line)
        if m is not None:
            out.append((n, m[1]))
    return out


def split_commands(line: str, where: str) -> list[Command]:
    """The simple commands of one shell line (pipelines, lists and $(...) taken apart)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a command line
        return []
    segments: list[list[str]] = [[]]
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in _SEPARATORS:
            segments.append([])
        elif token in _REDIRECTS or token == "<<":
            if segments[-1] and segments[-1][-1].isdigit():
                segments[-1].pop()  # the file descriptor of 2> and the like
            skip = True
        else:
            segments[-1].append(token)
    commands = []
    for words in segments:
        command = _command(words, where)
        if command is not None:
            commands.append(command)
    return commands


def _command(words: list[str], where: str) -> Command | None:
    while words and (_ASSIGNMENT.match(words[0]) or words[0] in _PREFIXES):
        words = words[1:]
    if "--" in words and words[0] in ("kubectl", "docker"):  # kubectl exec ... -- loraplex ...
        return _command(words[words.index("--") + 1:], where)
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    if program.startswith("python") and words[1:3] in (["-m", m] for m in _MODULES):
        return Command(where, _MODULES[words[2]], tuple(words[3:]))
    if program.startswith("python") and len(words) > 3 and words[1] == "-P" and words[2] == "-m" \
            and words[3] in _MODULES:
        return Command(where, _MODULES[words[3]], tuple(words[4:]))
    return Command(where, program, tuple(words[1:])) if program in PROGRAMS else None


def documented_commands(path: Path) -> list[Command]:
    """Every loraplex, loraplex-server, loraplex-store and helm command of ``path``'s shell
    blocks and systemd units."""
    commands = []
    for block in fenced_blocks(path):
        if block.lang in SHELL_LANGS:
            lines = shell_lines(block)
        elif block.lang in UNIT_LANGS:
            lines = unit_lines(block)
        else:
            continue
        for line, text in lines:
            commands.extend(split_commands(text, f"{rel(path)}:{line}"))
    return commands


def values_examples(path: Path) -> dict[str, Block]:
    """The Helm values files a document shows: yaml blocks whose first line is a comment naming
    a values file (``# my-values.yaml``, ``# values.yaml of the loraplex release``), by that name."""
    out = {}
    for block in fenced_blocks(path):
        first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
        m = re.match(r"#\s*(\S*values\.yaml)\b", first)
        if block.lang in ("yaml", "yml") and m is not None:
            out[m[1]] = block
    return out
