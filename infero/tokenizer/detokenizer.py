"""Streaming detokenization: text for each new token, never half a UTF-8 character.

The invariant: the concatenation of every `add()` output, plus `flush()` at the end of the stream, equals
`tok.decode(all_generated_ids, skip_special_tokens)` exactly. Work per token is constant.
"""

from __future__ import annotations

import codecs

from infero.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    `prompt_ids` is accepted for callers that have it, but the text depends only on the generated ids:
    the joined deltas must equal `tok.decode(generated_ids)`, which does not look at the prompt.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        if tok.pieces is not None:
            skip = tok.special_token_ids if skip_special_tokens else frozenset()
            self._stream: _ByteStream | _WindowStream = _ByteStream(tok, skip)
        else:
            self._stream = _WindowStream(tok, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        return self._stream.add(int(token_id))

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an unfinished character, as U+FFFD)."""
        return self._stream.flush()


class _ByteStream:
    """Concatenate each token's bytes and let Python's incremental UTF-8 decoder hold incomplete characters.

    The incremental decoder is built to give exactly what one-shot `bytes.decode("utf-8", "replace")` gives,
    which is how `Tokenizer.decode` turns the same bytes into text.
    """

    def __init__(self, tok: Tokenizer, skip: frozenset[int]) -> None:
        assert tok.pieces is not None
        self._pieces = tok.pieces
        self._skip = skip
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip_pending = tok.strip_leading_space  # the first character of the text, if a space, goes

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._pieces)})")
        if token_id in self._skip:
            return ""
        return self._emit(self._decoder.decode(self._pieces[token_id]))

    def flush(self) -> str:
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._strip_pending and text:
            self._strip_pending = False
            if text[0] == " ":
                text = text[1:]
        return text


class _WindowStream:
    """For decoders we have no byte table for: decode a short window of recent ids (vLLM's prefix/read offsets).

    The window is `ids[prefix:]`; `ids[prefix:read]` was already emitted and decodes to `prefix_text`.
    The delta is what the window adds after `prefix_text`; it is held back while it ends in U+FFFD (an
    unfinished character). The window keeps at least one rendered token before the new ones, so that
    decoders that treat the first token specially (a stripped leading space) see the same first token as
    a decode of the whole sequence does.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._skip_special = skip_special_tokens
        self._hidden = tok.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._emitted_chars = 0  # only consulted when a window disagrees with its prefix (rare)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < self._tok.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self._tok.vocab_size})")
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and text.endswith("\ufffd"):
            return ""
        if text.startswith(prefix_text):
            delta = text[len(prefix_text) :]
        else:  # the decoder re-read earlier text differently; fall back to the whole sequence once
            delta = self._decode(self._ids)[self._emitted_chars :]
        # Move the window past the emitted ids, unless they render nothing (see the class docstring).
        if any(i not in self._hidden for i in self._ids[self._read :]):
            self._prefix = self._read
        self._read = len(self._ids)
        self._emitted_chars += len(delta)
        return delta
