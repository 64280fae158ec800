"""Every published table and number that a marker names is generated from its result file in
docs/results/*.json (scripts/published_figures.py), and no cell is printed with two values
across README.md and docs/. The first test reads the repository itself; the others show on a
small tree of their own that a number edited by hand, a second value of a cell and a bad marker
are each caught, with the place named."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from fedproto.reproduce.published import (
    BLOCK,
    CELL,
    PublishedError,
    conflicts,
    load_results,
    make_result,
    printed_cells,
    regenerate,
)

ROOT = Path(__file__).resolve().parents[2]


def test_published_numbers_agree_with_their_results():
    results = load_results(ROOT)
    for name, r in results.items():  # each says when and from which code it was made, and how to make it again
        assert r["made"].get("date") and r["made"].get("commit"), name
        assert r["command"].strip(), name
        assert r["ci"] or r.get("cost"), f"{name}: too slow for CI, so it must say how long it takes"
    changed = regenerate(ROOT, write=False)
    assert not changed, ("generated from docs/results/*.json, these differ from the pages (run python "
                         f"scripts/published_figures.py): {sorted(str(p.relative_to(ROOT)) for p in changed)}")
    assert conflicts(ROOT) == []
    specs = {m["spec"] for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for m in BLOCK.finditer(p.read_text())}
    used = {s.split(":")[1] for s in specs if ":" in s} | {
        m["key"].split(":")[0] for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in CELL.finditer(p.read_text())}
    used = {part for name in used for part in name.split("+")}
    assert used <= set(results), f"markers name result files that do not exist: {used - set(results)}"


ROW = {"dataset": "mnist", "stdev": 2, "method": "fedavg", "algorithm": "fedavg", "model": "cnn", "ways": 3,
       "seeds": 1, "failed": 0, "acc_mean": 98.45625, "acc_std_clients": 1.47128, "acc_std_seeds": None,
       "acc_proto_mean": None, "acc_proto_std_clients": None, "acc_proto_std_seeds": None,
       "acc_global_mean": 97.38541, "acc_global_std_clients": 1.97140, "acc_global_std_seeds": None,
       "paper_mean": 95.04, "paper_std": 6.48, "rounds": 150, "paper_rounds": 150,
       "params_up_per_round": 436820.0, "paper_params_k": 430.0, "message": ""}

PAGE = """# A page

<!-- figures:tab1:toy:3 -->
<!-- /figures:tab1:toy:3 -->

Text: FedAvg scored globally gives <!-- cell:toy:fedavg:3:acc_global:pm -->x<!-- /cell -->, personally
<!-- cell:toy:fedavg:3:acc:1 -->x<!-- /cell -->.

<!-- figures:global-personal:toy -->
<!-- /figures:global-personal:toy -->
"""


@pytest.fixture
def tree(tmp_path):
    """A repository of one result file (toy) and one page with two blocks and two cells, rendered."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    result = {"name": "toy", "what": "a test", "command": "fedproto reproduce ...", "ci": False, "cost": "1 h",
              "made": {"date": "2026-12-06 08:00 UTC", "commit": "abc1234"}, "rows": [ROW]}
    (tmp_path / "docs" / "results" / "toy.json").write_text(json.dumps(result))
    (tmp_path / "README.md").write_text("# readme\n")
    (tmp_path / "docs" / "page.md").write_text(PAGE)
    changed = regenerate(tmp_path)
    assert set(changed) == {tmp_path / "docs" / "page.md"}
    return tmp_path


def test_blocks_and_cells_are_rendered_from_the_result(tree):
    text = (tree / "docs" / "page.md").read_text()
    assert "| FedAvg | 98.46 ± 1.47 | 95.04 ± 6.48 | 436.8 / 430 |" in text
    assert "| fedavg | 97.39 ± 1.97 | 98.46 ± 1.47 | 95.04 ± 6.48 |" in text
    assert "<!-- cell:toy:fedavg:3:acc_global:pm -->97.39 ± 1.97<!-- /cell -->" in text
    assert "<!-- cell:toy:fedavg:3:acc:1 -->98.5<!-- /cell -->" in text
    assert regenerate(tree, write=False) == {}  # rendered twice: the same text
    # tab1's ours, global-personal's global and personal, and the two cells: one cell key each
    printed = sorted((k[1:], t) for k, t, _ in printed_cells(tree))
    assert printed == [(("fedavg", 3, "acc"), "98.46 ± 1.47"), (("fedavg", 3, "acc"), "98.46 ± 1.47"),
                       (("fedavg", 3, "acc"), "98.5"), (("fedavg", 3, "acc_global"), "97.39 ± 1.97"),
                       (("fedavg", 3, "acc_global"), "97.39 ± 1.97")]
    assert conflicts(tree) == []


