"""What a user sees under ``mypy --strict``: the typing tests, the examples and the docs' code.

One mypy run checks ``typing_tests/`` (a file either type-checks cleanly or
gets exactly the errors its ``# E: <code>`` comments announce), ``examples/``
and the ```` ```python ```` blocks of README.md and docs/*.md. A block is
checked as a module of its own, with the files it includes through
``--8<-- "path"`` inlined. A block preceded by ``<!-- typing: skip (why) -->``
is left out; the reason is required.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from mypy import api

from cyclone_dsl.dsl.builder import OPTION_NAMES
from cyclone_dsl.dsl.signatures import CallOptions, NodeOptionArgs
from cyclone_dsl.dsl.step import CALL_KEYWORDS

ROOT = Path(__file__).resolve().parents[2]
TYPING_TESTS = ROOT / "typing_tests"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# The pages under docs/concepts/ and docs/howto/ show fragments that use names defined
# elsewhere (client, orders, ...); they are not checked.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CACHE_DIR = ROOT / ".mypy_cache" / "typing-tests"
BLOCKS_DIR = CACHE_DIR / "docs-blocks"

# A user's project: --strict, with the package's own modules read but not reported on.
MYPY_CONFIG = """\
[mypy]
strict = True

[mypy-cyclone_dsl.*]
follow_imports = silent

[mypy-pgserver.*]
ignore_missing_imports = True
"""

EXPECTED = re.compile(r"#\s*E:\s*(?P<codes>[\w-]+(?:\s*,\s*[\w-]+)*)\s*$")
REPORTED = re.compile(
    r"^(?P<path>.+?):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[\w-]+)\])?$"
)
FENCE = re.compile(r"^(?P<indent>\s*)```python\s*$")
SKIP = re.compile(r"^<!--\s*typing:\s*skip\b(?P<reason>.*?)-->$")
SNIPPET = re.compile(r'^-+8<-+\s+"(?P<path>[^"]+)"\s*$')
# `ruff format` formats python blocks in Markdown and would turn an include into
# `--8 < --"..."`, which mkdocs shows as text: <!-- fmt: off --> ... <!-- fmt: on --> around
# the block keeps it (tests/docs checks that the built pages show what they include).


def file_key(path: Path | str) -> str:
    """``folder/name.py``: mypy replays the errors of an unchanged module at the path it
    had when cached, which is not this checkout's when the cache came from another one."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}"


@attrs.frozen
class Error:
    file: str
    line: int
    code: str
    message: str


@attrs.frozen
class Block:
    """A code block of a document, written out as a module, with where each line came from."""

    module: Path
    origins: tuple[str, ...]

    def origin(self, line: int) -> str:
        return self.origins[line - 1] if 0 < line <= len(self.origins) else str(self.module)


def code_blocks(document: Path) -> Iterator[tuple[int, list[str]]]:
    """The ``python`` blocks of a Markdown file: (line of the fence, lines), skips left out."""
    lines = document.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = opening["indent"]
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        skip = SKIP.match(previous.strip())
        if skip is None:
            body = [line.removeprefix(indent) for line in lines[index + 1 : end]]
            yield index + 1, body
        else:
            reason = skip["reason"].strip(" ():")
            assert reason, f"{document.name}:{index + 1}: a typing skip needs a reason"
        index = end + 1


def write_blocks(directory: Path) -> list[Block]:
    blocks = []
    for document in DOCUMENTS:
        stem = document.relative_to(ROOT).with_suffix("").as_posix().replace("/", "_")
        stem = re.sub(r"\W", "_", stem).lower()
        for number, (fence, body) in enumerate(code_blocks(document), start=1):
            text: list[str] = []
            origins: list[str] = []
            for offset, line in enumerate(body, start=1):
                include = SNIPPET.match(line)
                if include is None:
                    text.append(line)
                    origins.append(f"{document.relative_to(ROOT)}:{fence + offset}")
                    continue
                included = (ROOT / include["path"]).read_text().splitlines()
                text.extend(included)
                origins.extend(f"{include['path']}:{n}" for n in range(1, len(included) + 1))
            module = directory / f"{stem}_{number}.py"
            source = "\n".join(text) + "\n"
            if not module.exists() or module.read_text() != source:
                module.write_text(source)
            blocks.append(Block(module, tuple(origins)))
    return blocks


def expected_errors(path: Path) -> set[tuple[int, str]]:
    expected = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = EXPECTED.search(line)
        if match is not None:
            expected.update((number, code.strip()) for code in match["codes"].split(","))
    return expected


@attrs.frozen
class Report:
    errors: tuple[Error, ...]
    blocks: tuple[Block, ...]

    def in_file(self, path: Path) -> list[Error]:
        return [e for e in self.errors if e.file == file_key(path)]


@pytest.fixture(scope="module")
def report() -> Report:
    BLOCKS_DIR.mkdir(parents=True, exist_ok=True)
    blocks = write_blocks(BLOCKS_DIR)
    config = CACHE_DIR / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    targets = [str(TYPING_TESTS), *map(str, EXAMPLES), *(str(b.module) for b in blocks)]
    stdout, stderr, status = api.run(
        [
            "--config-file",
            str(config),
            "--cache-dir",
            str(CACHE_DIR),
            "--no-error-summary",
            "--no-pretty",
            *targets,
        ]
    )
    assert status in (0, 1), stdout + stderr
    errors = []
    for line in stdout.splitlines():
        match = REPORTED.match(line)
        if match is not None:
            errors.append(
                Error(
                    file_key(match["path"]),
                    int(match["line"]),
                    match["code"] or "",
                    match["message"],
                )
            )
    assert errors or status == 0, stdout + stderr
    return Report(tuple(errors), tuple(blocks))


@pytest.mark.parametrize(
    "path",
    sorted(p for p in TYPING_TESTS.glob("*.py") if p.name != "__init__.py"),
    ids=lambda p: p.stem,
)
def test_typing_tests_get_exactly_the_errors_they_announce(report: Report, path: Path) -> None:
    errors = report.in_file(path)
    got = {(e.line, e.code) for e in errors}
    expected = expected_errors(path)
    unexpected = [
        f"{e.line}: {e.message} [{e.code}]" for e in errors if (e.line, e.code) in got - expected
    ]
    missing = [f"{line}: expected [{code}]" for line, code in sorted(expected - got)]
    assert not unexpected and not missing, "\n".join(
        ["unexpected:", *unexpected, "missing:", *missing]
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_type_check(report: Report, path: Path) -> None:
    problems = [f"{path.name}:{e.line}: {e.message} [{e.code}]" for e in report.in_file(path)]
    assert not problems, "\n".join(problems)


def test_the_code_blocks_of_the_docs_type_check(report: Report) -> None:
    assert report.blocks, "no code block found"
    problems = [
        f"{block.origin(e.line)}: {e.message} [{e.code}]"
        for block in report.blocks
        for e in report.in_file(block.module)
    ]
    assert not problems, "\n".join(problems)


def test_the_typed_keywords_are_the_ones_a_builder_call_takes() -> None:
    assert NodeOptionArgs.__optional_keys__ == OPTION_NAMES
    assert CallOptions.__optional_keys__ == set(CALL_KEYWORDS)
    assert not CallOptions.__required_keys__
