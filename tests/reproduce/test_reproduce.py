"""Plots (`fedproto plot`), the paper's table as data, and `fedproto reproduce` (grid, resume, sweep)
on the tiny sklearn digits set."""

import csv
import json

import pytest
from conftest import assert_png, run_cli

from fedproto.config.run_config import build_config
from fedproto.errors import ConfigError

TINY = ["clients=4", "shots=20", "stdev=1", "test_shots=8"]


def sets(*extra):
    out = []
    for kv in (*TINY, *extra):
        out += ["--set", kv]
    return out


def test_reproduce_grid_table_and_resume(capsys, monkeypatch, tmp_path):
    out = tmp_path / "rep"
    args = ["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto,fedavg", "--seeds", "7",
            "--rounds", "2", "--out", str(out), *sets()]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert text.count(" done in ") == 2 and "2 run, 0 skipped, 0 failed" in text
    for m in ("fedproto", "fedavg"):
        assert (out / "runs" / f"digits-n2-{m}-s7" / "summary.json").is_file()
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [(r["dataset"], r["method"], r["ways"]) for r in rows] == [("digits", "fedproto", "2"),
                                                                        ("digits", "fedavg", "2")]
    for r in rows:
        assert r["paper_mean"] == "" and r["seeds"] == "1" and r["rounds"] == "2"
        assert 0 <= float(r["acc_mean"]) <= 100 and float(r["params_up_per_round"]) > 0
    assert rows[0]["acc_proto_mean"] != "" and rows[1]["acc_proto_mean"] == ""
    md = (out / "table.md").read_text()
    assert "## digits (stdev 1)" in md and "| fedproto |" in md and "| fedavg |" in md
    assert "n.a." in md and "mean over seeds" in md
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}

    # same grid again: every cell is skipped, nothing is rerun, the table is rewritten the same
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert text.count("skipped (finished earlier)") == 2 and "0 run, 2 skipped" in text
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert list(csv.DictReader((out / "table.csv").open())) == rows
    status = json.loads((out / "status.json").read_text())
    assert [s["status"] for s in status] == ["skipped", "skipped"]

    # a changed option reruns the cells
    code, text = run_cli([*args, "--set", "lr=0.02"], capsys, monkeypatch)
    assert code == 0, text
    assert "2 run, 0 skipped" in text


def test_reproduce_failed_cell_is_recorded_and_grid_goes_on(capsys, monkeypatch, tmp_path):
    out = tmp_path / "rep"
    # an impossible partition (40 clients × 2 ways × 100 shots from digits' ~126 images per class)
    code, text = run_cli(["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto",
                          "--rounds", "1", "--out", str(out), "--set", "clients=40", "--set", "shots=100",
                          "--set", "stdev=0", "--set", "test_shots=8"], capsys, monkeypatch)
    assert code == 1, text  # the table is written, but a cell failed
    assert "failed" in text and "1 failed" in text
    status = json.loads((out / "status.json").read_text())
    assert status[0]["status"] == "failed" and status[0]["message"]
    # the advice names reproduce's options (--set shots=...), not fedproto run's flags (--shots)
    assert "--set shots=" in status[0]["message"] and "--set clients=" in status[0]["message"]
    assert "--shots" not in status[0]["message"] and "--clients" not in status[0]["message"]
    md = (out / "table.md").read_text()
    assert "| fedproto | failed |" in md and "## Failed cells" in md


def test_reproduce_bad_options_exit_2(capsys, monkeypatch, tmp_path):
    for extra, expect in ((["--methods", "fedfoo"], "unknown 'fedfoo'"),
                          (["--set", "ways=3"], "set by the grid"),
                          (["--set", "roundz=3"], "unknown option 'roundz'"),
                          (["--set", "lr=-1"], "lr=-1")):
        code, text = run_cli(["reproduce", "--datasets", "digits", "--out", str(tmp_path / "x"), *extra],
                             capsys, monkeypatch)
        assert code == 2 and expect in text and "Traceback" not in text, (extra, text)
    assert not (tmp_path / "x").exists()  # nothing ran


