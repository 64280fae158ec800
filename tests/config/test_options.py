"""One source for every option: RunConfig's fields give the flags, their help, the TOML keys and
the options page; errors name options the way each front end spells them; one dataset registry."""

import re
from pathlib import Path
from typing import Optional

import pytest
from conftest import DOCS, run_cli
from pydantic import Field

import fedproto.config.run_config as config
import fedproto.config.run_options as options
from fedproto.config.run_config import RunConfig, build_config
from fedproto.errors import ConfigError, opt, python_wording


def _sample(name: str):
    """A valid value of a field for a TOML file: its default, else mnist's default, else a value
    that fits its type."""
    cfg = RunConfig()
    value = getattr(cfg, name)
    if value is not None:
        return value
    return {"lambda_proto": 0.5, "data_dir": "/tmp", "pretrained": None, "name": "x", "classes": None,
            "server_epochs": 5, "server_lr": 0.1, "server_batch_size": 4}[name]


def test_flags_toml_keys_and_options_page_agree(tmp_path):
    """Every RunConfig field is a `fedproto run` flag whose help is the field's description and
    default, a TOML key that reaches the same field, and a row of docs/options.md (which is the
    generator's current output, so it is never stale)."""
    from fedproto.cli.app import run_command

    params = {p.name: p for p in run_command().params}
    fields = RunConfig.model_fields
    assert set(fields) <= set(params) and set(params) - set(fields) == {"config", "resume", "quiet"}
    page = (DOCS / "options.md").read_text(encoding="utf-8")
    assert page == options.fill_options_page(page), (
        "docs/options.md is stale: run `python -m fedproto.config.run_options docs/options.md`")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_0-9]+)`.*$", page, re.M)}
    assert set(rows) == set(fields)
    for name, info in fields.items():
        p = params[name]
        assert options.flag(name) in p.opts, name
        assert info.description and p.help.startswith(info.description.strip()), name
        for f in options.flags(name):
            assert f"`{f}`" in rows[name], (name, f)
        assert all(f in p.opts + p.secondary_opts for f in options.flags(name)), name
        value = _sample(name)
        if value is None:
            continue
        toml = tmp_path / f"{name}.toml"
        literal = (str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str)
                   else repr(value))
        toml.write_text(f"{name} = {literal}\n")
        assert getattr(build_config(toml), name) == (value if name != "data_dir" else str(Path(value).resolve())), name
    # aliases: `lambda` is a TOML key and a flag of lambda_proto
    toml = tmp_path / "alias.toml"
    toml.write_text("lambda = 0.25\n")
    assert build_config(toml).lambda_proto == 0.25
    assert "--lambda" in params["lambda_proto"].opts and "--keep-last" in params["drop_last"].secondary_opts


def test_a_new_field_becomes_a_flag_and_a_row_with_no_other_edit(monkeypatch):
    """What the lead's RunConfig fields get: `Field(default, ge=..., description=...)` is enough."""

    class Extended(RunConfig):
        clip_norm: Optional[float] = Field(None, ge=0.0, description="Clip client updates to this norm")
        robust_trim: int = Field(2, ge=0, description="Trimmed-mean: drop this many on each side")
        secure: bool = Field(False, description="Add secure aggregation")

    monkeypatch.setattr(config, "config_model", lambda: Extended)
    by_name = {p.name: p for p in options.run_params()}
    assert by_name["robust_trim"].opts == ["--robust-trim"]
    assert by_name["robust_trim"].help == "Trimmed-mean: drop this many on each side (default: 2)"
    assert by_name["clip_norm"].type.name == "float" and by_name["clip_norm"].help == "Clip client updates to this norm"
    assert by_name["secure"].opts == ["--secure"] and by_name["secure"].secondary_opts == ["--no-secure"]
    table = options.options_markdown()
    assert "| `robust_trim` | `--robust-trim` | integer | 2 | Trimmed-mean: drop this many on each side |" in table


def test_run_help_reads_at_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, text = run_cli(["run", "--help"], capsys, monkeypatch)
    assert code == 0
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in RunConfig.model_fields:
        if name == "classes":  # python_only: set by fedproto.federation, not offered
            continue
        for f in options.flags(name):  # every flag in full, none cut short
            assert re.search(re.escape(f) + r"(?![a-z-])", text), f
    switches = [line for line in text.splitlines() if "--download / --no-download" in line]
    assert switches and switches[0].split("--no-download")[1].startswith("  ")  # no metavar after a switch
    flat = " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())  # the text without the panels' borders
    assert "<bool>" not in text and "(default: mnist)" in flat and "(default: 1234)" in flat
    from fedproto.data.registry import DATASETS, LOADABLE

    rounds = ", ".join(f"{n} {DATASETS[n].rounds}" for n in LOADABLE)  # a dataset added to the registry shows
    assert f"(default: per dataset: {rounds})" in flat


def test_run_help_groups_every_option_in_its_panel(capsys, monkeypatch):
    """Every RunConfig field is listed once in options.PANELS; `fedproto run --help` shows the
    panels in that order, each flag inside its own panel; the options page has the same sections;
    dataset custom (and --classes, which only it takes) is not offered where the CLI refuses it."""
    listed = [n for names in options.PANELS.values() for n in names]
    assert sorted(listed) == sorted(RunConfig.model_fields), "list every RunConfig field once in options.PANELS"
    monkeypatch.setenv("COLUMNS", "100")
    code, text = run_cli(["run", "--help"], capsys, monkeypatch)
    assert code == 0
    titles = re.findall(r"^╭─ (.+?) ─", text, re.M)
    assert titles == ["Options", *options.PANELS], titles
    blocks = dict(zip(titles, re.split(r"^╭─ .+$", text, flags=re.M)[1:]))
    for panel, names in options.PANELS.items():
        for name in names:
            if name != "classes":
                assert re.search(r"│ " + re.escape(options.flag(name)) + r"[ ,/]", blocks[panel]), (panel, name)
    assert "--resume" in blocks["Execution"] and "--quiet" in blocks["Output"] and "--config" in blocks["Options"]
    assert "custom" not in text and "--classes" not in text
    sections = re.findall(r"^### (.+)$", options.options_markdown(), re.M)
    assert sections == list(options.PANELS)
    code, out = run_cli(["run", "--dataset", "custom"], capsys, monkeypatch)
    assert code == 2 and "fedproto.federation.federate" in out  # why custom is not offered


def test_errors_name_the_option_as_each_front_end_spells_it():
    from fedproto.config.run_options import cli_wording, flower_wording, set_wording

    with pytest.raises(ConfigError) as e:
        build_config(overrides={"lambda_proto": -1.0})
    err = e.value
    assert (err.option, err.value) == ("lambda_proto", -1.0)
    assert str(err).startswith("invalid configuration: lambda_proto=-1.0: Input should be greater")
    assert err.render(cli_wording).startswith("invalid configuration: --lambda-proto -1.0: Input")
    assert err.render(set_wording).startswith("invalid configuration: --set lambda_proto=-1.0: Input")
    assert err.render(flower_wording).startswith("invalid configuration: lambda-proto=-1.0: Input")
    with pytest.raises(ConfigError) as e:
        build_config(overrides={"ways": 11})
    assert (e.value.option, e.value.value, e.value.hint) == ("ways", 11, f"use {opt('ways', 10)} or fewer")
    assert e.value.render(cli_wording) == "invalid configuration: --ways 11 is more than the 10 classes of mnist; " \
                                          "use --ways 10 or fewer"
    # switches, the grid's own options and two alternatives
    assert cli_wording("drop_last", False) == "--keep-last"
    assert set_wording("drop_last", False) == "--set drop_last=false"
    assert python_wording("drop_last", False) == "drop_last=False"
    assert flower_wording("noise", "gaussian") == 'noise="gaussian"'
    assert set_wording("ways", 3) == "--ways 3" and set_wording("out_dir|name") == "--out"
    assert cli_wording("out_dir|name") == "--out-dir / --name" and cli_wording("data_dir", "a b") == "--data-dir 'a b'"
    assert cli_wording("resume") == "--resume" and python_wording("resume") == "resume=True"
    # a prefix keeps the references
    assert ConfigError(f"use {opt('lr')}").prefixed("cell x: ").render(set_wording) == "cell x: use --set lr=..."


def test_option_references_hold_any_value():
    """Reported: a TOML date in an error message raised TypeError from json.dumps."""
    import datetime

    from fedproto.config.run_options import cli_wording, flower_wording, set_wording
    from fedproto.errors import ConfigError, opt

    e = ConfigError(f"{opt('rounds', datetime.date(1979, 5, 27))} and {opt('lr', datetime.time(7, 32))} and "
                    f"{opt('name', object.__new__(type('Odd', (), {'__repr__': lambda s: 'odd'})))}")
    assert e.render(cli_wording) == "--rounds 1979-05-27 and --lr 07:32:00 and --name odd"
    assert e.render(set_wording).startswith("--rounds 1979-05-27 and --set lr=07:32:00")
    assert str(e).startswith("rounds=1979-05-27 and lr=07:32:00")
    assert flower_wording("rounds", "3") == 'rounds="3"'
    assert ConfigError(opt("x", {(1, 2): 3})).render(cli_wording)  # keys JSON cannot hold


def test_unknown_keys_get_a_suggestion_per_front_end():
    from fedproto.config.run_config import build_config
    from fedproto.config.run_options import FLOWER_KEYS, cli_wording, flower_wording
    from fedproto.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build_config(overrides={"round_timout": 5})
    assert "did you mean 'round-timeout'?" in info.value.render(flower_wording)
    assert "did you mean 'round_timeout'" not in info.value.render(cli_wording)  # no Flower key for fedproto run
    with pytest.raises(ConfigError) as info:
        build_config(overrides={"rouns": 5})
    assert "did you mean 'rounds'?" in str(info.value) and "known options" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_config(overrides={"xyzzy": 5})
    assert "known options: dataset, classes" in str(info.value)
    try:
        from fedproto.flower.records import FLOWER_KEYS as flower_keys
    except ImportError:
        return
    assert FLOWER_KEYS == flower_keys
