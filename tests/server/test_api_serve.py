"""`infero serve`: flags and their INFERO_* variables, and the real command from start to SIGTERM."""

import argparse
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from infero.errors import InferoError
from infero.server.serve import (
    add_arguments,
    context_length,
    engine_config,
    generation_notes,
    notes,
    parse_bytes,
    served_name,
)

TLS = Path(__file__).parent.parent / "fixtures" / "tls"


@pytest.fixture(autouse=True)
def no_infero_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("INFERO_") or n == "VLLM_API_KEY"]:
        monkeypatch.delenv(name)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_every_flag_defaults_to_its_environment_variable_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("INFERO_PORT", "9001")
    monkeypatch.setenv("INFERO_API_KEY", "k")
    monkeypatch.setenv("INFERO_KV_CACHE_MEMORY", "2GiB")
    monkeypatch.setenv("INFERO_MAX_WAITING_REQUESTS", "7")
    monkeypatch.setenv("INFERO_SERVED_MODEL_NAME", "m")
    args = parse([])
    assert (args.port, args.api_key, args.kv_cache_memory, args.max_waiting_requests) == (9001, "k", 2 << 30, 7)
    assert args.served_model_name == "m" and args.host == "127.0.0.1" and args.gpu_memory_utilization == 0.9
    assert parse(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # a vLLM deployment's key keeps protecting the server
    assert parse([]).api_key == "k" and parse(["--api-key", "x"]).api_key == "x"
    monkeypatch.delenv("INFERO_API_KEY")
    assert parse([]).api_key == "from-vllm"
    assert parse(["--port", "8000"]).port == 8000
    monkeypatch.setenv("INFERO_PORT", "eighty")
    with pytest.raises(SystemExit):
        parse([])


def test_defaults_and_engine_config():
    args = parse(["--max-model-len", "128", "--max-num-seqs", "8"])
    assert (args.port, args.max_waiting_requests, args.device) == (8080, 512, "auto")
    config = engine_config(args)
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (128, 8, None)  # backend's
    assert config.async_scheduling is None  # the backend decides: on where it overlaps steps (CUDA)
    assert [engine_config(parse(["--async-scheduling", v])).async_scheduling for v in ("on", "off")] == [True, False]
    bad_flags = (["--port", "70000"], ["--max-num-seqs", "0"], ["--gpu-memory-utilization", "1.5"],
                 ["--async-scheduling", "maybe"], ["--max-waiting-requests", "0"], ["--tool-call-parser", "mistral"],
                 ["--reasoning-parser", "nope"], ["--seed", "x"], ["--dtype", "float16"],
                 ["--tensor-parallel-size", "2"], ["--uvicorn-log-level", "loud"])  # fmt: skip
    for bad in bad_flags:
        with pytest.raises(SystemExit):
            parse(bad)


def test_vllm_serve_flags_for_tools_reasoning_and_the_seed():
    """A `vllm serve` command line's --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
    --seed 7 is taken: the parsers' names (for the server's settings) and the engine's default seed."""
    args = parse(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                  "--seed", "7"])  # fmt: skip
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice) == ("hermes", "qwen3", True)
    assert engine_config(args).seed == 7 and engine_config(parse([])).seed is None
    args = parse(["--dtype", "auto", "--tensor-parallel-size", "1", "--trust-remote-code"])
    assert (args.dtype, args.tensor_parallel_size, args.trust_remote_code) == ("auto", 1, True)
    assert notes(args) == [] and parse(["--uvicorn-log-level", "warning"]).uvicorn_log_level == "warning"
    args = parse(["--tokenizer", "Qwen/Qwen2.5-7B-Instruct", "--disable-log-requests", "--disable-log-stats"])
    assert args.disable_log_requests and args.disable_log_stats and not parse([]).disable_log_stats
    assert notes(args) == [
        "--tokenizer Qwen/Qwen2.5-7B-Instruct is not used: infero reads the tokenizer the GGUF file holds"
    ]


