"""The command line: `infero generate | inspect | tokenize`.

Errors a user can cause print one line on stderr and exit with status 2; progress and summaries go to
stderr so stdout carries only the answer (plain text, or JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import infero
from infero.backends import DEVICES
from infero.errors import InferoError
from infero.server.serve import BATCH_INVARIANT_ENV, batch_invariant

EXIT_USER_ERROR = 2
# `generate`'s sampling where neither a flag nor the model file says: llama.cpp CLI's, what users of a local CLI expect.
CLI_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or the flag has none (an unset
    value or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if not action.option_strings or "default" in text or default is None or default is False or default == []:
            return text
        if default is argparse.SUPPRESS:
            return text
        head, env, tail = text.partition(" [env ")  # the default before the environment variable that sets it
        return f"{head} (default: %(default)s){env}{tail}".lstrip()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="FILE",
        default=os.environ.get("INFERO_MODEL"),
        help="GGUF file (the first part of a split model) (default: the embedded SmolLM2-135M-Instruct) "
        "[env INFERO_MODEL]",
    )
    p.add_argument("--device", choices=DEVICES, default=os.environ.get("INFERO_DEVICE", "auto"),
                   help="where to run; auto takes the GPU when there is one [env INFERO_DEVICE]")  # fmt: skip
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=os.environ.get(BATCH_INVARIANT_ENV),
                   help="GPU: give a request's logits the same bits whatever shares its steps, at a cost in speed "
                        f"(docs/kernels.md) (default: off) [env {BATCH_INVARIANT_ENV}=on|off]")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infero", description="LLM inference with hand-written kernels",
                                     formatter_class=DefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"infero {infero.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(parent, name: str, **kwargs) -> argparse.ArgumentParser:
        return parent.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)

    g = command(sub, "generate", help="generate a completion for PROMPT, streamed to stdout")
    _add_model_args(g)
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")
    g.add_argument("--system", help="with --chat: a system message before PROMPT")
    g.add_argument("--chat-template", metavar="FILE", help="a jinja chat template to use instead of the model's")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="stop after N tokens")
    # A flag left out takes the model file's default (general.sampling.*), else llama.cpp CLI's, as llama.cpp does.
    for name, kind, metavar, what in (
        ("temperature", float, "T", "sampling temperature"),
        ("top_k", int, "K", "sample among the K most likely tokens"),
        ("top_p", float, "P", "sample within probability mass P"),
        ("min_p", float, "P", "drop tokens less likely than P times the most likely"),
        ("repetition_penalty", float, "R", "divide the logits of tokens seen so far by R"),
    ):
        fallback = CLI_SAMPLING.get(name, 1.0)
        g.add_argument("--" + name.replace("_", "-"), type=kind, metavar=metavar,
                       help=f"{what} (default: the model file's, else {fallback})")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="R",
                   help="subtract R from the logits of tokens generated so far")  # fmt: skip
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="R",
                   help="subtract R times its count from a generated token's logit")  # fmt: skip
    g.add_argument("--seed", type=int, help="seed of the sampler (default: a fresh one each run)")
    g.add_argument("--greedy", action="store_true", help="always take the most likely token (temperature 0)")
    g.add_argument("--logprobs", type=int, metavar="N", help="also report the top-N alternatives of every token")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    i = command(sub, "inspect", help="describe a model file")
    _add_model_args(i)
    i.add_argument("--json", action="store_true", help="print one JSON object instead of aligned lines")

    t = command(sub, "tokenize", help="print the token ids of TEXT as a JSON list")
    _add_model_args(t)
    t.add_argument("text", metavar="TEXT")
    t.add_argument("--no-special", action="store_true", help="do not add BOS/EOS the model asks for")
    from infero.checkpoint.synthetic import QUANTS, SHAPES

    sy = command(sub, "synth", help="write a GGUF of a real model's shape with random weights")
    sy.add_argument("shape", choices=sorted(SHAPES))
    sy.add_argument("--quant", choices=QUANTS, default="Q4_K_M", help="quantization of the linear layers")
    sy.add_argument("-o", "--output", required=True, metavar="FILE", help="the GGUF file to write")
    sy.add_argument("--seed", type=int, default=0, help="seed of the random weights")

    b = command(sub, "bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    d = command(bsub, "decode", help="prefill and batch-1 decode speed, and the roofline fraction")
    _add_model_args(d)
    d.add_argument("--prompt-tokens", type=int, default=512, metavar="N", help="tokens of the prompt to prefill")
    d.add_argument("--decode-tokens", type=int, default=64, metavar="N", help="tokens to decode after it")
    d.add_argument(
        "--profile",
        action="store_true",
        help="also time each op of a decode step, of 1 and of each --batch width (GPU, in a graph), and of the "
        "prompt's prefill",
    )
    d.add_argument("--batch", type=_batch_sizes, default=[], metavar="B[,B...]",
                   help="also time decode steps of B concurrent sequences, e.g. 1,8,32")  # fmt: skip
    from infero.bench import invariance
    from infero.bench import serve as bench_serve

    bench_serve.add_arguments(command(bsub, "serve", help="load an OpenAI-compatible endpoint with streaming clients"))
    inv = command(bsub, "invariance", help="check that a request's logits are the same bits whatever shares its step")
    _add_model_args(inv)
    invariance.add_arguments(inv)
    from infero.server import serve

    serve.add_arguments(command(sub, "serve", help="serve the model over an OpenAI-compatible HTTP API"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from infero.server.serve import main as _serve

        commands = {"generate": _generate, "inspect": _inspect, "tokenize": _tokenize, "bench": _bench, "synth": _synth}
        commands["serve"] = _serve
        return commands[args.command](args)
    except InferoError as e:
        print(f"infero: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _generate(args) -> int:
    from infero import LLM
    from infero.engine import generation_defaults

    llm = LLM(args.model, device=args.device, chat_template=args.chat_template, show_progress=True,
              batch_invariant=batch_invariant(args))  # fmt: skip
    print(llm.summary(), file=sys.stderr)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = llm.encode_chat(messages)
    else:
        prompt = args.prompt
    params = generation_defaults.sampling_params(
        {**CLI_SAMPLING, **llm.generation_defaults},
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        logprobs=args.logprobs, stop=args.stop, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    if args.json:
        [out] = llm.generate([prompt], params)
        result = {
            "model": str(llm.path),
            "prompt_ids": out.prompt_ids,
            "completion_ids": out.completion_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "logprobs": None if out.logprobs is None else [
                {"token_id": lp.token_id, "token": llm.tokenizer.decode([lp.token_id]), "logprob": lp.logprob,
                 "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]}
                for lp in out.logprobs
            ],
        }  # fmt: skip
        print(json.dumps(result, ensure_ascii=False))
        return 0
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _inspect(args) -> int:
    from infero.checkpoint import load_checkpoint
    from infero.default_model import default_model_path
    from infero.tokenizer import Tokenizer

    path = args.model or default_model_path()
    ckpt = load_checkpoint(path)
    c = ckpt.config
    tok = Tokenizer.from_gguf_metadata(ckpt.metadata)
    types = Counter(t.type_name for t in ckpt.tensors.values())
    params = sum(t.num_elements for t in ckpt.tensors.values())
    info = {
        "path": str(path),
        "name": c.name,
        "architecture": c.architecture,
        "parameters": params,
        "file_size_bytes": ckpt.file_size,
        "quantization": ckpt.quantization,
        "tensor_types": dict(types.most_common()),
        "layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "context_length": c.context_length,
        "rope": {"theta": c.rope_theta, "pairing": c.rope_pairing, "scaling": c.rope_scaling.kind},
        "tied_embeddings": c.tie_word_embeddings,
        "vocab_size": tok.vocab_size,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "end_of_generation_tokens": sorted(tok.id_to_token(i) for i in tok.eog_token_ids),
        "chat_template": tok.chat_template is not None,
    }
    if c.num_experts:  # a token runs num_experts_used of each layer's experts: the rest of their weights sit idle
        expert_params = sum(t.num_elements for name, t in ckpt.tensors.items() if name.endswith("_exps.weight"))
        info["experts"] = {"count": c.num_experts, "used": c.num_experts_used, "width": c.expert_intermediate_size}
        info["active_parameters"] = params - expert_params * (c.num_experts - c.num_experts_used) // c.num_experts
        if c.shared_expert_intermediate_size:
            info["experts"]["shared_width"] = c.shared_expert_intermediate_size
    if c.is_hybrid:
        info["layer_kinds"] = {"gated_deltanet": c.num_recurrent_layers,
                               "attention": c.num_layers - c.num_recurrent_layers}  # fmt: skip
        info["delta_net"] = {"key_heads": c.ssm_group_count, "value_heads": c.ssm_time_step_rank,
                             "key_dim": c.ssm_state_size, "value_dim": c.linear_v_dim,
                             "conv_kernel": c.ssm_conv_kernel}  # fmt: skip
    if args.json:
        print(json.dumps(info, ensure_ascii=False, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "tensor_types":
            value = ", ".join(f"{n} x{k}" for k, n in value.items())
        elif key in ("parameters", "active_parameters"):
            value = f"{value:,} ({value / 1e6:,.1f} M)"
        elif key == "experts":
            value = f"{value['count']}, {value['used']} per token, width {value['width']}"
            if "shared_width" in info["experts"]:
                value += f", a shared expert of width {info['experts']['shared_width']}"
        elif key == "layer_kinds":
            value = f"{value['gated_deltanet']} Gated DeltaNet, {value['attention']} attention"
        elif key == "delta_net":
            value = (f"{value['key_heads']} key heads of {value['key_dim']}, {value['value_heads']} value heads of "
                     f"{value['value_dim']}, conv kernel {value['conv_kernel']}")  # fmt: skip
        elif key == "file_size_bytes":
            value = f"{value:,} ({value / 2**20:,.1f} MiB)"
        print(f"{key.replace('_', ' '):<{width}}  {value}")
    return 0


def _tokenize(args) -> int:
    from infero.checkpoint import load_checkpoint
    from infero.default_model import default_model_path
    from infero.tokenizer import Tokenizer
    from infero.tokenizer.tokenizer import TooManyTokensError

    ckpt = load_checkpoint(args.model or default_model_path())
    tok = Tokenizer.from_gguf_metadata(ckpt.metadata)
    context = ckpt.config.context_length
    try:
        ids = tok.encode_bounded(args.text, context, add_special_tokens=not args.no_special)
    except TooManyTokensError as e:  # as the server's /tokenize: a text the model could never read
        count = e.num_tokens if e.exact else f"at least {e.num_tokens}"
        raise InferoError(f"TEXT has {count} tokens, more than the model's context of {context}") from None
    print(json.dumps(ids))
    return 0


def _synth(args) -> int:
    from pathlib import Path

    from infero.checkpoint.synthetic import tensor_plan, write_synthetic
    from infero.progress import Progress

    progress = Progress(f"writing {args.output}", len(tensor_plan(args.shape, args.quant)), unit="tensors")
    path = write_synthetic(args.shape, args.quant, Path(args.output), args.seed, progress)
    progress.close()
    print(
        f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB): {args.shape} {args.quant}, random weights",
        file=sys.stderr,
    )
    return 0


def _batch_sizes(value: str) -> list[int]:
    try:
        sizes = [int(b) for b in value.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {value!r}")
    return sizes


def _bench(args) -> int:
    if args.bench == "serve":
        from infero.bench import serve as bench_serve

        return bench_serve.main(args)
    if args.bench == "invariance":
        from infero.bench import invariance

        return invariance.main(args)
    from infero import LLM
    from infero.bench import decode

    llm = LLM(args.model, device=args.device, show_progress=True, batch_invariant=batch_invariant(args))
    print(llm.summary(), file=sys.stderr)
    result = decode.run(llm, args.prompt_tokens, args.decode_tokens)
    print(decode.format_table(llm.config.name, llm.backend.name, result))
    if args.batch:
        print()
        print(decode.format_batched([(b, decode.batched(llm, b, args.prompt_tokens)) for b in args.batch]))
    if args.profile:
        for b in [1] + [b for b in args.batch or () if b > 1]:
            print()
            print(decode.format_profile(*decode.profile(llm, args.prompt_tokens, batch=b), batch=b))
        rows, prefill_us, tokens = decode.profile_prefill(llm, args.prompt_tokens)
        print()
        print(decode.format_profile(rows, prefill_us, prefill=tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
