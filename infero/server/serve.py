"""`infero serve`: the OpenAI-compatible HTTP server on uvicorn.

Every flag can also come from an environment variable, `INFERO_` plus the flag's name in capitals
(`--port` <- INFERO_PORT, `--api-key` <- INFERO_API_KEY, ...); a flag on the command line wins.
The server listens at once and loads the model in the background: `GET /health` answers 503 until it is ready,
then the engine's one-line summary and the URL go to stderr. SIGTERM or Ctrl-C stops admitting (503), lets
running requests finish (up to 30 s, then aborts them), stops the engine and exits with status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

from infero.backends import DEVICES
from infero.engine.sampling import MAX_LOGPROBS
from infero.engine.scheduler import POLICIES
from infero.server.reasoning import REASONING_PARSERS
from infero.server.tool_parsers import TOOL_PARSERS

SHUTDOWN_TIMEOUT_S = 30.0
PREFIX_CACHING_ENV = "INFERO_ENABLE_PREFIX_CACHING"
BATCH_INVARIANT_ENV = "INFERO_BATCH_INVARIANT"
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}  # fmt: skip


def parse_bytes(text: str) -> int:
    """A byte count: "2GiB", "512 MiB", "1.5G", "3gb" or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or a number of bytes")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be at least one byte")
    return value


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range (must be {bound})")
        return value

    return parse


def context_length(text: str) -> int:
    """--max-model-len as vLLM reads it: a number of tokens, or one with a suffix, k / m / g decimal (25.6k is
    25,600), K / M / G binary (1K is 1,024; whole numbers only)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgKMG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length; write e.g. 32768, 32k (32,000) or 32K (32,768)")
    number, suffix = match.groups()
    if "." in number and not suffix.islower():
        whole = f"; did you mean {number}{suffix.lower()}?" if suffix else ""
        raise argparse.ArgumentTypeError(f"{text!r}: only k, m and g take a fraction{whole}")
    if suffix.islower():
        value = int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    else:
        value = int(number) * 1024 ** ("KMG".index(suffix) + 1 if suffix else 0)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} is out of range (must be >= 2)")
    return value


def _one_gpu(kind: str):
    def parse(text: str) -> int:
        if text.strip() != "1":
            raise argparse.ArgumentTypeError(f"{text!r}: infero runs a model on one GPU ({kind} is not built)")
        return 1

    return parse


def _only(accepted: tuple[str, ...], why: str):
    """A vllm serve flag's value infero takes only as what it does anyway; any other is refused, saying why."""

    def parse(text: str) -> str:
        if text.strip().lower() not in accepted:
            raise argparse.ArgumentTypeError(f"{text!r}: {why}")
        return text.strip().lower()

    return parse


