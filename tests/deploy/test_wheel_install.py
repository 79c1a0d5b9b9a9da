"""The built wheel, installed the way users install it, away from this checkout.

``pip install kvroute`` (no extras: no torch, no vLLM) must be enough for the router and the
simulator, write its state outside the installed package, and ship the package data (the
dashboard page, the Grafana board). The connector must load from the installed copy inside
an environment that has vLLM, under its module path and, for one release, the old one.

Slow (builds the wheel, creates a virtualenv and installs the base dependencies from the
package index): about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import urllib.request
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.helpers import leftovers, wait_until_up
from tests.paths import REPO_ROOT

PIP = ["-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the files a clone of this checkout has (tracked ones, and new
    ones git does not ignore), in a copy: the build writes nothing into the checkout."""
    src = _checkout_copy(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, *PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, "."],
        cwd=src,
        capture_output=True,
        check=True,
        timeout=300,
    )
    (built,) = dist.glob("kvroute-*.whl")
    return built


def _checkout_copy(src: Path) -> Path:
    """Into ``src``: the files a clone of this checkout has."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        path = REPO_ROOT / name
        if path.is_file():  # a tracked file deleted in the working tree is still listed
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    return src


def test_the_sdist_carries_the_native_core_sources(tmp_path: Path) -> None:
    """``pip install kvroute`` from the sdist builds the native core where a compiler exists:
    its sources and setup.py must be in it."""
    src = _checkout_copy(tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--no-isolation",
            "--skip-dependency-check",
            "-o",
            tmp_path / "dist",
        ],
        cwd=src,
        capture_output=True,
        check=True,
        timeout=300,
    )
    (sdist,) = (tmp_path / "dist").glob("kvroute-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {
        *("core.cpp", "walk.cpp", "holdings.cpp", "tables.cpp", "table_types.cpp"),
        *("native.h", "tables.h", "table_layout.h", "xxhash.h"),
    }
    assert {"setup.py", *(f"indexer/native/{name}" for name in sources)} <= names


@pytest.fixture(scope="module")
def base_install(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel and its base dependencies: its ``bin`` folder."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    subprocess.run(
        [bin_dir / "python", *PIP, "install", wheel], check=True, capture_output=True, timeout=400
    )
    return bin_dir


def user_env(bin_dir: Path, home: Path) -> dict[str, str]:
    """A user's shell with the virtualenv active and nothing pointing into this checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"KVROUTE_STATE_DIR", "XDG_CACHE_HOME", "PYTHONPATH", "VIRTUAL_ENV"}
    }
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return env


def package_files(bin_dir: Path) -> set[str]:
    """The installed package's files, less the bytecode Python caches next to them."""
    site = subprocess.run(
        [bin_dir / "python", "-c", "import kvroute, os; print(os.path.dirname(kvroute.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=bin_dir,
    ).stdout.strip()
    root = Path(site)
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def kvroute_up_sim(base_install: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``kvroute up --engine sim`` run from an unrelated folder, with the default state dir:
    the process and the state dir it must have chosen (the user's cache)."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    proc = subprocess.Popen(
        ["kvroute", "up", "--engine", "sim", "--replicas", "2", "--port", "0"],
        cwd=cwd,
        env=user_env(base_install, home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc, home / ".cache" / "kvroute" / "fleet"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_wheel_holds_one_namespace_and_its_data_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    # connector/ is the old module path of the vLLM connector (kvroute.old_connector_path).
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert top == {"kvroute", "connector", dist_info}
    # the native index core, built where a compiler exists (setup.py; docs/indexer.md)
    assert [n for n in names if n.startswith("kvroute/indexer/_native.") and n.endswith(".so")]
    assert "kvroute/router/ops/static/dashboard.html" in names
    assert "kvroute/deploy/grafana/kvroute-dashboard.json" in names
    assert "kvroute/bench/workloads/traces/kvroute_small.jsonl" in names  # `--trace` default
    assert "kvroute/connector/kvroute_connector.py" in names
    assert "connector/__init__.py" in names
    assert not [name for name in names if name.startswith("connector/") and "__init__" not in name]


def test_a_base_install_runs_the_router_on_the_simulator(
    base_install: Path, kvroute_up_sim: tuple[subprocess.Popen, Path]
) -> None:
    no_heavy = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('vllm'))"
    found = subprocess.run(
        [base_install / "python", "-c", no_heavy], capture_output=True, text=True, check=True
    )
    assert found.stdout.split() == ["None", "None"]  # the base dependencies, no extras
    core = "from kvroute.indexer import native_core; print(native_core.CORE)"
    ran = subprocess.run(  # not from the checkout, whose kvroute/ folder would shadow it
        [base_install / "python", "-c", core], capture_output=True, text=True, cwd=base_install
    )
    assert ran.stdout.strip() == "native", ran.stderr  # the wheel's extension loads there
    helped = subprocess.run(
        [base_install / "kvroute", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout and "up" in helped.stdout
    installed_before = package_files(base_install)

    proc, state = kvroute_up_sim
    wait_until_up(proc)
    manifest = json.loads((state / "fleet.json").read_text())
    router = manifest["routers"]["router"]["url"]
    for turn in range(3):
        answer = post_json(
            router + "/v1/chat/completions",
            {
                "model": manifest["served_model_name"],
                "messages": [{"role": "user", "content": f"hello from a wheel, turn {turn}"}],
                "max_tokens": 4,
            },
        )
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 4
    with urllib.request.urlopen(router + "/dashboard", timeout=30) as page:  # package data
        assert b"<html" in page.read().lower()

    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    assert "stopped" in output
    assert leftovers(state, manifest["process_groups"]) == []
    assert (state / "logs" / "router.log").is_file()
    assert package_files(base_install) == installed_before  # nothing written into the package


@pytest.mark.vllm
def test_the_connector_loads_from_the_installed_wheel_in_vllm_env(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, *PIP, "install", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )
    probe = """
import json, warnings
import kvroute.connector.kvroute_connector as new
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import connector.kvroute_connector as old
print(json.dumps({
    "file": new.__file__,
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    "same_class": old.KVRouteConnector is new.KVRouteConnector,
}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve().is_relative_to(target.resolve())
    assert [category for category, _ in report["warnings"]] == ["FutureWarning"]
    assert "kvroute.connector.kvroute_connector" in report["warnings"][0][1]
    assert report["same_class"] is True


def test_without_a_compiler_the_wheel_builds_without_the_native_core(tmp_path: Path) -> None:
    """setup.py's build_ext warns and goes on when it cannot compile: the package installs,
    and runs the Python index (tests/indexer/test_native_fallback.py)."""
    src = _checkout_copy(tmp_path / "src")
    no_compiler = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"}
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"),
            *("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", "."),
        ],
        cwd=src,
        capture_output=True,
        text=True,
        env=no_compiler,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert "kvroute's native index core was not built" in built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("kvroute-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvroute/indexer/native_core.py" in names
    assert not [n for n in names if n.startswith("kvroute/indexer/_native.")]
