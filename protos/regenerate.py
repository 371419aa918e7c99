"""Regenerates the gRPC stubs beside ``geoloco.proto`` so that they import as
``geoloco.protos``: protoc runs on a copy laid out as ``geoloco/protos/geoloco.proto``.

``python -m geoloco.protos.regenerate`` rewrites the committed stubs (``make protos``);
the test suite calls ``generate`` and compares. Needs grpcio-tools (a test dependency).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "geoloco.proto"
GENERATED = ("geoloco_pb2.py", "geoloco_pb2_grpc.py", "geoloco_pb2.pyi")
PACKAGE_PATH = Path("geoloco") / "protos"  # where the stubs live in the import namespace


def generate(proto: Path = HERE / PROTO) -> dict[str, str]:
    """The stubs protoc makes from ``proto``: file name -> text."""
    with tempfile.TemporaryDirectory(prefix="geoloco-protos-") as tmp:
        target = Path(tmp) / PACKAGE_PATH
        target.mkdir(parents=True)
        shutil.copy(proto, target / PROTO)
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
             "--grpc_python_out=.", "--pyi_out=.", str(PACKAGE_PATH / PROTO)],
            cwd=tmp, check=True,
        )
        return {name: (target / name).read_text() for name in GENERATED}


def main() -> int:
    for name, text in generate().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