def _json_list(text: str) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        example = '["http://localhost:3000"]'
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); write e.g. '{example}'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is out of range (must be > 0 and <= 1)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `infero serve`, each defaulting to its INFERO_* environment variable."""

    def flag(name: str, default=None, aliases: tuple[str, ...] = (), **kwargs) -> None:
        env = "INFERO_" + name.lstrip("-").upper().replace("-", "_")
        kwargs["help"] = f"{kwargs.get('help', '')} [env {env}]".strip()
        if "choices" in kwargs:  # argparse checks choices on arguments only, not on a default from the environment
            kwargs["type"] = _one_of(kwargs["choices"], env, kwargs.get("type", str))
        # argparse runs `type` on a string default, so a bad environment value fails like a bad flag
        parser.add_argument(name, *aliases, default=os.environ.get(env, default), **kwargs)

    parser.add_argument("model_file", nargs="?", metavar="MODEL",
                        help="the GGUF file as `vllm serve MODEL` takes it; wins over --model")  # fmt: skip
    flag("--model", metavar="FILE", help="GGUF file (the first part of a split model); default: SmolLM2-135M-Instruct")
    flag("--host", "127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    flag("--port", "8080", type=_int_at_least(0, 65535), help="port to listen on (default: 8080)")
    flag("--api-key", metavar="KEY", default=os.environ.get("VLLM_API_KEY"),
         help="require 'Authorization: Bearer KEY' on every API route (default: INFERO_API_KEY, else vLLM's "
              "VLLM_API_KEY, so that a vLLM deployment's key keeps protecting it, else none)")  # fmt: skip
    flag("--served-model-name", metavar="NAME", nargs="+",
         help="the model's name in the API, and more names requests may use, as vllm serve's (default: the GGUF "
              "file's stem)")  # fmt: skip
    flag("--max-model-len", type=context_length, metavar="N",
         help="context length, e.g. 32768, 32k (32,000) or 32K (32,768) (default: the model's)")  # fmt: skip
    flag("--max-num-seqs", "64", type=_int_at_least(1), metavar="N",
         help="sequences per batch, and a hybrid model's recurrent-state slots, taken from the KV cache's memory "
              "(default: 64)")  # fmt: skip
    flag("--max-num-batched-tokens", type=_int_at_least(1), metavar="N",
         help="tokens per engine step: decodes first, prompt chunks take the rest (default: the backend's, 2048 "
              "on a GPU, 16 on the CPU to keep a step near 100 ms)")  # fmt: skip
    flag("--max-waiting-requests", "512", type=_int_at_least(1), metavar="N",
         help="requests allowed to wait for their first token before new ones get 503 (default: 512)")  # fmt: skip
    flag("--gpu-memory-utilization", "0.90", type=_fraction, metavar="F",
         help="share of GPU memory for weights, workspace and KV cache (default: 0.90)")  # fmt: skip
    flag("--kv-cache-memory", type=parse_bytes, metavar="BYTES", aliases=("--kv-cache-memory-bytes",),
         help='KV cache budget, e.g. "2GiB" or vLLM\'s --kv-cache-memory-bytes 2147483648 (default: 1GiB on the '
              "CPU; on a GPU what --gpu-memory-utilization leaves)")  # fmt: skip
    flag("--async-scheduling", "auto", choices=("auto", "on", "off"), nargs="?", const="on",
         help="queue each step before the host has read the last one's tokens, so the GPU never waits on the host "
              "between steps; the bare flag (as vLLM's) is on, --no-async-scheduling off (default: auto, on with a "
              "GPU)")  # fmt: skip
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const="off",
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--enforce-eager", action="store_true",
                        help="as vllm serve's: no CUDA graphs, every decode step's kernels launched one by one "
                             "(slower; for debugging)")  # fmt: skip
    # A switch: the flag gives a bool, the environment a string that engine_config reads (on/off, 1/0, ...).
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=os.environ.get(PREFIX_CACHING_ENV),
                        help="reuse the KV cache of earlier requests' identical prompt prefixes (default: on) "
                             f"[env {PREFIX_CACHING_ENV}=on|off]")  # fmt: skip
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                        default=os.environ.get(BATCH_INVARIANT_ENV),
                        help="give a request's logits the same bits whatever other requests share its steps (GPU; "
                             "on an H200 it costs the 8B nothing alone but 45%% of its speed at 32 streams and "
                             "61%% of its prefill: docs/kernels.md) (default: off) "
                             f"[env {BATCH_INVARIANT_ENV}=on|off]")  # fmt: skip
    flag("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's")
    flag("--default-chat-template-kwargs", type=_json_object, metavar="JSON",
         help='template variables of every request, under its own chat_template_kwargs, e.g. \'{"enable_thinking": '
              "false}' (as vllm serve's)")  # fmt: skip
    flag("--tool-call-parser", choices=sorted(TOOL_PARSERS), metavar="NAME",
         help=f"how the model writes tool calls: {', '.join(sorted(TOOL_PARSERS))} (default: the format its chat "
              "template teaches, if any)")  # fmt: skip
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="taken as vllm serve takes it: infero parses tool calls (tool_choice auto) whenever the "
                             "model has a tool-call parser")  # fmt: skip
    flag("--reasoning-parser", choices=sorted(REASONING_PARSERS), metavar="NAME",
         help=f"how the model writes its reasoning: {', '.join(sorted(REASONING_PARSERS))} (default: from its chat "
              "template)")  # fmt: skip
    flag("--seed", type=int, metavar="N", help="the sampling seed of requests that bring none (default: a fresh one "
         "each)")  # fmt: skip
    flag("--generation-config", "auto", metavar="auto|vllm|PATH",
         help="the sampling defaults of requests that leave a parameter out: auto, the model file's (what its "
              "creators recommend, general.sampling.*, as llama.cpp applies them); vllm, none (temperature 1.0, "
              "every filter off); or a generation_config.json (or its folder) (default: auto)")  # fmt: skip
    flag("--override-generation-config", type=_json_object, metavar="JSON",
         help='laid over those defaults, e.g. \'{"temperature": 0.5, "max_new_tokens": 1024}\' (temperature, top_k, '
              "top_p, min_p, repetition_penalty; max_new_tokens caps every request's output)")  # fmt: skip
    # vllm serve flags a command line carries over whose only value here is what infero does anyway: taken, and any
    # other value refused in one line (weights stay in their GGUF encoding; one GPU).
    flag("--dtype", "auto", choices=("auto",), help="taken as vllm serve takes it; infero computes in its kernels' "
         "precision from the weights' own encoding")  # fmt: skip
    flag("--tensor-parallel-size", "1", type=_one_gpu("tensor parallelism"), metavar="1", aliases=("-tp",),
         help="taken as vllm serve takes it; infero runs a model on one GPU")  # fmt: skip
    flag("--pipeline-parallel-size", "1", type=_one_gpu("pipeline parallelism"), metavar="1", aliases=("-pp",),
         help="taken as vllm serve takes it; infero runs a model on one GPU")  # fmt: skip
    flag("--kv-cache-dtype", "auto", type=_only(("auto",), "infero's KV cache is fp16 (an fp8 KV cache is not built)"),
         metavar="auto", help="taken as vllm serve takes it: the KV cache in the model's precision, fp16")  # fmt: skip
    flag("--quantization", aliases=("-q",), metavar="gguf",
         type=_only(("gguf",), "infero serves GGUF files, whose tensors keep the types they were written in"),
         help="taken as vllm serve takes it for GGUF files: each tensor keeps its own type")  # fmt: skip
    flag("--load-format", "auto", type=_only(("auto", "gguf"), "infero reads GGUF files"), metavar="auto|gguf",
         help="taken as vllm serve takes it: a GGUF file")  # fmt: skip
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        help="taken as vllm serve takes it: prompts are always prefilled in chunks of "
                             "--max-num-batched-tokens beside the running streams (--no-enable-chunked-prefill is "
                             "refused)")  # fmt: skip
    flag("--swap-space", type=float, metavar="GIB",
         help="taken as vllm serve takes it, and not used: a preempted sequence's KV cache is computed again, "
              "not swapped to host memory")  # fmt: skip
    flag("--max-logprobs", "20", type=_int_at_least(0, MAX_LOGPROBS), metavar="N",
         help=f"the most alternatives a request may ask for a token (logprobs, top_logprobs, prompt_logprobs), "
              f"at most {MAX_LOGPROBS} (default: 20)")  # fmt: skip
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="taken as vllm serve takes it: usage.prompt_tokens_details.cached_tokens is always "
                             "reported")  # fmt: skip
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="taken as vllm serve takes it: infero's uvicorn keeps no access log")  # fmt: skip
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="taken as vllm serve takes it; a GGUF file holds no code")  # fmt: skip
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="taken as vllm serve takes it; infero logs no requests unless --enable-log-requests",
    )
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, queue, KV cache use, prefix cache hits every 10 s "
                             "while serving), as vllm serve's")  # fmt: skip
    flag("--scheduling-policy", "fcfs", choices=POLICIES,
         help="the order requests run in: fcfs (by arrival) or priority (by each request's priority, lower first, "
              "then arrival; the last in that order is preempted first), as vllm serve's (default: fcfs)")  # fmt: skip
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs name each token "token_id:N" (a request\'s return_tokens_as_token_ids says '
                             "otherwise for itself), as vllm serve's")  # fmt: skip
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="as vllm serve's: a log line as each request arrives (its prompts' lengths and "
                             "parameters, never its text) and as it ends")  # fmt: skip
    flag("--tokenizer", metavar="NAME", help="taken as vllm serve takes it for GGUF files, and not used: infero reads "
         "the tokenizer the GGUF file holds (a note says so at start)")  # fmt: skip
    flag("--uvicorn-log-level", "info", choices=("critical", "error", "warning", "info", "debug", "trace"),
         help="uvicorn's log level (default: info)")  # fmt: skip
    # The HTTP surface as vllm serve's flags set it.
    flag("--allowed-origins", '["*"]', type=_json_list, metavar="JSON",
         help="CORS: the origins whose browser pages may call the API, a JSON list (default: any)")  # fmt: skip
    flag("--allowed-methods", '["*"]', type=_json_list, metavar="JSON", help="CORS: the methods allowed (default: any)")
    flag("--allowed-headers", '["*"]', type=_json_list, metavar="JSON", help="CORS: the headers allowed (default: any)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    flag("--root-path", "", metavar="PATH",
         help="the path prefix a proxy serves the app under, as FastAPI's root_path (default: none)")  # fmt: skip
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs page and no /openapi.json")  # fmt: skip
    flag("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key (and --ssl-certfile)")
    flag("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate chain (and --ssl-keyfile)")
    flag("--ssl-ca-certs", metavar="FILE", help="CA certificates that client certificates are checked against")
    flag("--device", "auto", choices=DEVICES, help="where to run; auto takes the GPU when there is one")
    flag("--cpu-threads", type=_int_at_least(1), metavar="N",
         help="BLAS threads of the CPU backend (default: 1; more spin against other busy processes)")  # fmt: skip


def _switch(value: bool | str | None, env: str) -> bool | None:
    """A BooleanOptionalAction flag's value: the flag's bool, or its environment variable's text."""
    from infero.errors import InferoError

    if value is None or isinstance(value, bool):
        return value
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise InferoError(f"{env}={value!r} is not a switch; set it to on or off")


