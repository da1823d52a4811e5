import tempfile

import pytest

from rlcu import paths
from rlcu.paths import check_writable_file, check_writable_folder


def test_a_folder_another_start_removes_mid_check_is_made_again(tmp_path, monkeypatch):
    """Two runs started in one folder: the first's check removes the `runs` it made (keep=False) while the second's
    is writing its probe there; the second makes it again instead of failing with "cannot write there"."""
    folder, real, calls = tmp_path / "runs", tempfile.mkstemp, []

    def vanishing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            folder.rmdir()  # the other start's clean-up, between our mkdir and our probe
            raise FileNotFoundError(2, "No such file or directory")
        return real(*args, **kwargs)

    monkeypatch.setattr(paths.tempfile, "mkstemp", vanishing)
    assert check_writable_folder(folder, "--x", keep=True) == folder and folder.is_dir() and len(calls) == 2


def test_a_file_where_a_folder_goes_is_one_error(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="--out .*a-file/sub: cannot write there"):
        check_writable_folder(tmp_path / "a-file" / "sub", "--out")
    with pytest.raises(ValueError, match=r"^--out .*a-file is a file; give a folder path$"):
        check_writable_folder(tmp_path / "a-file", "--out")
    with pytest.raises(ValueError, match="is a folder; give a file path"):
        check_writable_file(tmp_path, "--output")
