"""The installed import hook (``deepspeed_dad_hook.pth``) for the tests' launches.

`pip install -e .` (scripts/setup_env.sh, as CI runs it) puts the hook's ``.pth`` in site-packages,
and then every launched process has it. Where the environment's install predates the hook (a
checkout tested against another checkout's venv), `hook_site` installs this checkout as a wheel
into a temporary folder and has every launched process read it as a site folder (a
``sitecustomize`` on ``PYTHONPATH`` calls ``site.addsitedir``), which runs its ``.pth`` as
site-packages would. The scripts themselves import nothing of dAD either way.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT

PTH = "deepspeed_dad_hook.pth"


def installed_pth() -> Path | None:
    """The hook's ``.pth`` in this interpreter's site-packages, if the install has one."""
    for d in site.getsitepackages():
        if (Path(d) / PTH).exists():
            return Path(d) / PTH
    return None


def source_copy(dest: Path) -> Path:
    """The checkout's files (tracked and new, as git lists them) copied to ``dest``, so that builds
    leave nothing in the checkout."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.parent / f"{dest.name}.tar"
    with tarfile.open(archive, "w") as tar:
        for f in files:
            if (ROOT / f).is_file():
                tar.add(ROOT / f, arcname=f)
    with tarfile.open(archive) as tar:
        tar.extractall(dest)
    archive.unlink()
    return dest


def can_build_here() -> bool:
    """Whether this environment's setuptools builds wheels without an index (>= 70.1 has
    ``bdist_wheel``; older ones need the ``wheel`` package)."""
    import importlib.util
    return importlib.util.find_spec("setuptools") is not None and (
        importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
        or importlib.util.find_spec("wheel") is not None)


def pip_install_wheel(src: Path, target: Path) -> Path:
    """``pip install --no-deps --target`` of ``src`` (a regular wheel build; with this environment's
    setuptools where it can, else pip's isolated build, which needs the package index)."""
    isolation = ["--no-build-isolation"] if can_build_here() else []
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def site_dir_launcher(site_dir: Path, dest: Path) -> Path:
    """A folder whose ``sitecustomize`` makes ``site_dir`` a site folder of every process that has
    the folder on ``PYTHONPATH``."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    return dest


@pytest.fixture(scope="session")
def hook_site(tmp_path_factory):
    """``PYTHONPATH`` entries that give launched processes the installed hook ('' where
    site-packages already has it). Use with ``monkeypatch.setenv("PYTHONPATH", ...)``."""
    if installed_pth() is not None:
        return ""
    if "launcher" not in _BUILT:  # once per session, although two test modules import the fixture
        work = tmp_path_factory.mktemp("hook_site")
        target = pip_install_wheel(source_copy(work / "src"), work / "site")
        _BUILT["launcher"] = str(site_dir_launcher(target, work / "launcher"))
    return _BUILT["launcher"]


_BUILT: dict = {}


@pytest.fixture
def with_hook(hook_site, monkeypatch):
    """Launched processes get the installed hook (see `hook_site`)."""
    if hook_site:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (hook_site, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("DAD_DEEPSPEED_HOOK", raising=False)
