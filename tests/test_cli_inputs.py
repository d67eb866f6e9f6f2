"""Every command's bad input is one `error:` line (issue 24): exit 2 before any write for bad
input, exit 1 for a runtime failure, no traceback. Export (its --output, --overwrite, file
modes, a failed export), import_hf (damaged folders), `--config=` specs, and read-only readers
(generate, eval, export) on a run whose checkpoint rotation deletes the step being read.
prepare's cases are in test_prepare_formats.py."""

import os

import pytest

import train as train_cli
from conftest import REPO
from onona_jax import config as config_lib
from test_reliability import errors


def one_error(capfd) -> str:
    """The one line on stderr, an `error:` line, with no traceback anywhere."""
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    [line] = errors(err)
    return line


# ----------------------------------------------------------------------------- --config= specs


@pytest.mark.parametrize("case", ["missing-file", "unknown-name", "file-raises", "get_config-raises"])
def test_bad_config_spec_is_one_error_line(tmp_path, capfd, monkeypatch, case):
    """A missing file, a name get_config does not know, a config file that raises: one error
    line naming the spec and where the valid names are (before: a traceback inside the line)."""
    monkeypatch.chdir(REPO)
    (tmp_path / "raises.py").write_text("raise RuntimeError('broken on purpose')\n")
    (tmp_path / "get_raises.py").write_text('"""Specs: get_raises.py:<n>."""\ndef get_config(arg):\n'
                                            '    return {}[arg]\n')
    spec, words = {
        "missing-file": ("configs/nope.py:dense-tiny-twin",
                         "no config file 'configs/nope.py'; the config files are in configs/: paper.py"),
        "unknown-name": ("configs/paper.py:dense-tiny-nohead",
                         "config arg 'dense-tiny-nohead': arch in ('dense', "),
        "file-raises": (f"{tmp_path / 'raises.py'}:x",
                        f"{tmp_path / 'raises.py'} fails to load (RuntimeError: broken on purpose); fix it or "
                        "choose another (the config files are in configs/: paper.py)"),
        "get_config-raises": (f"{tmp_path / 'get_raises.py'}:big",
                              f"KeyError: 'big'; {tmp_path / 'get_raises.py'}'s get_config defines the names "
                              f"(Specs: get_raises.py:<n>)"),
    }[case]
    assert train_cli.main([f"--config={spec}", f"--workdir={tmp_path / 'w'}"]) == 2
    line = one_error(capfd)
    assert line.startswith(f"error: --config={spec}: ") and words in line, line
    if case == "unknown-name":
        assert line.endswith("configs/paper.py's get_config defines the names (The paper's models and training "
                             "recipe: `configs/paper.py:<arch>-<size>-<head>`)"), line
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match=f"^config {spec}: "):
        config_lib.load(spec)
