"""`axon-gateway`: run the public API gateway, configured only by environment."""

import sys

from shared.stop_signals import StopSignals


def main() -> None:
    # Before the imports below (about a second): a stop requested while the gateway starts is
    # counted like any other, not a KeyboardInterrupt.
    signals = StopSignals.hold()
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings
    from shared.guarded_http import ConnectionLimits, guarded_protocol
    from shared.http1 import Http1Client
    from shared.logging import configure_logging, get_logger
    from shared.serving import grace_s, serve
    from shared.settings import InsecureConfiguration

    settings = GatewaySettings()
    configure_logging(
        service="gateway", level=settings.log_level, log_format=settings.log_format, traced=bool(settings.otlp_endpoint)
    )
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)

    async def end_streams() -> None:
        # Each stream still relayed ends with a `stream_interrupted` error event: its upstream
        # connection breaks, as when the session manager goes away.
        upstream: Http1Client = app.state.upstream
        upstream.abort()

    limits = ConnectionLimits(
        head_timeout_s=settings.request_head_timeout_s,
        max_head_bytes=settings.max_header_bytes,
        stall_timeout_s=settings.client_stall_timeout_s,
        send_buffer_bytes=settings.client_send_buffer_bytes,
    )
    serve(
        app,
        host=settings.host,
        port=settings.gateway_port,
        http=guarded_protocol(limits),
        ssl_certfile=settings.tls_certfile or None,
        ssl_keyfile=settings.tls_keyfile or None,
        # Longer than the session manager's wait, so its streams end (cleanly) first.
        grace_s=grace_s(settings.drain_timeout_s, hops_behind=2),
        at_deadline=end_streams,
        signals=signals,
    )


if __name__ == "__main__":
    main()