def batch_invariant(args: argparse.Namespace) -> bool:
    """--batch-invariant / --no-batch-invariant, else INFERO_BATCH_INVARIANT (on/off), else off."""
    return bool(_switch(args.batch_invariant, BATCH_INVARIANT_ENV))


def notes(args: argparse.Namespace) -> list[str]:
    """What a flag taken from a vllm serve command line does not do here, one line each; an InferoError for one
    that asks what infero never does."""
    from infero.errors import InferoError

    if args.enable_chunked_prefill is False:
        raise InferoError(
            "--no-enable-chunked-prefill: infero always prefills prompts in chunks of --max-num-batched-tokens, so "
            "that running streams keep decoding; leave it out"
        )
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise InferoError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    from infero.server.app import RESERVED_TEMPLATE_KWARGS

    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(args.default_chat_template_kwargs or {}))
    if reserved:
        raise InferoError(f"--default-chat-template-kwargs may not set {', '.join(reserved)}")
    said = []
    if args.tokenizer:
        said.append(f"--tokenizer {args.tokenizer} is not used: infero reads the tokenizer the GGUF file holds")
    if args.swap_space is not None:
        said.append(f"--swap-space {args.swap_space:g} is not used: infero computes a preempted sequence's KV cache "
                    "again rather than swapping it to host memory")  # fmt: skip
    return said


