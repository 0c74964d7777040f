"""`antiphon serve`'s flags are made from the config dataclasses (frontend/cli_options.py):
their defaults are the fields', serving with no flags runs the dataclasses' defaults, and the
flag table of docs/configuration.md is the one the parser makes (scripts/flag_table.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from engine.config import EngineConfig
from frontend import cli, cli_options
from frontend.server_config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent

# Fields no flag of `antiphon serve` sets: the offline LLM takes them as keywords.
# omni_speech: the server turns it on for an omni model with voice on; publish_cache_events:
# for data-parallel replicas (frontend/replica_set.py).
NOT_FLAGS = {"max_stalled_steps", "grammar_timeout_s", "omni_speech", "publish_cache_events"}
# Fields set by a switch of another name: the switch turns the field off.
SWITCHES = {"enable_prefix_caching": "no_prefix_caching", "enable_encoder_cache": "no_encoder_cache",
            "voice": "no_voice"}


def parse(*argv: str):
    return cli_options.serve_parser().parse_args(list(argv))


def configs(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    args = parse(*argv)
    return cli_options.engine_config_from(args), cli_options.server_config_from(args)


def flag_table_script():
    spec = importlib.util.spec_from_file_location("flag_table", ROOT / "scripts" / "flag_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_api_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("ANTIPHON_API_KEY", raising=False)


def test_serving_without_flags_runs_the_dataclass_defaults():
    engine, server = configs()
    # The one difference is on purpose: the server serves voice, the offline LLM does not.
    assert engine == dataclasses.replace(EngineConfig(), voice=True)
    assert server == ServerConfig()


def test_every_flag_default_is_its_fields_or_a_documented_derivation():
    fields = {f.name: cli_options.field_default(config, f.name)
              for config in (EngineConfig, ServerConfig) for f in dataclasses.fields(config)}
    checked = 0
    for action in cli_options.serve_parser()._actions:
        if action.dest not in fields:
            continue
        checked += 1
        field_default = fields[action.dest]
        if action.default is None and field_default is not None:
            assert action.dest in cli_options.DERIVED_DEFAULTS, f"{action.option_strings[0]}: None, derived from what?"
        elif action.dest == "async_scheduling":
            assert cli_options.ON_OFF[action.default] is field_default
        else:
            assert action.default == field_default, action.option_strings[0]
    assert checked > 60


def test_every_config_field_is_a_flag_or_listed_as_none():
    dests = {action.dest for action in cli_options.serve_parser()._actions}
    for config in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(config):
            if f.name not in NOT_FLAGS:
                assert f.name in dests or SWITCHES.get(f.name) in dests, f"{config.__name__}.{f.name} has no flag"


def test_no_field_name_is_in_both_configs():
    # A flag's dest names one field; a name in both would set both.
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine & {f.name for f in dataclasses.fields(ServerConfig)}


def test_engine_flags_set_the_fields_they_name():
    engine, _ = configs("--block-size", "32", "--no-prefix-caching", "--async-scheduling", "on", "--enforce-eager",
                        "--quantization", "bf16", "--kv-cache-dtype", "bfloat16", "--no-encoder-cache",
                        "--encoder-timeout", "5", "--no-voice", "--asr-model", "/models/whisper",
                        "--max-model-len", "100", "--kv-cache-memory-gib", "1.5")
    assert (engine.block_size, engine.enable_prefix_caching, engine.async_scheduling, engine.decode_graphs) == (
        32, False, True, "off")
    assert (engine.quantization, engine.kv_cache_dtype, engine.enable_encoder_cache) == ("bf16", "bfloat16", False)
    assert (engine.encoder_timeout_s, engine.voice, engine.asr_model) == (5.0, False, "/models/whisper")
    assert (engine.max_model_len, engine.kv_cache_memory_gib, engine.num_kv_blocks) == (100, 1.5, None)
    assert configs("--async-scheduling", "off")[0].async_scheduling is False


def test_server_flags_set_the_fields_they_name():
    _, server = configs("--api-key", "a", "--api-key", "b", "--share-cache-across-keys", "--allowed-host", "h",
                        "--allowed-host", "i", "--max-message-bytes", "5000", "--header-timeout", "3",
                        "--spoken-answer-ttl", "7", "--public-metrics", "--port", "9", "--host", "0.0.0.0")
    assert (server.api_keys, server.cache_salt_per_key, server.salts_per_key()) == (["a", "b"], False, False)
    assert (server.allowed_hosts, server.allowed_origins, server.max_message_bytes) == (["h", "i"], [], 5000)
    assert (server.header_timeout_s, server.spoken_answer_ttl_s, server.public_metrics) == (3.0, 7.0, True)
    assert (server.host, server.port, server.max_image_bytes) == ("0.0.0.0", 9, 20 << 20)
    # A repeatable flag's list is the parse's own: the next parse starts empty again.
    assert configs()[1].allowed_hosts == []
    assert configs("--cache-salt-per-key")[1].salts_per_key() is True


def test_environment_fills_what_the_flags_leave_unset(monkeypatch):
    monkeypatch.setenv("ANTIPHON_API_KEY", "k1, k2,")
    monkeypatch.setenv("ANTIPHON_QUANTIZATION", "int8")
    engine, server = configs()
    assert (server.api_keys, server.salts_per_key(), engine.quantization) == (["k1", "k2"], True, "int8")
    engine, server = configs("--api-key", "flag", "--quantization", "none")
    assert (server.api_keys, engine.quantization) == (["flag"], "none")


def test_contradicting_flags_are_refused():
    with pytest.raises(ValueError, match="--enforce-eager contradicts --decode-graphs padded-eager"):
        configs("--enforce-eager", "--decode-graphs", "padded-eager")
    with pytest.raises(SystemExit):
        parse("--cache-salt-per-key", "--share-cache-across-keys")
    with pytest.raises(SystemExit):
        parse("--dtype", "float64")


def test_serve_help_shows_each_flags_default(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "tokens per KV block (default: 16)" in shown
    assert "(default: 127.0.0.1)" in shown and "(default: 64 KiB)" in shown and "(default: 600 s)" in shown
    assert f"(default: {cli_options.DERIVED_DEFAULTS['api_keys']})" in shown


def test_the_docs_flag_table_is_the_parsers():
    script = flag_table_script()
    doc = script.DOC.read_text()
    assert script.with_table(doc, script.flag_table(cli_options.serve_parser())) == doc, (
        "docs/configuration.md's flag table is stale: run python scripts/flag_table.py --write")
    assert "| `--max-grammar-bytes` | 64 KiB |" in doc


def test_flag_table_check_fails_on_a_stale_table_and_write_mends_it(tmp_path, monkeypatch):
    script = flag_table_script()
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# Configuration\n\n{script.START}\n| `--port` | 8001 | old |\n{script.END}\n\nAfter.\n")
    monkeypatch.setattr(script, "DOC", stale)
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 1
    assert script.main(["--write"]) == 0
    assert script.main(["--check"]) == 0
    written = stale.read_text()
    assert written.startswith("# Configuration\n\n") and written.endswith(f"{script.END}\n\nAfter.\n")
    assert "| `--port` | 8000 | port to listen on |" in written


def test_a_default_with_a_percent_sign_does_not_break_help():
    @dataclasses.dataclass
    class Settings:
        log_format: str = "%(message)s"

    parser = cli_options.argparse.ArgumentParser(formatter_class=cli_options.DefaultsShown)
    cli_options.FieldFlags(parser, Settings).add("log_format", "how log lines look")
    assert "(default: %(message)s)" in parser.format_help()


def test_a_repeatable_flag_must_start_empty():
    @dataclasses.dataclass
    class Settings:
        origins: list[str] = dataclasses.field(default_factory=lambda: ["https://a.example"])

    parser = cli_options.argparse.ArgumentParser()
    with pytest.raises(TypeError, match="repeatable"):
        cli_options.FieldFlags(parser, Settings).add("origins", "allowed origins")