def test_a_number_edited_by_hand_is_found(tree):
    page = tree / "docs" / "page.md"
    page.write_text(page.read_text().replace("| FedAvg | 98.46 ± 1.47 |", "| FedAvg | 98.50 ± 1.35 |"))
    changed = regenerate(tree, write=False)
    assert list(changed) == [page] and "98.50 ± 1.35" in changed[page][0] and "98.50" not in changed[page][1]
    # the cross-check names both places of the cell: the table says 98.50, the other table 98.46
    found = conflicts(tree)
    assert len(found) == 1 and "fedavg n=3 acc" in found[0] and "98.50 ± 1.35" in found[0] and "98.46" in found[0]
    assert "docs/page.md (tab1:toy:3)" in found[0]


def test_a_second_value_of_a_cell_in_another_page_is_a_conflict(tree):
    # another result file of the same setting (an older run) printing the cell with another value
    old = json.loads((tree / "docs" / "results" / "toy.json").read_text())
    old["name"], old["rows"][0]["acc_global_mean"] = "older", 97.03
    (tree / "docs" / "results" / "older.json").write_text(json.dumps(old))
    (tree / "README.md").write_text("FedAvg global <!-- cell:older:fedavg:3:acc_global:2 -->x<!-- /cell -->\n")
    regenerate(tree)
    assert "97.03" in (tree / "README.md").read_text()
    found = conflicts(tree)
    assert found and all("acc_global" in f for f in found)
    assert any("README.md (cell older:fedavg:3:acc_global:2)" in f for f in found)
    # the same value at fewer decimals is no conflict: 97.4 is 97.39 rounded
    old["rows"][0]["acc_global_mean"] = 97.4
    (tree / "docs" / "results" / "older.json").write_text(json.dumps(old))
    regenerate(tree)
    assert conflicts(tree) == []


def test_a_table_of_cells_run_apart_takes_each_cell_from_the_first_file_that_has_it(tree):
    other = json.loads((tree / "docs" / "results" / "toy.json").read_text())
    other["name"] = "later"
    other["rows"] = [{**ROW, "acc_mean": 90.0}, {**ROW, "method": "fedprox", "acc_mean": 97.0}]
    (tree / "docs" / "results" / "later.json").write_text(json.dumps(other))
    (tree / "README.md").write_text("<!-- figures:tab1:toy+later:3 -->\n<!-- /figures:tab1:toy+later:3 -->\n")
    regenerate(tree)
    text = (tree / "README.md").read_text()
    assert "| FedAvg | 98.46 ± 1.47 |" in text and "| FedProx | 97.00 ± 1.47 |" in text and "90.00" not in text
    assert conflicts(tree) == []


def test_a_generated_table_page_and_its_csv(tree):
    page = tree / "docs" / "results" / "toy-table.md"
    page.write_text("<!-- figures:file:toy -->\n")
    changed = regenerate(tree)
    assert set(changed) == {page, page.with_suffix(".csv")}
    text = page.read_text()
    assert text.startswith("<!-- figures:file:toy -->\n# FedProto reproduction vs the paper")
    assert "| fedavg | 98.46 ± 1.47 | 95.04 ± 6.48 | – | – | – | – | 150 / 150 | 436.8 / 430 |" not in text
    assert "| fedavg | 98.46 ± 1.47 | 95.04 ± 6.48 | 150 / 150 | 436.8 / 430 |" in text
    assert "| mnist (stdev 2) | fedavg | 3 | 97.39 ± 1.97 | 98.46 ± 1.47 | 95.04 ± 6.48 |" in text
    assert page.with_suffix(".csv").read_text().splitlines()[1].startswith("mnist,2,fedavg,fedavg,cnn,3,1,0,98.4562,")
    page.write_text(text.replace("| fedavg | 98.46 ± 1.47 | 95.04", "| fedavg | 98.50 ± 1.35 | 95.04"))
    assert list(regenerate(tree, write=False)) == [page]
    assert any("98.50 ± 1.35" in c and "docs/results/toy-table.md (file:toy)" in c for c in conflicts(tree))


def test_bad_markers_and_result_files_are_named(tree):
    page = tree / "docs" / "page.md"
    page.write_text(PAGE.replace("tab1:toy:3", "tab1:nosuch:3"))
    with pytest.raises(PublishedError, match="no result file docs/results/nosuch.json"):
        regenerate(tree, write=False)
    page.write_text("<!-- cell:toy:fedavg:3:acc_global:pct -->x<!-- /cell -->")
    with pytest.raises(PublishedError, match="style 'pct': use pm, 2 or 1"):
        regenerate(tree, write=False)
    page.write_text("<!-- cell:toy:fedavg:4:acc:pm -->x<!-- /cell -->")
    with pytest.raises(PublishedError, match="no row for method 'fedavg', n = 4"):
        regenerate(tree, write=False)
    (tree / "docs" / "results" / "bad.json").write_text(json.dumps({"name": "bad", "rows": []}))
    with pytest.raises(PublishedError, match="bad.json: a result file needs command, made, ci"):
        load_results(tree)


