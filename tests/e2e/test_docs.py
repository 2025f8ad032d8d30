"""The README is a front page and the docs hold together: fast, no network, no model.

The README starts with the two commands that set everything up (`make run`, `make test`), stays
short, and every relative link in it and in docs/ (pages and images) points at a file that exists.
The full check of the site, anchors included, is `mkdocs build --strict` (docs/index.md), which
`test_site_builds_strict` runs, API reference (docs/api.md, from the docstrings) included.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TWO_COMMANDS = (
    "```bash\n"
    "make run    # set up .venv, then generate for a few prompts with the bundled"
    " SmolLM2-135M-Instruct\n"
    "make test   # set up .venv, then run the whole test suite\n"
    "```"
)
# [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _markdown_files() -> list[Path]:
    return [README, REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            continue  # http(s):, mailto:, in-page anchors, site-absolute paths
        out.append(target)
    return out


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move how-tos and history to docs/"


def test_readme_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    first_fence = text.index("```")
    assert text[first_fence:].startswith(TWO_COMMANDS), "the first code block must be the two commands"
    assert text[:first_fence].count("\n") < 25, "the two commands must come near the top"
    assert "make test-fast" in text


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(path):
    missing = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if file_part and not (path.parent / file_part).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(REPO)} links to missing files: {missing}"


def test_docs_pages_are_in_the_site_nav():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = [p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")]
    assert pages
    missing = [p for p in pages if not re.search(r":\s*" + re.escape(p) + r"\s*$", nav, re.M)]
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


def test_site_builds_strict(tmp_path):
    """The whole site builds with --strict (any warning fails: a broken link or anchor, a
    docstring griffe cannot read), the API reference included, without importing torch.

    mkdocs-material and mkdocstrings are in the `test` extra: without them this fails, not skips.
    """
    # mkdocstrings reads the source statically; a torch that cannot be imported proves it
    blocker = tmp_path / "blocker"
    for name in ("torch", "transformers"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(
            f"raise ImportError('building the docs must not import {name}')\n"
        )
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life notice
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        "mkdocs build --strict failed (mkdocs-material and mkdocstrings[python] come with the"
        f" `test` extra: make setup):\n{proc.stdout}\n{proc.stderr}"
    )
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for anchor in ("pagedllm.LLM.generate", "pagedllm.LLM.chat", "pagedllm.SamplingParams",
                   "pagedllm.RequestOutput", "pagedllm.CompletionOutput", "pagedllm.config.EngineConfig"):
        assert f'id="{anchor}"' in api, f"the API reference has no entry {anchor}"
    # the docstrings' text: generate's, and a SamplingParams argument's
    assert "Generate for every prompt; outputs come back in prompt order." in api
    assert "0 means greedy; higher flattens the distribution." in api
