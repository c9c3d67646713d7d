"""Session manager settings (`AXON_*` environment variables)."""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from shared.openai_requests import MAX_CHOICES, RequestLimits
from shared.settings import CommonSettings
from shared.topology import MAX_AFFINITY_WAIT_MS


class SessionsSettings(CommonSettings):
    host: str = "127.0.0.1"
    sessions_port: int = Field(8001, ge=1, le=65535)
    # Every request gets a deadline this far ahead; no wait outlives it.
    request_timeout_s: float = Field(300.0, gt=0)
    default_max_tokens: int = Field(256, ge=1)
    max_tokens_limit: int = Field(8192, ge=1)
    publish_timeout_s: float = Field(5.0, gt=0)
    # How long a session's job waits in the queue of the worker that served its last turn (whose
    # prefix cache holds the conversation) before RabbitMQ moves it to the model's shared queue.
    # 0: no affinity, every job goes to the shared queue.
    affinity_wait_ms: int = Field(250, ge=0, le=MAX_AFFINITY_WAIT_MS)
    # Sessionless chats that resend their history (an answer follows the first question) go first
    # to the worker their first exchange hashes to. Off by default: it pays for clients that keep
    # the conversation themselves, and piles requests sharing a few-shot example onto one worker.
    prefix_affinity: bool = False
    # The prefix index (`shared/prefix_index.py`): a request goes first to the live worker whose KV
    # cache holds the longest prefix of its prompt, learned from the engines' KV-cache events.
    prefix_routing: bool = Field(
        True,
        description=(
            "route a request first to the worker whose KV cache holds the longest prefix of its prompt (the"
            " prefix index, fed by the workers' engines' KV-cache events); false: session affinity only"
        ),
    )
    prefix_spill_seqs: int = Field(
        4,
        ge=1,
        description=(
            "a request's prefix home that runs this many more of this session manager's jobs than the least"
            " loaded worker is passed over for that one (load spill)"
        ),
    )
    prefix_lookup_timeout_ms: int = Field(
        50, ge=1, le=5000, description="how long a request waits for the prefix index before today's rules route it"
    )
    fair_share: bool = Field(
        True,
        description=(
            "interactive jobs and batch lines wait in their tenant's queue of the model and free"
            " sequences go to the tenant with the least weighted served tokens (docs/architecture.md,"
            " Fair share); false: the model's shared queue, first in, first out"
        ),
    )
    queue_poll_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "how often the session manager polls each model's queue depth and live workers and the"
            " tenants' waiting jobs for its metrics (a passive declare per model, a Redis read per band)"
        ),
    )
    cold_start_wait_s: float = Field(
        0.0,
        ge=0,
        description=(
            "how long a request for a model with no live worker waits for one (its job queued, so an"
            " autoscaler sees it) before 503 no_worker; 0 refuses at once"
        ),
    )
    cold_start_waits: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description=(
            "JSON object model -> seconds: the cold-start wait of each model of a pool that scales to"
            " zero, overriding cold_start_wait_s; a model listed is known even if no worker ever served it"
        ),
    )
    cold_start_adapters: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "JSON object LoRA adapter -> its base model, for the adapters of pools that scale to zero: a request"
            " for one waits in its base model's queue (which wakes the pool) even before any worker announced it"
        ),
    )
    subscribe_timeout_s: float = Field(5.0, gt=0)
    # Token channels of new job ids kept subscribed ahead, so a request need not wait for its own.
    subscribe_ahead: int = Field(32, ge=0)
    # How long the list of live models may be reused before asking Redis again.
    models_cache_ttl_s: float = Field(1.0, ge=0)
    # Chunks buffered per stream before a slow client is cut off.
    stream_buffer_chunks: int = Field(4096, ge=16)
    # Messages one chat request may carry.
    max_messages: int = Field(1000, ge=1)
    # Choices (`n`) one request may ask for: each is a job of its own.
    max_choices: int = Field(8, ge=1, le=MAX_CHOICES)
    # Size of a `response_format` JSON Schema, and of a request's tool parameter schemas together
    # (compiled into a grammar by the worker): larger ones are refused with 400.
    max_schema_bytes: int = Field(64 * 1024, ge=1024)

    # Sessions and history
    history_max_messages: int = Field(200, ge=2, description="recent messages kept in Redis per session")
    session_cache_ttl_s: int = Field(86_400, ge=60)
    # Stored responses (`POST /v1/responses` with `store`) expire this long after they were created.
    response_ttl_s: int = Field(30 * 86_400, ge=60)
    background_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="a background response's deadline: it may wait in the queue and run this long (a chat request"
        " has AXON_REQUEST_TIMEOUT_S)",
    )
    response_lease_s: float = Field(
        10.0,
        ge=1,
        description="the lease of the session manager relaying an unfinished stored response, renewed every third"
        " of it; once it expires (that process died) another one takes the response over",
    )
    stream_log_ttl_s: int = Field(
        3600,
        ge=60,
        description="how long a resumable stream's chunk log (`<ns>:chunks:<job>`) is kept after its last chunk",
    )
    batch_max_requests: int = Field(
        50_000,
        ge=1,
        description="the requests (lines) a batch's input file, or a message batch, may hold, as OpenAI's limit",
    )
    batch_lines_in_flight: int = Field(
        256,
        ge=1,
        description="the most lines of one batch its owner has released at a time (waiting in their model's"
        " batch queue or running on a worker)",
    )
    batch_queue_ahead: int = Field(
        32,
        ge=1,
        description="the lines of a model a session manager keeps waiting in the model's batch queue, for"
        " the workers to take into their free sequences (released while fewer wait)",
    )
    batch_queue_tokens: int = Field(
        0,
        ge=0,
        description="the most tokens one API key may have enqueued in its unfinished batches per model (each"
        " unanswered line's prompt estimate and max_tokens x n); 0: no limit",
    )
    batch_line_attempts: int = Field(
        3, ge=1, description="how many times a batch line that fails on the server's side (5xx) is tried"
    )
    batch_retention_days: int = Field(
        30,
        ge=1,
        description="how long an ended batch's row is kept after it was created (its lines are deleted as it"
        " ends: its output and error files hold the answers)",
    )
    usage_retention_days: int = Field(
        90,
        ge=1,
        description="how long the raw usage rows (one per request) are kept; the per-day rollups /admin/usage"
        " reports are kept beyond",
    )
    # Files API (`services/sessions/files/`)
    file_max_bytes: int = Field(
        200 * 1024 * 1024, ge=1, description="the largest file `POST /v1/files` takes (OpenAI's 200 MB); larger: 413"
    )
    file_store: Literal["postgres", "s3"] = Field(
        "postgres",
        description="where files' bytes go: PostgreSQL's `file_parts` (1 MiB pieces), or an S3 bucket"
        " (AXON_FILE_S3_*); their records are in PostgreSQL's `files` either way",
    )
    file_s3_bucket: str = Field("", description="the bucket of AXON_FILE_STORE=s3 (required then)")
    file_s3_prefix: str = Field("axon/files/", description="the key prefix of the files' objects in the bucket")
    file_s3_endpoint: str | None = Field(
        None, description="an S3-compatible endpoint URL (MinIO, a test server); unset: AWS's, of the region"
    )
    file_s3_region: str | None = Field(None, description="the bucket's region; unset: the environment's (AWS_REGION)")
    # Outbox persister (write-behind to PostgreSQL)
    persist_batch_size: int = Field(2000, ge=1)
    persist_flush_interval_ms: int = Field(100, ge=1)
    # Batches one persister commits at once, each on its own PostgreSQL connection.
    persist_concurrency: int = Field(2, ge=1, le=8)
    # Entries another persister read but did not acknowledge for this long are taken over.
    persist_reclaim_after_ms: int = Field(5_000, ge=100)

    @model_validator(mode="after")
    def _s3_needs_a_bucket(self) -> "SessionsSettings":
        if self.file_store == "s3" and not self.file_s3_bucket:
            raise ValueError("AXON_FILE_STORE=s3 needs AXON_FILE_S3_BUCKET")
        return self

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(max_choices=self.max_choices, max_schema_bytes=self.max_schema_bytes)
