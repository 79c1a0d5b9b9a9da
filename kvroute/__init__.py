"""kvroute: a cache-aware router for vLLM fleets.

One distribution, one import namespace. The source folders keep the names the project was
designed with (``router/``, ``indexer/``, ``connector/``, ``deploy/``, ``bench/`` at the top
of the repository); the build maps each to a subpackage of ``kvroute`` (pyproject.toml,
``[tool.setuptools.package-dir]``), so what is installed is ``kvroute.router``,
``kvroute.indexer``, ``kvroute.connector``, ``kvroute.deploy`` and ``kvroute.bench`` and
never a generic top-level name that another distribution, or the working directory, could
shadow. vLLM loads the connector as ``kvroute.connector.kvroute_connector``.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["__version__"]

try:
    __version__ = metadata.version("kvroute")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
