"""Structured logging: JSON lines from structlog, with request context bound per task.

Standard-library loggers (uvicorn, aio-pika) go through the same renderer so every
line a service writes is one JSON object.
"""

import logging
import sys

import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars, merge_contextvars

__all__ = ["bind_contextvars", "clear_contextvars", "configure_logging", "get_logger"]


def configure_logging(*, service: str, level: str = "INFO", log_format: str = "json") -> None:
    """Route structlog and stdlib logging to stderr as JSON (or console) lines tagged with `service`.

    Args:
        service: Name put on every line (`gateway`, `sessions`, `worker`, `cli`).
        level: Minimum level name.
        log_format: `json` for machines, `console` for people.
    """

    def add_service(_logger: object, _method: str, event_dict: dict) -> dict:
        event_dict.setdefault("service", service)
        return event_dict

    shared_processors = [
        merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        add_service,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared_processors, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared_processors,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # One access line per request is written by our own middleware.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    for noisy in ("aiormq", "aio_pika", "httpx", "httpcore", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
