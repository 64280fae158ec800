"""Flower's commands are found beside the running Python (a virtual environment that is not
activated), else on PATH; without them the error names where it looked and how to install. No
Flower needed: the commands here are stand-ins."""

import os
import sys
from pathlib import Path

import pytest

from fedproto.errors import ConfigError
from fedproto.flower.local import FLOWER_COMMANDS, LocalFederation, flower_command


def _stand_ins(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in FLOWER_COMMANDS:
        exe = folder / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    return folder


@pytest.mark.skipif(os.name == "nt", reason="POSIX executables")
def test_flower_commands_beside_the_interpreter_then_on_path(tmp_path, monkeypatch):
    venv, other = _stand_ins(tmp_path / "venv" / "bin"), _stand_ins(tmp_path / "elsewhere")
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(other))
    assert flower_command("flwr") == str(venv / "flwr")  # the venv's own, though PATH has another
    fed = LocalFederation(tmp_path / "fed")
    assert fed.commands == {n: str(venv / n) for n in FLOWER_COMMANDS}
    assert fed.env["PATH"].split(os.pathsep)[0] == str(venv)  # flwr-serverapp/-clientapp found there too
    (venv / "flwr").unlink()
    assert flower_command("flwr") == str(other / "flwr")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert flower_command("flwr") is None
    with pytest.raises(ConfigError, match=r"flwr is neither beside this Python \(.*venv/bin\) nor on PATH; install "
                       r"Flower into this environment: .*venv/bin/python -m pip install \"fedproto\[flower\]\""):
        LocalFederation(tmp_path / "fed2")
