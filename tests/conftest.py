"""How the suite spreads over pytest-xdist workers (`make test` runs `-n 3`; a plain
`pytest` runs in one process):

- an integration module is one unit of work, so its module fixtures (one training run
  that several tests judge) run once, in one worker, as without xdist; a unit test goes
  to whichever worker is free;
- the modules with such a fixture start first (a unit cannot be split, so a long one
  must not be left for the end); the container tests are one unit and run last: a cluster
  of five containers beside another cluster would measure the contention, and the images
  they need build in the background while the rest of the suite runs
  (tests/docker/conftest.py).

xdist's own `--dist loadgroup` cannot do this under pytest 9: it renames the tests through
an attribute pytest 9 no longer reads, so every test lands alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
DOCKER = TESTS / "docker"
INTEGRATION = TESTS / "integration"


def is_docker(item: pytest.Item) -> bool:
    return DOCKER in Path(item.fspath).parents


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture set up once for more than one test."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "package", "class")
                                    for defs in info.name2fixturedefs.values() for d in defs)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    grouped = {item.nodeid for item in items if shares_a_fixture(item)}
    items.sort(key=lambda item: (is_docker(item), item.nodeid not in grouped))  # stable within each part


def work_unit(nodeid: str) -> str:
    """The unit a test is sent in: the container tests together, an integration module,
    or the test alone."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(f"{DOCKER.relative_to(TESTS.parent).as_posix()}/"):
        return "docker"
    if path.startswith(f"{INTEGRATION.relative_to(TESTS.parent).as_posix()}/"):
        return path
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)
