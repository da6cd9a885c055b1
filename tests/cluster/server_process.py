"""Starting a server subprocess that a test stops with SIGINT, as Ctrl-C would."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def popen_stoppable_by_sigint(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` of a server whose SIGINT raises KeyboardInterrupt.

    A test run started in the background (``nohup``, ``cmd &``) has SIGINT ignored, and an
    ignored signal stays ignored across fork and exec: the server's Python would then never
    raise KeyboardInterrupt and never stop. A handled signal is reset to its default at
    exec, so the child is started while this process handles SIGINT."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
