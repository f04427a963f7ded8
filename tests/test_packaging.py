"""Package metadata: setup.cfg asks for ranges (so `pip install .` keeps an environment's own torch
and transformers), constraints.txt pins one tested version of each, inside those ranges."""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPOSITORY = Path(__file__).resolve().parents[1]

# The ends of the ranges that were tested (README, "Two commands"): the lower ends are what
# `make install` pins, the upper ends a throwaway venv with that torch installed first.
TESTED_ENDS = {"torch": ("2.13.0", "2.14.1"), "transformers": ("5.24.0", "5.25.0")}


def requirements() -> list[Requirement]:
    setup = configparser.ConfigParser()
    setup.read(REPOSITORY / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines() + setup["options.extras_require"]["test"].splitlines()
    return [Requirement(line) for line in (line.strip() for line in lines) if line and not line.startswith("#")]


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPOSITORY / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_requirements_are_ranges_that_admit_the_tested_ends():
    by_name = {canonicalize_name(r.name): r for r in requirements()}
    for name, ends in TESTED_ENDS.items():
        specifier = by_name[name].specifier
        assert not any(spec.operator == "==" for spec in specifier), f"{name} is pinned in setup.cfg: {specifier}"
        for version in ends:
            assert specifier.contains(version), f"{name} {version} is outside setup.cfg's {specifier}"


def test_constraints_pin_every_requirement_inside_its_range():
    pins = constraints()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pins[name]}, outside setup.cfg's {requirement.specifier}")
    assert pins["torch"] == Version("2.13.0")  # the CPU wheel on the project's machines
