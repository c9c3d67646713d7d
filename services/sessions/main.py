"""`axon-sessions`: run the session manager, configured only by environment."""

import sys

from shared.stop_signals import StopSignals


def main() -> None:
    # Before the imports below (a second or more): a stop requested while the session manager starts
    # is counted like any other, not a KeyboardInterrupt.
    signals = StopSignals.hold()
    from services.sessions.app import create_app
    from services.sessions.deps import SessionServices
    from services.sessions.settings import SessionsSettings
    from shared.logging import configure_logging, get_logger
    from shared.serving import grace_s, serve
    from shared.settings import InsecureConfiguration

    settings = SessionsSettings()
    configure_logging(
        service="sessions",
        level=settings.log_level,
        log_format=settings.log_format,
        traced=bool(settings.otlp_endpoint),
    )
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)

    async def interrupt_streams() -> None:
        services: SessionServices = app.state.services
        await services.run_on.call_off()
        await services.completions.interrupt_streams()

    serve(
        app,
        host=settings.host,
        port=settings.sessions_port,
        # Longer than a worker's drain, so the jobs it finishes reach their clients; then what
        # is still streaming ends with a `stream_interrupted` error event.
        grace_s=grace_s(settings.drain_timeout_s, hops_behind=1),
        at_deadline=interrupt_streams,
        # Longer than the gateway's idle-connection expiry (2 s): the gateway closes first.
        timeout_keep_alive=30,
        signals=signals,
    )


if __name__ == "__main__":
    main()
