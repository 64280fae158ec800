"""`fedproto reproduce --jobs N` and `--ray`: cells side by side give the serial table, a dead
worker is retried or reported, bad options are refused. Tiny grids on sklearn's digits."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from fedproto.errors import ConfigError
from fedproto.reproduce import plan_hetero, run_cell, run_hetero
from fedproto.reproduce.hetero import write_hetero_table
from fedproto.reproduce.side_by_side import Tally, check_jobs, run_side_by_side, thread_share

TINY = ["clients=4", "shots=20", "stdev=1", "test_shots=8", "model=projcnn:8-16,cnn"]
SETS = {"clients": 4, "shots": 20, "stdev": 1, "test_shots": 8, "model": "projcnn:8-16,cnn", "threads": 1}
GRID = ["reproduce", "--grid", "hetero", "--datasets", "digits", "--methods", "local,fedproto", "--seeds", "1,2",
        "--rounds", "2"]


def grid_args(out, *extra):
    args = [*GRID, "--out", str(out), *extra]
    for kv in TINY:
        args += ["--set", kv]
    return args


def table(out):
    """table.md, and table.csv without the wall-time column (how long a cell took is no result)."""
    rows = list(csv.DictReader((out / "table.csv").open()))
    for r in rows:
        r.pop("wall_s_per_seed")
    return (out / "table.md").read_text(), rows


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The tiny grid's tables, its cells run one after the other in this process on one thread."""
    out = tmp_path_factory.mktemp("serial")
    results = run_hetero(out, ["digits"], [3], ["local", "fedproto"], [1, 2], 2, SETS)
    assert [r.status for r in results] == ["done"] * 4
    return table(out)


def test_reproduce_jobs_gives_the_serial_table(serial, capsys, monkeypatch, tmp_path):
    out = tmp_path / "jobs"
    code, text = run_cli(grid_args(out, "--threads", "2", "--jobs", "2"), capsys, monkeypatch)
    assert code == 0, text
    assert "4 of 4 cells to run on 2 local processes, 1 thread each" in text
    assert "4 cells: 4 run, 0 skipped, 0 failed" in text and "4 done, 0 running, 0 failed" in text
    md, rows = table(out)
    assert md == serial[0] and rows == serial[1]
    assert [r["seeds"] for r in rows] == ["2", "2"]
    for name in ("local", "fedproto"):  # each cell ran with its share of the budget: 2 threads / 2 jobs
        conf = json.loads((out / "runs" / f"digits-n3-{name}-s1-projcnn_8-16_cnn" / "config.json").read_text())
        assert conf["threads"] == 1
    # again: every cell finished, so nothing runs (and --jobs 5 is clamped to the cells left)
    code, text = run_cli(grid_args(out, "--threads", "2", "--jobs", "5"), capsys, monkeypatch)
    assert code == 0 and "0 run, 4 skipped" in text and "0 of 4 cells to run on 1 local process" in text
    assert table(out) == serial


def test_reproduce_bad_jobs_and_missing_ray(capsys, monkeypatch, tmp_path):
    for bad in ("0", "-1"):
        code, text = run_cli(grid_args(tmp_path / "x", "--jobs", bad), capsys, monkeypatch)
        assert code == 2 and f"--jobs {bad}: give the number of cells to run at once, 1 or more" in text
        assert not (tmp_path / "x").exists()  # refused: no folder left behind
    with pytest.raises(ConfigError, match="--jobs True"):
        check_jobs(True)
    assert check_jobs(7, 3) == 3 and check_jobs(2, 3) == 2 and check_jobs(4, 0) == 1
    assert thread_share(8, 3) == 2 and thread_share(1, 2) == 1
    monkeypatch.setitem(sys.modules, "ray", None)  # as without the extra
    code, text = run_cli(grid_args(tmp_path / "y", "--ray", "auto"), capsys, monkeypatch)
    assert code == 2 and 'pip install "fedproto[ray]"' in text


