"""Shared code of the course tools (skeleton, status, compare).

Standard library only: the tools must run on a fresh machine before anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The tools live in <repo>/tools/, so the repository root is the parent of this file's folder;
# they work from any current directory.
REPO = Path(__file__).resolve().parent.parent

SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")
TEST_TIMEOUT_S = 600


class CourseError(Exception):
    """A problem the user can fix (bad argument, malformed markers); reported without a traceback."""


def rel(path: Path) -> str:
    """Path as shown to the user: relative to the repository root when inside it."""
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


# ── lessons ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Lesson:
    nn: str  # "01"
    slug: str  # folder name, "01_online_softmax"

    @property
    def solution_dir(self) -> Path:
        return REPO / "solutions" / self.slug

    @property
    def lesson_dir(self) -> Path:
        return REPO / "lessons" / self.slug

    def learner_sources(self) -> list[str]:
        """Names of the learner sources: the sources of solutions/NN_slug/ (not recursive)."""
        if not self.solution_dir.is_dir():
            return []
        return sorted(p.name for p in self.solution_dir.iterdir()
                      if p.is_file() and p.name.endswith(SOURCE_SUFFIXES))

    def test_exe(self, kind: str) -> Path:
        """The test executable of the 'learner' or 'solution' build of this lesson."""
        return build_dir() / "bin" / f"lesson{self.nn}_{kind}_test"

    def title(self) -> str:
        """First '# ' heading of the README, without a leading 'Lesson NN —' / 'Lesson NN:'."""
        readme = self.lesson_dir / "README.md"
        if readme.is_file():
            for line in readme.read_text(encoding="utf-8").splitlines():
                if line.startswith("# "):
                    return re.sub(r"^Lesson\s+\d+\s*[—:–-]\s*", "", line[2:].strip())
        return self.slug[3:].replace("_", " ")


def build_dir() -> Path:
    return REPO / os.environ.get("BUILD_DIR", "build")  # an absolute BUILD_DIR replaces REPO


def lessons_in(top: str) -> list[Lesson]:
    """Lesson folders NN_slug under REPO/top ('lessons' or 'solutions'), in order."""
    return [Lesson(p.name[:2], p.name) for p in sorted((REPO / top).glob("[0-9][0-9]_*"))
            if p.is_dir()]


def lesson_number(arg: str) -> str:
    """'1' or '01' -> '01'."""
    if not arg.isdigit() or int(arg) > 99:
        raise CourseError(f"a lesson number looks like 01 or 1, not '{arg}'")
    return f"{int(arg):02d}"


def find_lesson(arg: str, top: str) -> Lesson:
    nn = lesson_number(arg)
    for lesson in lessons_in(top):
        if lesson.nn == nn:
            return lesson
    raise CourseError(f"there is no lesson {nn} in {top}/")


# ── regions ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Markers:
    begin: str  # a line whose stripped text starts with this opens a region (a label may follow)
    end: str  # a line whose stripped text is exactly this closes it


SOLUTION = Markers("// BEGIN SOLUTION", "// END SOLUTION")
LEARNER = Markers("// BEGIN YOUR CODE", "// END YOUR CODE")
STUB = "// STUB:"


@dataclass(frozen=True)
class Region:
    begin: int  # index of the BEGIN line
    end: int  # index of the END line
    label: str  # text after the BEGIN marker, e.g. "task 3: the online pass"; may be empty
    indent: str  # leading whitespace of the BEGIN line

    def body(self, lines: list[str]) -> list[str]:
        return lines[self.begin + 1:self.end]

    def title(self, number: int) -> str:
        return f"region {number}" + (f" ({self.label})" if self.label else "")


def read_lines(path: Path) -> list[str]:
    """Lines with their endings kept, split on '\\n' only, so that joining gives the bytes back."""
    return re.findall(r"[^\n]*\n|[^\n]+\Z", path.read_bytes().decode("utf-8"))


def leading_ws(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


def line_ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")):]


def find_regions(lines: list[str], markers: Markers, where: str) -> list[Region]:
    """The marked regions of a file, in order; `where` names the file in error messages."""
    regions: list[Region] = []
    opened: int | None = None
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith(markers.begin):
            if opened is not None:
                raise CourseError(f"{where}:{i + 1}: '{markers.begin}' inside the region opened at "
                                  f"line {opened + 1} (regions do not nest)")
            opened = i
        elif text == markers.end:
            if opened is None:
                raise CourseError(f"{where}:{i + 1}: '{markers.end}' without a '{markers.begin}'")
            begin_line = lines[opened]
            label = begin_line.strip()[len(markers.begin):].strip()
            regions.append(Region(opened, i, label, leading_ws(begin_line)))
            opened = None
    if opened is not None:
        raise CourseError(f"{where}:{opened + 1}: '{markers.begin}' is never closed by "
                          f"'{markers.end}'")
    return regions


def is_stub(line: str) -> bool:
    return line.strip().startswith(STUB)


def stub_text(line: str) -> str:
    """The skeleton line a '// STUB: text' line stands for: its indentation, then 'text'."""
    text = line.strip()[len(STUB):]
    text = text.removeprefix(" ")
    return (leading_ws(line) + text if text else "") + line_ending(line)


def stub_lines(lines: list[str], region: Region) -> list[str]:
    """What the skeleton keeps of a solution region."""
    return [stub_text(line) for line in region.body(lines) if is_stub(line)]


def solution_lines(lines: list[str], region: Region) -> list[str]:
    """The solution code of a solution region (its STUB lines are for the skeleton only)."""
    return [line for line in region.body(lines) if not is_stub(line)]


# ── test executables ─────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class TestRun:
    returncode: int | None  # None when it ran past the timeout
    output: str  # stdout and stderr together
    results: list[dict]  # one object per test, as written to CP_RESULTS_JSON

    def problem(self) -> str | None:
        """Why the results cannot be trusted to be complete, or None."""
        if self.returncode is None:
            return f"timed out after {TEST_TIMEOUT_S} s"
        # gtest exits 1 when tests fail; a signal, or a failure with no results at all, is a crash.
        if self.returncode < 0 or (self.returncode != 0 and not self.results):
            return f"crashed (exit code {self.returncode})"
        return None

    def last_output_line(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


def run_test_exe(exe: Path, args: list[str] | None = None) -> TestRun:
    """Run a lesson test executable and collect the JSON Lines it writes to CP_RESULTS_JSON."""
    fd, results_path = tempfile.mkstemp(prefix="cp_results_", suffix=".jsonl")
    os.close(fd)
    env = {**os.environ, "CP_RESULTS_JSON": results_path, "GTEST_COLOR": "no"}
    try:
        try:
            done = subprocess.run([str(exe), *(args or [])], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=TEST_TIMEOUT_S)
            returncode, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as timeout:
            returncode, output = None, timeout.output or b""
        results = read_jsonl(Path(results_path))
    finally:
        os.unlink(results_path)
    return TestRun(returncode, output.decode("utf-8", "replace"), results)


def read_jsonl(path: Path) -> list[dict]:
    results = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # blank, or the last line of an executable that died while writing it
        if isinstance(record, dict) and "test" in record:
            results.append(record)
    return results


def worst_rel(result: dict) -> float | None:
    """Largest max_rel over the checks of one test result, None when it has none."""
    values = [c["max_rel"] for c in result.get("checks") or []
              if isinstance(c.get("max_rel"), (int, float))]
    return max(values, default=None)


def one_line(text: str, width: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


# ── colour ───────────────────────────────────────────────────────────────────────────────────


class Palette:
    """ANSI colours, only on a terminal and only when NO_COLOR is not set (to any value)."""

    CODES = {"red": "31", "green": "32", "yellow": "33", "cyan": "36", "bold": "1", "dim": "2"}

    def __init__(self, stream=sys.stdout):
        self.enabled = "NO_COLOR" not in os.environ and stream.isatty()

    def __call__(self, text: str, colour: str | None) -> str:
        if not self.enabled or colour is None:
            return text
        return f"\033[{self.CODES[colour]}m{text}\033[0m"


def main_guard(name: str, main) -> None:
    """Run a tool's main(); a CourseError becomes a one-line message and exit status 2."""
    try:
        sys.exit(main())
    except CourseError as error:
        print(f"{name}: {error}", file=sys.stderr)
        sys.exit(2)
