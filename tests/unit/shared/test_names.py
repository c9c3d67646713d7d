"""shared.names: every resource name is built from the namespace, so stacks never collide."""

from pathlib import Path

import pytest

from shared.names import Names

MODEL = "smollm2"
JOB_ID = "0f5e3c1a-job"


def all_names(names: Names) -> dict[str, str]:
    """Every name `Names` produces, keyed by what it is."""
    return {
        "jobs_exchange": names.jobs_exchange,
        "jobs_queue": names.jobs_queue(MODEL),
        "worker_queue": names.worker_queue(MODEL, "worker-1"),
        "batch_queue": names.batch_queue(MODEL),
        "tenant_queue": names.tenant_queue(MODEL, "tenant-a"),
        "fair_ready": names.fair_ready(MODEL),
        "fair": names.fair(MODEL, "interactive", "waiting"),
        "dead_letter_exchange": names.dead_letter_exchange,
        "dead_letter_queue": names.dead_letter_queue,
        "tokens_channel": names.tokens_channel(JOB_ID),
        "cancel_channel": names.cancel_channel,
        "workers_key": names.workers_key,
        "models_key": names.models_key,
        "models_seen_key": names.models_seen_key,
        "adapters_key": names.adapters_key,
        "model_profiles_key": names.model_profiles_key,
        "key_cache": names.key_cache("ab12"),
        "key_touched": names.key_touched("key_1"),
        "rate_limit": names.rate_limit("rpm", "key_1"),
        "session": names.session("s1"),
        "history": names.history("s1"),
        "session_seq": names.session_seq("s1"),
        "session_lock": names.session_lock("s1"),
        "affinity": names.affinity("s1"),
        "sessions_instance": names.sessions_instance("i1"),
        "outbox": names.outbox,
        "prefix_index": names.prefix_index(MODEL, "worker-1"),
        "job_progress": names.job_progress("j1"),
        "job_progress_text": names.job_progress_text("j1"),
        "job_progress_tokens": names.job_progress_tokens("j1"),
        "job_deliveries": names.job_deliveries("j1"),
        "chunk_log": names.chunk_log("j1"),
        "chunk_log_meta": names.chunk_log_meta("j1"),
        "response": names.response("resp_1"),
        "responses_running": names.responses_running,
        "responses_owners": names.responses_owners,
        "batches_running": names.batches_running,
        "batches_owners": names.batches_owners,
        "aliases_key": names.aliases_key,
        "tenant_weights": names.tenant_weights,
        "outbox_group": names.outbox_group,
    }


def test_all_names_covers_every_public_name() -> None:
    # Guard for the tests below: a new name added to Names must be added to all_names too.
    public = {n for n in dir(Names) if not n.startswith("_") and n not in ("namespace", "keys_without_expiry")}
    assert public == set(all_names(Names("ns")))


def test_every_key_without_expiry_is_a_name_the_architecture_lists_with_its_owner() -> None:
    names = Names("ns")
    assert names.keys_without_expiry <= set(all_names(names).values())
    table = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    rows = {row.split("|")[1].strip(): row for row in table.splitlines() if row.startswith("| `<ns>")}
    for key in names.keys_without_expiry:
        row = rows[key.replace("ns", "`<ns>", 1) + "`"]
        assert "no expiry; owner:" in row, row


@pytest.mark.parametrize("namespace", ["axon", "axon_test_1234"])
def test_every_name_starts_with_the_namespace(namespace: str) -> None:
    for kind, name in all_names(Names(namespace)).items():
        assert name.startswith(namespace), kind
        separator = name[len(namespace)]
        assert separator in ".:", f"{kind}: {name!r} does not separate the namespace"


def test_names_within_one_namespace_are_distinct() -> None:
    names = list(all_names(Names("axon")).values())
    assert len(set(names)) == len(names)


def test_two_namespaces_never_share_a_name() -> None:
    # "axon" is a prefix of "axon2": a separator must keep them apart.
    first = set(all_names(Names("axon")).values())
    second = set(all_names(Names("axon2")).values())
    assert first.isdisjoint(second)


def test_documented_shapes() -> None:
    names = Names("ns")
    assert names.jobs_exchange == "ns.jobs"
    assert names.jobs_queue(MODEL) == f"ns.jobs.{MODEL}"
    assert names.batch_queue(MODEL) == f"ns.jobs.{MODEL}.batch"
    assert names.dead_letter_queue == "ns.jobs.dead"
    assert names.tokens_channel(JOB_ID) == f"ns:tokens:{JOB_ID}"
    assert names.cancel_channel == "ns:cancel"


def test_job_channel_and_queue_depend_on_their_argument() -> None:
    names = Names("ns")
    assert names.tokens_channel("a") != names.tokens_channel("b")
    assert names.jobs_queue("m1") != names.jobs_queue("m2")


def test_a_tenant_queue_is_named_readably_when_it_can_be_and_safely_always() -> None:
    names = Names("axon")
    assert names.tenant_queue(MODEL, "acme") == "axon.jobs.smollm2.t.acme"
    assert names.tenant_queue(MODEL, "acme", batch=True) == "axon.jobs.smollm2.batch.t.acme"
    odd = names.tenant_queue(MODEL, "café / x" * 40)
    assert odd.startswith("axon.jobs.smollm2.t.h-") and len(odd.encode()) < 255
    assert odd != names.tenant_queue(MODEL, "café / y" * 40)
