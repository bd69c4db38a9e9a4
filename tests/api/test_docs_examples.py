"""Every code block of README.md and docs/*.md that is meant to run does, as written.

A fence's info string says how a block runs (GitHub highlights by its first word only):

- ``python``: ``python block.py`` in the page's working folder;
- ``python spmd=N``: ``gpucoll-run --nproc-per-node N block.py``;
- ``python pytest``: ``python -m pytest`` on the block;
- ``python file=NAME``: written to NAME for later blocks of the page, not run;
- ``bash run [rc=N] [expect="TEXT"]``: run with bash, exit status N (default 0),
  output containing TEXT;
- ``LANG skip (REASON)``: a placeholder or signature, not run; the reason is required.

Fences without a language are output and are not run. A python or bash block with
none of these marks fails the test, so a new example cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```", re.S | re.M)
RUNNABLE = ("python", "bash", "sh", "shell", "console")
TIMEOUT = 120


def _tokens(info: str) -> list[str]:
    try:
        return shlex.split(info)
    except ValueError:  # free text after 'skip' may hold an apostrophe
        return info.split()


def blocks(page: Path) -> list[tuple[int, str, list[str], str]]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text[:m.start()].count("\n") + 1
        out.append((line, m.group(1), _tokens(m.group(2)), m.group(3)))
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    # The console scripts of this interpreter's environment come first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(cmd: list[str], cwd: Path, where: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{where}: did not finish within {TIMEOUT} s: {exc}")


def _attrs(tokens: list[str]) -> dict[str, str]:
    return dict(t.split("=", 1) for t in tokens if "=" in t)


def run_block(page: Path, line: int, lang: str, tokens: list[str], code: str, work: Path) -> None:
    where = f"{page.relative_to(ROOT)}:{line}"
    attrs = _attrs(tokens)
    if lang == "python":
        if "file" in attrs:
            (work / attrs["file"]).write_text(code, encoding="utf-8")
            return
        name = f"test_block_{line}.py" if "pytest" in tokens else f"block_{line}.py"
        (work / name).write_text(code, encoding="utf-8")
        if "pytest" in tokens:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        elif "spmd" in attrs:
            cmd = [sys.executable, "-m", "gpucoll.run", "--nproc-per-node", attrs["spmd"], name]
        else:
            cmd = [sys.executable, name]
        rc, expect = 0, None
    else:
        assert "run" in tokens, f"{where}: a {lang} block must be marked 'run' or 'skip (reason)'"
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
        rc, expect = int(attrs.get("rc", "0")), attrs.get("expect")
    done = _run(cmd, work, where)
    output = done.stdout + done.stderr
    assert done.returncode == rc, (f"{where}: exit status {done.returncode}, expected {rc}\n"
                                   f"--- block ---\n{code}--- output ---\n{output[-4000:]}")
    if expect is not None:
        assert expect in output, f"{where}: output lacks {expect!r}\n--- output ---\n{output[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page: Path, tmp_path: Any) -> None:
    for line, lang, tokens, code in blocks(page):
        if lang not in RUNNABLE:
            continue
        where = f"{page.relative_to(ROOT)}:{line}"
        if tokens and tokens[0] == "skip":
            assert len(tokens) > 1, f"{where}: 'skip' needs a reason, e.g. ```{lang} skip (signature)"
            continue
        run_block(page, line, lang, tokens, code, tmp_path)


def test_every_runnable_block_is_marked() -> None:
    """A block in a shell language must say 'run' or 'skip (reason)': nothing runs by accident
    (an install) and nothing is skipped silently."""
    unmarked = [f"{p.relative_to(ROOT)}:{line}" for p in PAGES for line, lang, tokens, _ in blocks(p)
                if lang in RUNNABLE and lang != "python" and not tokens]
    assert not unmarked, f"unmarked blocks: {unmarked}"


def test_quickstart_is_checked() -> None:
    kinds = [(lang, tokens) for _, lang, tokens, _ in blocks(ROOT / "docs" / "quickstart.md")]
    runs = [t for lang, t in kinds if lang == "bash" and "run" in t]
    assert len(runs) >= 4 and any("rc=1" in t for t in runs)
