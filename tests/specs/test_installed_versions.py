"""dist_info_version: the version importlib.metadata finds, read without importing it, or
None (importlib decides) when that is not certain."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from trainmem.specs.frameworks import dist_info_version, installed_version


def _dist(folder: Path, dirname: str, version: str | None) -> None:
    info = folder / dirname
    info.mkdir(parents=True)
    if version is not None:
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: x\nVersion: {version}\n\nbody"
        )


@pytest.mark.parametrize("name", ["typer", "rich", "PyYAML", "pyyaml", "typing-extensions"])
def test_installed_distributions_read_as_importlib_reads_them(name: str) -> None:
    assert dist_info_version(name) == importlib.metadata.version(name)


def test_first_path_entry_wins_and_names_are_normalised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist(tmp_path / "a", "Foo_Bar-1.2.3.dist-info", "1.2.3")
    _dist(tmp_path / "b", "foo.bar-9.0.dist-info", "9.0")
    _dist(tmp_path / "b", "other-0.1.dist-info", "0.1")
    monkeypatch.setattr(
        sys, "path", [str(tmp_path / "missing"), str(tmp_path / "a"), str(tmp_path / "b")]
    )
    assert dist_info_version("foo-bar") == "1.2.3" == importlib.metadata.version("foo-bar")
    assert dist_info_version("other") == "0.1" == importlib.metadata.version("other")
    assert installed_version("foo.bar") == (1, 2, 3)
    assert dist_info_version("absent") is None
    assert installed_version("absent") is None


def test_uncertain_cases_are_left_to_importlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist(tmp_path / "a", "foo-1.0.egg-info", None)  # an egg-info first: importlib's rules
    _dist(tmp_path / "b", "foo-2.0.dist-info", "2.0")
    _dist(tmp_path / "b", "bar-3.0.dist-info", None)  # no METADATA
    (tmp_path / "c.zip").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "a"), str(tmp_path / "b")])
    assert dist_info_version("foo") is None
    assert dist_info_version("bar") is None
    monkeypatch.setattr(sys, "path", [str(tmp_path / "c.zip"), str(tmp_path / "b")])
    assert dist_info_version("foo") is None
