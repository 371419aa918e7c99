"""The committed gRPC stubs must be exactly what protoc generates from protos/geoloco.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("geoloco_pb2.py", "geoloco_pb2_grpc.py", "geoloco_pb2.pyi")


def test_stubs_match_proto(tmp_path: Path) -> None:
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "geoloco.proto", tmp_path / "protos" / "geoloco.proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
         "--grpc_python_out=.", "--pyi_out=.", "protos/geoloco.proto"],
        cwd=tmp_path, check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `make protos` and commit"


def test_package_is_versioned() -> None:
    from protos import geoloco_pb2

    assert geoloco_pb2.DESCRIPTOR.package == "geoloco.v1"
    assert "Coordinator" in geoloco_pb2.DESCRIPTOR.services_by_name
