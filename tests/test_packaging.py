"""pyproject.toml as a user installs the package: its name, its extras, its commands.

The distribution is "mate-messages" ("mate" and "mate-bench" belong to other
projects on PyPI); the import package stays `mate`. Building the sdist and the
wheel, and running an example from the installed wheel, is .ci/run's part.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest
from conftest import LAUNCHED

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="one process checks the files")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TAKEN_ON_PYPI = {"mate", "mate-bench"}  # other projects' distributions


def normalized(name: str) -> str:
    """A distribution name as PyPI compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_distribution_name_is_not_another_projects() -> None:
    assert normalized(PROJECT["name"]) not in TAKEN_ON_PYPI


def test_extra_all_installs_every_other_extra_of_this_distribution() -> None:
    extras = PROJECT["optional-dependencies"]
    (requirement,) = extras["all"]
    name, listed = re.fullmatch(r"([A-Za-z0-9._-]+)\[([^\]]*)\]", requirement).groups()
    assert normalized(name) == normalized(PROJECT["name"]), "`all` must name this distribution"
    assert {e.strip() for e in listed.split(",")} == set(extras) - {"all"}


@pytest.mark.parametrize("command", ["mate-run", "mate-bench"])
def test_console_scripts_name_callables_of_the_mate_package(command: str) -> None:
    module, _, attr = PROJECT["scripts"][command].partition(":")
    assert module.split(".")[0] == "mate"
    assert callable(getattr(importlib.import_module(module), attr))


def test_the_installed_distribution_provides_the_mate_package() -> None:
    providers = importlib.metadata.packages_distributions().get("mate", [])
    if providers and all(normalized(p) in TAKEN_ON_PYPI for p in providers):
        pytest.skip(f"this environment still has the old distribution {providers}: "
                    "pip uninstall mate, then pip install -e '.[all]'")
    assert normalized(PROJECT["name"]) in {normalized(p) for p in providers}
    dist = importlib.metadata.distribution(PROJECT["name"])
    assert {ep.name for ep in dist.entry_points if ep.group == "console_scripts"} >= {
        "mate-run", "mate-bench"}