def test_reproduce_lambda_sweep(capsys, monkeypatch, tmp_path):
    out = tmp_path / "sw"
    code, text = run_cli(["reproduce", "--sweep", "lambda=0,1", "--datasets", "digits", "--ways", "2",
                          "--rounds", "2", "--out", str(out), *sets()], capsys, monkeypatch)
    assert code == 0, text
    rows = list(csv.DictReader((out / "sweep_lambda.csv").open()))
    assert [(r["method"], float(r["value"])) for r in rows] == [("fedproto", 0.0), ("fedproto", 1.0)]
    for r in rows:
        assert 0 <= float(r["acc_mean"]) <= 100 and float(r["proto_mse_test"]) > 0
    assert float(rows[0]["loss_proto_train"]) == 0.0  # λ = 0 trains without the prototype term
    assert_png(out / "sweep_lambda.png")
    conf = json.loads((out / "runs" / "digits-n2-fedproto-s1234-lambda1" / "config.json").read_text())
    assert conf["lambda_proto"] == 1
    assert "2 cells: 2 run, 0 skipped, 0 failed" in text
    # reported: a sweep whose every cell failed still exited 0
    code, text = run_cli(["reproduce", "--sweep", "lambda=0,1", "--datasets", "digits", "--ways", "2",
                          "--rounds", "1", "--out", str(tmp_path / "bad"), "--set", "clients=40",
                          "--set", "shots=100", "--set", "stdev=0", "--set", "test_shots=8"], capsys, monkeypatch)
    assert code == 1 and "2 cells: 0 run, 0 skipped, 2 failed" in text


def test_sweep_refuses_duplicate_values():
    from fedproto import reproduce as rp

    assert rp.parse_sweep("lambda=0,1,2")[2] == [0, 1, 2]
    with pytest.raises(ConfigError, match="the value 1.0 is given twice"):
        rp.parse_sweep("lambda=1,1.0")


def test_table_rows_seed_rule_and_appendix_paper_column(tmp_path):
    from fedproto import reproduce as rp

    cells = rp.plan_grid(tmp_path, ["mnist"], [3], ["fedproto"], [1, 2], sets={"stdev": 3})
    assert [c.cfg.rounds for c in cells] == [100, 100] and cells[0].cfg.model == "cnn"
    assert rp.plan_grid(tmp_path, ["cifar10"], [3], ["fedproto-mh"], [1])[0].cfg.model == "resnet18-mh"
    # --set model=cnn swaps the model family for every method (the -mh variant for fedproto-mh)
    swapped = rp.plan_grid(tmp_path, ["cifar10"], [3], ["fedavg", "fedproto-mh"], [1], sets={"model": "cnn"})
    assert [c.cfg.model for c in swapped] == ["cnn", "cnn-mh"]
    custom = rp.plan_grid(tmp_path, ["mnist"], [3], ["fedproto", "fedproto-mh"], [1],
                          sets={"model": "projcnn:4-8,projcnn:8-8"})
    assert [c.cfg.model for c in custom] == ["projcnn:4-8,projcnn:8-8"] * 2  # no "projcnn:...-mh"
    assert rp.plan_grid(tmp_path, ["femnist"], [3], ["local"], [1])[0].cfg.rounds == 120  # Local: 0 rounds in tab. 1

    def summary(m, s):
        return {"accuracy": {"acc": {"mean": m, "std": s}}, "params_per_round": {"up": 3000.0}}

    results = [rp.CellResult(cells[0], "done", summary(0.90, 0.02)),
               rp.CellResult(cells[1], "skipped", summary(0.94, 0.04))]
    (row,) = rp.table_rows(results)
    assert (row["paper_mean"], row["paper_std"]) == (96.71, 0.43)  # appendix tab. 2, stdev 3
    assert abs(row["acc_mean"] - 92.0) < 1e-9 and abs(row["acc_std_clients"] - 3.0) < 1e-9
    assert abs(row["acc_std_seeds"] - 2 * 2 ** 0.5) < 1e-9  # sample std of (90, 94)
    assert row["seeds"] == 2 and row["rounds"] == 100 and row["paper_rounds"] == 100
    assert "92.00 ± 3.00 [±2.83, 2 seeds]" in rp.render_markdown([row])
    assert "Models: cnn." in rp.render_markdown([row])  # the paper's MNIST model: no remark
    assert "Models: resnet18 (not the paper's" not in rp.render_markdown([row])
    swapped = dict(row, dataset="cifar10", model="cnn")
    assert "Models: cnn (not the paper's models for this dataset)." in rp.render_markdown([swapped])


