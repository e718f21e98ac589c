"""`building`: a cache folder is built out of sight and published whole, once, whoever finishes first;
`stored_bytes`: the size on disk that data_bytes reports."""

import os
import time

import pytest

from common.paths import building, stored_bytes


def test_a_folder_is_published_whole_once(tmp_path):
    folder = tmp_path / "cache" / "key"
    with building(folder, "done") as work:
        assert work is not None and not folder.exists()
        (work / "data").write_text("mine")
        (work / "done").write_text("")
    assert (folder / "data").read_text() == "mine" and not list(folder.parent.glob("key.partial-*"))
    with building(folder, "done") as work:
        assert work is None


def test_another_process_that_published_first_keeps_its_folder(tmp_path):
    folder = tmp_path / "key"
    with building(folder, "done") as work:
        (work / "data").write_text("mine")
        (work / "done").write_text("")
        folder.mkdir()  # another run (or machine) finished the same folder meanwhile
        (folder / "data").write_text("theirs")
        (folder / "done").write_text("")
    assert (folder / "data").read_text() == "theirs" and not list(tmp_path.glob("key.partial-*"))


def test_a_failed_build_leaves_nothing_and_day_old_leftovers_are_removed(tmp_path):
    folder = tmp_path / "key"
    old, recent = tmp_path / "key.partial-host-1-aaaa", tmp_path / "key.partial-host-2-bbbb"
    old.mkdir(), recent.mkdir()
    os.utime(old, (time.time() - 2 * 86_400,) * 2)
    with pytest.raises(ValueError), building(folder, "done") as work:
        (work / "data").write_text("half")
        raise ValueError("killed halfway")
    assert not folder.exists() and not old.exists() and recent.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == [recent.name]


def test_stored_bytes_counts_files_and_every_file_under_a_folder(tmp_path):
    (tmp_path / "set" / "nested").mkdir(parents=True)
    (tmp_path / "set" / "a.png").write_bytes(b"x" * 10)
    (tmp_path / "set" / "nested" / "b.png").write_bytes(b"x" * 25)
    (tmp_path / "labels.csv").write_bytes(b"x" * 7)
    assert stored_bytes(tmp_path / "labels.csv") == 7
    assert stored_bytes(tmp_path / "set") == 35
    assert stored_bytes(tmp_path / "labels.csv", tmp_path / "set" / "a.png") == 17
    assert stored_bytes() == 0
