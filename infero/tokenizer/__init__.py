"""Tokenization: GGUF or Hugging Face vocabularies as a `tokenizers.Tokenizer`, and streaming detokenization."""

from infero.tokenizer.detokenizer import IncrementalDetokenizer
from infero.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
