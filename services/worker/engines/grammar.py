"""Grammars for the CPU engine's constrained decoding: xgrammar, each schema compiled once; and the
probe that bounds a new schema's compile on both engines.

xgrammar was chosen by measured cost (research for issue 21): the cheapest token mask that covers
every case (1.4 to 4.6 µs a token, against ~14 µs for llguidance; outlines-core cannot express
`json_object` or recursive schemas), it compiles a schema in milliseconds, and it is vLLM's default
structured-output backend, so both engines read a schema the same way.

* Built once at load: the vocabulary as xgrammar sees it (`TokenizerInfo`), a `GrammarCompiler`, and
  the added tokens to keep out of constrained answers (with a GGUF tokenizer xgrammar takes
  `<|im_start|>` and friends for plain text and would let them into JSON strings).
* Compiled grammars are cached by schema text in an LRU bounded in bytes
  (`AXON_GRAMMAR_CACHE_MB`); concurrent requests for the same new schema share one compile.
* A schema is refused (`InvalidPrompt`, a 400) when it is invalid, larger than
  `AXON_GRAMMAR_MAX_SCHEMA_BYTES`, or too complex: a new schema is first compiled in a child
  process (the probe, behind `SchemaGate`) that is killed when it takes longer than
  `AXON_GRAMMAR_COMPILE_TIMEOUT_S` or uses more than `AXON_GRAMMAR_COMPILE_MEMORY_MB`; only a
  schema that compiled there is compiled in the worker (on a thread, off the event loop). A hostile
  schema therefore costs at most that time on one core, never the engine's generation thread, and
  its refusal is remembered too.
* The vLLM engine puts the same gate before vLLM's xgrammar backend (`SchemaGate`, with vLLM's
  vocabulary), which would otherwise compile any schema for as long as it takes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from services.worker.engines.base import EngineError, Guide, InvalidPrompt
from shared.logging import get_logger

log = get_logger(__name__)

# `json_object`: any JSON object.
_ANY_OBJECT = '{"type": "object"}'
# Whitespace xgrammar allows between JSON tokens, per run: enough for indented output, and a small
# model cannot loop on newlines until max_tokens.
_MAX_WHITESPACE = 16
# Schemas probed, remembered by digest (passed, or refused and why), so a hostile schema sent again
# is not compiled again.
_SCHEMAS_KEPT = 4096
# How long the probe process may take to start (importing xgrammar imports torch).
_PROBE_START_S = 120.0
# How long a new schema may wait for the probe to finish those before it (each within its limit).
_QUEUE_S = 120.0
# xgrammar's messages start with "[time] file.cc:line: " and C++ check text: not for clients.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    compile_timeout_s: float = 5.0
    max_schema_bytes: int = 64 * 1024
    cache_mb: int = 256
    compile_memory_mb: int = 1024


def compile_schema(compiler: Any, schema: str) -> Any:
    """Compile a JSON schema with the options both the probe and the worker use (`strict_mode`:
    no properties beyond the schema's unless it allows them, as OpenAI's strict schemas)."""
    return compiler.compile_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=_MAX_WHITESPACE, strict_mode=True
    )


def _client_message(exc: BaseException) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


class SchemaGate:
    """Lets a JSON schema through to an engine's compiler only once it compiled in the probe within
    the limits (`GrammarLimits`): time, memory and size. A schema is probed once: what passed and
    what was refused (with its reason) are remembered by digest; concurrent checks of the same new
    schema share one probe. Used by the CPU engine (`Grammars`) and by the vLLM engine, whose
    structured-output backend compiles a schema on one thread of its engine core with no time
    limit (a 2 KB schema of 40 strings with distinct `maxLength` bounds in the millions held it for
    52 s on the 2-core development machine, and every other constrained request waited behind it)."""

    def __init__(self, tokenizer_info_json: str, limits: GrammarLimits) -> None:
        self.limits = limits
        self._probe = _Probe(tokenizer_info_json, limits)
        # Digest of a schema -> None (it passed) or why it was refused; least recently used first.
        self._seen: OrderedDict[bytes, str | None] = OrderedDict()
        self._pending: dict[bytes, asyncio.Task[None]] = {}

    def wait_ready(self) -> None:
        """Block until the probe process is up (it takes seconds to start: importing xgrammar imports torch)."""
        self._probe.wait_ready()

    def close(self) -> None:
        self._probe.close()

    async def check(self, schema: str) -> None:
        """Return once `schema` compiled in the probe (now or before).

        Raises:
            InvalidPrompt: it is larger than `max_schema_bytes`, xgrammar refuses it, or compiling
                it took longer than `compile_timeout_s` or more than `compile_memory_mb` (why, for
                the client).
            EngineError: the probe is not running.
        """
        size = len(schema.encode())
        if size > self.limits.max_schema_bytes:
            raise InvalidPrompt(
                f"The JSON schema is {size} bytes; this model accepts schemas of at most "
                f"{self.limits.max_schema_bytes} bytes."
            )
        key = _digest(schema)
        if key in self._seen:
            self._seen.move_to_end(key)
            refusal = self._seen[key]
            if refusal is not None:
                raise InvalidPrompt(refusal)
            return
        task = self._pending.get(key)
        if task is None:
            # A task of its own: a request cancelled while waiting leaves it running for the others.
            task = asyncio.create_task(self._probe_new(key, schema))
            self._pending[key] = task
            task.add_done_callback(lambda _: self._pending.pop(key, None))
        await asyncio.shield(task)

    def refuse(self, schema: str, reason: str) -> None:
        """Remember that `schema` is refused (an engine's own compile failed after the probe's passed)."""
        self._remember(_digest(schema), reason)

    async def _probe_new(self, key: bytes, schema: str) -> None:
        started = time.perf_counter()
        try:
            refusal = await asyncio.to_thread(self._probe.check, schema, self.limits.compile_timeout_s)
        except _TooComplex as exc:
            refusal = str(exc)
        self._remember(key, refusal)
        if refusal is not None:
            log.info("grammar_refused", reason=refusal, schema_bytes=len(schema))
            raise InvalidPrompt(refusal)
        log.info("grammar_probed", ms=round((time.perf_counter() - started) * 1000, 1), schema_bytes=len(schema))

    def _remember(self, key: bytes, refusal: str | None) -> None:
        self._seen[key] = refusal
        self._seen.move_to_end(key)
        while len(self._seen) > _SCHEMAS_KEPT:
            self._seen.popitem(last=False)


def _digest(schema: str) -> bytes:
    return hashlib.blake2b(schema.encode(), digest_size=16).digest()


class Grammars:
    """Compiles guides into xgrammar matchers for one vocabulary."""

    def __init__(
        self, info: Any, *, blocked_ids: list[int], limits: GrammarLimits, token_bytes: list[bytes] | None = None
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.blocked_ids = blocked_ids
        self.token_bytes: list[bytes] = token_bytes if token_bytes is not None else list(info.decoded_vocab)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[str, asyncio.Task[Any]] = {}
        self._gate = SchemaGate(info.serialize_json(), limits)
        self.hits = 0
        self.misses = 0

    @property
    def limits(self) -> GrammarLimits:
        return self._gate.limits

    @limits.setter
    def limits(self, limits: GrammarLimits) -> None:
        self._gate.limits = limits

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, *, vocab_size: int, eos_ids: set[int], limits: GrammarLimits) -> Grammars:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        blocked = sorted(i for i in added if i not in eos_ids and 0 <= i < vocab_size)
        return cls(info, blocked_ids=blocked, limits=limits)

    def wait_ready(self) -> None:
        """Block until the probe process is up (it takes seconds to start: importing xgrammar imports torch)."""
        self._gate.wait_ready()

    def close(self) -> None:
        self._gate.close()

    async def matcher(self, guide: Guide) -> Any:
        """A fresh `xgrammar.GrammarMatcher` for `guide`; `InvalidPrompt` naming the guide's
        parameter if the schema cannot be used."""
        try:
            compiled = await self.compile(guide)
        except InvalidPrompt as exc:
            raise InvalidPrompt(str(exc), param=guide.param) from exc
        return self._xgr.GrammarMatcher(compiled)

    async def compile(self, guide: Guide) -> Any:
        schema = _ANY_OBJECT if guide.kind == "json_object" else (guide.schema or "")
        compiled = self._cache.get(schema)
        if compiled is not None:
            self._cache.move_to_end(schema)
            self.hits += 1
            return compiled
        task = self._pending.get(schema)
        if task is None:
            self.misses += 1
            # A task of its own: a request cancelled while waiting leaves it running for the others.
            task = asyncio.create_task(self._compile_new(schema))
            self._pending[schema] = task
            task.add_done_callback(lambda done: self._settled(schema, done))
        else:  # the same new schema is compiling for another request: one compile for both
            self.hits += 1
        result: Any = await asyncio.shield(task)
        return result

    def _settled(self, schema: str, task: asyncio.Task[Any]) -> None:
        self._pending.pop(schema, None)
        if not task.cancelled() and task.exception() is None:
            self._remember(schema, task.result())

    async def _compile_new(self, schema: str) -> Any:
        started = time.perf_counter()
        await self._gate.check(schema)
        # Compiled again here rather than sent back: a grammar serializes to megabytes of
        # token-mask cache, slower to write and read than to compile for most schemas.
        try:
            compiled = await asyncio.to_thread(compile_schema, self._compiler, schema)
        except Exception as exc:  # noqa: BLE001  # xgrammar raises plain RuntimeErrors
            refusal = f"The JSON schema cannot be used: {_client_message(exc)}"
            self._gate.refuse(schema, refusal)
            raise InvalidPrompt(refusal) from None
        log.info("grammar_compiled", ms=round((time.perf_counter() - started) * 1000, 1), schema_bytes=len(schema))
        return compiled

    def _remember(self, schema: str, compiled: Any) -> None:
        self._cache[schema] = compiled
        self._cache_bytes += int(compiled.memory_size_bytes)
        budget = self.limits.cache_mb * 1024 * 1024
        while self._cache_bytes > budget and len(self._cache) > 1:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= int(evicted.memory_size_bytes)


class _TooComplex(Exception):
    """The probe ran out of time or memory on a schema (the message is for the client)."""


class _Probe:
    """A child process that compiles each new schema first, where it can be killed.

    One request at a time, one JSON line each way. Started at once (it takes a few seconds to
    import xgrammar), started again after it was killed or died.
    """

    def __init__(self, tokenizer_info_json: str, limits: GrammarLimits) -> None:
        # The vocabulary goes through a file: the child reads it only once xgrammar is imported,
        # and a pipe would block the writer until then.
        with tempfile.NamedTemporaryFile("w", prefix="axon-vocab-", suffix=".json", delete=False) as file:
            file.write(tokenizer_info_json)
        self._info_path = file.name
        self._limits = limits
        self._lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._spawn()

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.worker.engines.grammar",
                self._info_path,
                str(self._limits.compile_memory_mb),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Not in the worker's process group: a terminal's Ctrl+C is the worker's to handle (it
            # drains); the probe ends when the worker closes it, or at the end of its stdin.
            process_group=0,
        )
        self._ready = False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._stop()
        Path(self._info_path).unlink(missing_ok=True)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def wait_ready(self) -> None:
        with self._lock:
            if not self._ready:
                self._wait_ready()

    def _wait_ready(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        assert self._proc is not None and self._proc.stdout is not None
        if self._read_line(self._proc.stdout, time.monotonic() + _PROBE_START_S) != b"ready":
            self._stop()
            raise EngineError("The grammar compiler did not start.")
        self._ready = True

    def check(self, schema: str, timeout: float) -> str | None:
        """None if `schema` compiles within the limits; else why not (for the client).
        Raises `_TooComplex` past the time or memory limit: `timeout` counts from when the probe
        starts on this schema, not while it compiles the new schemas before it (one at a time),
        which may take up to `_QUEUE_S` together."""
        if not self._lock.acquire(timeout=_QUEUE_S):
            raise EngineError("The grammar compiler is busy; try again.")
        try:
            if self._closed:
                raise EngineError("The engine is stopping.")
            if not self._ready:
                self._wait_ready()
            deadline = time.monotonic() + timeout
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps({"schema": schema}).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                self._stop()
                raise EngineError("The grammar compiler is not running.") from None
            line = self._read_line(proc.stdout, deadline)
            if line is None:
                self._stop()
                self._spawn()  # warm for the next schema
                raise _TooComplex(f"The JSON schema is too complex: it did not compile within {timeout:g} s.")
            if not line:
                self._stop()
                self._spawn()
                raise _TooComplex(
                    f"The JSON schema is too complex: compiling it needs more than {self._limits.compile_memory_mb} MB."
                )
            try:
                error = json.loads(line)["error"]
            except (ValueError, KeyError, TypeError):
                self._stop()
                raise EngineError("The grammar compiler answered something unreadable.") from None
            return None if error is None else f"The JSON schema cannot be used: {error}"
        finally:
            self._lock.release()

    @staticmethod
    def _read_line(stream: IO[bytes], deadline: float) -> bytes | None:
        """One line without its newline; b"" at end of stream; None past `deadline`."""
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                return None
        return stream.readline().rstrip(b"\n")


def _probe_main(info_path: str, memory_mb: int) -> None:
    """The probe process: one schema per line in, one reply per line out."""
    # The replies get the real stdout to themselves; anything printed (a library's warning) goes to stderr.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import resource

    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(Path(info_path).read_text())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    with open("/proc/self/statm") as statm:  # first field: address space size, in pages
        in_use = int(statm.read().split()[0]) * resource.getpagesize()
    limit = in_use + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    stdout.write(b"ready\n")
    stdout.flush()
    for line in stdin:
        schema = json.loads(line)["schema"]
        try:
            compile_schema(compiler, schema)
            reply: dict[str, str | None] = {"error": None}
        except MemoryError:
            sys.exit(3)  # the parent reads the end of the stream as "out of memory"
        except Exception as exc:  # noqa: BLE001  # anything xgrammar refuses is a reason to give
            if "bad_alloc" in str(exc):
                sys.exit(3)
            reply = {"error": _client_message(exc)}
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _probe_main(sys.argv[1], int(sys.argv[2]))
