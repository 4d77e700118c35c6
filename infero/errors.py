"""Errors a user can cause. The CLI and the HTTP server turn them into one line or an OpenAI error body."""


class InferoError(Exception):
    """A problem with the user's input (file, model, prompt, parameters), with a message that says what to do."""


class ModelFileError(InferoError):
    """The model file is missing, is not GGUF, is truncated, or holds something we cannot run."""


class UnsupportedModelError(InferoError):
    """An architecture or tensor type infero does not implement."""


class PromptTooLongError(InferoError):
    """The prompt (plus requested output) does not fit the model's context."""


class ChatTemplateError(InferoError):
    """The model has no chat template, or the template failed to render the conversation."""
