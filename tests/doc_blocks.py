"""The documents the tests execute: README.md, then the docs/ pages in the order the README first links them (a
page it does not link, in the order of the pages that do), read into their fenced blocks, links and headings.

A block is named "<heading> #<n>" in the README and "docs/<page>: <heading> #<n>" in a docs page: the n-th fenced
block of its language under that heading. `<!-- readme-test: skip (reason) -->` on the line before a block marks one
that cannot run here (GPUs, Slurm, several machines); `<!-- readme-test: quoted from PATH -->` marks a python block
whose every line is a line of PATH.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"

_HEADING = re.compile(r"^(#{1,4}) (.+)$")
_MARKER = re.compile(r"^<!-- readme-test: (skip \((?P<reason>.+)\)|quoted from (?P<source>\S+)) -->$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


@dataclasses.dataclass(frozen=True)
class Block:
    name: str
    path: Path
    language: str
    text: str
    line: int  # the first line of the block's text, 1-based
    skip: str | None = None  # why it does not run here
    quoted_from: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)} line {self.line}"


def documents() -> list[Path]:
    """README.md, then every docs page it links, in the order of its first link (pages the README does not link
    come from the links of the pages before them)."""
    order, queue = [README], [README]
    while queue:
        page = queue.pop(0)
        for target in links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            if path.suffix == ".md" and path.is_relative_to(DOCS) and path.exists() and path not in order:
                order.append(path)
                queue.append(path)
    return order


def links(page: Path) -> list[str]:
    """The relative link targets of a markdown page outside its code, in order (web addresses left out)."""
    found = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if not re.match(r"^[a-z]+:", target):
                found.append(target)
    return found


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced blocks and inline code."""
    lines, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as dashes, repeats
    numbered (-1, -2, ...); and the explicit ones, `<a id="name"></a>` (docs/comparison.md's sources)."""
    seen: dict[str, int] = {}
    result = set()
    fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            result.update(re.findall(r'<a id="([\w-]+)"></a>', line))
        if fence or not (match := re.match(r"^#{1,6} (.+)$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one document with their names and markers, in order."""
    prefix = "" if path == README else f"{path.relative_to(REPO)}: "
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    heading, counts, marker, i = "", {}, None, 0
    while i < len(lines):
        line = lines[i]
        if match := _HEADING.match(line):
            heading, counts = match.group(2), {}
        elif match := _MARKER.match(line):
            marker = match
        elif line.startswith("```"):
            language, start = line[3:].strip(), i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            counts[language] = counts.get(language, 0) + 1
            found.append(
                Block(
                    name=f"{prefix}{heading} #{counts[language]}",
                    path=path,
                    language=language,
                    text="\n".join(lines[start:end]),
                    line=start + 1,
                    skip=marker.group("reason") if marker else None,
                    quoted_from=marker.group("source") if marker else None,
                )
            )
            marker, i = None, end
        elif line.strip():
            marker = None  # a marker belongs to the block right after it
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]


def shell_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.language in ("bash", "sh", "shell")]


@dataclasses.dataclass(frozen=True)
class Command:
    """One invocation of a torchpre entry point (or of torchrun) in a shell block, with the flags it passes."""

    entry_point: str  # "train.py", a module ("torchpre.generate") or "torchrun"
    flags: tuple[str, ...]  # "--section.key" or "--name", without values


ENTRY_POINTS = ("train.py", "torchpre.")


def commands(script: str) -> list[Command]:
    """The entry-point invocations of a shell script: torchrun's own flags as one command, the program it runs as
    another; pipes, `&&`, `;` and continuation lines understood, comments dropped."""
    found = []
    for line in re.sub(r"\\\n", " ", script).splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for words in _split_on_operators(tokens):
            found += _invocations(words)
    return found


def _split_on_operators(tokens: list[str]) -> list[list[str]]:
    parts, current = [], []
    for token in tokens:
        if token in ("&&", "||", ";", "|", "&"):
            parts.append(current)
            current = []
        else:
            current.append(token.rstrip(";"))
    return [part for part in parts + [current] if part]


def _invocations(words: list[str]) -> list[Command]:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the program
        words = words[1:]
    if not words:
        return []
    found = []
    if Path(words[0]).name == "torchrun":
        # the program starts at "-m" or at a script; what comes before it is torchrun's
        i = next((j for j, w in enumerate(words) if w == "-m" or w.endswith(".py")), len(words))
        found.append(Command("torchrun", tuple(w.split("=")[0] for w in words[1:i] if w.startswith("--"))))
        program = words[i:]
    elif Path(words[0]).name in ("python", "python3"):
        program = words[1:]
    elif words[0] == "sbatch":  # multinode.slurm passes what follows its config file to train.py
        script = next((j for j, w in enumerate(words) if w.endswith(".slurm")), len(words))
        program = ["train.py", *words[script + 2 :]]
    else:
        return []
    if program[:1] == ["-m"] and len(program) > 1:
        entry, rest = program[1], program[2:]
    elif program and program[0].endswith(".py"):
        entry, rest = Path(program[0]).name, program[1:]
    else:
        return found
    if entry == "train.py" or entry.startswith("torchpre."):
        found.append(Command(entry, tuple(w.split("=")[0] for w in rest if w.startswith("--"))))
    return found
