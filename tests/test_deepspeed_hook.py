"""The ``"dad"`` block of a DeepSpeed config is enough once the package is installed, or the job
raises naming it: the import hook (``deepspeed_dad_hook.pth``) wraps ``deepspeed.initialize``.

Packaging: a regular wheel and an editable install both carry the ``.pth`` and activate the hook,
which imports nothing while DeepSpeed is not imported. Real jobs (torchrun, 2 ranks, CPU
accelerator, gloo; `workers/ds_json_worker.py`): a plain script with no dAD import gets exact dAD
from the block (config dict, and the file named by ``--deepspeed_config``), gradients equal to
DeepSpeed's own; a config without a block runs exactly DeepSpeed's function; bad blocks and the
opt-out with an enabled block raise. The Trainer and ``accelerate launch`` paths are in
test_accelerate.py (``test_trainer_on_deepspeed_takes_dad_from_the_config_block[1-json-only]``,
``test_example_on_deepspeed_through_accelerate``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, WORKERS, result, run_torchrun
from dad_hook_site import PTH, can_build_here, pip_install_wheel, source_copy
from dad_hook_site import hook_site  # noqa: F401  (fixture)

pytest.importorskip("deepspeed")

TOL = 1e-5
SCALAR_BYTES = 16  # what DeepSpeed may still all-reduce itself in a step (a flag), not gradients

EXACT = {"mode": "exact"}
CASES = {
    "plain": {"kind": "plain"},  # first: nothing of dAD imported yet
    "block-config": {"kind": "block", "dad": EXACT},
    "block-args": {"kind": "block", "dad": {"enabled": True, "mode": "exact"}, "how": "args"},
    "err-unknown-key": {"kind": "error", "dad": {"mode": "exact", "rnak": 4}},
    "err-unknown-key-args": {"kind": "error", "dad": {"mdoe": "exact"}, "how": "args"},
    "err-opt-out": {"kind": "error", "dad": EXACT, "env": {"DAD_DEEPSPEED_HOOK": "0"}},
    "opt-out-disabled-block": {"kind": "error", "dad": {"enabled": False}, "env": {"DAD_DEEPSPEED_HOOK": "0"}},
}


@pytest.fixture(scope="module")
def ds_json(tmp_path_factory, hook_site):
    work = tmp_path_factory.mktemp("ds_json")
    (work / "cases.json").write_text(json.dumps(CASES))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        mp.delenv("DAD_DEEPSPEED_HOOK", raising=False)
        if hook_site:
            mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (hook_site, os.environ.get("PYTHONPATH")) if p))
        run_torchrun(WORKERS / "ds_json_worker.py", 2, [work / "out.json", work / "cases.json"], timeout=600)
    return json.loads((work / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["block-config", "block-args"])
def test_block_alone_attaches_dad_to_plain_deepspeed_initialize(ds_json, case_id):
    """No dAD import in the script: deepspeed.initialize with the block gives exact dAD, parameters
    equal to DeepSpeed's own all-reduce after 3 steps, and DeepSpeed all-reduces no gradient."""
    for rank, r in enumerate(result(ds_json, case_id)):
        assert r["attached"], f"rank {rank}: the block was ignored"
        assert r["moved"] > 1e-4
        assert r["rel"] <= TOL, f"rank {rank}: {r['rel']:.2e} from DeepSpeed's own run"
        assert r["identical"]
        assert r["totals"]["sent_bytes"] > 0
        for ref_step, step in zip(r["ref_bytes"], r["bytes"]):
            assert ref_step["all_reduce"] > 1000 and step.get("all_reduce", 0) <= SCALAR_BYTES, step


@pytest.mark.slow
def test_config_without_block_is_deepspeeds_own(ds_json):
    """Without a block the wrapped deepspeed.initialize is DeepSpeed's: bit-identical parameters,
    the same bytes at every collective, and nothing of dAD's adapter imported."""
    for r in result(ds_json, "plain"):
        assert r["hooked"], "deepspeed.initialize is not wrapped: the hook is not active"
        assert r["bitwise"]
        assert r["bytes"] == r["ref_bytes"]
        assert r["loaded_before"] == [] and not r["dad_adapter_imported"]


@pytest.mark.slow
@pytest.mark.parametrize("case_id,names", [("err-unknown-key", ["'dad' block", "rnak"]),
                                           ("err-unknown-key-args", ["'dad' block", "mdoe"]),
                                           ("err-opt-out", ["'dad' block", "DAD_DEEPSPEED_HOOK=0"])])
def test_block_that_cannot_take_effect_raises(ds_json, case_id, names):
    for r in result(ds_json, case_id):
        assert r["error"] is not None, f"{case_id} was accepted"
        assert r["error"].startswith("ValueError") and all(n in r["error"] for n in names), r["error"]


