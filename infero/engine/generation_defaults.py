"""The model's recommended sampling defaults: what a request that leaves a parameter out gets.

A model's creators publish them in its generation_config.json (Qwen3: temperature 0.6, top_k 20, top_p 0.95);
llama.cpp's converter copies them into the GGUF file as `general.sampling.*`, llama.cpp applies them, and vLLM
applies the generation_config.json (`--generation-config auto`, its default). So do we:

    auto    the GGUF file's general.sampling.* (the default)
    vllm    none: a parameter left out gets infero's own default (temperature 1.0, every filter off)
    PATH    a generation_config.json, or a folder holding one (as vLLM's --generation-config FOLDER)

`--override-generation-config '{"temperature": 0.5}'` is laid over the chosen one. As vLLM's, a default's
`max_new_tokens` caps every request's output tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from infero.engine.sampling import SamplingError, SamplingParams
from infero.errors import InferoError

# What a generation config may set (vLLM takes the same six from one), with the SamplingParams field each sets.
FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# The GGUF keys llama.cpp's converter writes from generation_config.json, by the name above.
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


class GenerationConfigError(InferoError):
    """A generation config the user gave cannot be read or holds a value no request may have."""


def resolve(choice: str, metadata: dict[str, Any], override: dict[str, Any] | None = None) -> tuple[dict, list[str]]:
    """(defaults, notes): the defaults by FIELDS name from `choice` (auto / vllm / a path) with `override` laid
    over them; notes say what of the model file's was not used (a value out of range), one line each."""
    notes: list[str] = []
    if choice == "auto":
        defaults = from_gguf(metadata, notes)
    elif choice == "vllm":
        defaults = {}
    else:
        defaults = from_file(Path(choice))
    if override:
        unknown = sorted(set(override) - set(FIELDS))
        if unknown:
            raise GenerationConfigError(
                f"--override-generation-config: {', '.join(unknown)} cannot be set there; it takes {', '.join(FIELDS)}"
            )
        defaults = {**defaults, **override}
        check(override, "--override-generation-config")
    return defaults, notes


def from_gguf(metadata: dict[str, Any], notes: list[str]) -> dict:
    """The general.sampling.* values of a GGUF file; one the sampler would refuse is left out with a note."""
    defaults = {}
    for name, key in GGUF_KEYS.items():
        if key not in metadata:
            continue
        value = _number(metadata[key])
        try:
            check({name: value}, key)
        except GenerationConfigError as e:
            notes.append(f"{e}; the model file's value is not used")
            continue
        defaults[name] = value
    return defaults


def from_file(path: Path) -> dict:
    """The FIELDS of a generation_config.json (or of the one in folder `path`); its other keys (token ids, flags
    of transformers' generate) are not sampling defaults."""
    file = path / "generation_config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise GenerationConfigError(f"--generation-config {path}: cannot read {file}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GenerationConfigError(f"--generation-config {path}: {file} is not JSON ({e})") from e
    if not isinstance(config, dict):
        raise GenerationConfigError(f"--generation-config {path}: {file} holds no JSON object")
    defaults = {name: config[name] for name in FIELDS if config.get(name) is not None}
    check(defaults, f"--generation-config {file}")
    return defaults


def check(values: dict[str, Any], source: str) -> None:
    """A GenerationConfigError naming `source` unless every value is one a request could have asked for."""
    try:
        SamplingParams(**{FIELDS[name]: value for name, value in values.items()})
    except SamplingError as e:
        raise GenerationConfigError(f"{source}: {e}") from None


def sampling_params(defaults: dict[str, Any], **values) -> SamplingParams:
    """SamplingParams from `values` (None: not given), each left out taking its default; max_tokens is capped by
    the defaults' max_new_tokens."""
    merged = {FIELDS[name]: value for name, value in defaults.items() if name != "max_new_tokens"}
    merged.update({name: value for name, value in values.items() if value is not None})
    cap = defaults.get("max_new_tokens")
    if cap is not None:
        merged["max_tokens"] = min(merged.get("max_tokens", cap), cap)
    return SamplingParams(**merged)


def describe(defaults: dict[str, Any]) -> str:
    """Like "temperature 0.6, top_k 20, top_p 0.95"."""
    return ", ".join(f"{name} {value}" for name, value in defaults.items())


def _number(value: Any) -> Any:
    """A GGUF float32 as the decimal it was written from (0.95, not 0.949999988079071); other values as they are."""
    if isinstance(value, (float, np.floating)) and math.isfinite(value):
        return float(str(np.float32(value)))  # numpy prints a float32 as its shortest round-trip decimal
    if isinstance(value, np.integer):
        return int(value)
    return value
