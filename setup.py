"""The optional native index core (``kvroute.indexer._native``, docs/indexer.md "Native core").

Everything else is in pyproject.toml. The extension is optional on purpose: where no C++
compiler (or no pybind11) is available, ``pip install`` still succeeds and kvroute runs the
Python index, warning at startup. ``make install`` builds it, and its tests fail without it.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_NAME = "kvroute.indexer._native"
_SOURCES = [
    "indexer/native/core.cpp",
    "indexer/native/walk.cpp",
    "indexer/native/holdings.cpp",
    "indexer/native/tables.cpp",
    "indexer/native/table_types.cpp",
]


def _warn(reason: object) -> None:
    print(
        f"WARNING: kvroute's native index core was not built ({reason}); kvroute will run "
        "the Python index (slower ingest and lookups at fleet scale).",
        file=sys.stderr,
    )


class OptionalBuildExt(build_ext):
    """build_ext that warns and goes on when the extension cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises its own types)
            _warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            _warn(exc)


def _extensions() -> list[Extension]:
    try:
        import pybind11
    except ImportError:
        _warn("pybind11 is not installed")
        return []
    return [
        Extension(
            _NAME,
            _SOURCES,
            include_dirs=[pybind11.get_include(), "indexer/native"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden"],
        )
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
