"""`axon-sessions`: run the session manager, configured only by environment."""

import sys

import uvicorn

from services.sessions.app import create_app
from services.sessions.settings import SessionsSettings
from shared.logging import configure_logging, get_logger
from shared.settings import InsecureConfiguration


def main() -> None:
    settings = SessionsSettings()
    configure_logging(service="sessions", level=settings.log_level, log_format=settings.log_format)
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.sessions_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        # Longer than the gateway's idle-connection expiry (2 s): the gateway closes first.
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
