"""The web server's generated files live in a folder of its own that no planted link can
redirect (issue: the cleanup followed ``<tmp>/trainmem-web`` and deleted its target's files)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from trainmem.web import handlers


def _old(path: Path) -> None:
    hour_ago = time.time() - 2 * 3600
    os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(handlers, "_OUT_DIR", None)
    return shared


def test_a_planted_folder_link_is_never_followed(private_tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "thesis.tex"
    precious.write_text("years of work")
    _old(precious)
    (private_tmp / "trainmem-web").symlink_to(victim, target_is_directory=True)

    made = handlers._new_file("estimate", ".json")

    assert precious.exists()
    assert made.parent != private_tmp / "trainmem-web"
    assert made.parent.parent == private_tmp
    assert not made.parent.is_symlink()
    assert (made.parent.stat().st_mode & 0o777) == 0o700


def test_cleanup_unlinks_a_link_inside_and_keeps_its_target(
    private_tmp: Path, tmp_path: Path
) -> None:
    folder = handlers._out_dir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("not the server's")
    _old(target)
    link = folder / "planted.json"
    link.symlink_to(target)
    _old(link)
    stale = folder / "old-estimate.json"
    stale.write_text("{}")
    _old(stale)
    fresh = folder / "new-estimate.json"
    fresh.write_text("{}")

    assert handlers._out_dir() == folder

    assert target.read_text() == "not the server's"
    assert not link.is_symlink()
    assert not stale.exists()
    assert fresh.exists()


def test_each_server_process_gets_its_own_folder(private_tmp: Path) -> None:
    first = handlers._out_dir()
    handlers._OUT_DIR = None
    second = handlers._out_dir()
    assert first != second
