"""Structured logging: JSON lines from structlog, with request context bound per task.

Axon's own lines take structlog's fast path: a level-filtering bound logger that renders with
orjson and writes bytes straight to stderr, with no stdlib `logging` record in between (every
request writes at least one line, so this is on the hot path). Standard-library loggers
(uvicorn, aio-pika) go through the same processors and renderer, so every line a service writes
is one JSON object of the same shape.
"""

import logging
import sys
from typing import BinaryIO, TextIO, cast

import orjson
import structlog
from opentelemetry.trace import get_current_span
from structlog.contextvars import bind_contextvars, clear_contextvars, merge_contextvars
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

__all__ = ["bind_contextvars", "clear_contextvars", "configure_logging", "get_logger"]


def configure_logging(*, service: str, level: str = "INFO", log_format: str = "json", traced: bool = False) -> None:
    """Route structlog and stdlib logging to stderr as JSON (or console) lines tagged with `service`.

    Args:
        service: Name put on every line (`gateway`, `sessions`, `worker`, `cli`).
        level: Minimum level name.
        log_format: `json` for machines, `console` for people.
        traced: tracing is on (`AXON_OTLP_ENDPOINT`): a line written in a span carries its
            `trace_id` and `span_id`.
    """

    def add_service(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service)
        return event_dict

    level_no = logging.getLevelNamesMapping()[level.upper()]
    shared_processors: list[Processor] = [
        merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        add_service,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if traced:
        shared_processors.insert(1, _add_trace_ids)
    if log_format == "json":
        structlog.configure(
            processors=[
                *shared_processors,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(serializer=orjson.dumps),
            ],
            # structlog types the file as BinaryIO; it only calls write() and flush().
            logger_factory=structlog.BytesLoggerFactory(cast(BinaryIO, _CurrentStderrBytes())),
            wrapper_class=structlog.make_filtering_bound_logger(level_no),
            cache_logger_on_first_use=True,
        )
        foreign_renderer: Processor = structlog.processors.JSONRenderer()
    else:
        structlog.configure(
            processors=[*shared_processors, structlog.dev.ConsoleRenderer(colors=False)],
            # structlog types the file as TextIO; it only calls write() and flush().
            logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _CurrentStderrText())),
            wrapper_class=structlog.make_filtering_bound_logger(level_no),
            cache_logger_on_first_use=True,
        )
        foreign_renderer = structlog.dev.ConsoleRenderer(colors=False)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared_processors,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            foreign_renderer,
        ],
    )
    # Like structlog's lines, the standard library's go to whatever `sys.stderr` is when written: a
    # handler holding the stream of its configuration writes to a closed file once that is swapped.
    handler = logging.StreamHandler(cast(TextIO, _CurrentStderrText()))
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # One access line per request is written by our own middleware.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    for noisy in ("aiormq", "aio_pika", "httpx", "httpcore", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # transformers' continuous batching logs to a handler of its own, in another format, unless
    # its logger already has a handler and does not propagate: give it ours. Its INFO lines are
    # notes on GPU features (flash attention, CUDA graphs) and cache sizes: DEBUG shows them.
    batching = logging.getLogger("ContinuousBatchingLogger")
    batching.handlers[:] = [handler]
    batching.propagate = False
    batching.setLevel(level_no if level_no <= logging.DEBUG else logging.WARNING)


class _CurrentStderrBytes:
    """Whatever `sys.stderr` is when a line is written (test runners and tools swap it), as bytes."""

    def write(self, data: bytes) -> int:
        return sys.stderr.buffer.write(data)

    def flush(self) -> None:
        sys.stderr.flush()


class _CurrentStderrText:
    """Whatever `sys.stderr` is when a line is written (test runners and tools swap it), as text."""

    def write(self, data: str) -> int:
        return sys.stderr.write(data)

    def flush(self) -> None:
        sys.stderr.flush()


def _add_logger_name(logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """`logger`: the stdlib record's name for foreign lines, else the name given to `get_logger`."""
    record = event_dict.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name:
        event_dict["logger"] = name
    return event_dict


def _add_trace_ids(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """`trace_id` and `span_id` of the span the line is written in (none outside a span)."""
    context = get_current_span().get_span_context()
    if context.is_valid:
        event_dict["trace_id"] = format(context.trace_id, "032x")
        event_dict["span_id"] = format(context.span_id, "016x")
    return event_dict


def get_logger(name: str | None = None) -> FilteringBoundLogger:
    """A logger whose lines carry `logger=name`."""
    logger: FilteringBoundLogger = structlog.get_logger(name)  # untyped (Any) in structlog
    return logger
