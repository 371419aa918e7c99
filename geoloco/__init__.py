"""GeoLoCo: SparseLoCo training across regions over slow links (README.md).

Importing the package sets nothing process-wide; the ``geoloco`` command sets its
process defaults itself (``geoloco.cli``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("geoloco")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
