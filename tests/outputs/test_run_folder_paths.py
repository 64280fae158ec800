"""Run folders given with ".." in their path (created and, after a failed set-up, removed by name),
and the one-sentence message for a misspelt flag."""

from __future__ import annotations

from fedproto.outputs.run_folder import RunDir


def test_discard_if_unused_resolves_dot_dot(tmp_path, monkeypatch):
    """``new/../runs/x``: only ``runs/x`` is created (not ``new``), and a set-up that fails removes
    ``runs/x`` and ``runs`` again, leaving the working folder as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep").mkdir()
    rd = RunDir("new/../runs/x")
    assert (tmp_path / "runs" / "x").is_dir() and not (tmp_path / "new").exists()
    rd.discard_if_unused()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    # an existing parent stays; only what the run folder created goes
    (tmp_path / "runs").mkdir()
    RunDir("keep/../runs/y").discard_if_unused()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "runs"] and not any((tmp_path / "runs").iterdir())


def test_a_misspelt_flag_gets_one_sentence_with_the_suggestions(capsys, monkeypatch, tmp_path):
    """click's "(Did you mean ...?)" becomes "; did you mean ...? If not, see ... --help" (no "?); see"), exit 2."""
    from conftest import run_cli

    code, text = run_cli(["run", "--out-dir", str(tmp_path), "--roundz", "3"], capsys, monkeypatch)
    assert code == 2
    assert "No such option '--roundz'; did you mean one of: " in text
    assert "'--rounds'? If not, see fedproto run --help" in text
    assert "?);" not in text and "(Did you mean" not in text


def test_sigterm_ends_a_run_with_exit_code_143(capsys, monkeypatch, tmp_path):
    """SIGTERM (kill, timeout, a scheduler) ends a run as Ctrl-C does (partial metrics kept, the
    message says interrupted) but exits 128 + 15 = 143, as shells report a process ended by
    SIGTERM; Ctrl-C stays 130."""
    import os
    import signal

    from conftest import run_cli

    from fedproto.simulation import Simulation

    def stopped(self, resume=False, sig=signal.SIGTERM):
        os.kill(os.getpid(), sig)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary: the handler runs here
        raise AssertionError("the handler did not run")

    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background
    try:  # job of a shell starts with SIGINT ignored, and Python keeps it so)
        monkeypatch.setattr(Simulation, "run", stopped)
        args = ["run", "--dataset", "digits", "--rounds", "2", "--threads", "1", "--out-dir", str(tmp_path)]
        code, text = run_cli(args, capsys, monkeypatch)
        assert code == 143 and "interrupted after round 0" in text, text
        monkeypatch.setattr(Simulation, "run", lambda self, resume=False: stopped(self, sig=signal.SIGINT))
        code, text = run_cli(args, capsys, monkeypatch)
        assert code == 130 and "interrupted after round 0" in text, text
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
