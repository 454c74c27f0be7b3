"""The API's embedded scheduler, run in a child process of each API process.

A tick orders every queued job and makes a dozen database reads; run as a thread of the API
process it shared the interpreter lock with the request handlers and the event loop, and under
a stream of submits (bench/api_load.py: 20/s with hundreds queued) it took about as much of the
process's time as all the requests together, so each request waited behind it. In a process of
its own the scheduler costs the requests no lock.

The parent talks to the child over the child's stdin: the first line is the settings as JSON,
then one byte per wake ("w"); "q" or the end of the pipe (the parent stopped or died) stops it.
The child releases the scheduler lock on the way out (also on SIGTERM, which a process-group
kill sends it together with the API), so a restarted API does not wait for the lease to lapse.

    python -m core.scheduler_proc      (started by SchedulerProcess, never by hand)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from core.settings import Settings
from core.telemetry import process_exited

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
WAKE = b"w"
QUIT = b"q"


def _settings_json(settings: Settings) -> str:
    # the scheduler never needs the admin's token, nor where it was read from (the file is gone
    # once the API is up): it stays in the API process
    return settings.model_dump_json(exclude={"admin_token", "admin_token_file"})


class SchedulerProcess:
    """Start, wake and stop a scheduler (core/scheduler.py Scheduler.run) in a child process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self) -> SchedulerProcess:
        # this checkout first on the child's path, as it is on ours (tests and the stack run
        # from a worktree with PYTHONPATH pointing at it)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "core.scheduler_proc"],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            close_fds=True,
        )
        assert self.proc.stdin is not None
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._write((_settings_json(self.settings) + "\n").encode(), block=True)
        return self

    def _write(self, data: bytes, *, block: bool = False) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.poll() is not None:
            return
        fd = self.proc.stdin.fileno()
        with self._lock:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    if not block:
                        return  # the pipe is full of wakes already: the child will tick anyway
                    threading.Event().wait(0.01)
                except (BrokenPipeError, OSError):
                    log.warning("the scheduler process is gone (exit code %s)", self.proc.poll())
                    return

    def wake(self) -> None:
        """A job was queued: the child ticks soon (wakes coalesce, core/scheduler_loop.py WAKE_GAP_S).
        No lock: a write of one byte to a pipe lands whole whatever other threads write, and under
        a stream of submits each one waited on the lock for the previous submit's thread to get the
        interpreter back (bench/api_load.py: the API's stall reports named it)."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            return
        try:
            os.write(proc.stdin.fileno(), WAKE)
        except BlockingIOError:
            pass  # the pipe is full of wakes already: the child will tick anyway
        except ValueError:
            pass  # stopping: stop() has closed the pipe
        except OSError:
            log.warning("the scheduler process is gone (exit code %s)", proc.poll())

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        self._write(QUIT)
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the scheduler process did not stop within %.0f s: killed", timeout_s)
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    from core.scheduler_loop import Scheduler
    from core.webhooks import Deliverer

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the API stops us through the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    settings = Settings.model_validate_json(stdin.readline())
    sched = Scheduler(settings)
    # webhooks go out from here: one process per API process, not one per request thread, and
    # never from a worker, whose processes come and go with the jobs
    deliverer = Deliverer(settings).start()

    def stop(*_: object) -> None:
        deliverer.stop_event.set()
        sched.stop_event.set()
        sched.wake_event.set()

    signal.signal(signal.SIGTERM, stop)

    def listen() -> None:
        while True:
            data = os.read(stdin.fileno(), 4096)
            if not data or QUIT in data:
                break
            sched.wake()
        stop()

    threading.Thread(target=listen, daemon=True, name="wakes").start()
    try:
        sched.run()
    finally:
        deliverer.stop()
        process_exited()


if __name__ == "__main__":
    main()
