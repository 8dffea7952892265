"""Each process's settings model (`pipeline.runtime.settings`, `pipeline.tools.launcher_settings`, each
`pipeline` subcommand's in `pipeline.cli`): its flags, the `PIPELINE_*` variables they default from, and the
groups the processes share."""

import argparse
from pathlib import Path

import pytest

from pipeline import cli, docgen
from pipeline.cli import build_parser
from pipeline.runtime import router_settings, server_settings, service_settings, settings
from pipeline.runtime.client_settings import Client
from pipeline.runtime.service_settings import Repository
from pipeline.runtime.settings_cli import ProcessSettings, SettingError, add_arguments
from pipeline.stage.service import python_service_parser
from pipeline.tools import launcher_settings
from pipeline.tools.autoscaler import Autoscaling
from pipeline.tools.bench.bench_settings import BenchOutput, BenchTarget, Workload
from pipeline.tools.infer import InferRequest, InferSettings, InferTarget
from pipeline.tools.launcher_settings import LauncherSettings
from pipeline.tools.supervisor import RestartPolicy
from pipeline.tools.trace_view import TraceChoice
from services.model.__main__ import build_parser as model_parser
from services.model.quantize import QuantizeSettings, QuantizeTarget


def parse(model: type[ProcessSettings], argv: list[str]) -> ProcessSettings:
    """The settings a command line gives, as a process reads them (parsed once into its model)."""
    parser = argparse.ArgumentParser(prog="test")
    add_arguments(parser, model)
    return model.parse(parser, argv)


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    assert parse(router_settings.RouterSettings, []).cache_size == 0
    monkeypatch.setenv("PIPELINE_CACHE_SIZE", "64M")
    assert parse(router_settings.RouterSettings, []).cache_size == 64 << 20
    assert parse(router_settings.RouterSettings, ["--cache-size", "1k"]).cache_size == 1024
    monkeypatch.setenv("PIPELINE_PREPROCESS_METRICS_PORT", "off")
    args = python_service_parser("preprocess").parse_args([])
    assert args.metrics_port is None and args.port == 8101
    assert python_service_parser("preprocess").parse_args(["--metrics-port", "9"]).metrics_port == 9
    # Another service's variables are its own.
    assert python_service_parser("postprocess").parse_args([]).metrics_port == 8203


def test_a_variable_is_read_as_its_flags_text_is(monkeypatch):
    monkeypatch.setenv("PIPELINE_TLS_IDENTITIES", "a, b")
    monkeypatch.setenv("PIPELINE_STRICT_READINESS", "false")
    monkeypatch.setenv("PIPELINE_ENSEMBLES", "here")
    model = router_settings.RouterSettings().model_dump()
    assert model["tls_identities"] == frozenset({"a", "b"}) and model["strict_readiness"] is False
    assert model["ensembles"] == [Path("here")] and model["workers"] == 1
    args = parse(router_settings.RouterSettings, ["--tls-identities", "c", "--ensembles", "x", "y"])
    assert args.tls_identities == frozenset({"c"}) and args.ensembles == [Path("x"), Path("y")]
    assert args.strict_readiness is False and args.stage is None


def test_an_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("PIPELINE_MAX_MESSAGE_MB", "  ")
    monkeypatch.setenv("PIPELINE_MODEL_DIR", "")
    args = model_parser().parse_args([])
    assert args.max_message_mb == 64 and args.model_dir == Path("model_repository")


