"""The command line is generated from the configuration records: every ``EngineConfig``, ``ServerSettings``
and ``HTTPLimits`` field has a flag with help and its default, a value given on the command line reaches
the engine's config or the server's settings, and the newcomer's path (``--version``, a busy port, Ctrl-C) ends with a line, not a traceback.

The engine is not loaded here: ``pagedllm.LLM`` is replaced by a stand-in that builds the config as
``LLM`` does (``make_engine_config``) and stops, so each case costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.engine import llm as engine_llm
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.http_protocol import HTTPLimits
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.loader import bundled_model_path
from pagedllm.pooler_config import PoolerConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.limits import GrammarLimits

# field -> (the flags that set it to a value other than its default, the value EngineConfig then holds)
VALUES: dict[str, tuple[list[str], object]] = {
    "tokenizer": (["--tokenizer", "/some/tokenizer"], "/some/tokenizer"),
    # the config records them; the model's resolution (which refuses them for a local model) is stubbed below
    "revision": (["--revision", "v2"], "v2"),
    "gguf_file": (["--gguf-file", "model-Q8_0.gguf"], "model-Q8_0.gguf"),
    "tokenizer_revision": (["--tokenizer-revision", "v3"], "v3"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "device": (["--device", "cuda"], "cuda"),
    "kv_cache_dtype": (["--kv-cache-dtype", "int8"], "int8"),
    "block_size": (["--block-size", "32"], 32),
    "num_kv_blocks": (["--num-kv-blocks", "4096"], 4096),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "123456789"], 123456789),
    "max_model_len": (["--max-model-len", "384"], 384),
    "fit_max_model_len": (["--no-fit-max-model-len"], False),
    "max_num_seqs": (["--max-num-seqs", "7"], 7),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "999"], 999),
    "itl_target_ms": (["--itl-target-ms", "off"], None),
    "enable_prefix_caching": (["--no-prefix-caching"], False),
    "state_snapshot_interval": (["--state-snapshot-interval", "512"], 512),
    "kv_allocator": (["--kv-allocator", "contiguous"], "contiguous"),
    "kv_cache_dir": (["--kv-cache-dir", "/some/kv"], "/some/kv"),
    "kv_cache_dir_max_bytes": (["--kv-cache-dir", "/some/kv", "--kv-cache-dir-max-bytes", "1000"], 1000),
    "contiguous_reserve": (["--kv-allocator", "contiguous", "--contiguous-reserve", "max_model_len"], "max_model_len"),
    "seed": (["--engine-seed", "11"], 11),
    "generation_config": (["--generation-config", "vllm"], "vllm"),
    "attention_backend": (["--attention-backend", "sdpa"], "sdpa"),
    "num_threads": (["--num-threads", "1"], 1),
    "quantization": (["--quantization", "none"], "none"),
    "quantization_group_size": (["--quantization", "int4", "--quantization-group-size", "64"], 64),
    "gguf_activations": (["--gguf-activations", "float32"], "float32"),
    "linear_backend": (["--linear-backend", "torch"], "torch"),
    "enforce_eager": (["--enforce-eager"], True),
    "capture_min_decode_steps": (["--capture-min-decode-steps", "3"], 3),
    "tensor_parallel_size": (["-tp", "2"], 2),
    "distributed_executor_backend": (["--distributed-executor-backend", "mp"], "mp"),
    "cpu_bind": (["--cpu-bind", "0"], "0"),
    "distributed_timeout_s": (["--distributed-timeout-s", "7.5"], 7.5),
    "all_reduce_backend": (["--all-reduce-backend", "gloo"], "gloo"),
    "grammar_limits": (["--grammar-max-depth", "9", "--grammar-compile-timeout-s", "2.5"],
                       GrammarLimits(max_depth=9, compile_timeout_s=2.5)),
    "batch_invariant": (["--no-batch-invariant"], False),
    "speculative_config": (["--speculative-config", '{"method": "suffix"}'], SpeculativeConfig(method="suffix")),
    "runner": (["--runner", "pooling"], "pooling"),
    "convert": (["--runner", "pooling", "--convert", "embed"], "embed"),
    "pooler_config": (["--runner", "pooling", "--pooler-pooling-type", "MEAN", "--no-pooler-normalize",
                       "--pooler-dimensions", "8"], PoolerConfig(pooling_type="MEAN", normalize=False, dimensions=8)),
}


# ServerSettings field -> (the serve flags that set it to a value other than its default, the value it then holds)
SERVER_VALUES: dict[str, tuple[list[str], object]] = {
    "model_name": (["--served-model-name", "tiny"], "tiny"),
    # vLLM's several names: the first answers, the others are aliases
    "model_aliases": (["--served-model-name", "tiny", "tiny-alias", "other"], ["tiny-alias", "other"]),
    "enable_auto_tool_choice": (["--no-enable-auto-tool-choice"], False),
    "chat_template": (["--chat-template", "{{ messages[0].content }}"], "{{ messages[0].content }}"),
    "api_key": (["--api-key", "sk-test"], "sk-test"),
    "max_waiting": (["--max-waiting", "5"], 5),
    "host": (["--host", "0.0.0.0"], "0.0.0.0"),
    "port": (["--port", "9001"], 9001),
    "log_level": (["--log-level", "trace"], "trace"),
    "max_request_bytes": (["--max-request-bytes", "1000"], 1000),
    "allowed_hosts": (["--allowed-hosts", "a.test, b.test"], ["a.test", "b.test"]),
    "allowed_origins": (["--allowed-origins", "http://x.test"], ["http://x.test"]),
    "tool_call_parser": (["--tool-call-parser", "hermes"], "hermes"),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], "qwen3"),
    "kv_page": (["--no-kv-page"], False),
    "http_limits": (["--header-timeout", "2.5", "--max-linger-bytes", "7"],
                    HTTPLimits(header_timeout_s=2.5, max_linger_bytes=7)),
    "default_max_tokens": (["--default-max-tokens", "4"], 4),
    "stream_write_timeout_s": (["--stream-write-timeout", "0"], None),  # 0: no bound
    "max_num_stored_responses": (["--max-num-stored-responses", "3"], 3),
    "max_stored_response_bytes": (["--max-stored-response-bytes", "4096"], 4096),
}
# HTTPLimits field -> the same, for the settings' http_limits
HTTP_VALUES: dict[str, tuple[list[str], object]] = {
    "header_timeout_s": (["--header-timeout", "2.5"], 2.5),
    "max_header_connections": (["--max-header-connections", "3"], 3),
    "linger_timeout_s": (["--linger-timeout", "0"], 0.0),
    "max_linger_bytes": (["--max-linger-bytes", "7"], 7),
}
# set by serve itself, not by a flag: the model's path, the start time
SERVER_SET_BY_SERVE = {"model_path", "created"}
# set by another field's flag: --served-model-name's names after the first
SERVER_SET_BY_OTHER_FLAG = {"model_aliases"}


class _Loaded(Exception):
    """Raised by the stand-in LLM with the config the command line built."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config