def test_progress_tally_estimates_the_time_left():
    from fedproto.reproduce.grid import CellResult

    t = Tally(total=5, width=2)
    t.start(), t.start()
    assert t.line() == "0 done, 2 running, 0 failed, time left: after the first cell"
    t.end(CellResult(None, "done", {}, "", 10.0))
    t.end(CellResult(None, "failed", None, "x", 30.0))
    t.end(CellResult(None, "skipped", {}))
    # mean 20 s per cell run, 2 cells left, 2 at once: 20 s
    assert t.left_s() == 20.0 and t.line() == "1 done, 0 running, 1 failed (1 skipped), about 20 s left"


def die_on_first_run(cell):
    """Runs a cell; the first run of the fedproto cells kills its own process (as the OOM killer
    would), once per marker file next to the grid."""
    marker = Path(cell.cfg.out_dir).parent / f"died-{cell.name}"
    if cell.method == "fedproto" and cell.seed == 1 and not marker.exists():
        marker.write_text("")
        os._exit(9)
    return run_cell(cell)


def always_die(cell):
    if cell.method == "fedproto" and cell.seed == 1:
        os._exit(9)
    return run_cell(cell)


def plan(out, threads=1, seeds=(1, 2)):
    return plan_hetero(out, ["digits"], [3], ["local", "fedproto"], list(seeds), 2, {**SETS, "threads": threads})


def test_reproduce_jobs_reports_a_cell_whose_process_dies_and_builds_the_rest(tmp_path):
    out = tmp_path / "dies"
    (out / "runs").mkdir(parents=True)
    cells = plan(out, 2, seeds=[1])
    results = run_side_by_side(cells, out, after=lambda rs: write_hetero_table(out, rs, ["local", "fedproto"]), jobs=2,
                               run=always_die)
    # local ran beside the dying cell: it is run again alone (or found finished, if it was)
    assert [r.status for r in results][1] == "failed" and results[0].status in ("done", "skipped")
    assert "process died before it finished, also when it ran alone" in results[1].message
    assert [s["status"] for s in json.loads((out / "status.json").read_text())][1] == "failed"
    md = (out / "table.md").read_text()  # the table is built from the rest and names the failed cell
    assert "## Failed cells" in md and "digits-n3-fedproto-s1-projcnn_8-16_cnn" in md
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [(r["method"], r["seeds"], r["failed"]) for r in rows] == [("local", "1", "0"), ("fedproto", "0", "1")]


@pytest.fixture
def ray_cluster():
    """A Ray cluster of this test's own on 127.0.0.1 with 2 CPUs (2 workers at once)."""
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tasks below run this module's functions
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_reproduce_on_a_local_ray_cluster(serial, ray_cluster, capsys, monkeypatch, tmp_path):
    out = tmp_path / "ray"
    code, text = run_cli(grid_args(out, "--threads", "2", "--ray", "auto"), capsys, monkeypatch)
    assert code == 0, text
    assert "4 of 4 cells to run on Ray cluster (2 CPUs), 1 thread each" in text
    assert table(out) == serial
    # the run folders brought back in the tasks' results (as from workers without a shared filesystem)
    out = tmp_path / "returned"
    (out / "runs").mkdir(parents=True)
    results = run_side_by_side(plan(out, 2), out, after=lambda rs: write_hetero_table(out, rs, ["local", "fedproto"]),
                               ray="auto", return_files=True)
    assert [r.status for r in results] == ["done"] * 4
    assert table(out) == serial
    assert (out / "runs" / "digits-n3-fedproto-s2-projcnn_8-16_cnn" / "summary.json").is_file()
    # a cell asking for more CPUs than any node has would wait for ever: refused
    with pytest.raises(ConfigError, match="ask Ray for 4 CPUs .4 threads over 1 jobs. but the largest node has 2"):
        run_side_by_side(plan(tmp_path / "big", 4), tmp_path / "big", ray="auto", jobs=1)