def test_a_variable_that_does_not_parse_is_named(monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_CACHE_SIZE", "lots")
    with pytest.raises(SettingError, match="PIPELINE_CACHE_SIZE='lots': expected a size in bytes"):
        router_settings.RouterSettings()
    with pytest.raises(SystemExit) as exit:
        build_parser()
    assert exit.value.code == 2
    assert "PIPELINE_CACHE_SIZE='lots'" in capsys.readouterr().err


def test_a_variable_without_a_flag_is_read_the_same_way(monkeypatch, capsys):
    """A setting that no flag sets (a secret, or what no command line needs) is a field of its group with a
    variable: read with the others when the command line is parsed, blank as unset, a bad value named."""
    model = service_settings.ModelServiceSettings
    assert "--max-connection-age-s" not in model_parser().format_help()
    settings = parse(model, [])
    assert settings.group(server_settings.Limits).max_connection_age_s == 30.0
    assert settings.group(server_settings.Security).auth_tokens is None
    monkeypatch.setenv("PIPELINE_MAX_CONNECTION_AGE_S", " 5 ")
    monkeypatch.setenv("PIPELINE_AUTH_TOKENS", "a,b")
    monkeypatch.setenv("PIPELINE_STAGE_TOKEN_FILE", " ")
    settings = parse(model, [])
    assert settings.group(server_settings.Limits).max_connection_age_s == 5.0
    assert settings.group(server_settings.Security).auth_tokens == "a,b"
    assert settings.group(server_settings.StageToken).stage_token_file is None
    monkeypatch.setenv("PIPELINE_MAX_CONNECTION_AGE_S", "soon")
    with pytest.raises(SettingError, match="PIPELINE_MAX_CONNECTION_AGE_S='soon'"):
        model()
    with pytest.raises(SystemExit):
        parse(model, [])
    assert "PIPELINE_MAX_CONNECTION_AGE_S='soon'" in capsys.readouterr().err


def test_a_value_the_model_refuses_in_code_is_named():
    """The model service's runners refuse a device or a thread count given in code as on the command line."""
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        service_settings.Runners(device="tpu")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        service_settings.Runners(torch_threads=0)
    with pytest.raises(SettingError, match="--torch-threads: Input should be greater than or equal to 1"):
        service_settings.ModelServiceSettings.of(argparse.Namespace(torch_threads=0))


def test_a_flag_that_does_not_parse_is_named(capsys):
    with pytest.raises(SystemExit):
        parse(router_settings.RouterSettings, ["--max-batch-items", "0"])
    assert "argument --max-batch-items: must be at least 1, got 0" in capsys.readouterr().err


def test_load_model_flags_replace_the_variables_list(monkeypatch):
    monkeypatch.setenv("PIPELINE_MODEL_LOAD_MODEL", "a, b")
    assert model_parser().parse_args([]).load_model == ["a", "b"]
    assert model_parser().parse_args(["--load-model", "c", "--load-model", "d"]).load_model == ["c", "d"]
    assert model_parser().parse_args([]).load_model == ["a", "b"]  # the default is not changed by a parse


def test_the_router_and_the_stage_services_share_their_groups():
    stages = [service_settings.stage_settings("preprocess"), service_settings.stage_settings("postprocess")]
    stages.append(service_settings.ModelServiceSettings)
    for group in (
        server_settings.Limits,
        server_settings.Shutdown,
        server_settings.Security,
        server_settings.Logging,
        server_settings.ModelControl,
    ):
        assert group in router_settings.RouterSettings.groups
        for stage in stages:
            assert group in stage.groups and issubclass(stage, group)
            for name in group.model_fields:
                assert (
                    stage.model_fields[name].default
                    == router_settings.RouterSettings.model_fields[name].default
                )
    assert server_settings.listening("model") is server_settings.listening("model")
    assert service_settings.stage_settings("preprocess") is service_settings.stage_settings("preprocess")


def test_the_reference_lists_every_variable_with_the_flags_that_read_it():
    page = docgen.generate()["environment.md"]
    for command, model in [("pipeline run", LauncherSettings), *settings.processes().items()]:
        for name, option, _ in model.options():
            assert name == option.flags[0][2:].replace("-", "_")  # the flag's argparse attribute
            if option.env is not None:
                [row] = [line for line in page.splitlines() if line.startswith(f"| `{option.env}` |")]
                assert f"`{option.flags[0]}` of" in row, (command, option.env)


def test_the_launchers_restart_defaults_are_the_supervisors(monkeypatch):
    monkeypatch.setenv("PIPELINE_PREPROCESS_PORT", "9101")
    command, settings = cli.parse(["run", "--autoscale", "model=1:3", "--replicas", "preprocess=2"])
    assert command.settings is LauncherSettings
    restarts = settings.group(launcher_settings.Restarts)
    assert (restarts.restart_limit, restarts.restart_window) == (
        RestartPolicy().limit,
        RestartPolicy().window,
    )
    assert settings.group(Autoscaling).autoscale == {"model": (1, 3)}
    assert settings.group(launcher_settings.LauncherSecurity).replicas == {"preprocess": 2}
    ports = settings.group(launcher_settings.LauncherStagePorts).stage_ports()
    assert ports == {"preprocess": 9101, "model": 8102, "postprocess": 8103}


def test_each_subcommand_reads_its_command_line_into_its_settings(monkeypatch, tmp_path):
    """`pipeline infer`, `bench`, `trace` and `quantize` parse into their models: positional arguments,
    flags the command line must give, flags whose attribute is not their name, and the client's variables."""
    monkeypatch.setenv("PIPELINE_URL", "server:1")
    _, settings = cli.parse(["infer", "a.png", "b.png", "-m", "digits", "--json", "--value", "X=1"])
    assert settings.group(Client).url == "server:1"
    target = settings.group(InferTarget)
    assert target.files == ["a.png", "b.png"] and target.model == "digits"
    request = settings.group(InferRequest)
    assert request.as_json and request.value == ["X=1"] and request.timeout == 30.0 and not request.stream
    _, settings = cli.parse(["bench", "-m", "m", "--rate", "5,10", "--json", "out.json", "--no-progress"])
    assert settings.group(BenchTarget).model == "m" and settings.group(Workload).rate == [5.0, 10.0]
    assert settings.group(Workload).concurrency == [1]
    output = settings.group(BenchOutput)
    assert output.json_file == Path("out.json") and output.progress is False
    _, settings = cli.parse(["trace", str(tmp_path / "spans.jsonl"), "--trace-id", "ab"])
    choice = settings.group(TraceChoice)
    assert (choice.file, choice.trace_id, choice.last) == (tmp_path / "spans.jsonl", "ab", False)
    _, settings = cli.parse(["quantize", "tiny", "--per-tensor", "--model-dir", str(tmp_path)])
    assert settings.group(QuantizeTarget).model == "tiny" and settings.group(Repository).model_dir == tmp_path
    assert settings.group(QuantizeSettings).per_channel is False


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["infer", "a.png"], "the following arguments are required: --model/-m"),
        (
            ["bench", "-m", "m", "--concurrency", "1", "--rate", "2"],
            "not allowed with argument --concurrency",
        ),
        (["bench", "-m", "m", "--protocol", "ftp"], "argument --protocol: invalid choice: 'ftp'"),
        (
            ["trace", "x", "--last", "--trace-id", "ab"],
            "argument --trace-id: not allowed with argument --last",
        ),
        (["quantize"], "the following arguments are required: model"),
        (
            ["quantize", "tiny", "--min-agreement", "2"],
            "--min-agreement: Value error, the least agreement is",
        ),
    ],
)
def test_a_command_line_its_settings_refuse_is_a_usage_error_naming_the_flag(argv, said, capsys):
    with pytest.raises(SystemExit) as refused:
        cli.parse(argv)
    assert refused.value.code == 2
    assert said in capsys.readouterr().err


def test_the_defaults_of_a_model_with_a_flag_it_must_be_given_are_the_environments(monkeypatch):
    monkeypatch.setenv("PIPELINE_TOKEN", "secret")
    defaults = InferSettings.defaults()
    assert defaults["model"] is None and defaults["token"] == "secret" and defaults["files"] == []
    assert "model" not in dict(launcher_settings.LauncherSettings.defaults())
    monkeypatch.setenv("PIPELINE_URL", " ")
    assert InferSettings.defaults()["url"] == Client().url