def _script():
    """scripts/published_figures.py as a module (its main(argv) returns the exit code)."""
    spec = importlib.util.spec_from_file_location("published_figures", ROOT / "scripts" / "published_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_import_and_check_from_the_command_line(tree, tmp_path, capsys):
    out = tmp_path / "grid"
    out.mkdir()
    (out / "table.json").write_text(json.dumps({"made": {"date": "2026-12-06 09:00 UTC", "commit": "def5678"},
                                                "rows": [{**ROW, "acc_mean": 98.0, "failed_cells": []}]}))
    res = make_result(out / "table.json", "toy2", "x", "fedproto reproduce", False, "2 h", commit="b2c9c24")
    assert res["made"]["commit"] == "b2c9c24" and "failed_cells" not in res["rows"][0]
    main = _script().main
    root = ["--root", str(tree)]
    assert main([*root, "import", str(out), "--name", "toy", "--what", "x", "--command", "fedproto reproduce",
                 "--slow", "2 h", "--replace"]) == 0  # toy.json exists: replaced on purpose
    assert math.isclose(load_results(tree)["toy"]["rows"][0]["acc_mean"], 98.0)
    capsys.readouterr()
    assert main([*root, "--check"]) == 1  # the page still shows 98.46: the diff, and nothing written
    text = capsys.readouterr().out
    assert "-| FedAvg | 98.46 ± 1.47" in text and "+| FedAvg | 98.00 ± 1.47" in text
    assert "last made 2026-12-06 09:00 UTC at commit def5678; too slow for CI (2 h)" in text
    assert main(root) == 0 and "rewrote docs/page.md" in capsys.readouterr().out
    assert main([*root, "--check"]) == 0
    assert "every generated table, number and file agrees" in capsys.readouterr().out


def test_the_grid_timing_table_gives_the_median_and_each_pair(tree):
    rows = [{"run": 1, "mode": "serial (`--threads 1`)", "wall_s": 500.0, "load_before": "14.1 15.0 15.2",
             "load_after": "13.9 14.0 15.0", "table": "reference"},
            {"run": 1, "mode": "`--jobs 2` (`--threads 2`)", "wall_s": 400.0, "load_before": "13.9 14.0 15.0",
             "load_after": "13.0 13.5 14.8", "table": "identical"},
            {"run": 2, "mode": "serial (`--threads 1`)", "wall_s": 300.0, "load_before": "13.0 13.5 14.8",
             "load_after": "12.0 13.0 14.0", "table": "identical"},
            {"run": 2, "mode": "`--jobs 2` (`--threads 2`)", "wall_s": 360.0, "load_before": "12.0 13.0 14.0",
             "load_after": "12.5 13.0 14.0", "table": "identical"}]
    (tree / "docs" / "results" / "grid.json").write_text(json.dumps(
        {"name": "grid", "what": "x", "command": "python scripts/measure_grid_jobs.py --pairs 2", "ci": False,
         "cost": "30 min", "made": {"date": "2026-12-06 08:20 UTC", "commit": "c40c695"}, "rows": rows}))
    (tree / "README.md").write_text("<!-- figures:grid-jobs:grid -->\n<!-- /figures:grid-jobs:grid -->\n")
    regenerate(tree)
    text = (tree / "README.md").read_text()
    assert "| 1 | serial (`--threads 1`) | 500.0 | 14.1 15.0 15.2 | 13.9 14.0 15.0 | reference |" in text
    # medians of two: 400 s serial, 380 s with --jobs 2; per run 1.25x and 0.83x
    assert "| median | serial / `--jobs 2` | 400.0 / 380.0 | | | **1.05x** (per run: 1.25x, 0.83x) |" in text


def test_import_refuses_what_would_lose_or_misplace_a_result(tree, tmp_path, capsys):
    """Reported: `--check import` wrote a file, `--name mnist` replaced a committed result, `--name ../../x`
    wrote outside docs/results, a table.json without rows was a KeyError, and `--check` on a folder with no
    result files passed. Each is refused, naming the value and the fix, and nothing is written."""
    out = tmp_path / "grid"
    out.mkdir()
    (out / "table.json").write_text(json.dumps({"rows": [{**ROW, "acc_mean": 98.0}]}))
    main = _script().main
    root = ["--root", str(tree)]
    before = {p: p.read_bytes() for p in (tree / "docs" / "results").iterdir()}
    existing = next(iter(before)).stem
    for argv, why in [([*root, "--check", "import", str(out), "--name", "new"], "--check writes nothing"),
                      ([*root, "import", str(out), "--name", existing], "exists: pick another --name"),
                      ([*root, "import", str(out), "--name", "../../evil"], "a result file's name is letters")]:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--what", "x", "--command", "c"] if "import" in argv else argv)
        assert e.value.code == 2 and why in capsys.readouterr().err
    (out / "table.json").write_text('{"bad": 1}')
    assert main([*root, "import", str(out), "--name", "bad", "--what", "x", "--command", "c"]) == 2
    assert "not a table.json of fedproto reproduce" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (tree / "docs" / "results").iterdir()} == before
    assert not (tmp_path.parent / "evil.json").exists()
    assert main(["--root", str(tmp_path / "nothere"), "--check"]) == 2
    assert "no result files" in capsys.readouterr().err
