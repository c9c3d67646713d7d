"""Every Redis key and channel, RabbitMQ exchange and queue, built from the namespace.

Two stacks with different namespaces can share one Redis and one broker without
seeing each other's traffic; the tests rely on that.

Every Redis key either expires (its docstring says when) or is one of `keys_without_expiry`, whose
docstrings name the owner that removes what they hold, so nothing in Redis grows without bound.
"""

import hashlib
import re
from dataclasses import dataclass

# A tenant or model name used as it is in a queue name; any other is hashed (`queue_safe`).
_QUEUE_SAFE = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def queue_safe(name: str) -> str:
    """`name` where it is short and plain, else a hash of it: a queue name stays readable and
    within RabbitMQ's 255 bytes, whatever a tenant is called."""
    if _QUEUE_SAFE.fullmatch(name):
        return name
    return "h-" + hashlib.sha256(name.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class Names:
    """Names of every shared resource for one namespace."""

    namespace: str

    # RabbitMQ
    @property
    def jobs_exchange(self) -> str:
        """Direct exchange that routes a job to its model's queue (routing key = model)."""
        return f"{self.namespace}.jobs"

    def jobs_queue(self, model: str) -> str:
        """Durable queue holding one model's jobs."""
        return f"{self.namespace}.jobs.{model}"

    def worker_queue(self, model: str, worker_id: str) -> str:
        """One worker's own queue of `model` jobs (session affinity), also its routing key on the
        jobs exchange; what waits there too long is dead-lettered to the model's queue."""
        return f"{self.namespace}.jobs.{model}.w.{worker_id}"

    def batch_queue(self, model: str) -> str:
        """Durable queue holding one model's batch lines' jobs, also their routing key on the jobs
        exchange. Workers take from it only into a free sequence (`basic.get`), and hand a line
        back to it when an interactive job needs its sequence."""
        return f"{self.namespace}.jobs.{model}.batch"

    def tenant_queue(self, model: str, tenant: str, *, batch: bool = False) -> str:
        """Durable queue of one tenant's waiting jobs of `model` (`batch`: its batch lines'), also
        its routing key on the jobs exchange. Workers take from it (`basic.get`) when the fair
        share picks the tenant (`shared/fair.py`); deleted by the broker after a week unused."""
        kind = "batch.t" if batch else "t"
        return f"{self.namespace}.jobs.{model}.{kind}.{queue_safe(tenant)}"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.namespace}.jobs.dlx"

    @property
    def dead_letter_queue(self) -> str:
        """Where poison and rejected jobs end up, with the reason in their headers."""
        return f"{self.namespace}.jobs.dead"

    # Redis pub/sub
    def tokens_channel(self, job_id: str) -> str:
        """Channel the worker publishes a job's token chunks on."""
        return f"{self.namespace}:tokens:{job_id}"

    @property
    def cancel_channel(self) -> str:
        """Channel carrying ids of jobs whose client went away."""
        return f"{self.namespace}:cancel"

    def fair_ready(self, model: str) -> str:
        """Channel on which a session manager says a tenant's job of `model` waits (the workers'
        doorbell, `shared/fair.py`)."""
        return f"{self.namespace}:fair-ready:{model}"

    # Redis keys
    def fair(self, model: str, band: str, part: str) -> str:
        """The fair share's state of one model and band (`interactive` or `batch`), `part` one of
        `waiting` (hash: tenant -> its jobs waiting), `backlog` (sorted set: the tenants with jobs
        waiting, scored by their weighted served tokens), `served` (hash: tenant -> weighted served
        tokens), `vtime` (the score of the tenant picked last), `active` (hash: tenant -> when it
        was last served or queued a job) and, for `interactive`, `free` (hash: worker -> its free
        sequences and until when that holds). Each expires a week after its last write, `free`
        with its last report (`shared/fair.py`)."""
        return f"{self.namespace}:fair:{model}:{band}:{part}"

    def prefix_index(self, model: str, worker_id: str) -> str:
        """Set of the prompt anchors whose prefix `worker_id`'s engine holds in its KV cache for
        `model` (`shared/prefix_index.py`); written by that worker alone, expiring
        `PREFIX_INDEX_TTL_S` after its last write."""
        return f"{self.namespace}:prefix:{model}:{worker_id}"

    def job_progress(self, job_id: str) -> str:
        """Hash of a running job's progress: next `seq`, tokens so far (for failover). Expires at the
        job's deadline + 60 s (`shared.usage.PROGRESS_GRACE_S`)."""
        return f"{self.namespace}:progress:{job_id}"

    def job_progress_text(self, job_id: str) -> str:
        """Text a running job has published so far. Deleted by the job's final chunk; expires with
        its progress."""
        return f"{self.namespace}:progress-text:{job_id}"

    def job_progress_tokens(self, job_id: str) -> str:
        """Token ids a running job has generated so far (engines that expose them). Deleted by the
        job's final chunk; expires with its progress."""
        return f"{self.namespace}:progress-tokens:{job_id}"

    def chunk_log(self, job_id: str) -> str:
        """Capped stream of a job's chunks as published (entry `0-<seq + 1>`, field `c`), kept
        for a client that reconnects when its job asks for it: it expires `Job.chunk_log_ttl_s`
        (`AXON_STREAM_LOG_TTL_S`) after its last chunk."""
        return f"{self.namespace}:chunks:{job_id}"

    def chunk_log_meta(self, job_id: str) -> str:
        """A resumable chat stream's meta (JSON: its tenant, the fields its events repeat), kept
        as long as its chunk log can be: it expires at the job's deadline + `AXON_STREAM_LOG_TTL_S`."""
        return f"{self.namespace}:chunks-meta:{job_id}"

    def response(self, response_id: str) -> str:
        """A stored response's record (JSON: `sessions/responses/store.py:StoredResponse`), kept
        `AXON_RESPONSE_TTL_S` after its last write; deleted by `DELETE /v1/responses/{id}`."""
        return f"{self.namespace}:response:{response_id}"

    @property
    def responses_running(self) -> str:
        """Sorted set of unfinished stored responses, scored by their lease's expiry (epoch ms). No
        expiry; owner: the session managers, which remove a response when it finishes or is
        deleted, and take over (then finish) one whose lease expired."""
        return f"{self.namespace}:responses:running"

    @property
    def responses_owners(self) -> str:
        """Hash: unfinished stored response -> the instance id holding its lease. No expiry; owner:
        the session managers, with `responses_running`."""
        return f"{self.namespace}:responses:owners"

    @property
    def batches_running(self) -> str:
        """Sorted set of unfinished batches, scored by their owner's lease expiry (epoch ms), as
        `responses_running`. No expiry; owner: the session managers, which remove a batch when it
        ends and lease again any unfinished batch PostgreSQL holds that the set lost."""
        return f"{self.namespace}:batches:running"

    @property
    def batches_owners(self) -> str:
        """Hash: unfinished batch -> the instance id holding its lease, with `batches_running`."""
        return f"{self.namespace}:batches:owners"

    def job_deliveries(self, job_id: str) -> str:
        """How many times a job was redelivered (poison-job detection). Expires at the job's
        deadline + 60 s."""
        return f"{self.namespace}:deliveries:{job_id}"

    @property
    def aliases_key(self) -> str:
        """Hash: public model name -> served model. No expiry; owner: the operator, who sets and
        removes aliases (`/admin/models/aliases`, `axon models alias/unalias`)."""
        return f"{self.namespace}:aliases"

    @property
    def workers_key(self) -> str:
        """Hash: worker id -> JSON heartbeat (model, expiry). No expiry; owner: the workers, which
        remove their entry when they stop, and the readers of the registry (every session manager
        at least every 5 s), which delete entries expired for 60 s (`shared/registry.py`)."""
        return f"{self.namespace}:workers"

    @property
    def model_profiles_key(self) -> str:
        """Hash: model -> JSON of what its live workers last offered (context, supported parameters),
        for requests that wait for a worker of a model that has none. No expiry; owner: the
        workers' heartbeats, which forget a model with `models_key`."""
        return f"{self.namespace}:model-profiles"

    @property
    def models_key(self) -> str:
        """Set of the models workers served in this namespace (known models: 503 rather than 404
        without a live worker). No expiry; owner: the workers' heartbeats, which forget a model no
        live worker served for `shared.registry.FORGET_MODEL_AFTER_S` (7 days)."""
        return f"{self.namespace}:models"

    @property
    def models_seen_key(self) -> str:
        """Sorted set: every known model and adapter -> when a live worker last served it (Unix
        s). No expiry; owner: the workers' heartbeats, which write it and forget with it."""
        return f"{self.namespace}:models-seen"

    @property
    def adapters_key(self) -> str:
        """Hash: every LoRA adapter a worker announced -> the base model it runs on (its queue). No
        expiry; owner: the workers' heartbeats, which forget an adapter with `models_key`."""
        return f"{self.namespace}:adapters"

    @property
    def tenant_weights(self) -> str:
        """Hash: tenant -> its fair-share weight as a decimal string ("3", "0.5"); a tenant absent
        from it has weight 1. Read by the scheduler on every settlement. No expiry; owner: the
        gateways, which copy PostgreSQL's `tenants` table into it every
        `AXON_TENANT_WEIGHTS_SYNC_S` and remove the tenants no longer in the table
        (`shared/tenants.py`); `axon tenants set` and `PUT /admin/tenants/{tenant}` write a change
        at once."""
        return f"{self.namespace}:tenant-weights"

    def key_cache(self, key_hash_hex: str) -> str:
        """Cached lookup of an API key by its hash ("-" caches "no such key"). Expires after
        `AXON_KEY_CACHE_TTL_S`; deleted when the key is revoked or changed."""
        return f"{self.namespace}:key:{key_hash_hex}"

    def key_touched(self, key_id: str) -> str:
        """Set while a key's `last_used_at` was written recently, so it is written rarely. Expires
        after 60 s."""
        return f"{self.namespace}:key-touched:{key_id}"

    def rate_limit(self, kind: str, key_id: str) -> str:
        """Limiter state of one key: `rpm`/`tpm` (GCRA arrival time; expires once it is in the
        past), `conc` (lease set; expires `AXON_CONCURRENCY_LEASE_S` after its last lease) or
        `budget` with `<key_id>:<period>` (token budget; expires two days after its period)."""
        return f"{self.namespace}:rl:{kind}:{key_id}"

    # Sessions and history
    def session(self, session_id: str) -> str:
        """Cached session metadata (JSON), or a tombstone once deleted. Expires after
        `AXON_SESSION_CACHE_TTL_S`."""
        return f"{self.namespace}:session:{session_id}"

    def history(self, session_id: str) -> str:
        """List of a session's most recent messages (JSON), oldest first. Expires
        `AXON_SESSION_CACHE_TTL_S` after its last message; deleted with the session."""
        return f"{self.namespace}:history:{session_id}"

    def affinity(self, session_id: str) -> str:
        """Id of the worker that served a session's last turn (whose prefix cache holds it). Expires
        after 1 h; deleted with the session."""
        return f"{self.namespace}:affinity:{session_id}"

    def session_seq(self, session_id: str) -> str:
        """Counter handing out a session's message sequence numbers. Expires
        `AXON_SESSION_CACHE_TTL_S` after its last message, as the history; deleted with the session.
        A counter that is gone continues after the last seq stored."""
        return f"{self.namespace}:session-seq:{session_id}"

    def session_lock(self, session_id: str) -> str:
        """Held by the one request currently answering in a session. Expires after
        `AXON_REQUEST_TIMEOUT_S` + 30 s."""
        return f"{self.namespace}:session-lock:{session_id}"

    def sessions_instance(self, instance_id: str) -> str:
        """Exists while that session manager process is alive (its turn locks are valid). Expires
        after 10 s unless refreshed (every 3 s)."""
        return f"{self.namespace}:sessions-alive:{instance_id}"

    @property
    def outbox(self) -> str:
        """Redis Stream of rows waiting to be written to PostgreSQL (write-behind). No expiry;
        owner: the persisters, which trim what they committed."""
        return f"{self.namespace}:outbox"

    @property
    def outbox_group(self) -> str:
        """Consumer group of the persisters draining the outbox (part of the outbox's key)."""
        return f"{self.namespace}:persisters"

    @property
    def keys_without_expiry(self) -> frozenset[str]:
        """The Redis keys that have no expiry, each with an owner that removes what it holds (see
        their docstrings); every other key expires."""
        return frozenset(
            {
                self.workers_key,
                self.models_key,
                self.models_seen_key,
                self.adapters_key,
                self.model_profiles_key,
                self.aliases_key,
                self.tenant_weights,
                self.responses_running,
                self.responses_owners,
                self.batches_running,
                self.batches_owners,
                self.outbox,
            }
        )
