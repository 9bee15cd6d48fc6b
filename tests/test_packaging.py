"""pyproject.toml and requirements.txt agree: every declared dependency (runtime and the test
extra) is pinned in requirements.txt to a version inside the declared range, so `make` (the
pins) and `pip install .` (the ranges) install the same kind of environment."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"requirements.txt must pin exactly: {line}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in
            project["dependencies"] + project["optional-dependencies"]["test"]]


@pytest.mark.parametrize("req", _declared(), ids=str)
def test_declared_dependency_is_pinned_within_its_range(req: Requirement) -> None:
    name = canonicalize_name(req.name)
    if name == "torch":
        # Installed first, separately (the CPU build): the Makefile's pin must be in range.
        pin = re.search(r"torch==([\w.]+)", (REPO / "Makefile").read_text())
        assert pin and req.specifier.contains(pin.group(1)), (pin, req.specifier)
        return
    if req.marker is not None and not req.marker.evaluate({"extra": "test"}):
        pytest.skip(f"not for this platform: {req.marker}")
    pins = _pins()
    assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in requirements.txt"
    assert req.specifier.contains(pins[name], prereleases=True), \
        f"requirements.txt pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}"


def test_build_backend_supports_spdx_license() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert isinstance(data["project"]["license"], str)  # an SPDX expression, not a table
    (setuptools,) = [Requirement(r) for r in data["build-system"]["requires"]
                     if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.9")  # PEP 639 license strings: setuptools>=77
