"""Run folders given with ".." in their path (created and, after a failed set-up, removed by name),
and the one-sentence message for a misspelt flag."""

from __future__ import annotations

from fedproto.results import RunDir


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
    """click's "(Did you mean ...?)" becomes "; did you mean ...? See ... --help" (no "?); see"), exit 2."""
    from conftest import run_cli

    code, text = run_cli(["run", "--out-dir", str(tmp_path), "--roundz", "3"], capsys, monkeypatch)
    assert code == 2
    assert "No such option '--roundz'; did you mean one of: " in text and "'--rounds'? See fedproto run --help" in text
    assert "?);" not in text and "(Did you mean" not in text
