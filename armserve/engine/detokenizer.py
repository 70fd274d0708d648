"""Incremental detokenization of one completion, with stop strings and streaming hold-back.

Text is produced with the prefix_offset / read_offset algorithm: decode a small window of
already-emitted tokens with and without the new ones and keep the difference. Decoding a
window (instead of single tokens) keeps the decoder's context, e.g. SentencePiece's
leading-space handling and byte-fallback tokens that only form a character together.
"""

from __future__ import annotations

from typing import Any, Callable

from armserve.sampling_params import SamplingParams

# How many prompt tokens seed the decode window, so the first generated token is decoded
# in context (same number as vLLM uses).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _make_raw_decode(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) without transformers' clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer directly: no Python-side overhead and no clean-up step.
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns the generated token ids of one completion into text, step by step.

    `update` appends tokens and checks stop strings; `get_next_output_text` hands out the
    text for streaming, holding back a possible stop-string prefix. With
    `params.detokenize == False` no text is produced at all.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.detokenize = params.detokenize
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or []) if self.detokenize else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # With include_stop_str_in_output a streamed stop-string prefix is part of the final
        # text anyway, so nothing needs holding back (as in vLLM).
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._raw_decode = _make_raw_decode(tokenizer)

        # spaces_between_special_tokens=False: suppress whatever separator the decoder puts
        # between two consecutive added tokens (vLLM v1 semantics for fast tokenizers).
        self._added_ids: set[int] | None = None
        self._special_ids: set[int] = set()
        if not params.spaces_between_special_tokens and hasattr(tokenizer, "get_added_vocab"):
            added = set(tokenizer.get_added_vocab().values())
            if self.skip_special_tokens:
                # Skipped tokens vanish first; non-special added tokens can still be adjacent.
                self._special_ids = set(getattr(tokenizer, "all_special_ids", []))
                added -= self._special_ids
            if added:
                self._added_ids = added

        # Decode window: the last prompt tokens, then every generated token.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if self.detokenize else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # cached decode of ids[prefix:read]

        self._output_text = ""
        self._num_output_tokens = 0  # including a stop token whose text is dropped
        self._sent_offset = 0  # characters of output_text already streamed as deltas
        self._stopped_by_string = False
        self._token_text_cache: dict[int, str] = {}

    @property
    def output_text(self) -> str:
        """All text so far (including any held-back tail; cut at a matched stop string)."""
        return self._output_text

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def _decode(self, ids: list[int]) -> str:
        if self._added_ids is None:
            return self._raw_decode(ids, self.skip_special_tokens)
        if self.skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        # Decode in groups split only between two consecutive added tokens, and join them
        # with nothing: the decoder's own context is kept everywhere else.
        parts, start = [], 0
        for j in range(1, len(ids)):
            if ids[j] in self._added_ids and ids[j - 1] in self._added_ids:
                parts.append(self._raw_decode(ids[start:j], self.skip_special_tokens))
                start = j
        parts.append(self._raw_decode(ids[start:], self.skip_special_tokens))
        return "".join(parts)

    def _decode_next(self) -> str:
        """New text made complete by the tokens appended to the window ('' if none yet)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Wait while the text ends in an incomplete UTF-8 sequence (decoded as U+FFFD), or
        # when the token added no text (e.g. a skipped special token).
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset > 256:
            # Tokens before the window are never decoded again; keep the list short.
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens, extend output_text; return the stop string if one matched (text is then cut).

        `stop_terminated`: the last of `new_token_ids` is a stop token (EOS or one of
        stop_token_ids); it counts as a generated token but its text is not added.
        Stop strings are not looked for within the first `min_tokens` tokens (as in vLLM).
        """
        if not new_token_ids:
            return None
        if not self.detokenize or self._stopped_by_string:
            self._num_output_tokens += len(new_token_ids)
            return None
        text_ids = new_token_ids[:-1] if stop_terminated else new_token_ids
        stop_check_offset = len(self._output_text)
        for token_id in text_ids:
            self._ids.append(token_id)
            self._num_output_tokens += 1
            self._output_text += self._decode_next()
            if self._num_output_tokens <= self.min_tokens:
                stop_check_offset = len(self._output_text)
        if stop_terminated:
            self._num_output_tokens += 1

        if not self.stop or self._num_output_tokens <= self.min_tokens:
            return None
        match = self._find_stop_string(stop_check_offset)
        if match is None:
            return None
        stop_str, index = match
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self._output_text = self._output_text[:end]
        self._stopped_by_string = True
        return stop_str

    def _find_stop_string(self, new_text_offset: int) -> tuple[str, int] | None:
        """Earliest stop string that ends in the text after `new_text_offset`.

        Only the new text plus len(stop) - 1 characters before it are searched: anything
        earlier was already searched. Ties at one position go to the shorter string.
        """
        text = self._output_text
        if len(text) <= new_text_offset:
            return None
        best: tuple[str, int] | None = None
        for stop_str in self.stop:
            index = text.find(stop_str, max(0, new_text_offset - len(stop_str) + 1))
            if index == -1:
                continue
            if best is None or index < best[1] or (index == best[1] and len(stop_str) < len(best[0])):
                best = (stop_str, index)
        return best

    def _flush(self) -> None:
        """At the end: add text still waiting for more bytes (it decodes with U+FFFD), so
        the final text equals decoding all the tokens at once."""
        if self._read_offset >= len(self._ids):
            return
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.startswith(self._prefix_text):
            self._output_text += new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Full text or the new part since the last call; while not finished, holds back the last
        (max stop-string length - 1) characters so a stop string split across tokens is never streamed.

        With `finished`, pending incomplete characters are flushed first (unless a stop
        string ended the text), so call it once with `finished=True` at the end.
        """
        if not self.detokenize:
            return ""
        if finished and not self._stopped_by_string:
            self._flush()
        text = self._output_text
        length = len(text) if finished else len(text) - self.stop_buffer_length
        if not delta:
            return text[: max(length, 0)]
        if length <= self._sent_offset:
            return ""
        out = text[self._sent_offset : length]
        self._sent_offset = length
        return out

    def decode_token(self, token_id: int) -> str:
        """Text of a single token on its own (for logprobs' decoded_token); special tokens
        are shown, an incomplete byte sequence decodes to U+FFFD."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._raw_decode([token_id], False)
            self._token_text_cache[token_id] = text
        return text
