"""`axon-gateway`: run the public API gateway, configured only by environment."""

import uvicorn

from shared.logging import configure_logging
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    configure_logging(service="gateway", level=settings.log_level, log_format=settings.log_format)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        h11_max_incomplete_event_size=64 * 1024,
    )


if __name__ == "__main__":
    main()
