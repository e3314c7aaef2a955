"""SIGTERM read by a thread of its own, so a stopping server ends its streams at once."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable


class SigtermWatcher:
    """Calls `on_sigterm` on its own thread each time the process gets SIGTERM.

    Triton calls a model's finalize only after its in-flight requests are done, so on its own a server stopping
    with long streams waits out its exit timeout and then exits abruptly; `neo_backend serve` signals the server's
    process group, stub included. A Python-level handler would only run once the stub's main thread next runs
    Python code, so the signal is read from the interpreter's wakeup fd instead. Start and stop it on the main
    thread, which owns signal handlers and the wakeup fd; the no-op handler it installs stays after `stop`.
    """

    def __init__(self, on_sigterm: Callable[[], None]) -> None:
        self._on_sigterm = on_sigterm
        self._write_fd: int | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> bool:
        """Whether it could start (only on the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._watch, args=(read_fd,), name="neo-sigterm", daemon=True)
        self.thread.start()
        return True

    def stop(self) -> None:
        """Detach from the wakeup fd; the thread ends once it reads the pipe's end (join `thread` to wait)."""
        if self._write_fd is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(-1)  # before the close: a later signal must not write into a reused fd
        os.close(self._write_fd)
        self._write_fd = None

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as signals:
            while byte := signals.read(1):
                if byte[0] == signal.SIGTERM:
                    self._on_sigterm()
