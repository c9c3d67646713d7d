-- The usage table grew by a row per request, forever. Now:
-- - `usage` is partitioned by month of `created_at` (UTC): partitions `usage_YYYYMM` hold
--   [first of the month, first of the next), and `usage_default` takes a row no partition covers
--   (so a write never fails); the session manager's retention task (services/sessions/
--   usage_retention.py) creates the coming months' partitions, moves what `usage_default` holds
--   into partitions of its own, and drops the raw rows older than AXON_USAGE_RETENTION_DAYS (whole
--   partitions where it can).
-- - `usage_daily` keeps, per UTC day, tenant, key and model, the requests and tokens: what
--   /admin/usage reports, kept when the raw rows are dropped. A statement trigger adds each
--   INSERT's new rows to it, in the same transaction. Rows an INSERT skips (ON CONFLICT DO NOTHING:
--   a redelivered outbox entry) are not in its transition table, so they are counted once; rows
--   moved between partitions, inserted into a partition directly, are not counted again.
-- A partitioned table's primary key must hold the partition key: a row is now unique by
-- (job_id, created_at), which is what a redelivered outbox entry repeats.

ALTER TABLE usage RENAME TO usage_unpartitioned;
ALTER INDEX usage_pkey RENAME TO usage_unpartitioned_pkey;
ALTER INDEX usage_tenant_created_idx RENAME TO usage_unpartitioned_tenant_created_idx;
ALTER INDEX usage_key_created_idx RENAME TO usage_unpartitioned_key_created_idx;

CREATE TABLE usage (
    job_id            uuid NOT NULL,
    tenant            text NOT NULL,
    model             text NOT NULL,
    prompt_tokens     integer NOT NULL,
    completion_tokens integer NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    key_id            text,
    latency_ms        integer,
    PRIMARY KEY (job_id, created_at)
) PARTITION BY RANGE (created_at);
CREATE INDEX usage_tenant_created_idx ON usage (tenant, created_at);
CREATE INDEX usage_key_created_idx ON usage (key_id, created_at);
-- Rows are appended in time order: a BRIN index finds those past the retention for a few pages.
CREATE INDEX usage_created_brin ON usage USING brin (created_at);
CREATE TABLE usage_default PARTITION OF usage DEFAULT;

CREATE TABLE usage_daily (
    day               date NOT NULL,
    tenant            text NOT NULL,
    key_id            text,
    model             text NOT NULL,
    requests          bigint NOT NULL,
    prompt_tokens     bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    CONSTRAINT usage_daily_day_tenant_key_model UNIQUE NULLS NOT DISTINCT (day, tenant, key_id, model)
);
CREATE INDEX usage_daily_key_day_idx ON usage_daily (key_id, day);

-- Rollup rows are updated in key order, so two transactions adding to the same ones never deadlock.
CREATE FUNCTION usage_roll_up() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_daily AS d (day, tenant, key_id, model, requests, prompt_tokens, completion_tokens)
    SELECT (created_at AT TIME ZONE 'UTC')::date, tenant, key_id, model,
           count(*), sum(prompt_tokens), sum(completion_tokens)
    FROM inserted
    GROUP BY 1, 2, 3, 4
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (day, tenant, key_id, model) DO UPDATE SET
        requests = d.requests + excluded.requests,
        prompt_tokens = d.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = d.completion_tokens + excluded.completion_tokens;
    RETURN NULL;
END
$$;
CREATE TRIGGER usage_roll_up AFTER INSERT ON usage
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION usage_roll_up();

-- A partition for every month from the oldest row to the next month, then the rows (rolled up on
-- the way in by the trigger).
DO $$
DECLARE
    month timestamp := date_trunc('month', coalesce(
        (SELECT min(created_at) FROM usage_unpartitioned), now()) AT TIME ZONE 'UTC');
    last timestamp := date_trunc('month', now() AT TIME ZONE 'UTC') + interval '1 month';
BEGIN
    WHILE month <= last LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF usage FOR VALUES FROM (%L) TO (%L)',
            'usage_' || to_char(month, 'YYYYMM'),
            month AT TIME ZONE 'UTC',
            (month + interval '1 month') AT TIME ZONE 'UTC'
        );
        month := month + interval '1 month';
    END LOOP;
END
$$;

INSERT INTO usage (job_id, tenant, model, prompt_tokens, completion_tokens, created_at, key_id, latency_ms)
SELECT job_id, tenant, model, prompt_tokens, completion_tokens, created_at, key_id, latency_ms
FROM usage_unpartitioned;

DROP TABLE usage_unpartitioned;
