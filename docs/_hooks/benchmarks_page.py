"""mkdocs hook: BENCHMARKS.md lives at the repository root (where GitHub shows it);
the site renders it as benchmarks.md and points the docs' links to it there."""

import os
import re

from mkdocs.structure.files import File

_LINK = re.compile(r"\]\(((?:\.\./)+)BENCHMARKS\.md(#[^)]*)?\)")


def on_files(files, config):
    root = os.path.dirname(config["config_file_path"])
    with open(os.path.join(root, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    # images it names from the repository root (docs/memory.png) sit beside the page on the site
    text = text.replace("](docs/", "](")
    files.append(File.generated(config, "benchmarks.md", content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")
    target = "../" * depth + "benchmarks.md"
    return _LINK.sub(lambda m: "](" + target + (m.group(2) or "") + ")", markdown)
