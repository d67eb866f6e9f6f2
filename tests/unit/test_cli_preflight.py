"""`cli.unwritable`, the one "is this writable?" of the package: the reason in one line or None,
and nothing left behind that the probe made (no file ever; no directory on failure, nor with
`leave_nothing` on success)."""

import pytest

from onona_jax import cli, paths


def test_a_writable_directory_is_made_and_holds_no_probe(tmp_path):
    deep = tmp_path / "a" / "b"
    assert cli.unwritable(str(deep)) is None
    assert deep.is_dir() and list(deep.iterdir()) == []


def test_leave_nothing_removes_every_directory_it_made(tmp_path):
    assert cli.unwritable(str(tmp_path / "a" / "b"), leave_nothing=True) is None
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_place_is_its_reason_and_leaves_nothing(tmp_path):
    (tmp_path / "f").write_text("x")
    why = cli.unwritable(str(tmp_path / "f" / "sub"))
    assert why == "Not a directory" or why == "File exists", why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_an_interruption_inside_the_probe_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    def cut(path, text):
        raise cli.Interrupted()

    monkeypatch.setattr(paths, "write_atomic", cut)
    with pytest.raises(cli.Interrupted):
        cli.unwritable(str(tmp_path / "a" / "b"))
    assert list(tmp_path.iterdir()) == []


def test_the_reason_is_one_line():
    assert cli.reason(PermissionError(13, "Permission denied")) == "Permission denied"
    assert cli.reason(OSError("first\nsecond")) == "first"
    assert cli.reason(RuntimeError()) == "RuntimeError"
