"""The command line: bad input exits with code 2 and one clear message, no traceback."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from conftest import DATA, needs_mnist, run_cli

from fedproto.config.run_config import build_config


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (["--ways", "11"], "--ways 11 is more than the 10 classes of mnist; use --ways 10 or fewer"),
        (["--lambda-proto", "-1"], "--lambda-proto -1: Input should be greater than or equal to 0; use --lambda-proto "
                                  "0 or more"),
        (["--rounds", "0"], "--rounds 0"),
        (["--distance", "cosine"], "Invalid value for '--distance': 'cosine' is not one of"),
        (["--algorithm", "fedfoo"], "unknown algorithm 'fedfoo'"),
        (["--model", "foo", "--data-dir", "/nonexistent", "--no-download"], "unknown model 'foo'"),
        (["--bogus"], "No such option"),  # click < 8.2: "No such option: --bogus", later "... '--bogus'"
        (["--lr", "inf"], "--lr inf: Input should be a finite number"),
        (["--seed", "-1"], "--seed -1"),
        (["--threads", "100000"], "--threads 100000"),
        (["--name", "../escape"], "is not a plain folder name"),
        (["--clients", "abc"], "Invalid value for '--clients'"),
        # the fix in every message: a near name, the bound to respect (issue 41)
        (["--dataset", "mnits"], "unknown dataset 'mnits'; did you mean 'mnist'? choose one of mnist, femnist"),
        (["--clients", "0"], "--clients 0: Input should be greater than or equal to 1; use --clients 1 or more"),
        (["--participation", "0"], "--participation 0: Input should be greater than 0; give --participation a "
                                   "value above 0"),  # the value as typed, not 0.0
        (["--lr", "1000"], "--lr 1000: Input should be less than or equal to 100; use --lr 100 or less"),
        # a choice flag's near name, as TOML files and build_config give it
        (["--partition", "dirichlt"], "'dirichlt' is not one of 'fewshot', 'natural', 'dirichlet'; did you mean "
                                      "--partition dirichlet?"),
        (["--execution", "batchd"], "did you mean --execution batched?"),
        (["--aggregation", "medain"], "did you mean --aggregation median?"),
        (["--lr-schedule", "coss"], "did you mean --lr-schedule cosine?"),
        (["--model", "resnet19", "--data-dir", "/nonexistent", "--no-download"],
         "unknown model 'resnet19'; did you mean 'resnet18'? (known: cnn, cnn-mh, resnet18"),
    ],
)
def test_bad_config_exits_2_with_message(args, expect, capsys, monkeypatch, tmp_path):
    code, text = run_cli(["run", "--out-dir", str(tmp_path), *args], capsys, monkeypatch)
    assert code == 2
    assert expect in text
    assert "--bogus" in text or "--bogus" not in args
    assert "Traceback" not in text
    assert not any(tmp_path.iterdir())  # nothing written before validation passed


def test_usage_errors_exit_2(capsys, monkeypatch):
    code, text = run_cli(["plot"], capsys, monkeypatch)
    assert code == 2 and "Missing argument" in text and "Traceback" not in text


def test_help_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, text = run_cli(["run", "--help"], capsys, monkeypatch)
    assert code == 0 and "(default: mnist)" in text and "(default: 1234)" in text


def test_bad_toml_and_unknown_key(capsys, monkeypatch, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = [\n")
    code, text = run_cli(["run", "--config", str(bad)], capsys, monkeypatch)
    assert code == 2 and "not valid TOML" in text and "write each option as key = value" in text
    unk = tmp_path / "unk.toml"
    unk.write_text("roundz = 3\n")
    code, text = run_cli(["run", "--config", str(unk)], capsys, monkeypatch)
    assert code == 2 and "unknown option 'roundz'" in text


def test_missing_data_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FEDPROTO_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "nodata").mkdir()
    code, text = run_cli(["run", "--data-dir", str(tmp_path / "nodata"), "--no-download", "--rounds", "1",
                          "--out-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "train-images-idx3-ubyte" in text and "Traceback" not in text
    assert not any((tmp_path / "runs").glob("*"))  # no empty run folder left


@needs_mnist
def test_corrupt_data_and_capacity_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FEDPROTO_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "data" / "mnist"
    shutil.copytree(Path(DATA) / "mnist", folder)
    code, text = run_cli(["run", "--data-dir", str(tmp_path / "data"), "--clients", "200", "--shots", "400",
                          "--rounds", "1", "--out-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "runs short" in text and "short by" in text
    raw = bytearray(gzip.decompress((folder / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] ^= 0xFF
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    code, text = run_cli(["run", "--data-dir", str(tmp_path / "data"), "--no-download", "--rounds", "1",
                          "--out-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "t10k-labels-idx1-ubyte" in text and "Traceback" not in text


def test_toml_config_and_flag_override(capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nclients = 4\nways = 2\nshots = 20\nstdev = 1\ntest_shots = 8\nrounds = 5\n')
    code, text = run_cli(["run", "--config", str(cfg), "--rounds", "2", "--out-dir", str(tmp_path / "runs"),
                          "--name", "t", "-q"], capsys, monkeypatch)
    assert code == 0, text
    assert "nearest prototype" in text
    import json

    conf = json.loads((tmp_path / "runs" / "t" / "config.json").read_text())
    assert conf["rounds"] == 2 and conf["clients"] == 4 and conf["dataset"] == "digits"


def test_unwritable_out_dir_and_drop_last_without_batches(capsys, monkeypatch, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, text = run_cli(["run", "--dataset", "digits", "--rounds", "1", "--out-dir", str(afile)], capsys, monkeypatch)
    assert code == 2 and "cannot write the run directory" in text and "Traceback" not in text
    code, text = run_cli(["run", "--dataset", "digits", "--rounds", "1", "--batch-size", "1000", "--drop-last",
                          "--out-dir", str(tmp_path / "r")], capsys, monkeypatch)
    assert code == 2 and "--batch-size 1000 with --drop-last leaves clients" in text and "--keep-last" in text


def test_rerun_removes_stale_results_and_divergence_is_an_error(capsys, monkeypatch, tmp_path):
    args = ["run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--out-dir", str(tmp_path), "--name", "r"]
    assert run_cli(args, capsys, monkeypatch)[0] == 0
    run = tmp_path / "r"
    assert (run / "summary.json").is_file()
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    # a run that fails during set-up (an impossible partition) loses nothing of the finished one
    code, text = run_cli(args + ["--shots", "1000"], capsys, monkeypatch)
    assert code == 2 and "runs short" in text
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    # a second run in the same folder that fails part-way never mixes its files with the old run's:
    # the finished run is kept aside while it trains and put back (reported fault: it was deleted)
    code, text = run_cli(args[:6] + ["3"] + args[7:] + ["--lr", "100", "--weight-decay", "1", "--momentum", "0.99"],
                         capsys, monkeypatch)
    assert code == 2 and "training diverged" in text
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_plot_rejects_broken_metrics(capsys, monkeypatch, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": \n')
    code, text = run_cli(["plot", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "line 2 is not valid JSON" in text


def test_plot_draws_tsne_for_a_weight_sharing_run(capsys, monkeypatch, tmp_path):
    # fig. 2 also shows FedAvg: embeddings without global prototypes still give a t-SNE
    code, text = run_cli(["run", "--dataset", "digits", "--algorithm", "fedavg", "--clients", "3", "--rounds", "1",
                          "--out-dir", str(tmp_path), "--name", "avg"], capsys, monkeypatch)
    assert code == 0, text
    assert "ways 3, shots 10, 1 round (" in " ".join(text.split())  # one round, not "1 rounds"
    assert not (tmp_path / "avg" / "prototypes.npz").exists()
    code, text = run_cli(["plot", str(tmp_path / "avg")], capsys, monkeypatch)
    assert code == 0, text
    assert (tmp_path / "avg" / "tsne.png").stat().st_size > 1000 and "no t-SNE" not in text


def test_reproduce_threads_option(capsys, monkeypatch, tmp_path):
    out = tmp_path / "rep"
    base = ["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto", "--rounds", "1",
            "--out", str(out)]
    code, text = run_cli(base + ["--threads", "1", "--set", "threads=2"], capsys, monkeypatch)
    assert code == 2 and "disagree" in text
    code, text = run_cli(base + ["--threads", "1"], capsys, monkeypatch)
    assert code == 0, text
    conf = json.loads((out / "runs" / "digits-n2-fedproto-s1234" / "config.json").read_text())
    assert conf["threads"] == 1


def test_huge_batch_is_capped_and_damaged_run_folders_are_clear_errors(capsys, monkeypatch, tmp_path):
    # reported: --batch-size 20000000 (now above the bound) padded every step to that width (2.98 GiB of dropout masks)
    args = ["run", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--out-dir", str(tmp_path)]
    code, text = run_cli(args + ["--name", "big", "--batch-size", "9000000"], capsys, monkeypatch)
    assert code == 0, text
    code, text = run_cli(args + ["--name", "ref", "--batch-size", "100000"], capsys, monkeypatch)
    assert code == 0, text
    big = json.loads((tmp_path / "big" / "summary.json").read_text())["accuracy"]
    assert big == json.loads((tmp_path / "ref" / "summary.json").read_text())["accuracy"]  # same batches
    # plot on damaged files: one message naming the folder, exit 2, no traceback
    run = tmp_path / "big"
    (run / "config.json").write_text("[1, 2]")
    code, text = run_cli(["plot", str(run)], capsys, monkeypatch)
    assert code == 2 and "its files are damaged" in text and "Traceback" not in text
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"loss_ce": 1.0}\n')
    code, text = run_cli(["plot", str(run)], capsys, monkeypatch)
    assert code == 2 and "damaged" in text and "KeyError" in text


def test_reproduce_reruns_a_cell_whose_summary_is_damaged(capsys, monkeypatch, tmp_path):
    out = tmp_path / "rep"
    args = ["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto", "--rounds", "1",
            "--out", str(out)]
    assert run_cli(args, capsys, monkeypatch)[0] == 0
    (out / "runs" / "digits-n2-fedproto-s1234" / "summary.json").write_text('{"accuracy": {"acc": {"mean": "x"}}}')
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0 and "1 run, 0 skipped" in text, text
    (out / "table.md").unlink()
    (out / "table.md").mkdir()
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "table.md' is a folder" in text


def test_error_text_with_brackets_is_printed_whole(capsys, monkeypatch, tmp_path):
    # reported: rich read "[k - s + 1, ...]" in the message as markup and dropped it
    code, text = run_cli(["run", "--dataset", "digits", "--shots", "1", "--stdev", "3", "--out-dir", str(tmp_path)],
                         capsys, monkeypatch)
    assert code == 2 and "from [k - s + 1, ...] = [-1, ...], below 1 sample" in " ".join(text.split())


def test_option_spellings_duplicates_and_model_lists(capsys, monkeypatch, tmp_path):
    """TOML and --set accept '-' for '_' and 'lambda' for lambda_proto; a key given at the top
    level and under [run] is refused (reported: the [run] value silently won); so are model lists
    with an empty entry or more models than clients."""
    ok = tmp_path / "ok.toml"
    ok.write_text('dataset = "digits"\ntest-shots = 3\nlambda = 0.5\n')
    assert (build_config(ok).test_shots, build_config(ok).lambda_proto) == (3, 0.5)
    dup = tmp_path / "dup.toml"
    dup.write_text("ways = 3\n[run]\nways = 4\n")
    code, text = run_cli(["run", "--config", str(dup), "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "sets ways both at the top level and under [run]" in text
    for model, expect in (("cnn,", "has an empty entry"), ("cnn,,cnn", "has an empty entry"),
                          ("cnn,cnn-mh,cnn", "lists 3 models but --clients 2")):
        code, text = run_cli(["run", "--dataset", "digits", "--clients", "2", "--model", model, "--out-dir",
                              str(tmp_path)], capsys, monkeypatch)
        assert code == 2 and expect in text, (model, text)


def test_os_errors_are_one_line_errors(capsys, monkeypatch, tmp_path):
    """Reported: an over-long path gave an OSError traceback in run, plot and onboard."""
    long = str(tmp_path / ("a" * 300))
    for args in (["run", "--dataset", "digits", "--out-dir", long], ["plot", long], ["onboard", long],
                 ["run", "--config", long]):
        code, text = run_cli(args, capsys, monkeypatch)
        assert code == 2 and "Traceback" not in text and "too long" in text, (args, text)


def test_plot_refuses_a_truncated_npz(capsys, monkeypatch, tmp_path):
    args = ["run", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--out-dir", str(tmp_path), "--name", "p"]
    assert run_cli(args, capsys, monkeypatch)[0] == 0
    npz = tmp_path / "p" / "embeddings.npz"
    npz.write_bytes(npz.read_bytes()[:300])
    code, text = run_cli(["plot", str(tmp_path / "p")], capsys, monkeypatch)
    assert code == 2 and "damaged" in text and "BadZipFile" in text and "Traceback" not in text, text


def test_version(capsys, monkeypatch):
    from fedproto import __version__

    code, text = run_cli(["--version"], capsys, monkeypatch)
    assert code == 0 and text.strip() == f"fedproto {__version__}"


@pytest.mark.parametrize("toml, expect", [
    ("rounds = 1979-05-27\n", "rounds = 1979-05-27 in '{f}': Input should be a valid integer"),
    ("lr = 07:32:00\n", "lr = 07:32:00 in '{f}': Input should be a valid number"),
    ('rounds = "3"\n', "rounds = \"3\" in '{f}': Input should be a valid integer"),
    ('download = "yes"\n', "download = \"yes\" in '{f}': Input should be a valid boolean"),
    ('model = ["cnn"]\n', "model = [\"cnn\"] in '{f}': Input should be a valid string"),
    ("ways = 11\n", "ways = 11 in '{f}' is more than the 10 classes of mnist"),
    ("Rounds = 1\n", "unknown option 'Rounds' in '{f}'; did you mean 'rounds'?"),
    ("test-shotz = 1\n", "unknown option 'test-shotz' in '{f}'; did you mean 'test_shots'?"),
])
def test_toml_values_are_named_as_toml_keys(toml, expect, capsys, monkeypatch, tmp_path):
    """Reported: a TOML date crashed (TypeError, exit 1); TOML values were worded as flags
    ('--rounds 3' for rounds = "3"); an unknown key listed all 70 options with no suggestion."""
    f = tmp_path / "c.toml"
    f.write_text(toml)
    code, text = run_cli(["run", "--config", str(f), "--out-dir", str(tmp_path / "o")], capsys, monkeypatch)
    text = " ".join(text.split())
    assert code == 2 and expect.format(f=f) in text and "Traceback" not in text, text
    assert "--" not in text.split("error:")[1].split(";")[0]  # no flag wording for a file value
    assert "known options:" not in text


def test_flag_values_stay_flags_over_a_toml_file(capsys, monkeypatch, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('rounds = 2\ndataset = "digits"\n')
    code, text = run_cli(["run", "--config", str(f), "--lr", "1000", "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "--lr 1000: Input should be less than or equal to 100" in text


@pytest.mark.parametrize("args, expect", [
    (["run", "--device", "cuda:abc"], "--device cuda:abc:"),
    (["run", "--name", "a:fire:b"], "--name a:fire:b is not"),
    (["run", "--model", "projcnn:smile:"], "'projcnn:smile:'"),
    (["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto", "--set", "device=cuda:abc"],
     "--set device=cuda:abc:"),
])
def test_user_values_are_printed_as_typed_not_as_emoji(args, expect, capsys, monkeypatch, tmp_path):
    """Reported: rich read ':abc:' and ':fire:' in error text as emoji codes."""
    code, text = run_cli([*args, "--out-dir" if args[0] == "run" else "--out", str(tmp_path / "o")],
                         capsys, monkeypatch)
    assert code == 2 and expect in " ".join(text.split()) and "🔤" not in text and "🔥" not in text, text


def test_consoles_print_emoji_codes_as_text():
    from fedproto.cli.app import console, err_console

    for c in (console, err_console):
        with c.capture() as cap:
            c.print("/tmp/x:fire:y")
        assert cap.get().strip() == "/tmp/x:fire:y"


def test_reproduce_set_and_sweep_values_are_worded_as_given(capsys, monkeypatch, tmp_path):
    base = ["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto", "--out", str(tmp_path / "o")]
    code, text = run_cli(base + ["--set", "lr=1979-05-27"], capsys, monkeypatch)
    assert code == 2 and "--set lr=1979-05-27: Input should be a valid number" in text, text
    code, text = run_cli(base + ["--sweep", "lambda=abc"], capsys, monkeypatch)
    assert code == 2 and "--sweep lambda=abc: Input should be a valid number" in text and "--set" not in text, text
    code, text = run_cli(base + ["--set", "rouns=3"], capsys, monkeypatch)
    assert code == 2 and "unknown option 'rouns'; did you mean 'rounds'?" in text
    assert "known options" not in text
    code, text = run_cli(base + ["--set", "lambda=abc"], capsys, monkeypatch)  # named as typed, with the fix
    assert code == 2 and "--set lambda=abc: Input should be a valid number; give --set lambda=... a number" in text
    assert "lambda_proto" not in text, text
    code, text = run_cli(base + ["--set", 'lr="0.1"'], capsys, monkeypatch)
    assert code == 2 and '--set lr="0.1": Input should be a valid number; write it without quotes: --set lr=0.1' \
        in " ".join(text.split()), text
    code, text = run_cli(base + ["--set", "device=gpu"], capsys, monkeypatch)
    assert code == 2 and "--set device=gpu: should be one of auto, cpu, cuda, cuda:N, mps; did you mean --set " \
        "device=cuda?" in " ".join(text.split()), text


def test_participation_above_the_client_count_says_so(capsys, monkeypatch, tmp_path):
    """Reported: '--participation 4 --clients 3' said '4.0 is neither a fraction nor a whole number'."""
    code, text = run_cli(["run", "--dataset", "digits", "--participation", "4", "--clients", "3", "--out-dir",
                          str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "--participation 4 is more than --clients 3" in text and "neither" not in text, text
    from fedproto.engine.seeding import sample_clients

    with pytest.raises(ValueError, match="participation=4 is more than the 3 clients"):
        sample_clients(1, 1, 3, 4.0)


@pytest.mark.parametrize("args", [["-h"], ["reproduce", "-h"], ["run", "-h"], ["plot", "-h"]])
def test_short_help_option(args, capsys, monkeypatch):
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0 and "Usage:" in text and "No such option" not in text, text


@pytest.mark.parametrize("args, expect", [
    (["--lambda-proto", "1", "--lambda", "2"], "--lambda-proto and --lambda both set lambda_proto; give it once"),
    (["--lr", "1", "--lr=2"], "--lr is given twice; give it once"),
    (["--drop-last", "--keep-last"], "--drop-last and --keep-last both set drop_last"),
    (["--rounds=1_0"], "'1_0' is not a valid integer"),
    (["--lr", "0.0_1"], "'0.0_1' is not a valid float"),
])
def test_run_refuses_an_option_twice_and_digit_separators(args, expect, capsys, monkeypatch, tmp_path):
    code, text = run_cli(["run", "--out-dir", str(tmp_path), *args], capsys, monkeypatch)
    assert code == 2 and expect in " ".join(t.strip("│ ") for t in text.split()), text
    assert not any(tmp_path.iterdir())


def test_run_option_value_that_looks_like_a_flag_is_no_duplicate(capsys, monkeypatch, tmp_path):
    code, text = run_cli(["run", "-q", "-q", "--dataset", "digits", "--name", "--lr", "--lr", "0.1", "--out-dir",
                          str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "--name --lr is not a plain folder name" in text, text


@pytest.mark.parametrize("args, expect", [
    (["--seeds", "1,,2"], "--seeds '1,,2' has an empty item"),
    (["--seeds", "1_0"], "--seeds: '1_0' is not a valid value"),
    (["--sweep", "lambda=1,,2"], "--sweep 'lambda=1,,2' has an empty value"),
])
def test_reproduce_refuses_empty_list_items(args, expect, capsys, monkeypatch, tmp_path):
    code, text = run_cli(["reproduce", "--datasets", "digits", "--ways", "2", "--methods", "fedproto", "--out",
                          str(tmp_path / "o"), *args], capsys, monkeypatch)
    assert code == 2 and expect in text, text


def test_run_help_names_toml_keys_of_switches(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, text = run_cli(["run", "--help"], capsys, monkeypatch)
    text = " ".join(text.split())
    assert code == 0 and "drop_last = false" in text and "download = false" in text
    assert "is also a key" not in text


def test_progress_off_a_terminal_is_one_line_per_evaluated_round(capsys, monkeypatch, tmp_path):
    """Output to a file or a CI log (stderr no terminal): one plain line per evaluated round with the
    round, the losses, the accuracies and the elapsed time, matching metrics.jsonl; --quiet: none."""
    args = ["run", "--dataset", "digits", "--clients", "3", "--rounds", "4", "--eval-every", "2", "--threads", "1",
            "--out-dir", str(tmp_path), "--name", "r"]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    lines = [line for line in text.splitlines() if line.startswith("round ")]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "acc_mean" in r]
    assert [r["round"] for r in evaluated] == [2, 4] and len(lines) == 2
    for line, r in zip(lines, evaluated):
        assert line.startswith(f"round {r['round']}/4: loss ce {r['loss_ce']:.4f}, proto {r['loss_proto']:.4f}; "
                               f"accuracy % classifier {100 * r['acc_mean']:.2f}, nearest prototype "
                               f"{100 * r['acc_proto_mean']:.2f}; elapsed "), line
        assert line.endswith(" s")
    elapsed = [float(line.split("elapsed ")[1][:-2]) for line in lines]
    assert 0 <= elapsed[0] <= elapsed[1], elapsed
    code, text = run_cli([*args, "--quiet"], capsys, monkeypatch)
    assert code == 0 and not [line for line in text.splitlines() if line.startswith("round ")], text


@pytest.mark.parametrize("args, named", [
    (["--dataset", "custom"], "--dataset custom"),  # was: "--dataset custom needs --classes", a hidden flag
    (["--dataset", "digits", "--classes", "3"], "--classes"),  # was: "applies to --dataset custom only"
    (["--dataset", "custom", "--classes", "3"], "--dataset custom"),
])
def test_cli_refuses_python_only_custom_and_classes_at_once(args, named, capsys, monkeypatch, tmp_path):
    from conftest import run_cli

    code, out = run_cli(["run", *args, "--threads", "1", "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2, out
    assert f"error: {named} is for your own clients, built from Python with fedproto.federation.federate(" in out
    assert "needs --classes" not in out and not any(tmp_path.iterdir())


@pytest.mark.parametrize("toml, named", [
    ('dataset = "custom"\nclasses = 3\n', 'dataset = "custom" in'),
    ('[run]\ndataset = "digits"\nclasses = 3\n', "classes in"),
])
def test_cli_refuses_python_only_options_from_the_config_file(toml, named, capsys, monkeypatch, tmp_path):
    """Options only the Python API can give are refused by name from a TOML file; dataset = "custom"
    there is refused as such, not with a misleading "needs --classes"."""
    from conftest import run_cli

    f = tmp_path / "run.toml"
    f.write_text(toml)
    code, out = run_cli(["run", "--config", str(f), "--threads", "1", "--out-dir", str(tmp_path / "runs")], capsys,
                        monkeypatch)
    assert code == 2, out
    assert f"error: {named} '{f}' is for your own clients, built from Python with fedproto.federation.federate(" in out
    assert "needs --classes" not in out and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [["run", "--bogus"], ["run", "--rounds", "abc"], ["plot"], ["reproduce", "--bogus"]])
def test_usage_errors_have_the_one_error_style(args, capsys, monkeypatch):
    """click's refusals read like every other bad input: one ``error:`` line with the fix, exit 2, no box."""
    code, text = run_cli(args, capsys, monkeypatch)
    lines = [x for x in text.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, text
    assert lines[0].startswith("error: ") and lines[0].endswith(f"see fedproto {args[0]} --help"), text
    assert "╭" not in text and "Traceback" not in text


@pytest.mark.parametrize("where", ["front", "after-run", "last"])
def test_verbose_is_read_anywhere(where, capsys, monkeypatch, tmp_path):
    """``-v`` was read only before ``run``; after it, it was an unknown option."""
    import logging

    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    run = ["run", "--dataset", "digits", "--rounds", "1", "--clients", "3", "--threads", "1", "-q",
           "--out-dir", str(tmp_path)]
    args = {"front": ["-v", *run], "after-run": ["run", "-v", *run[1:]], "last": [*run, "--verbose"]}[where]
    code, text = run_cli(args, capsys, monkeypatch)
    assert code == 0, text
    assert logging.getLogger().level == logging.INFO


@needs_mnist
def test_config_json_says_where_the_data_came_from(capsys, monkeypatch, tmp_path):
    """config.json said ``data_dir: null`` when $FEDPROTO_DATA supplied the files: it now names the folders
    searched, in order, and the variable's value."""
    monkeypatch.setenv("FEDPROTO_DATA", DATA)
    code, text = run_cli(["run", "--rounds", "1", "--clients", "2", "--ways", "2", "--shots", "5", "--test-shots", "5",
                          "--stdev", "0", "--eval-every", "0", "--threads", "1", "-q", "--no-download",
                          "--out-dir", str(tmp_path), "--name", "m"], capsys, monkeypatch)
    assert code == 0, text
    source = json.loads((tmp_path / "m" / "config.json").read_text())["data_source"]
    assert source["kind"] == "files" and source["data_dir"] is None and source["FEDPROTO_DATA"] == DATA
    assert source["searched"][0] == DATA


def test_an_unknown_dataset_is_answered_with_the_datasets_the_help_lists(capsys, monkeypatch, tmp_path):
    """The command line offers the datasets its help lists (custom, for your own clients, is built
    from Python and refused here); Python's build_config offers custom as well."""
    from fedproto.config.run_config import RunConfig, build_config
    from fedproto.data.registry import DATASETS
    from fedproto.errors import ConfigError

    listed = RunConfig.model_fields["dataset"].description.removeprefix("Dataset: ").split(" | ")
    assert sorted(listed) == sorted(n for n in DATASETS if n != "custom")
    code, text = run_cli(["run", "--out-dir", str(tmp_path), "--dataset", "foo"], capsys, monkeypatch)
    assert code == 2 and f"unknown dataset 'foo'; choose one of {', '.join(listed)}" in text, text
    assert "custom" not in text
    with pytest.raises(ConfigError, match="custom"):
        build_config(overrides={"dataset": "foo"})


@pytest.mark.parametrize("value", ["nan", "inf", "-1.0"])
def test_a_bad_number_in_the_config_file_is_named_as_its_line(value, capsys, monkeypatch, tmp_path):
    """``lr = nan`` was named as the flag ``--lr nan`` (NaN is not equal to itself), ``inf`` as its line."""
    from conftest import run_cli

    f = tmp_path / "c.toml"
    f.write_text(f"lr = {value}\n")
    code, out = run_cli(["run", "--config", str(f), "--dataset", "digits", "--out-dir", str(tmp_path / "runs")],
                        capsys, monkeypatch)
    assert code == 2 and f"lr = {value} in '{f}'" in out and "--lr" not in out, out


def test_reproduce_refuses_an_unreachable_ray_address_within_3_s(tmp_path):
    """The drill: `--ray 127.0.0.1:1` was refused clearly but after 11-17 s on a loaded machine (torch and Ray
    were imported first). Now the address is checked before anything heavy is imported: refused (status 2)
    in under 3 s, with neither torch nor ray loaded, and no output folder made."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "grid"
    code = ("import atexit, sys; atexit.register(lambda: print('heavy:', [m for m in ('torch', 'ray') "
            "if m in sys.modules], file=sys.stderr)); from fedproto.cli.app import main; "
            f"sys.argv = ['fedproto', 'reproduce', '--grid', 'hetero', '--datasets', 'digits', '--out', {str(out)!r}, "
            f"'--ray', '127.0.0.1:{port}']; main()")
    src = str(Path(__file__).resolve().parents[2] / "src")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": src})
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"--ray '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} within 2 s" in p.stderr
    assert "start the cluster (ray start --head)" in p.stderr
    assert "heavy: []" in p.stderr
    assert took < 3, took
    assert not out.exists()
