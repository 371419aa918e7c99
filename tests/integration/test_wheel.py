"""The built wheel, installed (not editable) into a fresh virtual environment: its only
top-level import name is ``geoloco``, the command runs from a folder outside the checkout,
and a ``compression`` package ahead of site-packages (as Python 3.14's standard library
has, PEP 784) changes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import geoloco

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STAND_IN = "raise ImportError('the stand-in for the standard library compression package was imported')\n"


def _tracked_sources(dest: Path) -> Path:
    """A copy of the checkout's files (tracked, or new and not ignored), so the build
    leaves nothing in the checkout."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in names.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _tracked_sources(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(src)], check=True, timeout=300)
    (built,) = out.glob("geoloco-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding only the wheel; its dependencies are read from this test run's
    environment through a path entry appended after the venv's own site-packages."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300)
    return env_dir


def test_the_only_top_level_name_is_geoloco(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names}
        dist_info = next(t for t in top if t.endswith(".dist-info"))
        assert top == {"geoloco", dist_info}
        assert z.read(f"{dist_info}/top_level.txt").decode().split() == ["geoloco"]
    for package in ("compression", "coordinator", "worker", "protos", "links"):
        assert f"geoloco/{package}/__init__.py" in names
    assert "geoloco/py.typed" in names
    assert "geoloco/protos/geoloco.proto" in names
    # the pinned corpus and its licence (geoloco.tasks.corpus)
    assert {"geoloco/tasks/stdlib311.jsonl.xz", "geoloco/tasks/stdlib311.LICENSE.txt"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def _run(env_dir: Path, args: list[str], cwd: Path, stand_in: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if stand_in is not None:
        env["PYTHONPATH"] = str(stand_in)
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_version_runs_outside_the_checkout(fresh_env: Path, tmp_path: Path) -> None:
    out = _run(fresh_env, [str(fresh_env / "bin" / "geoloco"), "--version"], cwd=tmp_path)
    assert out.strip() == f"geoloco {geoloco.__version__}"


def test_the_installed_wheel_reads_the_pinned_corpus(fresh_env: Path, tmp_path: Path) -> None:
    from geoloco.tasks.corpus import corpus_fingerprint, pinned_bytes

    code = "from geoloco.tasks.corpus import *; print(len(pinned_bytes()), corpus_fingerprint())"
    out = _run(fresh_env, [str(fresh_env / "bin" / "python"), "-c", code], cwd=tmp_path)
    assert out.split() == [str(len(pinned_bytes())), corpus_fingerprint()]


def test_a_compression_package_ahead_of_site_packages_changes_nothing(fresh_env: Path, tmp_path: Path) -> None:
    stand_in = tmp_path / "stdlib-like"
    (stand_in / "compression").mkdir(parents=True)
    (stand_in / "compression" / "__init__.py").write_text(STAND_IN)
    check = ("import importlib, pkgutil, sys, geoloco\n"
             "assert geoloco.__file__.startswith(sys.prefix), geoloco.__file__\n"
             "names = [m.name for m in pkgutil.walk_packages(geoloco.__path__, 'geoloco.')]\n"
             "for name in names:\n"
             "    importlib.import_module(name)\n"
             "assert 'compression' not in sys.modules, 'a top-level compression was imported'\n"
             "from geoloco.compression import Compressor, decode_frame\n"
             "print(len(names))\n")
    out = _run(fresh_env, [str(fresh_env / "bin" / "python"), "-c", check], cwd=tmp_path, stand_in=stand_in)
    assert int(out) > 20  # every module of the wheel imported
    version = _run(fresh_env, [str(fresh_env / "bin" / "geoloco"), "--version"], cwd=tmp_path, stand_in=stand_in)
    assert version.strip() == f"geoloco {geoloco.__version__}"
