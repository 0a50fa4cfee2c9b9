"""The worker side of the progress channel: ``course_utils.report`` sends through it.

Inside a launched worker, :func:`open_channel` makes a non-blocking pipe to the launcher the
channel.  :func:`send_report` writes one framed, pickled report into it and never blocks:

The pipe is enlarged to 1 MiB where the system allows (some 10,000 reports), and the launcher
empties it continuously, so normally every report arrives, in order.  If the notebook falls so far
behind that the pipe is full, the report is held back instead of blocking training: only the newest
held-back report is kept (the ones it replaces are intermediate values, dropped by design and
counted in :func:`stats`), it is written before the next report, and a helper thread writes it as
soon as the notebook has read, so that a rank's last report still arrives when training ends while
the pipe is full.  (It is lost only if the worker exits before the notebook reads anything more.)
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import struct
import threading

__all__ = ["MAX_FRAME", "STARTED", "open_channel", "close_channel", "in_worker", "send_report",
           "announce_start", "stats", "wait_flushed", "decode_frames"]

MAX_FRAME = 4096  # pipe writes up to PIPE_BUF bytes are atomic: a report is never half-written
PIPE_SIZES = (1 << 20, 1 << 18)  # pipe sizes to ask for (Linux default: 64 KiB)
STARTED = "__course_started__"  # the key of the one report that says "the function starts now"


class _Channel:
    def __init__(self, fd: int):
        self.fd = fd
        self.pending: bytes | None = None  # the newest report that did not fit yet
        self.dropped = 0  # intermediate reports replaced before they could be written
        self.lock = threading.Lock()
        self.flusher: threading.Thread | None = None


_channel: _Channel | None = None


def open_channel(fd: int) -> None:
    """Make ``fd`` (the write end of the report pipe) this worker's channel."""
    global _channel
    os.set_blocking(fd, False)
    for size in PIPE_SIZES:
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
            break
        except (OSError, AttributeError):
            continue
    _channel = _Channel(fd)


def close_channel() -> None:
    """Forget the channel (the fd itself belongs to the caller); ``send_report`` returns False again."""
    global _channel
    _channel = None


def wait_flushed(timeout: float) -> bool:
    """Wait until no report is held back and the helper thread has ended; False on timeout."""
    ch = _channel
    if ch is None or ch.flusher is None:
        return True
    ch.flusher.join(timeout)
    return not ch.flusher.is_alive()


def in_worker() -> bool:
    """True inside a worker started by ``launch`` (reports go to the notebook)."""
    return _channel is not None


def stats() -> dict[str, int]:
    """``dropped``: reports replaced by a newer one while the pipe was full; ``pending``: 0 or 1."""
    ch = _channel
    if ch is None:
        return {"dropped": 0, "pending": 0}
    return {"dropped": ch.dropped, "pending": int(ch.pending is not None)}


def send_report(metrics: dict) -> bool:
    """Send one report to the launching notebook without blocking.

    Returns False when not inside ``launch``, or when the report could not be written now (it is
    then held back, see the module's docstring).
    """
    ch = _channel
    if ch is None:
        return False
    body = pickle.dumps(metrics, protocol=pickle.HIGHEST_PROTOCOL)
    frame = struct.pack("<I", len(body)) + body
    if len(frame) > MAX_FRAME:
        raise ValueError("a report must be a few numbers and short strings (under 4 KiB pickled)")
    with ch.lock:
        if ch.pending is not None and not _write(ch.fd, ch.pending):
            ch.pending = frame  # the held-back one was an intermediate value: replace it
            ch.dropped += 1
            return False
        ch.pending = None
        if _write(ch.fd, frame):
            return True
        ch.pending = frame
        if ch.flusher is None or not ch.flusher.is_alive():
            ch.flusher = threading.Thread(target=_flush, args=(ch,), name="report-flusher", daemon=True)
            ch.flusher.start()
        return False


def announce_start() -> None:
    """Tell the launcher that this rank's function starts now (its hang timeout counts from here)."""
    send_report({STARTED: True})


def _write(fd: int, frame: bytes) -> bool:
    """One non-blocking, all-or-nothing write (frames are at most PIPE_BUF bytes)."""
    try:
        os.write(fd, frame)
        return True
    except BlockingIOError:
        return False
    except OSError:  # the launcher is gone; the watchdog ends this worker
        return True


def _flush(ch: _Channel) -> None:
    """Worker thread: write the held-back report as soon as the pipe has room, then end."""
    while True:
        with ch.lock:
            if ch.pending is None:
                return
        try:
            select.select([], [ch.fd], [], 0.5)
        except (OSError, ValueError):
            return
        with ch.lock:
            if ch.pending is not None and _write(ch.fd, ch.pending):
                ch.pending = None


def decode_frames(buf: bytes) -> tuple[list[dict], bytes]:
    """Launcher side: the complete reports at the start of ``buf``, and the bytes left over."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack("<I", buf[:4])
        if len(buf) < 4 + n:
            break
        body, buf = buf[4:4 + n], buf[4 + n:]
        try:
            out.append(pickle.loads(body))
        except Exception:  # a report the notebook cannot unpickle is skipped, never fatal
            pass
    return out, buf
