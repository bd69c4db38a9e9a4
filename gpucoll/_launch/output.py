"""The output pump of gpucoll-run: ranks' stdout/stderr to the console (prefixed) and log files.

One thread multiplexes every rank's two pipes with ``selectors``: it reads what
arrives, writes complete lines to the console as ``[rank3]: ...`` and the raw bytes
to ``rank3.log``. Partial lines wait for their newline (or for the pipe to close),
so one rank's line is never cut by another's.
"""

from __future__ import annotations

import os
import selectors
import threading
from dataclasses import dataclass
from typing import IO, BinaryIO

__all__ = ["OutputPump"]

_CHUNK = 1 << 16


@dataclass
class _Stream:
    rank: int
    pipe: IO[bytes]
    console: BinaryIO | None
    log: BinaryIO | None
    partial: bytes = b""


class OutputPump:
    """Copies ranks' output pipes to the console and to per-rank log files.

    Args:
        stdout, stderr: the console's binary streams (``sys.stdout.buffer``, ...).
        prefix: prefix console lines with ``[rank<N>]: ``.
        log_dir: write ``rank<N>.log`` files there (stdout and stderr interleaved, no
            prefix), or None.
        console: show the output on the console at all.
    """

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, *, prefix: bool,
                 log_dir: str | None, console: bool) -> None:
        self._out = stdout
        self._err = stderr
        self._prefix = prefix
        self._log_dir = log_dir
        self._console = console
        self._sel = selectors.DefaultSelector()
        self._logs: list[BinaryIO] = []
        self._thread: threading.Thread | None = None
        self._console_broken = False

    def add(self, rank: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Start copying one rank's pipes (before :meth:`start`); the pump closes them.

        Raises:
            OSError: the log file cannot be opened.
        """
        log: BinaryIO | None = None
        if self._log_dir is not None:
            log = open(os.path.join(self._log_dir, f"rank{rank}.log"), "wb")
            self._logs.append(log)
        for pipe, console in ((stdout, self._out), (stderr, self._err)):
            os.set_blocking(pipe.fileno(), False)
            self._sel.register(pipe.fileno(), selectors.EVENT_READ,
                               _Stream(rank, pipe, console if self._console else None, log))

    def start(self) -> None:
        """Start the pump thread."""
        self._thread = threading.Thread(target=self._run, name="gpucoll-run-output", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every pipe to close, then release the files."""
        if self._thread is not None:
            self._thread.join(timeout)
        for log in self._logs:
            try:
                log.close()
            except OSError:
                pass

    def _run(self) -> None:
        while self._sel.get_map():
            for key, _ in self._sel.select(timeout=1.0):
                fd = int(key.fd)
                stream: _Stream = key.data
                try:
                    chunk = os.read(fd, _CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._copy(stream, chunk)
                else:
                    if stream.partial:
                        # The console line still needs its end; the log keeps the bytes as sent.
                        stream.log, log = None, stream.log
                        self._copy(stream, b"\n")
                        stream.log = log
                    self._sel.unregister(fd)
                    stream.pipe.close()
            self._flush()
        self._sel.close()

    def _copy(self, stream: _Stream, chunk: bytes) -> None:
        if stream.log is not None:
            try:
                stream.log.write(chunk)
            except OSError:
                stream.log = None
        if stream.console is None or self._console_broken:
            return
        data = stream.partial + chunk
        end = data.rfind(b"\n") + 1
        stream.partial = data[end:]
        if not end:
            return
        lines = data[:end]
        if self._prefix:
            tag = b"[rank%d]: " % stream.rank
            lines = b"".join(tag + line + b"\n" for line in lines[:-1].split(b"\n"))
        try:
            stream.console.write(lines)
        except (OSError, ValueError):
            # The console went away (``gpucoll-run ... | head``): keep draining the
            # pipes so that ranks never block on a full pipe.
            self._console_broken = True

    def _flush(self) -> None:
        for f in (self._out, self._err, *self._logs):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
