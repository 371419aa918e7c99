"""The committed gRPC stubs must be exactly what protoc generates from protos/geoloco.proto,
laid out so that they import as ``geoloco.protos``."""

from __future__ import annotations

from geoloco.protos import regenerate


def test_stubs_match_proto() -> None:
    for name, fresh in regenerate.generate().items():
        committed = (regenerate.HERE / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `make protos` and commit"


def test_stubs_import_under_the_namespace() -> None:
    text = (regenerate.HERE / "geoloco_pb2_grpc.py").read_text()
    assert "from geoloco.protos import geoloco_pb2" in text


def test_package_is_versioned() -> None:
    from geoloco.protos import geoloco_pb2

    assert geoloco_pb2.DESCRIPTOR.package == "geoloco.v1"
    assert "Coordinator" in geoloco_pb2.DESCRIPTOR.services_by_name