@pytest.mark.slow
def test_opt_out_with_disabled_block_keeps_deepspeed(ds_json):
    for r in result(ds_json, "opt-out-disabled-block"):
        assert r["error"] is None and not r["attached"]
        assert r["bytes"][0]["all_reduce"] > 1000


# -- packaging ---------------------------------------------------------------------------------
_PROBE = ("import sys; import deepspeed_dad_hook as h; "
          "print(h.__file__); "
          "print(any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path)); "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'deepspeed_dad', "
          "'dad_integrations', 'accelerate')))")


def _probe(site_dir, cwd) -> list:
    """In a fresh interpreter whose only dAD install is ``site_dir`` (read as a site folder): where
    the hook module comes from, whether its finder is installed, which heavy modules got imported
    (``-S``: not even this environment's site-packages, which may hold another install)."""
    code = f"import site; site.addsitedir({str(site_dir)!r}); " + _PROBE
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_wheel_and_editable_install_ship_the_hook(tmp_path):
    """`pip install` (a wheel) and `pip install -e` (setuptools' editable wheel) both put
    deepspeed_dad_hook.pth at the top of site-packages; it installs the finder and imports nothing else."""
    if not can_build_here():
        pytest.skip("this environment's setuptools cannot build wheels without an index")
    src = source_copy(tmp_path / "src")
    wheel_site = pip_install_wheel(src, tmp_path / "wheel_site")
    assert "deepspeed_dad_hook.install()" in (wheel_site / PTH).read_text()
    out = _probe(wheel_site, tmp_path)
    assert out[0] == str(wheel_site / "deepspeed_dad_hook.py") and out[1] == "True" and out[2] == "[]", out
    # a .pth whose module is gone (an editable install's deleted checkout) keeps start-up quiet
    stale = tmp_path / "stale_site"
    stale.mkdir()
    (stale / PTH).write_text((wheel_site / PTH).read_text())
    proc = subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(stale)!r})"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

    dist = tmp_path / "dist"
    dist.mkdir()
    build = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                            f"print(build_meta.build_editable({str(dist)!r}))"],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = dist / build.stdout.split()[-1]
    editable_site = tmp_path / "editable_site"
    with zipfile.ZipFile(wheel) as zf:  # what pip does with a pure-Python wheel's root
        assert PTH in zf.namelist(), zf.namelist()
        zf.extractall(editable_site)
    out = _probe(editable_site, tmp_path)
    assert out[0] == str(src / "deepspeed_dad_hook.py") and out[1] == "True" and out[2] == "[]", out


def test_hook_wraps_deepspeed_on_import_only(tmp_path):
    """The hook's finder waits for `import deepspeed`; then initialize is wrapped, DeepSpeed's own
    kept on it, and still nothing of dAD is imported (that waits for a config with a block)."""
    code = ("import deepspeed_dad_hook as h; h.install(); import sys; "
            "assert 'deepspeed' not in sys.modules; import deepspeed; "
            "assert hasattr(deepspeed.initialize, '_dad_original'); "
            "assert deepspeed.initialize.__name__ == 'initialize'; "
            "assert not any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path) or "
            "'accelerate.utils.dataclasses' in h._pending; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed_dad', 'dad_integrations')))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_block_found_wherever_deepspeed_reads_its_config(tmp_path):
    """The wrapper looks for the block where deepspeed.initialize reads its config: ``config``,
    ``config_params``, ``args.deepspeed_config`` / ``deepscale_config`` (a JSON or hjson file),
    and DeepSpeed's base64-encoded JSON; split_config reads the same sources."""
    import argparse
    import base64

    import deepspeed

    import deepspeed_dad_hook as hook
    from deepspeed_dad import split_config

    own = getattr(deepspeed.initialize, "_dad_original", deepspeed.initialize)
    cfg = {"train_batch_size": 2, "dad": {"mode": "exact"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    hjson_path = tmp_path / "ds_hjson.json"  # DeepSpeed parses its config files with hjson
    hjson_path.write_text("{\n  # a comment\n  train_batch_size: 2\n  dad: {\n    mode: exact\n  }\n}\n")
    b64 = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    calls = [((), {"config": cfg}), ((), {"config_params": cfg}), ((), {"config": str(path)}), ((), {"config": b64}),
             ((argparse.Namespace(deepspeed_config=str(path)),), {}),
             ((argparse.Namespace(deepscale_config=str(hjson_path)),), {})]
    for args, kwargs in calls:
        kwargs = {"model": None, **kwargs}
        assert hook.has_dad_block(own, args, kwargs), (args, kwargs)
        assert split_config(hook.config_source(own, args, kwargs))[1].config.mode == "exact"
    assert not hook.has_dad_block(own, (), {"model": None, "config": {"train_batch_size": 2}})
    assert not hook.has_dad_block(own, (), {"model": None, "config": "neither a file nor base64"})
    assert not hook.has_dad_block(own, (), {"model": None, "no_such_argument": 1})  # DeepSpeed will say so
