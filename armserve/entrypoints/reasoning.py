"""Split a reasoning model's `<think>...</think>` text into `reasoning_content` and `content`.

Works on text, not token ids, so it does not matter whether the tags are single tokens. The
streaming parser holds back a possible partial tag (`"</thi"`) until the next delta decides it.
"""

from __future__ import annotations

START, END = "<think>", "</think>"

# name -> does reasoning start implicitly? DeepSeek-R1's chat template already puts `<think>`
# in the prompt, so its output begins inside the reasoning; Qwen3 writes the tag itself.
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One completion's parser. `feed(delta)` -> (reasoning delta, content delta); `finish()`
    flushes what was held back. `parse(text)` does a whole text at once."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
        self.implicit_start = REASONING_PARSERS[name]
        # "start": before any reasoning seen; "think": inside; "content": after </think>.
        self._state = "start"
        self._buf = ""
        self._strip_newlines = False  # the newline(s) right after </think> are layout, not content

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) of this text delta; `final`: the completion's last, so
        what was held back goes out too."""
        text = self._buf + delta
        self._buf = ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text = stripped[len(START):]
                    self._state = "think"
                elif START.startswith(stripped):  # maybe the tag is still arriving
                    self._buf = text
                    text = ""
                else:
                    # No opening tag: reasoning already started in the prompt, or there is none.
                    self._state = "think" if self.implicit_start else "content"
            elif self._state == "think":
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(END):]
                    self._state = "content"
                    self._strip_newlines = True
                else:
                    k = partial_suffix(text, END)
                    reasoning.append(text[: len(text) - k])
                    self._buf = text[len(text) - k:]
                    text = ""
            else:
                if self._strip_newlines:
                    text = text.lstrip("\n")
                    self._strip_newlines = not text  # still only newlines: keep stripping
                content.append(text)
                text = ""
        if final:
            held_reasoning, held_content = self.finish()
            reasoning.append(held_reasoning)
            content.append(held_content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the completion."""
        buf, self._buf = self._buf, ""
        if not buf:
            return "", ""
        if self._state == "think" or (self._state == "start" and self.implicit_start):
            return buf, ""
        return "", buf

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole-text parse: (reasoning_content, content), None where there is none."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None
