"""The connector's pre-namespace module path, ``connector.kvroute_connector``, kept for one
release.

vLLM imports ``kv_connector_module_path`` by name inside its own processes. Fleets started
before kvroute 0.2 name ``connector.kvroute_connector``; that still loads, with a
FutureWarning (shown by default, unlike a DeprecationWarning, so it reaches the vLLM log),
and yields the very module objects of ``kvroute.connector`` (not a second copy whose classes
would differ from the real ones). Removed in kvroute 0.3.
"""

from __future__ import annotations

import sys
import warnings

OLD = "connector"
NEW = "kvroute.connector"
MESSAGE = (
    "the module path 'connector.kvroute_connector' is deprecated and will be removed in "
    "kvroute 0.3: set kv_connector_module_path to 'kvroute.connector.kvroute_connector'"
)


def redirect() -> None:
    """Make ``connector`` and ``connector.kvroute_connector`` the ``kvroute.connector``
    modules. Called while ``connector`` itself is being imported: the import system then
    returns what ``sys.modules`` holds under the old names."""
    warnings.warn(MESSAGE, FutureWarning, stacklevel=3)
    import kvroute.connector
    import kvroute.connector.kvroute_connector as adapter

    sys.modules[OLD] = kvroute.connector
    sys.modules[f"{OLD}.kvroute_connector"] = adapter
