"""Errors of the layout math: one small hierarchy, every message naming the tensor or rule at fault."""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout is malformed, or does not fit the model it is applied to."""


class PatternError(LayoutError):
    """A dim pattern does not parse, or does not fit a tensor; the message shows a caret under the fault."""

    def __init__(self, message: str, text: str = "", span: tuple[int, int] | None = None, context: str = "") -> None:
        self.reason = message
        self.text = text
        self.span = span
        self.context = context
        super().__init__(self._render())

    def _render(self) -> str:
        head = f"{self.context}: {self.reason}" if self.context else self.reason
        if not self.text:
            return head
        start, stop = self.span if self.span is not None else (0, len(self.text))
        caret = " " * start + "^" * max(1, stop - start)
        return f"{head}\n    {self.text}\n    {caret}"

    def in_pattern(self, text: str, context: str) -> "PatternError":
        """The same error, located in pattern ``text`` and said of ``context`` (a tensor or rule)."""
        return PatternError(self.reason, text, self.span, context)

    def within(self, context: str) -> "PatternError":
        """The same error, said of ``context`` (a tensor or rule name) — prefixed to any context it had."""
        ctx = f"{context}: {self.context}" if self.context else context
        return PatternError(self.reason, self.text, self.span, ctx)


class PlanError(ValueError):
    """Source pieces cannot fill the requested target (missing tensor, gaps or overlaps, bad regions)."""