def generation_notes(llm, args: argparse.Namespace) -> list[str]:
    """What the sampling defaults are and where they come from (vLLM logs the same), and what of the model file's
    was not used."""
    from infero.engine.generation_defaults import describe

    notes = list(llm.generation_notes)
    if llm.generation_defaults:
        choice = args.generation_config
        source = {"auto": "the model file", "vllm": "--override-generation-config"}.get(choice, choice)
        if choice != "vllm" and args.override_generation_config:
            source += " and --override-generation-config"
        turn_off = "; --generation-config vllm turns the file's off" if choice == "auto" else ""
        notes.append(f"a request that leaves a sampling parameter out gets its default from {source}: "
                     f"{describe(llm.generation_defaults)}{turn_off}")  # fmt: skip
    return notes


def served_name(path: Path) -> str:
    """The model's default API name: the file's stem, without a split file's "-00001-of-00003"."""
    return re.sub(r"-\d{5}-of-\d{5}$", "", path.stem)


def _one_of(choices, env: str, convert):
    def checked(text: str):
        value = convert(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(map(str, choices))} (flag or {env})")
        return value

    return checked


def engine_config(args: argparse.Namespace):
    from infero.engine.engine import EngineConfig

    values = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_bytes": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "async_scheduling": {"auto": None, "on": True, "off": False}[args.async_scheduling],
        "cpu_threads": args.cpu_threads,
        "enable_prefix_caching": _switch(args.enable_prefix_caching, PREFIX_CACHING_ENV),
        "seed": args.seed,
        "scheduling_policy": args.scheduling_policy,
    }
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in values.items() if v is not None and k in known})


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a clean stop, 2 when the model cannot be loaded."""
    import uvicorn

    from infero.default_model import default_model_path
    from infero.errors import ModelFileError
    from infero.llm import LLM
    from infero.server.app import CorsSettings, ServerSettings, create_app
    from infero.server.stats_log import LOG_INTERVAL_S

    model = args.model_file or args.model
    path = Path(model) if model else default_model_path()
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass --model FILE.gguf (or set INFERO_MODEL)")
    said = notes(args)
    names = args.served_model_name or [served_name(path)]
    names = names.split() if isinstance(names, str) else names  # INFERO_SERVED_MODEL_NAME="a b"
    name = names[0]
    config = engine_config(args)
    invariant = batch_invariant(args)
    cors = CorsSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    settings = ServerSettings(name, api_key=args.api_key or None, max_waiting_requests=args.max_waiting_requests,
                              shutdown_timeout=SHUTDOWN_TIMEOUT_S, tool_call_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser, max_logprobs=args.max_logprobs, cors=cors,
                              docs=not args.disable_fastapi_docs, aliases=tuple(names[1:]),
                              log_requests=args.enable_log_requests,
                              default_chat_template_kwargs=args.default_chat_template_kwargs,
                              return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                              log_stats_interval=None if args.disable_log_stats else LOG_INTERVAL_S)  # fmt: skip
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{_url_host(args.host)}:{args.port}"  # where it answers; a proxy adds --root-path
    exit_code = 0

    def load():
        return LLM(path, device=args.device, chat_template=args.chat_template, engine_config=config,
                   show_progress=True, batch_invariant=invariant, generation_config=args.generation_config,
                   override_generation_config=args.override_generation_config,
                   enforce_eager=args.enforce_eager)  # fmt: skip

    def on_ready(llm) -> None:
        for note in generation_notes(llm, args):
            print(f"infero: note: {note}", file=sys.stderr)
        print(llm.summary(), file=sys.stderr)
        print(f"serving {name!r} at {url}/v1 (OpenAI API); {url}/health, {url}/metrics", file=sys.stderr, flush=True)

    def on_load_error(error: BaseException) -> None:
        nonlocal exit_code
        print(f"infero: error: {error}", file=sys.stderr, flush=True)
        exit_code = 2
        server.should_exit = True

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s", stream=sys.stderr)
    app = create_app(load, settings, on_ready=on_ready, on_load_error=on_load_error)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False,
                               timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S, lifespan="on", root_path=args.root_path,
                               ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                               ssl_ca_certs=args.ssl_ca_certs)  # fmt: skip
    if args.ssl_certfile:
        _load_ssl(uv_config, args)
    server = graceful_server(uv_config, app.state.infero)
    sock = listen_socket(args.host, args.port)
    for note in said:
        print(f"infero: note: {note}", file=sys.stderr)
    print(f"infero: listening on {url}, loading {path.name} ...", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return exit_code


def _load_ssl(uv_config, args: argparse.Namespace) -> None:
    """Build uvicorn's SSL context now, so that a missing or wrong key or certificate is one line, not a traceback
    from inside the server."""
    import ssl

    from infero.errors import InferoError

    try:
        uv_config.load()
    except (OSError, ssl.SSLError) as e:
        raise InferoError(
            f"cannot serve HTTPS with --ssl-certfile {args.ssl_certfile} and --ssl-keyfile {args.ssl_keyfile}"
            f"{' and --ssl-ca-certs ' + args.ssl_ca_certs if args.ssl_ca_certs else ''}: {e.strerror or e}"
        ) from e


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn. Made with proto=IPPROTO_TCP, which is what makes asyncio set TCP_NODELAY on
    the connections it accepts: uvicorn's own socket (proto 0) leaves Nagle on, and a small SSE chunk written
    after an unacknowledged one then waits ~40 ms for the client's delayed ACK."""
    from infero.errors import InferoError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise InferoError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def graceful_server(config, state):
    """uvicorn's server, with a stop that first makes new requests 503 and ends with status 0.

    uvicorn re-raises a caught signal after its graceful shutdown (so SIGTERM would end the process as if
    killed); we stop the same way but return normally, since stopping was what was asked for.
    """
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            state.begin_shutdown()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop without waiting
            else:
                self.should_exit = True

    return GracefulServer(config)
