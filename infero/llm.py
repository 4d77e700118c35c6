"""The offline Python API: load a model once, generate for one or many prompts.

from infero import LLM, SamplingParams
llm = LLM()                                   # the embedded default model
[out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
print(out.text, out.completion_ids)
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infero.backends import select_backend
from infero.checkpoint import load_checkpoint
from infero.default_model import default_model_path
from infero.engine import generation_defaults
from infero.engine.engine import Engine, EngineConfig
from infero.engine.request import RequestOutput, TokenLogprob
from infero.engine.sampling import SamplingParams
from infero.errors import ChatTemplateError, InferoError, PromptTooLongError
from infero.models import load_model
from infero.progress import Progress
from infero.tokenizer import Tokenizer
from infero.tokenizer.chat_template import ChatTemplate
from infero.tokenizer.tokenizer import TooManyTokensError


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # entry 0 is None: nothing predicts the first token


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        device: str = "auto",
        chat_template: str | os.PathLike | None = None,
        engine_config: EngineConfig | None = None,
        show_progress: bool = False,
        batch_invariant: bool = False,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        enforce_eager: bool = False,
    ):
        """generation_config: whose sampling defaults a request that leaves a parameter out gets, "auto" (the model
        file's), "vllm" (none) or a generation_config.json's path; override_generation_config is laid over them
        (infero.engine.generation_defaults). enforce_eager: no CUDA graphs (vLLM's flag)."""
        start = time.monotonic()
        self.path = Path(model) if model is not None else default_model_path()
        self.checkpoint = load_checkpoint(self.path)
        self.config = self.checkpoint.config
        self.generation_defaults, self.generation_notes = generation_defaults.resolve(
            generation_config, self.checkpoint.metadata, override_generation_config
        )
        self.tokenizer = Tokenizer.from_gguf_metadata(self.checkpoint.metadata)
        self.backend = select_backend(device, self.config.head_dim)
        if hasattr(self.backend, "batch_invariant"):  # the numpy backend is invariant as it is
            self.backend.batch_invariant = batch_invariant
        if enforce_eager and hasattr(self.backend, "use_graphs"):  # the GPU backend's decode-step graphs
            self.backend.use_graphs = False
        compile_kernels = getattr(self.backend, "compile_kernels", None)  # the GPU backend's, before the long load
        if compile_kernels is not None:
            compile_kernels(self.checkpoint)
        total = sum(t.nbytes for t in self.checkpoint.tensors.values())
        progress = Progress(f"loading {self.path.name}", total, enabled=show_progress)
        self.model = load_model(self.checkpoint, self.backend.ops, progress)
        progress.close()
        self.engine = Engine(self.model, self.backend, self.tokenizer, engine_config or EngineConfig())
        capture_graphs = getattr(self.backend, "capture_graphs", None)  # the GPU backend's decode-step graphs
        if capture_graphs is not None:
            capture_graphs(self.model, self.engine.cache)
        source = ChatTemplate.from_file(chat_template).source if chat_template else self.tokenizer.chat_template
        self.chat_template = (
            ChatTemplate(source, self.tokenizer.bos_token, self.tokenizer.eos_token) if source else None
        )
        self.ready_seconds = time.monotonic() - start

    def summary(self) -> str:
        """One line: model, quantization, memory for weights and KV, KV tokens that fit (and a hybrid model's
        recurrent-state slots), device."""
        c = self.config
        weights = self.checkpoint.file_size / 2**20
        kv = self.engine.pool.num_blocks * self.backend.kv_block_bytes(c, self.engine.pool.block_size) / 2**20
        return (
            f"ready: {c.name} ({c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}) "
            f"{self.checkpoint.quantization}, file {weights:,.0f} MiB, KV cache {kv:,.0f} MiB = "
            f"{self.engine.kv_capacity_tokens:,} tokens{self._state_note()}, context {self.engine.max_model_len:,}, "
            f"device {self.backend.name}{self._kernel_note()}, in {self._time_to_ready()}"
        )

    def _state_note(self) -> str:
        """A hybrid model's recurrent-state slots, and why its prompts skip the prefix cache."""
        states = self.engine.states
        if states is None:
            return ""
        return (f", recurrent state {self.engine.state_bytes / 2**20:,.0f} MiB = {states.num_slots} sequences "
                "(prefix caching off: a cached prefix lacks its recurrent state)")  # fmt: skip

    def _time_to_ready(self) -> str:
        """Like "12.3 s (load 2.1, compile 8.0, graphs 2.2)": the GPU backend's own parts (compiling kernels,
        capturing graphs), the rest (reading the file, uploading the weights, sizing the KV cache) as load; "1.2 s"
        where the load is all of it (the CPU backend)."""
        parts = getattr(self.backend, "startup_seconds", {})
        if not parts:
            return f"{self.ready_seconds:.1f} s"
        load = self.ready_seconds - sum(parts.values())
        spent = ", ".join(f"{name} {seconds:.1f}" for name, seconds in {"load": load, **parts}.items())
        return f"{self.ready_seconds:.1f} s ({spent})"

    def _kernel_note(self) -> str:
        status = getattr(self.backend, "kernel_status", None)  # the GPU backend reports its compiled kernels
        return f" ({status})" if status else ""

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.config.name!r} has no chat template; pass --chat-template FILE")
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """The conversation's prompt ids; PromptTooLongError, before the whole text is encoded, when it cannot fit."""
        max_bytes = self.tokenizer.max_token_bytes
        max_chars = None if max_bytes is None else self.engine.max_model_len * max_bytes
        try:
            text = self.render_chat(messages, max_chars=max_chars, **kwargs)
        except PromptTooLongError:
            raise self._too_long(self.engine.max_model_len, False) from None
        # The template writes BOS itself where the model wants one, so the tokenizer adds none (as vLLM).
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; PromptTooLongError as soon as it is known to leave no room for a generated token (time
        and memory follow the context, not the text)."""
        try:
            return self.tokenizer.encode_bounded(text, self.engine.max_model_len - 1, add_special_tokens)
        except TooManyTokensError as e:
            raise self._too_long(e.num_tokens, e.exact) from None

    def _too_long(self, num_tokens: int, exact: bool) -> PromptTooLongError:
        count = num_tokens if exact else f"at least {num_tokens}"
        return PromptTooLongError(
            f"the prompt has {count} tokens; this model's context holds {self.engine.max_model_len} including at "
            "least one generated token"
        )

    def default_sampling_params(self, **values) -> SamplingParams:
        """SamplingParams of `values` (None: not given), the model's generation defaults for the rest (as vLLM's
        LLM.get_default_sampling_params); the defaults' max_new_tokens caps max_tokens."""
        return generation_defaults.sampling_params(self.generation_defaults, **values)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's new tokens and text for one prompt (all n choices, told apart by `index`); without
        `params`, the model's generation defaults."""
        params = params or self.default_sampling_params()
        request_id = uuid.uuid4().hex
        self.engine.add_request(request_id, self._ids(prompt), params)
        running = params.n
        try:
            while running:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.error is not None:
                            raise out.error
                        running -= out.finished
                        yield out
        finally:
            self.engine.abort(request_id)

    def generate(
        self,
        prompts: str | list[int] | list,
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt in one batch; results prompt-major (each prompt's n choices in order); without
        `params`, the model's generation defaults; `priority`: each prompt's, under EngineConfig's priority
        scheduling policy (lower first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        priorities = priority if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InferoError(f"priority has {len(priorities)} values for {len(prompts)} prompts")
        results: dict[tuple[str, int], Completion] = {}
        ids: list[str] = []
        try:
            for prompt, p, rank in zip(prompts, params_list, priorities, strict=True):
                rid = uuid.uuid4().hex
                prompt_ids = self._ids(prompt)
                self.engine.add_request(rid, prompt_ids, p, priority=rank)
                ids.append(rid)
                for j in range(p.n):
                    results[rid, j] = Completion(prompt_ids, logprobs=[] if p.logprobs is not None else None)
            running = len(results)
            while running:
                for out in self.engine.step():
                    if out.error is not None:
                        raise out.error
                    c = results[out.request_id, out.index]
                    c.completion_ids += out.new_token_ids
                    c.text += out.new_text
                    if out.logprobs is not None:
                        c.logprobs += out.logprobs
                    if out.prompt_logprobs is not None:
                        c.prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        c.finish_reason = out.finish_reason
                        running -= 1
        finally:
            for rid in ids:
                self.engine.abort(rid)
        return list(results.values())

    def _ids(self, prompt: str | list[int]) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)
