"""The wire: ``geoloco.proto`` (package geoloco.v1) and its generated gRPC stubs
(``regenerate`` makes them; a test checks they are current)."""