def test_cells_stored_before_personal_layers_existed():
    """A stored config without ``personal_layers`` was a FedPer/FedRep run that kept only the last
    layer local: it no longer matches the default ("fc") and is rerun; other methods, for which
    the field means nothing, still match and are skipped."""
    from fedproto.reproduce import comparable

    for method, same in (("fedper", False), ("fedrep", False), ("fedavg", True), ("fedproto", True)):
        cfg = build_config(overrides={"dataset": "digits", "algorithm": method}).model_dump()
        stored = {k: v for k, v in cfg.items() if k != "personal_layers"}
        assert (comparable(stored) == comparable(cfg)) is same, method
        legacy = build_config(overrides={"dataset": "digits", "algorithm": method, "personal_layers": "head"})
        assert comparable(stored) == comparable(legacy.model_dump()), method
    # ResNet18's only fully connected layer is its head, so both splits are the same run
    cfg = build_config(overrides={"dataset": "cifar10", "algorithm": "fedrep"}).model_dump()
    assert comparable({k: v for k, v in cfg.items() if k != "personal_layers"}) == comparable(cfg)


def test_table_records_global_and_personal_protocols(tmp_path):
    """A weight-sharing cell's acc_global goes into table.csv and the markdown's
    "Global vs personal" table beside its personal accuracy and the paper's; FedProto has none."""
    from fedproto import reproduce as rp

    cells = rp.plan_grid(tmp_path, ["mnist"], [3], ["fedavg", "fedproto"], [1])

    def summary(m, g):
        acc = {"acc": {"mean": m, "std": 0.01}}
        if g is not None:
            acc["acc_global"] = {"mean": g, "std": 0.02}
        return {"accuracy": acc, "params_per_round": {"up": 3000.0}}

    results = [rp.CellResult(cells[0], "done", summary(0.985, 0.9734)),
               rp.CellResult(cells[1], "done", summary(0.98, None))]
    rows = {r["method"]: r for r in rp.table_rows(results)}
    assert rows["fedavg"]["acc_global_mean"] == pytest.approx(97.34) and rows["fedavg"]["acc_mean"] == 98.5
    assert rows["fedavg"]["acc_global_std_clients"] == pytest.approx(2.0)
    assert rows["fedproto"]["acc_global_mean"] != rows["fedproto"]["acc_global_mean"]  # NaN: no global model
    md = rp.render_markdown(list(rows.values()))
    assert "## Global vs personal (weight-sharing methods)" in md
    assert "| mnist (stdev 2) | fedavg | 3 | 97.34 ± 2.00 | 98.50 ± 1.00 | 95.04 ± 6.48 |" in md
    assert "| fedproto | 3 |" not in md.split("## Global vs personal")[1]
    rp.write_table(tmp_path, results)
    import csv

    with open(tmp_path / "table.csv") as f:
        by = {r["method"]: r for r in csv.DictReader(f)}
    assert float(by["fedavg"]["acc_global_mean"]) == pytest.approx(97.34) and by["fedproto"]["acc_global_mean"] == ""


@pytest.mark.usefixtures("one_thread")
def test_sweep_cell_names_are_plain_folder_names(tmp_path):
    """Reported: sweeping a model spec or a path failed with 'is not a plain folder name'."""
    from fedproto.reproduce import plan_sweep

    cells = plan_sweep(tmp_path, "model", "model", ["projcnn:8-8", "cnn"], "digits", 3, ["fedproto"], [1])
    assert [c.name for c in cells] == ["digits-n3-fedproto-s1-modelprojcnn_8-8", "digits-n3-fedproto-s1-modelcnn"]
    with pytest.raises(ConfigError, match="would share a run folder"):
        plan_sweep(tmp_path, "pretrained", "pretrained", ["/a/x.pth", "/b/x.pth"], "cifar10", 3, ["fedproto"], [1])


