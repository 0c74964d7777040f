"""Worker processes die with their parent, stop cleanly on SIGTERM/SIGINT, and tell the
frontend why when they fail."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # The parent may have died before prctl took effect.
    if os.getppid() == 1:
        os._exit(0)


def exit_on_signals() -> None:
    def handler(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def start_worker_process(name: str) -> None:
    """What every worker process does first: tie its life to the frontend's, log as `name`."""
    die_with_parent()
    exit_on_signals()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


def run_worker(name: str, worker) -> None:
    """Loads and runs a worker (its `load`, `run`, `close` and `outputs` socket). A failure is
    sent to the frontend as WorkerFailed, with its traceback, before the process exits with it."""
    from engine import protocol

    try:
        worker.load()
        worker.run()
    except SystemExit:
        pass
    except Exception:
        message = traceback.format_exc()
        logging.getLogger(f"antiphon.{name}").error("%s failed:\n%s", name, message)
        worker.outputs.send(protocol.encode(protocol.WorkerFailed(worker=name, message=message)))
        raise
    finally:
        worker.close()
