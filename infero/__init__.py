"""infero: an LLM inference engine with hand-written kernels and an OpenAI-compatible server."""

__all__ = ["LLM", "Completion", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import infero.checkpoint` (or the CLI's inspect) does not pull in the whole engine.
    if name == "SamplingParams":
        from infero.engine.sampling import SamplingParams

        return SamplingParams
    if name in ("LLM", "Completion"):
        from infero import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'infero' has no attribute {name!r}")