# the model-heterogeneous grid


def test_hetero_grid_plans_every_model_set_with_the_methods_algorithms(tmp_path):
    from fedproto import reproduce as rp

    cells = rp.plan_hetero(tmp_path, ["mnist", "cifar10"], [3], ["fedtgp", "lgfedavg"], [1, 2])
    assert [(c.dataset, c.cfg.model, c.cfg.algorithm, c.seed) for c in cells[:4]] == [
        ("mnist", "cnn-mh", "fedtgp", 1), ("mnist", "cnn-mh", "fedtgp", 2),
        ("mnist", "cnn-mh", "lgfedavg", 1), ("mnist", "cnn-mh", "lgfedavg", 2)]
    models = [c.cfg.model for c in cells]
    assert models.count("projcnn:8-16,projcnn:16-32,projcnn:32-64") == 4 and len(cells) == 4 * 2 + 4
    assert {c.cfg.rounds for c in cells} == {rp.HETERO_ROUNDS}
    assert cells[0].name == "mnist-n3-fedtgp-s1-cnn-mh"
    assert cells[4].name == "mnist-n3-fedtgp-s1-projcnn_8-16_projcnn_16-32_projcnn_32-64"
    assert len({c.name for c in cells}) == len(cells)  # one run folder per cell
    # --set model=... gives one model set for every dataset, used as given; --rounds every cell's rounds
    one = rp.plan_hetero(tmp_path, ["mnist"], [3], ["fd"], [1], rounds=4, sets={"model": "projcnn:4-8,cnn"})
    assert [(c.cfg.model, c.cfg.rounds) for c in one] == [("projcnn:4-8,cnn", 4)]


def test_hetero_ranking_compares_the_gap_with_the_spread_over_seeds():
    from fedproto import reproduce as rp

    def row(m, mean, sd):
        return {"method": m, "acc_mean": mean, "acc_std_seeds": sd}

    rows = [row("a", 90.0, 0.5), row("b", 89.2, 1.0), row("c", 85.0, 1.0), row("d", float("nan"), float("nan"))]
    assert rp.ranking(rows) == ("a", ["b"], ["c"])  # 0.8 <= max(0.5, 1.0); 5.0 > 1.0
    assert rp.ranking([row("a", 90.0, float("nan")), row("b", 80.0, float("nan"))]) == ("a", ["b"], [])  # one seed
    assert rp.ranking([row("d", float("nan"), float("nan"))]) == (None, [], [])


def test_reproduce_hetero_grid_runs_and_writes_its_table(capsys, monkeypatch, tmp_path):
    out = tmp_path / "het"
    args = ["reproduce", "--grid", "hetero", "--datasets", "digits", "--methods", "local,fedtgp,lgfedavg",
            "--seeds", "1,2", "--rounds", "2", "--out", str(out), "--set", "model=projcnn:8-16,cnn",
            "--set", "server_epochs=2", *sets()]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert "6 run, 0 skipped, 0 failed" in text
    rows = {r["method"]: r for r in csv.DictReader((out / "table.csv").open())}
    assert list(rows) == ["local", "fedtgp", "lgfedavg"]
    assert all(r["seeds"] == "2" and r["model"] == "projcnn:8-16,cnn" and r["rounds"] == "2" for r in rows.values())
    assert rows["local"]["params_up_per_round"] == "0.0" and float(rows["lgfedavg"]["params_down_per_round"]) > 0
    assert rows["fedtgp"]["acc_proto_mean"] != "" and rows["lgfedavg"]["acc_global_mean"] != ""
    assert rows["local"]["acc_proto_mean"] == rows["local"]["acc_global_mean"] == ""
    md = (out / "table.md").read_text()
    assert "## digits, n=3, models `projcnn:8-16,cnn`" in md and "Classifier accuracy: **" in md
    code, text = run_cli([*args[:2], "nope", *args[3:]], capsys, monkeypatch)
    assert code == 2 and "--grid 'nope': unknown grid; choose from paper, hetero" in text
