"""Installed as the top-level ``connector`` package for one release only: the old module
path of the vLLM connector (see kvroute.old_connector_path)."""

from kvroute.old_connector_path import redirect

redirect()