def _fake_llm(model: str | None = None, **kwargs: object) -> None:
    from pagedllm.engine.llm import make_engine_config

    raise _Loaded(make_engine_config(model, **kwargs))


def _config_from(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> EngineConfig:
    monkeypatch.setattr(pagedllm, "LLM", _fake_llm, raising=False)
    # flags are checked here, not where a model comes from (tests/models/test_hub_models.py)
    monkeypatch.setattr(engine_llm, "resolve_model_path", lambda model, **kwargs: bundled_model_path())
    with pytest.raises(_Loaded) as info:
        cli.main(argv)
    return info.value.config


def test_the_table_covers_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert fields == set(VALUES), "a new EngineConfig field needs a row here (and gets its flag generated)"


@pytest.mark.parametrize("field", sorted(VALUES))
def test_a_flag_given_reaches_the_engine_config(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flags, expected = VALUES[field]
    default = _config_from(["generate", "hi"], monkeypatch)
    assert getattr(default, field) != expected  # the case sets something the defaults do not
    config = _config_from(["generate", "hi", *flags], monkeypatch)
    assert getattr(config, field) == expected


def _settings_from(argv: list[str]) -> ServerSettings:
    return cli._server_settings(cli.build_parser().parse_args(["serve", *argv]))


def test_the_server_tables_cover_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(ServerSettings)} - SERVER_SET_BY_SERVE
    assert fields == set(SERVER_VALUES), "a new ServerSettings field needs a row here (and gets its flag generated)"
    assert {f.name for f in dataclasses.fields(HTTPLimits)} == set(HTTP_VALUES)


@pytest.mark.parametrize("field", sorted(SERVER_VALUES))
def test_a_serve_flag_given_reaches_the_server_settings(field: str) -> None:
    flags, expected = SERVER_VALUES[field]
    assert getattr(_settings_from([]), field) != expected  # the case sets something the defaults do not
    assert getattr(_settings_from(flags), field) == expected


@pytest.mark.parametrize("field", sorted(HTTP_VALUES))
def test_a_serve_flag_given_reaches_the_http_limits(field: str) -> None:
    flags, expected = HTTP_VALUES[field]
    assert getattr(_settings_from([]).http_limits, field) != expected
    assert getattr(_settings_from(flags).http_limits, field) == expected


def test_serve_flags_left_out_keep_the_records_defaults() -> None:
    settings = _settings_from([])
    assert dataclasses.replace(settings, created=0) == ServerSettings(model_name="", created=0)
    assert _settings_from(["--stream-write-timeout", "1.5"]).stream_write_timeout_s == 1.5


def test_every_serve_field_has_a_flag_with_help_and_default() -> None:
    sub = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    by_dest = {a.dest: a for a in sub._actions}
    names = [f.name for f in dataclasses.fields(ServerSettings)
             if f.name not in SERVER_SET_BY_SERVE | SERVER_SET_BY_OTHER_FLAG | {"http_limits"}]
    for name in [*names, *HTTP_VALUES]:
        assert by_dest[name].help and "(default: " in by_dest[name].help, name
    assert not SERVER_SET_BY_SERVE & set(by_dest)


@pytest.mark.parametrize("flag, value", [("--header-timeout", "0"), ("--stream-write-timeout", "-1"),
                                         ("--allowed-hosts", ","), ("--tool-call-parser", "nope"),
                                         ("--reasoning-parser", "granite9"),
                                         ("--max-waiting", "0"), ("--port", "70000"),
                                         ("--chat-template", "no-such-template-file.jinja")])
def test_a_bad_serve_value_names_its_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", flag, value]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} ") and "_" not in err.split()[1], err


