"""Errors a user can cause. The CLI and the HTTP server turn them into one line or an OpenAI error body."""


class InferoError(Exception):
    """A problem with the user's input (file, model, prompt, parameters), with a message that says what to do."""


class ModelFileError(InferoError):
    """The model file is missing, is not GGUF, is truncated, or holds something we cannot run."""


class NonFiniteLogitsError(InferoError):
    """The model computed NaN or infinite logits for a request: its weights are broken, not the request."""


class UnsupportedModelError(InferoError):
    """An architecture or tensor type infero does not implement."""


class PromptTooLongError(InferoError):
    """The prompt (plus requested output) does not fit the model's context."""


class ChatTemplateError(InferoError):
    """The model has no chat template, or the template failed to render the conversation."""


def excerpt(value, limit: int = 60) -> str:
    """A short printable rendering of a value read from a file, for an error message: a corrupt length can make
    a string hundreds of megabytes long, and its characters need not be printable."""
    if isinstance(value, str):
        quoted = ascii(value[:limit])
        return quoted if len(value) <= limit else f"{quoted}... ({len(value):,} characters)"
    if hasattr(value, "__len__"):
        return f"an array of {len(value):,} values"
    return ascii(value)[:limit]
