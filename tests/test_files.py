"""Atomic writes (mot_jax.files.atomic_file, atomic_folder): the new content appears whole, or nothing changes."""

import pytest
from etils import epath

from mot_jax.files import atomic_file, atomic_folder


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_an_atomic_file_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "sub" / "table.json"  # the missing folder is made
    previous = None
    for text in ("first", "second"):
        with atomic_file(target) as partial:
            partial.write_text(text)
            assert partial.parent == target.parent
            assert (target.read_text() if target.exists() else None) == previous  # untouched until the block ends
        previous = text
    assert target.read_text() == "second" and listing(target.parent) == ["table.json"]


def test_an_error_while_writing_a_file_leaves_the_old_one(tmp_path):
    target = tmp_path / "table.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target) as partial:
        partial.write_text("half")
        raise RuntimeError
    assert target.read_text() == "old" and listing(tmp_path) == ["table.json"]  # the temporary file is gone


def test_an_atomic_folder_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "cache"
    previous = None
    for name in ("first.txt", "second.txt"):
        with atomic_folder(target) as partial:
            (partial / name).write_text(name)
            assert (listing(target) if target.exists() else None) == previous  # untouched until the block ends
        previous = [name]
    assert listing(target) == ["second.txt"] and listing(tmp_path) == ["cache"]  # the old folder is removed


def test_an_error_while_writing_a_folder_leaves_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "cache"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_folder(target) as partial:
        (partial / "new.txt").write_text("half")
        raise RuntimeError
    assert listing(target) == ["old.txt"] and listing(tmp_path) == ["cache"]

    # the final rename fails after the old folder was moved aside: it is moved back
    path_class = type(epath.Path(tmp_path))
    rename = path_class.rename

    def failing_rename(self, destination):
        if self.name.endswith(".partial"):
            raise OSError("no space left on device")
        return rename(self, destination)

    monkeypatch.setattr(path_class, "rename", failing_rename)
    with pytest.raises(OSError, match="no space"), atomic_folder(target) as partial:
        (partial / "new.txt").write_text("new")
    assert listing(target) == ["old.txt"] and listing(tmp_path) == ["cache"]
