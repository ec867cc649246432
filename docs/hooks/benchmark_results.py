"""MkDocs hook: the benchmark result files in the site, from `benchmarks/results/` itself.

* ``<!-- results: NAME.md -->`` on a line of its own is replaced by the contents of
  ``benchmarks/results/NAME.md``; ``<!-- results: NAME.md level=3 -->`` also moves the file's
  headings down so that its top heading is at that level. The tables on the benchmarks page are
  therefore the files the benchmarks wrote, never copies.
* Every ``benchmarks/results/*.png`` is served as ``assets/results/NAME.png``.

A marker naming a file that does not exist fails the build (`PluginError`).
"""
from __future__ import annotations

import os
import re
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

RESULTS_DIR = os.path.join("benchmarks", "results")
ASSETS_URI = "assets/results"
_MARKER = re.compile(r"^<!--\s*results:\s*(?P<name>[\w.\-]+\.md)(?:\s+level=(?P<level>[1-6]))?\s*-->\s*$",
                     re.MULTILINE)
_HEADING = re.compile(r"^(#{1,6})(\s)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _results_dir(config: Any) -> str:
    # the repository root is the folder that holds mkdocs.yml
    return os.path.join(os.path.dirname(os.path.abspath(config["config_file_path"])), RESULTS_DIR)


def _shift_headings(text: str, level: int) -> str:
    lines = text.splitlines()
    in_fence = False
    found = []
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and _HEADING.match(line):
            found.append(len(_HEADING.match(line).group(1)))
    shift = max(0, level - min(found)) if found else 0
    if not shift:
        return text
    out, in_fence = [], False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and _HEADING.match(line):
            line = "#" * shift + line
        out.append(line)
    return "\n".join(out)


def on_files(files: Any, config: Any) -> Any:
    folder = _results_dir(config)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".png"):
            files.append(File.generated(config, f"{ASSETS_URI}/{name}", abs_src_path=os.path.join(folder, name)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    folder = _results_dir(config)

    def include(match: "re.Match[str]") -> str:
        path = os.path.join(folder, match.group("name"))
        if not os.path.isfile(path):
            raise PluginError(f"{page.file.src_uri}: no result file {os.path.join(RESULTS_DIR, match.group('name'))}")
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip("\n")
        if match.group("level"):
            text = _shift_headings(text, int(match.group("level")))
        return text + "\n"

    return _MARKER.sub(include, markdown)
