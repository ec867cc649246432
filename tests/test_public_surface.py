"""The public surface holds: every import the README, docs/ and examples/ show works, and every path
an earlier README showed still imports, warning once with the new path.

The documented imports are read, not hand-listed: the import statements of every ```python block in
README.md and docs/**/*.md (at any depth of the block), and of every examples/**/*.py (its top-level
imports, and its imports of this project's packages wherever they are). One subprocess runs them all,
each on its own, so a failure names the file and line of the import that broke. Horovod's imports
are among them: CI builds Horovod (scripts/build_horovod.sh), and without it they fail, saying so.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the project's own top-level packages and modules: an example's import of one counts at any depth
OURS = ("dad_integrations", "dad_examples", "horovod_dad", "deepspeed_dad", "deepspeed_dad_hook")
OPEN_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*\{?\s*\.?(?P<lang>[\w-]*)")
MARK = "public-surface-result: "

Import = Tuple[str, str]  # ("docs/guides/horovod.md:42", "import horovod.torch as hvd")


def _imports_in(source: str, where: str, first_line: int, top_level_only: bool) -> List[Import]:
    """The absolute import statements of ``source`` (whose line 1 is ``first_line`` of ``where``)."""
    tree = ast.parse(source)  # a block or example that is not Python fails the test, naming it
    nodes = [n for n in (tree.body if top_level_only else ast.walk(tree))
             if isinstance(n, (ast.Import, ast.ImportFrom))]
    if top_level_only:  # ... and the project's own imports wherever they are
        nodes += [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in nodes
                  and _module_of(n).split(".")[0] in OURS]
    return [(f"{where}:{first_line + n.lineno - 1}", ast.get_source_segment(source, n))
            for n in sorted(nodes, key=lambda n: n.lineno) if not getattr(n, "level", 0)]


def _module_of(node: ast.AST) -> str:
    return (node.module or "") if isinstance(node, ast.ImportFrom) else node.names[0].name


def markdown_imports(path: Path) -> List[Import]:
    """The imports in ``path``'s ```python blocks (fences indented in lists or admonitions too)."""
    where = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    found: List[Import] = []
    i = 0
    while i < len(lines):
        opening = OPEN_FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], opening["indent"]
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
        if opening["lang"].lower() in ("python", "py", "python3"):
            body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                             for line in lines[i + 1:end])
            found += _imports_in(body, where, i + 2, top_level_only=False)
        i = end + 1
    return found


def example_imports(path: Path) -> List[Import]:
    """An example's top-level imports, and its imports of the project's packages at any depth."""
    return _imports_in(path.read_text(), path.relative_to(ROOT).as_posix(), 1, top_level_only=True)


def documented_imports() -> List[Import]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return ([imp for page in pages for imp in markdown_imports(page)]
            + [imp for example in sorted((ROOT / "examples").rglob("*.py")) for imp in example_imports(example)])


# Runs every statement on its own in a fresh namespace; reports what raised, and what imported an
# old path (the docs show the new ones). The shims' once-per-process memory is cleared after each
# statement, so every use of an old path is reported.
RUNNER = r"""
import json, sys, warnings
failures = []
for where, statement in json.load(sys.stdin):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(statement, where, "exec"), {"__name__": "__documented__"})
        except BaseException as error:  # SystemExit and KeyboardInterrupt from an import, too
            failures.append(f"{where}: `{statement}` raised {type(error).__name__}: {error}")
            continue
        finally:
            moved = sys.modules.get("dad_integrations._moved")
            if moved is not None:
                moved._warned.clear()
    old = [str(w.message) for w in caught if " has moved to " in str(w.message)]
    if old:
        failures.append(f"{where}: `{statement}` imports an old path: {old[0]}")
print(MARK + json.dumps(failures))
""".replace("MARK", repr(MARK))


def test_every_documented_import_works():
    imports = documented_imports()
    places = {where.split(":")[0].split("/")[0] for where, _ in imports}
    # the reader itself: it finds the README's, the docs' and the examples' imports
    assert {"README.md", "docs", "examples"} <= places, places
    assert any("horovod" in statement for _, statement in imports)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(imports), capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    result = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and result, f"the import runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    failures = json.loads(result[-1][len(MARK):])
    assert failures == [], "documented imports that do not work:\n" + "\n".join(failures)


# Paths an earlier README or docs page showed (`git log -p -- README.md docs/ examples/`), the new
# home of each name, and the name the warning gives.
OLD_DOCUMENTED = [
    ("dad_integrations.checkpoint", "save_rank_state", "dad_integrations"),
    ("dad_integrations.checkpoint", "load_rank_state", "dad_integrations"),
    ("dad_integrations.comm_counter", "CollectiveCounter", "dad_integrations"),
    ("dad_integrations.text_data", "VOCAB_SIZE", "dad_examples.text_data"),
    ("dad_integrations.text_data", "byte_lm_batches", "dad_examples.text_data"),
    ("dad_integrations.text_data", "stdlib_source_bytes", "dad_examples.text_data"),
    ("dad_integrations.text_data", "stdlib_package_snippets", "dad_examples.text_data"),
]
SHIMS = ("dad_integrations.checkpoint", "dad_integrations.comm_counter", "dad_integrations.text_data")


def _every_moved_name():
    for shim in SHIMS:
        for name, new in importlib.import_module(shim)._MOVES.items():
            yield shim, name, new


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The shims' once-per-process memory, emptied for one test."""
    monkeypatch.setattr(importlib.import_module("dad_integrations._moved"), "_warned", set())


@pytest.mark.parametrize("old, name, new", sorted(set(OLD_DOCUMENTED) | set(_every_moved_name())))
def test_an_old_path_imports_and_warns_once(old, name, new, fresh_warnings):
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-place filter must not hide a second warning
        exec(f"from {old} import {name}", namespace)
        exec(f"from {old} import {name}", namespace)
        exec(f"import {old} as shim; shim.{name}", namespace)
    moved = [w for w in caught if " has moved to " in str(w.message)]
    assert [w.category for w in moved] == [FutureWarning], [str(w.message) for w in caught]
    assert f"{new}.{name}" in str(moved[0].message)
    assert moved[0].filename == "<string>"  # it points at the importing line, not at the shim
    assert namespace[name] is getattr(importlib.import_module(new), name)


def test_old_paths_know_only_the_names_they_held():
    with pytest.raises(ImportError, match="save_rank_state_v2"):
        exec("from dad_integrations.checkpoint import save_rank_state_v2", {})


def test_the_checkpoint_helpers_are_on_the_face():
    import dad_integrations
    from dad_integrations.engines import checkpoint

    for name in ("save_rank_state", "load_rank_state", "merge_rank_states", "state_file"):
        assert name in dad_integrations.__all__ and getattr(dad_integrations, name) is getattr(checkpoint, name)


def test_the_banner_logger_keeps_its_documented_name():
    """docs/guarantees.md: ``logging.getLogger("dad_integrations.banner")`` silences the attach line."""
    from dad_integrations.engines import banner

    assert banner.LOGGER_NAME == "dad_integrations.banner"
