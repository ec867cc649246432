"""Ships ``deepspeed_dad_hook.pth`` beside the packages; everything else is in pyproject.toml.

A ``.pth`` file must sit at the top of site-packages, which no pyproject.toml key expresses, so
``build_py`` writes it: into the build folder for a wheel (whose root installs into
site-packages), and straight into the editable wheel for ``pip install -e .``, where setuptools
keeps only what the install step writes (its ``install_lib`` is that wheel's root).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "deepspeed_dad_hook.pth"
# one line that site.py runs at start-up; deepspeed_dad_hook imports only sys and os. Quiet when
# the module is gone (an editable install whose checkout was deleted): site.py would otherwise
# print a traceback at every interpreter start
PTH_LINE = ('import sys; exec("try:\\n import deepspeed_dad_hook\\nexcept ImportError:\\n pass\\n'
            'else:\\n deepspeed_dad_hook.install()")\n')


class BuildPyWithPth(build_py):
    """``build_py`` that also writes `PTH_NAME`."""

    def run(self):
        super().run()
        target = self._pth_path()
        self.mkpath(os.path.dirname(target))
        if not self.dry_run:
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(PTH_LINE)

    def _pth_path(self):
        if getattr(self, "editable_mode", False):
            return os.path.join(self.get_finalized_command("install").install_lib, PTH_NAME)
        return os.path.join(self.build_lib, PTH_NAME)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), self._pth_path()]


setup(cmdclass={"build_py": BuildPyWithPth})
