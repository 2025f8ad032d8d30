"""`make run` sets up only the project's own .venv: no system packages as a side effect of generating text."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEM_INSTALLERS = re.compile(r"\b(apt-get|apt|dnf|yum|zypper|apk|pacman|brew|sudo|snap)\b")


def _dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's two commands need it")
    # -B: every recipe of the target and its prerequisites (the set-up too), -n: printed, not run
    proc = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_run_installs_nothing_outside_the_venv() -> None:
    recipe = _dry_run("run")
    assert "pip install" in recipe and "pagedllm generate" in recipe  # the dry run did print the set-up
    assert not SYSTEM_INSTALLERS.search(recipe), recipe


def test_the_browser_packages_come_with_make_test_only() -> None:
    assert "apt-get install" in _dry_run("test")  # the check above would see it, were it in `make run`
