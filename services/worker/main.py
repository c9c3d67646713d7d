"""`axon-worker`: run one inference worker, configured only by environment."""

import os
import sys
from typing import TYPE_CHECKING

from shared.stop_signals import StopSignals

if TYPE_CHECKING:
    from pydantic import ValidationError

# After the drain, the HTTP server only answers probes and scrapes: they end at once.
_PROBES_GRACE_S = 5.0


def main() -> None:
    # Before the imports below (a second or more): a stop requested while the worker starts
    # is counted like any other, not a KeyboardInterrupt.
    signals = StopSignals.hold()
    from pydantic import ValidationError

    from services.worker.library_output import quiet_libraries
    from services.worker.settings import WorkerSettings
    from shared.logging import configure_logging, get_logger

    try:
        settings = WorkerSettings()
    except ValidationError as exc:
        # Not a traceback: one line naming each bad setting, and the exit status of a refusal.
        configure_logging(service="worker", level="INFO", log_format="json")
        get_logger(__name__).error("refusing_to_start", reason=_settings_errors(exc))
        sys.exit(2)
    # Before the app's imports: the libraries read their verbosity when they are imported.
    quiet_libraries(settings.log_level, os.environ)
    from services.worker.app import create_app
    from services.worker.lifecycle import Worker
    from shared.serving import serve
    from shared.settings import InsecureConfiguration

    configure_logging(
        service="worker", level=settings.log_level, log_format=settings.log_format, traced=bool(settings.otlp_endpoint)
    )
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)
    worker: Worker = app.state.worker
    # The drain runs first, while /ready answers 503 "shutting down".
    serve(
        app,
        host=settings.host,
        port=settings.worker_port,
        grace_s=_PROBES_GRACE_S,
        drain=worker.drain,
        drain_timeout_s=settings.drain_timeout_s,
        signals=signals,
    )
    if worker.fatal is not None:
        sys.exit(1)


def _settings_errors(exc: "ValidationError") -> str:
    """Each bad setting as `AXON_NAME: why`; a check across settings by its message alone."""
    problems = []
    for error in exc.errors():
        name = "_".join(str(part) for part in error["loc"]).upper()
        problems.append(f"AXON_{name}: {error['msg']}" if name else error["msg"])
    return "; ".join(problems)


if __name__ == "__main__":
    main()
