"""The `raincheck` command: flags and environment variables become settings; a bad value is one line and
exit code 2 before anything starts; a runtime error is one line and exit code 1; `raincheck chat` survives
a bad /image and shows /status as a table."""

from __future__ import annotations

import _thread
import io
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from raincheck_client import Client, Token, Unavailable
from raincheck_core.config import BACKENDS, DTYPES
from raincheck_core.deferral.policy import POLICIES
from raincheck_core.speculative.config import METHODS
from services import chat_cli, cli
from services.common.settings import Backend, ChatSettings, DType, Policy, SpeculativeMethod
from tests.multimodal.mm_helpers import png

ROOT = Path(__file__).resolve().parents[2]


def _settings(argv: list[str]) -> dict:
    return cli.settings(argv)[1]


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of `raincheck ARGV` run in this process."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    return stop.value.code, capsys.readouterr().err


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---------------------------------------------------------------------------------- flags and variables
def test_flags_and_environment(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k2\n\nk3\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    monkeypatch.setenv("RAINCHECK_API_KEYS", "k1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/5")
    monkeypatch.setenv("RAINCHECK_DRAIN_TIMEOUT_S", "30")
    monkeypatch.setenv("RAINCHECK_MAX_IMAGE_BYTES", "1024")
    monkeypatch.setenv("RAINCHECK_INSECURE_ALLOW_NO_AUTH", "yes")
    s = _settings(["serve", "--port", "0", "--api-keys-file", str(keys), "--metrics-port", "-1", "--model",
                   str(ckpt), "--policy", "full", "--num-pages", "64", "--recovery-mode", "disaggregated",
                   "--max-new-tokens", "9", "--random-size", "bench", "--max-model-len", "1000"])
    front, worker = s["frontend"], s["worker"]
    assert front.api_keys == ("k1", "k2", "k3") and front.metrics_port is None and front.port == 0
    assert (front.default_recovery_mode, front.drain_s, front.metrics_host) == ("disaggregated", 30.0, "127.0.0.1")
    assert (front.max_image_bytes, front.allow_no_auth) == (1024, True)
    assert front.store.redis_url == worker.store.redis_url == "redis://127.0.0.1:6379/5"
    assert (worker.model, worker.default_policy, worker.engine) == (str(ckpt), "full",
                                                                    {"num_pages": 64, "max_model_len": 1000})
    assert worker.model_spec().engine == worker.engine
    assert (worker.max_new_tokens, worker.random_size, worker.host, worker.port) == (9, "bench", "127.0.0.1", 0)
    monkeypatch.setenv("RAINCHECK_METRICS_HOST", "0.0.0.0")
    w = _settings(["decode-worker", "--port", "7", "--worker-id", "w", "--advertise", "h:7"])["worker"]
    assert (w.port, w.worker_id, w.advertise, w.metrics_port, w.metrics_host) == (7, "w", "h:7", 9465, "0.0.0.0")
    assert w.recovery_modes == ("colocated",) and (w.deferred.ray_address, w.deferred.workers) == (None, 1)
    # a flag wins over its variable; logging options go before or after the command
    monkeypatch.setenv("RAINCHECK_LOG_LEVEL", "warning")
    assert _settings(["serve"])["log"].log_level == "WARNING"
    assert _settings(["--log-level", "debug", "serve"])["log"].log_level == "DEBUG"
    assert _settings(["serve", "--log-level", "error", "--debug"])["log"].debug is True


def test_recovery_and_ray_settings(monkeypatch):
    monkeypatch.setenv("RAINCHECK_RECOVERY_MODES", "colocated, disaggregated")
    monkeypatch.setenv("RAINCHECK_RAY_NAMESPACE", "ns")
    monkeypatch.setenv("RAINCHECK_DEFERRED_NUM_GPUS", "1")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    w = _settings(["decode-worker", "--deferred-timeout-s", "9", "--deferred-resource", ""])["worker"]
    assert w.recovery_modes == ("colocated", "disaggregated")
    d = w.deferred
    assert (d.ray_address, d.namespace, d.num_gpus, d.num_cpus, d.resource, d.timeout_s) == \
        ("ray://head:10001", "ns", 1.0, 1.0, "", 9.0)
    monkeypatch.delenv("RAINCHECK_RECOVERY_MODES")
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert _settings(["decode-worker"])["worker"].deferred.ray_address is None
    serve = _settings(["serve"])["worker"]
    assert serve.recovery_modes == ("colocated",)
    serve = _settings(["serve", "--deferred-workers", "3"])["worker"]
    assert serve.recovery_modes == ("colocated", "disaggregated") and serve.deferred.workers == 3
    s = _settings(["deferred-worker", "--model-name", "m", "--deferred-workers", "2"])
    assert (s["spec"].model_name, s["deferred"].workers, s["deferred"].namespace) == ("m", 2, "ns")


def test_every_flag_names_its_variable_and_default():
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        assert options, name
        for action in options:
            assert "; default: " in action.help and action.help.rstrip().endswith("]"), (name, action.option_strings)
            env = action.help.rsplit("[", 1)[1].split(";")[0]
            assert env == "REDIS_URL" or env.startswith(("RAINCHECK_", "RAY_")), (name, env)


def test_the_choices_agree_with_the_engine():
    """The settings spell the engine's choices out (no torch in the frontend); they must stay the same."""
    assert typing.get_args(Policy) == POLICIES
    assert set(typing.get_args(DType)) == set(DTYPES)
    assert typing.get_args(Backend) == BACKENDS
    assert typing.get_args(SpeculativeMethod) == METHODS


# ------------------------------------------------------------------------------------ bad values
BAD = [
    (["serve", "--port", "abc"], {}, "--port 'abc': Input should be a valid integer"),
    (["serve"], {"RAINCHECK_PORT": "abc"}, "RAINCHECK_PORT='abc': Input should be a valid integer"),
    (["frontend", "--port", "70000"], {}, "--port '70000': Input should be less than or equal to 65535"),
    (["serve", "--policy", "bogus"], {}, "--policy 'bogus': Input should be 'full', 'hard', 'raincheck' or"),
    (["decode-worker"], {"RAINCHECK_POLICY": "bogus"}, "RAINCHECK_POLICY='bogus'"),
    (["serve", "--tpot-slo", "0.5"], {}, "--tpot-slo '0.5': a TPOT objective is a ratio of the plain decode step"),
    (["decode-worker"], {"RAINCHECK_TPOT_SLO": "nan"}, "RAINCHECK_TPOT_SLO='nan'"),
    (["serve", "--model", "/nonexistent"], {}, "no checkpoint at /nonexistent: it is not a folder"),
    (["demo", "--model", "/nonexistent"], {}, "no checkpoint at /nonexistent"),
    (["serve", "--dtype", "fp8"], {}, "--dtype 'fp8': Input should be 'float32', 'bfloat16' or 'float16'"),
    (["serve", "--backend", "cudnn"], {}, "--backend 'cudnn': Input should be 'auto', 'native', 'torch', 'flex' or"),
    (["serve", "--max-image-bytes", "0"], {}, "--max-image-bytes '0': Input should be greater than 0"),
    # checked before the model loads: no CUDA here (or not 100 devices), and no such device type
    (["serve", "--device", "cuda:99"], {}, "--device 'cuda:99': "),
    (["decode-worker"], {"RAINCHECK_DEVICE": "tpu"}, "RAINCHECK_DEVICE='tpu': 'tpu' is not a device"),
    (["serve", "--max-model-len", "0"], {}, "--max-model-len '0': Input should be greater than 0"),
    (["serve"], {"RAINCHECK_MAX_IMAGE_BYTES": "10MB"}, "RAINCHECK_MAX_IMAGE_BYTES='10MB'"),
    (["serve", "--num-pages", "many"], {}, "--num-pages 'many': Input should be a valid integer"),
    (["decode-worker"], {"RAINCHECK_NUM_PAGES": "-4"}, "RAINCHECK_NUM_PAGES='-4': Input should be greater than 0"),
    (["serve", "--max-new-tokens", "0"], {}, "--max-new-tokens '0'"),
    (["decode-worker"], {"RAINCHECK_MAX_NEW_TOKENS": "x"}, "RAINCHECK_MAX_NEW_TOKENS='x'"),
    (["serve", "--random-size", "huge"], {}, "--random-size 'huge': Input should be 'tiny' or 'bench'"),
    (["serve"], {"RAINCHECK_INSECURE_ALLOW_NO_AUTH": "maybe"}, "RAINCHECK_INSECURE_ALLOW_NO_AUTH='maybe'"),
    (["decode-worker", "--recovery-modes", "colocated,remote"], {}, "--recovery-modes 'colocated,remote'"),
    (["decode-worker", "--recovery-modes", ","], {}, "should have at least 1 item"),
    (["frontend"], {"RAINCHECK_METRICS_PORT": "x"}, "RAINCHECK_METRICS_PORT='x'"),
    (["frontend", "--drain-timeout-s", "-1"], {}, "--drain-timeout-s '-1'"),
    (["frontend", "--host", "0.0.0.0"], {}, "refusing to serve without API keys on 0.0.0.0"),
    (["frontend", "--api-keys-file", "/nonexistent/keys"], {}, "cannot read the API keys file /nonexistent/keys"),
    (["frontend", "--tls-cert", "cert.pem"], {}, "TLS needs both --tls-cert and --tls-key"),
    (["deferred-worker", "--deferred-workers", "0"], {}, "--deferred-workers '0': Input should be greater than"),
    (["serve", "--deferred-workers", "-1"], {}, "--deferred-workers '-1'"),
    (["decode-worker", "--deferred-num-cpus", "lots"], {}, "--deferred-num-cpus 'lots'"),
    (["chat", "--max-new-tokens", "0"], {}, "--max-new-tokens '0'"),
    (["chat", "--wait-s", "soon"], {}, "--wait-s 'soon'"),
    (["chat"], {"RAINCHECK_CHAT_POLICY": "soft"}, "RAINCHECK_CHAT_POLICY='soft'"),
    (["chat"], {"RAINCHECK_LOG_LEVEL": "loud"}, "RAINCHECK_LOG_LEVEL='loud'"),
    (["serve", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["serve", "--port"], {}, "argument --port: expected one argument"),
    (["bogus"], {}, "invalid choice: 'bogus'"),
    ([], {}, "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD, ids=[" ".join(a) + "|" + ",".join(e) for a, e, _ in BAD])
def test_a_bad_value_is_one_line_and_exit_code_2(monkeypatch, capsys, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = _main(argv, capsys)
    assert code == 2
    assert message in err and err.startswith("raincheck") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_help_works_whatever_the_environment_says():
    for args in (["--help"], ["serve", "--help"]):
        result = _run("-m", "services.cli", *args, env={"RAINCHECK_PORT": "abc", "RAINCHECK_LOG_LEVEL": "loud"})
        assert result.returncode == 0 and "RAINCHECK_LOG_LEVEL" in result.stdout, result.stderr


def test_auth_is_refused_before_anything_loads():
    """A public address without keys is refused from the settings: torch was never imported."""
    script = ("import sys\nfrom services import cli\ntry:\n    cli.main(['serve', '--host', '0.0.0.0'])\n"
              "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    result = _run("-c", script)
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert result.stderr.count("\n") == 1 and "refusing to serve without API keys" in result.stderr


def test_a_runtime_error_is_one_line_unless_debug():
    args = ("-m", "services.cli", "chat", "--address", "127.0.0.1:1", "--wait-s", "0")
    result = _run(*args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("raincheck chat: error: UNAVAILABLE") and result.stderr.count("\n") == 1
    debug = _run(*args, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "Unavailable" in debug.stderr


def test_a_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = _run("-m", "services.cli", "serve", "--port", "0", "--metrics-port", "-1", "--model", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("raincheck serve: error: model_type 'llama' is not supported"), result.stderr


# ------------------------------------------------------------------------------------------- chat
def _chat(monkeypatch, capsys, settings: ChatSettings, lines: list[str]) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    chat_cli.run_chat(settings)
    return capsys.readouterr().out


def test_chat_recovers_from_a_bad_image_and_shows_status(embedded, monkeypatch, capsys, tmp_path):
    _, frontend, _ = embedded
    good, broken = tmp_path / "scene.png", tmp_path / "broken.png"
    good.write_bytes(png())
    broken.write_bytes(b"not an image")
    out = _chat(monkeypatch, capsys, ChatSettings(address=frontend.address, max_new_tokens=3), [
        "/image /nonexistent/scene.png",      # never queued
        "hello",                              # so this goes without an image
        f"/image {broken}",                   # read, but the server cannot decode it
        "what is this ?",
        "and now ?",                          # the broken image did not stay queued
        f"/image {good}",
        "what is this ?",
        "/status",
        "/bogus",
        "/quit",
    ])
    assert "cannot attach /nonexistent/scene.png: No such file or directory" in out
    assert "error: INVALID_ARGUMENT" in out and "1 attached image(s) dropped" in out
    assert out.count("error:") == 1 and out.count("[length]") + out.count("[stop]") == 3, out
    table = out[out.index("  session "):].splitlines()
    assert [row.split()[0] for row in table[:8]] == ["session", "model", "policy", "recovery", "status", "turns",
                                                     "cached", "pending"]
    assert table[5].split() == ["turns", "3"]
    assert "unknown command /bogus" in out


def test_chat_waits_for_a_server_with_a_progress_line(monkeypatch, capsys):
    start = time.monotonic()
    with pytest.raises(Unavailable):
        _chat(monkeypatch, capsys, ChatSettings(address="127.0.0.1:1", wait_s=1.5), [])
    assert time.monotonic() - start >= 1.5
    assert "waiting for the server at 127.0.0.1:1 (not reachable yet)" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_a_taken_port_is_named_before_anything_loads(capsys, flag):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "-1", "--http-port": "0", flag: str(port)}
        code, err = _main(["serve", *[x for kv in ports.items() for x in kv]], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in err
    assert "loading" not in capsys.readouterr().out


@pytest.fixture
def default_sigint():
    """Ctrl-C as a fresh `raincheck chat` process gets it: KeyboardInterrupt in the main thread. A library
    loaded earlier in the same test process (a Ray driver, a server's shutdown handler) may have replaced
    the handler, and then interrupt_main() raised nothing and the turn ran to its end."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_an_answer_streams_cancels_the_turn_and_the_chat_goes_on(embedded, capsys, default_sigint):
    _, frontend, _ = embedded
    client = Client(frontend.address)
    session = client.create_session()
    send = session.send

    def interrupted_after_the_first_token(*args, **kwargs):
        turn = send(*args, **kwargs)

        class Interrupted:
            cancel = turn.cancel

            def __iter__(self):
                for event in turn:
                    yield event
                    if isinstance(event, Token):
                        _thread.interrupt_main()      # what Ctrl-C does to the main thread
                        time.sleep(5)                 # the interrupt lands here, mid-stream

        return Interrupted()

    session.send = interrupted_after_the_first_token
    chat_cli._turn(session, "list the objects in row two .", [], max_new_tokens=200)
    out = capsys.readouterr().out
    assert "cancelling the turn (Ctrl-C again leaves)" in out and "[cancelled]" in out
    session.send = send
    assert session.send("hello", max_new_tokens=2, ignore_eos=True).result().finish_reason == "length"
    assert not session.cancel()                       # nothing left running
    session.close()
    client.close()
