"""scripts/test_floors.sh installs the floors pyproject.toml declares: every `>=` floor of the dependencies and of the
extras it installs (dev, fp8) is pinned in scripts/floor_constraints.txt to that version's series, so a floor that
moves in one file and not the other fails here rather than in a floor run nobody does."""

import re
import sys

from tests.launch import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# The extras test_floors.sh installs besides the dependencies; pytest's own stack (dev) is left at what pip picks.
CHECKED_EXTRAS = ("fp8",)


def _floors(requirements: list[str]) -> dict[str, str]:
    """name -> floor version for each `name>=X` requirement (markers ignored)."""
    found = (re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", r.replace(" ", "")) for r in requirements)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def test_every_declared_floor_is_pinned_for_the_floor_run():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = _floors(project["dependencies"])
    for extra in CHECKED_EXTRAS:
        declared |= _floors(project["optional-dependencies"][extra])
    pins = dict(
        line.split("==") for line in (REPO / "scripts" / "floor_constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )  # fmt: skip
    pinned = {name.lower(): version.removesuffix(".*") for name, version in pins.items()}
    assert declared == {name: pinned.get(name) for name in declared}, (declared, pinned)
    assert '-e ".[dev,fp8]"' in (REPO / "scripts" / "test_floors.sh").read_text()  # the extra is installed