def test_vllm_engine_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    free = os.path.getsize(bundled_model_path()) * 2 + (64 << 20)
    monkeypatch.setattr("pagedllm.device_memory.available_memory_bytes", lambda device: free)
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    config = _config_from(["serve", "--dtype", "auto", "--trust-remote-code", "--gpu-memory-utilization", "0.5"],
                          monkeypatch)
    assert config.dtype == "float32"
    assert config.kv_cache_memory_bytes == free // 2 - os.path.getsize(bundled_model_path())


def test_gpu_memory_utilization_is_refused_for_replicas(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    assert cli.main(["serve", "--data-parallel-size", "2", "--gpu-memory-utilization", "0.5"]) == 2
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_chat_template_reads_a_file(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _settings_from(["--chat-template", str(path)]).chat_template == path.read_text()


def test_serve_takes_the_same_flags_and_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    config = _config_from(["serve", "--seed", "5", "--max-num-seqs", "3", "--grammar-max-bytes", "100"], monkeypatch)
    assert (config.seed, config.max_num_seqs, config.grammar_limits.max_bytes) == (5, 3, 100)


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["bench", "throughput"],
                                     ["bench", "latency"], ["bench", "sharing"]])
def test_every_field_has_a_flag_with_help_and_default(command: list[str]) -> None:
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command[0]]
    if len(command) > 1:
        sub = sub._subparsers._group_actions[0].choices[command[1]]
    by_dest = {a.dest: a for a in sub._actions}
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    names += ["grammar_" + f.name for f in dataclasses.fields(GrammarLimits)]
    names += ["pooler_" + f.name for f in dataclasses.fields(PoolerConfig)]
    for name in names:
        if name in ("grammar_limits", "pooler_config"):  # records: a flag per field, above
            continue
        action = by_dest.get("engine_" + name) or by_dest[name]  # engine_: the command has a flag of its name
        assert action.help and "(default: " in action.help, name
    # the sampling flags of generate/chat have help and defaults too
    if command[0] in ("generate", "chat"):
        for dest in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "n", "stop", "ignore_eos"):
            assert "default" in by_dest[dest].help, dest


def test_a_choice_flag_lists_the_literal_choices() -> None:
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices["generate"]
    action = next(a for a in sub._actions if a.dest == "kv_cache_dtype")
    assert "fp8_e5m2" in action.choices and "auto" in action.choices


def test_a_bad_value_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "hi", "--grammar-max-depth", "0"]) == 2
    assert "grammar_limits.max_depth must be a positive integer, got 0" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {pagedllm.__version__}"


def test_a_busy_port_is_an_error_before_the_model_loads(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    loaded = []
    monkeypatch.setattr(pagedllm, "LLM", lambda *a, **k: loaded.append(1), raising=False)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        busy.listen()
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err
    assert loaded == []  # refused before any model was loaded


# a CLI whose model load blocks until interrupted, as a long first load or kernel build does
_SLOW_LOAD = """
import sys, time
import pagedllm
from pagedllm.entrypoints import cli

def slow_llm(*args, **kwargs):
    print("loading", flush=True)
    time.sleep(60)

pagedllm.LLM = slow_llm
sys.exit(cli.main(["generate", "hi"]))
"""


def test_ctrl_c_during_the_load_exits_quietly_with_130() -> None:
    # SIGINT back to its default in the child: a shell that runs the suite as a background job hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "loading"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip() == "interrupted"


def test_a_first_kernel_build_says_what_it_is_doing(monkeypatch: pytest.MonkeyPatch, tmp_path,  # noqa: ANN001
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """One line before a build and one, with its time, after; nothing when the library is built already."""
    import logging

    from torch.utils import cpp_extension

    from pagedllm import kernels

    def fake_build(**kwargs: object) -> None:  # the compiler's work, without the minutes
        (tmp_path / "build" / f"{kernels._LIBRARY_NAME}.so").write_bytes(b"")

    monkeypatch.setattr(kernels, "_loaded_builds", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    with caplog.at_level(logging.INFO, logger="pagedllm.kernels"):
        kernels._compile(tmp_path / "build", [])
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        kernels._compile(tmp_path / "build", [])  # built: quiet
    assert len(first) == 2
    assert first[0].startswith("building the native CPU kernels into") and "minutes" in first[0]
    assert first[1].startswith("built the native CPU kernels in") and first[1].endswith(" s")
    assert caplog.records == []
