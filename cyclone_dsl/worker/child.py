"""One worker process of a supervisor: ``python -m cyclone_dsl.worker.child``.

It reads its settings from ``$CYCLONE_WORKER_SPEC`` (see :mod:`.processes`), imports
the handler modules by name, and runs a :class:`Worker` named ``<base>/<index>`` until
a signal, or until its stop pipe closes (the supervisor stops it, or is gone). It
reports its completed steps and settings to the supervisor through its report pipe.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

import attrs

from cyclone_dsl.db.errors import DatabaseError
from cyclone_dsl.errors import CycloneError, WorkerCrashed
from cyclone_dsl.worker.processes import ENV_SPEC, REPORT_INTERVAL_S, STOP_SIGNALS
from cyclone_dsl.worker.worker import Worker

log = logging.getLogger("cyclone.worker")


def resolve(ref: str) -> object:
    """``module`` or ``module:attribute``, imported."""
    module_name, _, attribute = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def _configure_logging(settings: dict[str, Any] | None) -> None:
    from cyclone_dsl.observability import configure_logging

    if settings is None:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    else:
        configure_logging(json=settings["json"], level=settings["level"])


def _watch(stop_fd: int, worker: Worker, index: int) -> None:
    """Stop gracefully once the supervisor closes the pipe (or dies)."""
    while os.read(stop_fd, 1):
        pass
    log.info("worker process %d: the supervisor asks it to stop", index)
    worker.request_stop()


def _report(report_fd: int, worker: Worker, ended: threading.Event) -> None:
    """Write the worker's completed steps and settings, as a JSON line, when they changed
    (and once more when ``ended``). A report the pipe cannot take now is skipped: the
    next one carries the counts too."""
    os.set_blocking(report_fd, False)
    last = ""
    while True:
        done = ended.wait(REPORT_INTERVAL_S)
        try:
            line = json.dumps(
                {"completed": worker.completed_count, "settings": attrs.asdict(worker.settings())}
            )
        except Exception:  # a report is not worth the worker: try again later
            log.debug("worker process report failed", exc_info=True)
            line = last
        if line != last or done:
            try:
                os.write(report_fd, line.encode() + b"\n")
                last = line
            except BlockingIOError:
                pass  # sent again with the next change, or at the end
            except OSError:  # the supervisor is gone
                return
        if done:
            os.close(report_fd)
            return


class _EarlySignals:
    """SIGTERM and SIGINT before the worker runs (its imports can take seconds; a group
    signal from systemd or Ctrl-C reaches this process too): a stop, not a death."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.signalled = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        # Blocked by the supervisor until now: one that came meanwhile is handled here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True
        if self.worker is not None:
            self.worker.request_stop()

    def hand_over(self, worker: Worker) -> None:
        """From now on ``worker`` hears the signals (its run() installs its handlers)."""
        self.worker = worker
        if self.signalled:
            worker.request_stop()


def main() -> int:
    early = _EarlySignals()
    spec: dict[str, Any] = json.loads(os.environ.pop(ENV_SPEC))
    # The supervisor's import path (a script's directory first): its modules import here.
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    _configure_logging(spec["log"])
    for name in spec["also"]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - only its workflows are missing then
            log.warning("could not import %r (it defines workflows): %r", name, exc)
    options = dict(spec["options"])
    retention = options.pop("retention")
    metrics_port = options.pop("metrics_port")
    index = int(spec["index"])
    try:
        handlers = [resolve(ref) for ref in spec["refs"]]
    except Exception:
        # Through the logging set-up, so that with JSON logs the traceback is in a field.
        log.exception("worker process %d cannot import its handlers", index)
        return 1
    worker = Worker(
        spec["dsn"],
        handlers,
        name=f"{spec['name']}/{index}",
        retention=None if retention is None else timedelta(seconds=retention),
        # Each process serves its own /metrics: on the given port plus its index - 1.
        metrics_port=metrics_port + index - 1 if metrics_port else metrics_port,
        **options,
    )
    early.hand_over(worker)
    threading.Thread(
        target=_watch, args=(spec["stop_fd"], worker, index), name="cyclone-stop-pipe", daemon=True
    ).start()
    ended = threading.Event()
    reporter = threading.Thread(
        target=_report, args=(spec["report_fd"], worker, ended), name="cyclone-report"
    )
    reporter.start()
    try:
        worker.run()
    except WorkerCrashed:
        return 1  # already logged, with its cause
    except (CycloneError, DatabaseError) as exc:
        log.error("worker process %d could not start: %s", index, str(exc).strip())
        return 1
    finally:
        ended.set()
        reporter.join()
        # The worker has stopped: a stop signal now (a group signal that reached this
        # process after its pipe closed) is moot. Ignored, so that one arriving while the
        # interpreter exits, once it has put the default action back, does not kill it.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
