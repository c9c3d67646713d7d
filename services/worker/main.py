"""`axon-worker`: run one inference worker, configured only by environment."""

import sys

from shared.stop_signals import StopSignals

# After the drain, the HTTP server only answers probes and scrapes: they end at once.
_PROBES_GRACE_S = 5.0


def main() -> None:
    # Before the imports below (a second or more): a stop requested while the worker starts
    # is counted like any other, not a KeyboardInterrupt.
    signals = StopSignals.hold()
    from services.worker.app import create_app
    from services.worker.lifecycle import Worker
    from services.worker.settings import WorkerSettings
    from shared.logging import configure_logging, get_logger
    from shared.serving import serve
    from shared.settings import InsecureConfiguration

    settings = WorkerSettings()
    configure_logging(service="worker", level=settings.log_level, log_format=settings.log_format)
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)
    worker: Worker = app.state.worker
    # The drain runs first, while /ready answers 503 "shutting down".
    serve(
        app, host=settings.host, port=settings.worker_port, grace_s=_PROBES_GRACE_S, drain=worker.drain, signals=signals
    )
    if worker.fatal is not None:
        sys.exit(1)


if __name__ == "__main__":
    main()
