"""The one place that imports Horovod, so that a missing build fails with directions.

Horovod 0.28.1 has no wheel for the torch this project uses: it is compiled by
``scripts/build_horovod.sh``. ``dad_integrations`` itself never imports Horovod.
"""
from __future__ import annotations

BUILD_HINT = ("Horovod is not importable: build and install it with `bash scripts/build_horovod.sh` "
              "(Horovod 0.28.1 from source with the C++17 fix; VENV=... selects the virtual environment)")

try:
    import horovod.torch as hvd  # noqa: F401
    from horovod.torch.compression import Compression  # noqa: F401
    from horovod.common.exceptions import HorovodInternalError  # noqa: F401
except ImportError as e:  # re-raised with the way out
    raise ImportError(f"{BUILD_HINT}; the import failed with: {e}") from e
