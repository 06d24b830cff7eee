#!/usr/bin/env python3
"""Set up and run Cyclone from a fresh clone: ``python3 dev.py demo`` or ``python3 dev.py test``.

Creates ``.venv`` beside this file on first use, installs the package with
the extras the command needs, then runs it. Needs only Python 3.11+ and
access to the package index. Later runs reuse the virtualenv and reinstall
only when ``pyproject.toml`` changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
EXTRAS = "dev,embedded"


def ensure_venv() -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"Cyclone needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        print("==> creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    stamp = VENV / ".cyclone-install"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + EXTRAS.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    print("==> installing cyclone-dsl and its dependencies into .venv", flush=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{EXTRAS}]"], check=True)
    stamp.write_text(digest)


def regenerate_query_names() -> None:
    """Rewrite the typed attribute list of cyclone_dsl.sql.Q from the .sql files."""
    import re

    body = []
    for path in sorted((ROOT / "cyclone_dsl" / "sql").glob("*.sql")):
        names = re.findall(r"^--\s*name:\s*(\w+)", path.read_text(), re.MULTILINE)
        body.append(f"    # {path.name}")
        body += [f"    {name}: LiteralString" for name in names]
    target = ROOT / "cyclone_dsl" / "sql" / "__init__.py"
    text = target.read_text()
    start = text.index("class _Queries:\n") + len("class _Queries:\n")
    end = text.index("\n    def __init__")
    target.write_text(text[:start] + "\n".join(body) + "\n" + text[end:])


def parallel(args: list[str]) -> list[str]:
    """pytest-xdist options for the whole suite: two processes per core, up to 4, with
    work stealing (most tests wait on the database, timers and subprocesses); none when
    the caller chose (-n, -p no:xdist).

    Measured on two cores: two processes used a third of the CPU and ran in 625 s, three
    in 458 s; with the audits of 2026-12-06, 655 s with three and 564 s with four. Later
    that day (bytecode cached, fewer gated claims): 604 s with four, 567 s with six (the
    CPU busy until a tail of 75 s where a few long tests ran alone), 490 s with six and
    ``--dist worksteal`` (no tail: an idle process takes pending tests from a busy one).
    Six processes made the audits that count connections and threads under load fail
    (waits cancelled 500 times: a wait connection left after 20 s), so four, stealing.
    """
    cores = os.cpu_count() or 1
    chose = any(a == "-n" or a.startswith("-n") or "xdist" in a for a in args)
    if chose or cores < 2:
        return []
    return ["-n", str(min(cores * 2, 4)), "--dist", "worksteal"]


def run(argv: list[str]) -> int:
    return subprocess.run(argv, cwd=ROOT, check=False).returncode


def main() -> int:
    args = sys.argv[1:]
    # Bytecode caches (gitignored) are written even where the environment says not to: the
    # suite starts hundreds of interpreters (CLI commands, worker processes), and each one
    # compiling the package, the tests and their dependencies from source cost a third of
    # the CPU of the subprocess-heavy tests.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if args[:1] == ["queries"]:
        regenerate_query_names()
        return 0
    if not args or args[0] not in {"demo", "test", "lint", "bench", "docs", "shell"}:
        print(__doc__)
        print(
            "commands: demo | test [pytest args] | lint | bench [args] | docs | queries | shell CMD"
        )
        return 2
    ensure_venv()
    command, rest = args[0], args[1:]
    if command == "demo":
        return run([str(BIN / "cyclone"), "demo", *rest])
    if command == "test":
        code = run([str(PYTHON), "-m", "pytest", *parallel(rest), *rest])
        if code == 5:
            print("pytest collected no tests: that is a failure", file=sys.stderr)
            return 1
        return code
    if command == "lint":
        return run([str(PYTHON), "-m", "ruff", "check", "."]) or run([str(PYTHON), "-m", "mypy"])
    if command == "bench":
        subprocess.run(
            [str(PYTHON), "-m", "pip", "install", "-q", "-e", f"{ROOT}[bench]"], check=True
        )
        return run([str(PYTHON), "-m", "bench", *rest])
    if command == "docs":
        subprocess.run(
            [str(PYTHON), "-m", "pip", "install", "-q", "-e", f"{ROOT}[docs]"], check=True
        )
        return run([str(PYTHON), "-m", "mkdocs", "build", "--strict"])
    return run([str(BIN / rest[0]), *rest[1:]])


if __name__ == "__main__":
    sys.exit(main())
