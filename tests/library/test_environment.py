"""environment.yml and pyproject.toml name the same packages, and every one carries a comment."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ]", spec.strip(), maxsplit=1)[0].lower()


def _pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = data["dependencies"] + data["optional-dependencies"]["test"]
    return {_name(s): s.replace(" ", "") for s in specs}


def _environment() -> tuple[dict[str, str], list[str]]:
    pkgs, uncommented = {}, []
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if re.match(r"\s*- pip:\s*$", line):
            in_pip = True
            continue
        m = re.match(r"\s*- ([^#\s]+)\s*(#.*)?$", line)
        if in_pip and m and m.group(1) not in ("-e",) and not line.strip().startswith("- -e"):
            pkgs[_name(m.group(1))] = m.group(1)
            if not m.group(2):
                uncommented.append(m.group(1))
    return pkgs, uncommented


def test_same_packages_and_versions():
    env, _ = _environment()
    assert env == _pyproject()


def test_every_dependency_says_what_uses_it():
    _, uncommented = _environment()
    assert uncommented == []


def test_python_and_package_install():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"- python=3\.11", text)
    assert "- -e ." in text


def test_deprecated_pynvml_is_not_a_dependency():
    assert "pynvml" not in _pyproject()
    assert "nvidia-ml-py" in _pyproject()


def test_requires_python_is_the_version_the_environment_installs():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = re.match(r">=\s*(\d+\.\d+)", spec).group(1)
    assert re.search(rf"- python={re.escape(floor)}\b", (ROOT / "environment.yml").read_text())
