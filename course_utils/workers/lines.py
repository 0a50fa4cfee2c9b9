"""Split a stream of bytes into whole lines: worker output and command output are printed a line at a time."""

from __future__ import annotations

__all__ = ["LineSplitter"]


class LineSplitter:
    """Feed it chunks as they arrive; it hands back the complete lines and keeps the rest."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The lines completed by ``chunk`` (without their newlines), decoded as UTF-8."""
        buf = self._partial + chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            self._partial = buf
            return []
        self._partial = buf[cut + 1:]
        return buf[: cut + 1].decode("utf-8", errors="replace").splitlines()

    def flush(self) -> list[str]:
        """At end of stream: the last line, if it did not end with a newline."""
        rest, self._partial = self._partial, b""
        return [rest.decode("utf-8", errors="replace")] if rest else []