def test_max_model_len_as_vllm_reads_it():
    assert [context_length(t) for t in ("4096", "32k", "32K", "25.6k", "1m", "2M", " 8k ")] == [
        4096, 32_000, 32_768, 25_600, 1_000_000, 2 << 20, 8_000]  # fmt: skip
    for bad in ("1.5K", "4096.5", "lots", "-1", "1", "32kb", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            context_length(bad)
    assert engine_config(parse(["--max-model-len", "2K"])).max_model_len == 2048


def test_a_vllm_serve_command_line_of_a_gguf_deployment_is_taken():
    """The flags vllm serve deployments carry: each is what infero does anyway, or does what vLLM's does; any other
    value is refused in one line, saying why."""
    args = parse(["--enforce-eager", "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--quantization", "gguf",
                  "--load-format", "gguf", "-tp", "1", "-pp", "1", "--kv-cache-memory-bytes", "1073741824",
                  "--async-scheduling", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                  "--max-logprobs", "5", "--swap-space", "4"])  # fmt: skip
    assert args.enforce_eager and args.kv_cache_memory == 1 << 30 and args.max_logprobs == 5
    assert (args.kv_cache_dtype, args.quantization, args.load_format) == ("auto", "gguf", "gguf")
    assert engine_config(args).async_scheduling is True
    assert engine_config(parse(["--no-async-scheduling"])).async_scheduling is False
    assert engine_config(parse(["--async-scheduling", "off"])).async_scheduling is False
    assert notes(args) == ["--swap-space 4 is not used: infero computes a preempted sequence's KV cache again "
                           "rather than swapping it to host memory"]  # fmt: skip
    for bad in (["--kv-cache-dtype", "fp8"], ["-q", "awq"], ["--load-format", "safetensors"], ["-tp", "2"],
                ["--pipeline-parallel-size", "4"], ["--max-logprobs", "21"], ["--max-logprobs", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(InferoError, match="always prefills prompts in chunks"):
        notes(parse(["--no-enable-chunked-prefill"]))


def test_the_http_surfaces_flags():
    args = parse([])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["*"], ["*"], ["*"])
    assert not args.allow_credentials and not args.disable_fastapi_docs and args.root_path == ""
    args = parse(["--allowed-origins", '["http://localhost:3000"]', "--allow-credentials", "--root-path", "/llm",
                  "--disable-fastapi-docs"])  # fmt: skip
    assert args.allowed_origins == ["http://localhost:3000"] and args.allow_credentials and args.root_path == "/llm"
    for bad in ('["*"', '"*"', "[1]"):
        with pytest.raises(SystemExit):
            parse(["--allowed-origins", bad])
    with pytest.raises(InferoError, match="needs both"):
        notes(parse(["--ssl-keyfile", "key.pem"]))
    args = parse(["--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.default_chat_template_kwargs == {"enable_thinking": False} and notes(args) == []
    with pytest.raises(InferoError, match="may not set messages"):
        notes(parse(["--default-chat-template-kwargs", '{"messages": []}']))
    assert parse(["--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    assert not parse([]).return_tokens_as_token_ids
    assert engine_config(parse(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    assert engine_config(parse([])).scheduling_policy == "fcfs"


def test_an_environment_value_outside_a_flags_choices_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("INFERO_SCHEDULING_POLICY", "lifo")
    with pytest.raises(SystemExit):
        parse([])
    assert "'lifo' is not one of fcfs, priority (flag or INFERO_SCHEDULING_POLICY)" in capsys.readouterr().err
    monkeypatch.setenv("INFERO_ASYNC_SCHEDULING", "sometimes")  # was a KeyError traceback
    monkeypatch.delenv("INFERO_SCHEDULING_POLICY")
    with pytest.raises(SystemExit):
        parse([])
    monkeypatch.setenv("INFERO_ASYNC_SCHEDULING", "off")
    assert engine_config(parse([])).async_scheduling is False


def test_generation_config_flags_and_what_the_server_says_of_the_defaults():
    args = parse([])
    assert (args.generation_config, args.override_generation_config) == ("auto", None)
    args = parse(["--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}'])
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"temperature": 0.5})
    for bad in ("{", "[1]", "0.5"):
        with pytest.raises(SystemExit):
            parse(["--override-generation-config", bad])
    llm = SimpleNamespace(generation_defaults={"temperature": 0.6, "top_k": 20}, generation_notes=["a note"])
    assert generation_notes(llm, parse([])) == [
        "a note",
        "a request that leaves a sampling parameter out gets its "
        "default from the model file: temperature 0.6, top_k 20; --generation-config vllm turns the file's off",
    ]
    said = generation_notes(llm, parse(["--generation-config", "/g", "--override-generation-config", '{"top_k": 20}']))
    assert "from /g and --override-generation-config: temperature 0.6" in said[1]
    llm.generation_defaults = {}
    assert generation_notes(llm, parse(["--generation-config", "vllm"])) == ["a note"]


def test_a_generation_config_that_cannot_be_read_is_one_line_and_status_2(tmp_path, tiny_model_path):
    r = subprocess.run([sys.executable, "-m", "infero", "serve", str(tiny_model_path), "--port", str(free_port()),
                        "--generation-config", str(tmp_path / "nowhere.json")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "infero: error: --generation-config" in r.stderr and "cannot read" in r.stderr


def test_sizes_and_served_names():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512 MiB") == 512 << 20 and parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("3gb") == 3 * 10**9 and parse_bytes("4096") == 4096
    for bad in ("lots", "2 XB", "-1", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    assert served_name(Path("/m/Qwen2.5-7B-Q4_K_M.gguf")) == "Qwen2.5-7B-Q4_K_M"
    assert served_name(Path("/m/big-00001-of-00003.gguf")) == "big"


def test_a_missing_or_broken_model_is_one_line_and_status_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infero", "serve", "--model", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("infero: error:") and "none.gguf" in r.stderr
    r = subprocess.run([sys.executable, "-m", "infero", "serve", str(tmp_path / "other.gguf"), "--model", "x.gguf"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "other.gguf" in r.stderr  # the model as vLLM takes it, first, wins over --model
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model at all")
    r = subprocess.run([sys.executable, "-m", "infero", "serve", "--model", str(broken), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    # it listened first, then the load failed in the background: one error line, and the server stopped
    assert r.returncode == 2 and "infero: error:" in r.stderr and "broken.gguf" in r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_infero_serve_answers_and_stops_cleanly_on_sigterm(tiny_model_path):
    port = free_port()
    env = {**os.environ, "INFERO_PORT": str(port), "INFERO_KV_CACHE_MEMORY": "16MiB", "INFERO_API_KEY": "key"}
    command = [sys.executable, "-m", "infero", "serve", str(tiny_model_path), "--device", "cpu",
               "--tokenizer", "org/tiny", "--uvicorn-log-level", "warning"]  # fmt: skip
    with serving(command, env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        headers = {"Authorization": "Bearer key"}
        [model] = httpx.get(url + "/v1/models", headers=headers).json()["data"]
        assert model["id"] == "tiny-llama"  # the file's stem
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, headers=headers).json()["usage"]["completion_tokens"]
    stderr = proc.stderr.read()
    assert "ready: " in stderr and f"serving 'tiny-llama' at http://127.0.0.1:{port}/v1" in stderr
    assert "infero: note: --tokenizer org/tiny is not used" in stderr
    assert "Started server process" not in stderr  # uvicorn's info lines, below --uvicorn-log-level warning


@contextmanager
def serving(command: list[str], **popen) -> Iterator[subprocess.Popen]:
    """`infero serve` as a process for the block; SIGTERM at its end must stop it with status 0."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, **popen)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, **client) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            if httpx.get(url + "/health", **client).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def test_https_with_a_certificate_and_one_line_without_a_usable_one(tiny_model_path, tmp_path):
    port = free_port()
    cert, key = TLS / "localhost.pem", TLS / "localhost-key.pem"
    command = [sys.executable, "-m", "infero", "serve", str(tiny_model_path), "--device", "cpu", "--port", str(port),
               "--kv-cache-memory", "16MiB", "--uvicorn-log-level", "warning"]  # fmt: skip
    with serving([*command, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]) as proc:
        url, trust = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(cert))
        wait_healthy(proc, url, verify=trust)
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, verify=trust).json()["usage"]["completion_tokens"]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health")  # plain HTTP is not served beside it
    assert f"serving 'tiny-llama' at https://127.0.0.1:{port}/v1" in proc.stderr.read()
    for files in ((tmp_path / "none.pem", key), (key, key)):
        r = subprocess.run([*command, "--ssl-certfile", str(files[0]), "--ssl-keyfile", str(files[1])],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (
            r.returncode == 2
            and r.stderr.startswith("infero: error: cannot serve HTTPS")
            and "Traceback" not in r.stderr
        )


def test_the_listening_socket_makes_connections_without_nagle_delays():
    import asyncio

    from infero.errors import InferoError
    from infero.server.serve import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def accept_one() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        nodelay = await accepted
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(accept_one()) != 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InferoError, match="cannot listen"):
            listen_socket("127.0.0.1", taken.getsockname()[1])


def test_help_never_shows_an_api_key_taken_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("INFERO_API_KEY", "sekrit-1")
    monkeypatch.setenv("VLLM_API_KEY", "sekrit-2")
    from infero.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--api-key" in shown and "sekrit" not in shown
