"""GeoLoCo: SparseLoCo training across regions over slow links (README.md).

Importing the package sets nothing process-wide; the ``geoloco`` command sets its
process defaults itself (``geoloco.cli``). The Python API is imported on first use:

- ``run_local(config) -> RunResult``: a coordinator and its workers as local processes;
- ``Coordinator(cfg)`` and ``Worker(address, token, inner_step=...)``: started and
  stopped from a script, in this process;
- ``RunConfig``, ``load_config``, ``ConfigError``: the run configuration.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("geoloco")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["ConfigError", "Coordinator", "RunConfig", "RunResult", "Worker", "__version__",
           "load_config", "run_local"]


def __getattr__(name: str) -> Any:
    """The API's names, each imported when first asked for (docs/architecture.md: the
    package root may re-export the entry points and the two sides' apps, lazily)."""
    if name in ("run_local", "RunResult"):
        from geoloco import launch

        return getattr(launch, name)
    if name == "Coordinator":
        from geoloco.coordinator.app import Coordinator

        return Coordinator
    if name == "Worker":
        from geoloco.worker.app import WorkerThread

        return WorkerThread
    if name in ("RunConfig", "load_config", "ConfigError"):
        from geoloco import config

        return getattr(config, name)
    raise AttributeError(f"module 'geoloco' has no attribute {name!r}")