@pytest.mark.slow
def test_ray_retries_a_cell_whose_worker_died(serial, ray_cluster, tmp_path):
    out = tmp_path / "ray-retry"
    (out / "runs").mkdir(parents=True)
    results = run_side_by_side(plan(out, 2), out, after=lambda rs: write_hetero_table(out, rs, ["local", "fedproto"]),
                               ray="auto", run=die_on_first_run)
    assert (out / "died-digits-n3-fedproto-s1-projcnn_8-16_cnn").is_file()  # the worker died once
    assert [r.status for r in results] == ["done"] * 4
    assert table(out) == serial


@pytest.mark.extras
def test_reproduce_refuses_a_ray_address_where_nothing_answers(capsys, monkeypatch, tmp_path):
    pytest.importorskip("ray")
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    code, text = run_cli(grid_args(tmp_path / "mine", "--ray", f"127.0.0.1:{port}"), capsys, monkeypatch)
    assert code == 2 and f"--ray '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port}" in text
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


_PLUGIN_PACKAGE = '''
from pydantic import Field

from fedproto.algorithms import FedProto
from fedproto.plugins import AlgorithmOptions


class JobsProto(FedProto):
    """Installed: an entry point of the fedproto.algorithms group."""

    name = "jobsproto"

    class Options(AlgorithmOptions):
        jobs_x: float = Field(1.0, description="x of the installed method")


class PyProto(FedProto):
    """Registered in Python by the user's process only (register_algorithm)."""

    name = "pyproto"

    class Options(AlgorithmOptions):
        py_y: int = Field(3, description="y of the method registered in Python")
'''


def test_reproduce_jobs_runs_with_an_installed_plugin(capsys, monkeypatch, tmp_path):
    from fedproto import plugins
    from fedproto.algorithms import register_algorithm

    site = tmp_path / "site"
    (site / "jobsplugin").mkdir(parents=True)
    (site / "jobsplugin" / "__init__.py").write_text(_PLUGIN_PACKAGE)
    info = site / "jobsplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jobsplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{plugins.GROUP}]\njobsproto = jobsplugin:JobsProto\n")
    monkeypatch.delenv(plugins.NO_ENTRY_POINTS, raising=False)  # a user's process: installed plug-ins load
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "jobs"
    args = ["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto,fedavg", "--seeds", "1",
            "--rounds", "1", "--out", str(out), "--jobs", "2", "--set", "jobs_x=2.5", "--set", "py_y=4",
            *[a for kv in TINY[:4] for a in ("--set", kv)]]
    with plugins.scope(entry_points=True):
        from jobsplugin import PyProto

        register_algorithm(PyProto)
        assert {"jobsproto", "pyproto"} <= set(plugins.algorithm_names())
        code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert "PicklingError" not in text and "2 cells: 2 run, 0 skipped, 0 failed" in text
    for m in ("fedproto", "fedavg"):  # each cell ran in its own process with every plug-in's options
        run = out / "runs" / f"digits-n2-{m}-s1"
        conf = json.loads((run / "config.json").read_text())
        assert (conf["algorithm"], conf["jobs_x"], conf["py_y"], conf["rounds"]) == (m, 2.5, 4, 1)
        assert json.loads((run / "summary.json").read_text())["rounds"] == 1


def test_files_a_ray_worker_returns_keep_models_and_prototypes_private(tmp_path):
    """A cell run on a worker that does not see the driver's folder: its files come back in the task's result.
    prototypes.npz and checkpoint.pt were written with the usual permissions there (0644); now 0600 in a 0700
    folder, as where the cell writes in place; the other files keep the usual ones."""
    import stat

    from fedproto.reproduce.raycells import write_files

    old = os.umask(0o022)
    try:
        cell = tmp_path / "runs" / "cell"
        write_files(cell, {"prototypes.npz": b"p", "checkpoint.pt": b"c", "metrics.jsonl": b"{}\n"})
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in cell.iterdir()}
    assert mode == {"prototypes.npz": 0o600, "checkpoint.pt": 0o600, "metrics.jsonl": 0o644}
    assert stat.S_IMODE(cell.stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match="outside the cell's folder"):
        write_files(cell, {"../elsewhere.npz": b"x"})
