"""The test folders hold no packages (no ``__init__.py``), so pytest imports each test
module by its basename: two modules of the same name in tests/unit and tests/integration
stop the whole run at collection. ``make check`` collects tests/unit only and would not
see such a clash; this test does."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_") or path.name.endswith("_test.py"):
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: sorted(paths) for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules with the same basename (pytest cannot collect both): {clashes}"
