-- OpenAI's Batch API (`/v1/batches`). A batch's row holds its state and counts; each line of its
-- input file, once validated, is a row of `batch_lines` holding the request to run and, once the
-- line is answered, its output or error line (`result`). A line is answered at most once
-- (`result` is only set while NULL, in the same statement that counts it), so a session manager
-- that takes a batch over after its owner died runs exactly the lines still unanswered.
CREATE TABLE batches (
    id                 text PRIMARY KEY,
    tenant             text NOT NULL,
    key_id             text,
    endpoint           text NOT NULL,
    input_file_id      text NOT NULL,
    completion_window  text NOT NULL,
    status             text NOT NULL,
    metadata           jsonb,
    errors             jsonb,
    output_file_id     text,
    error_file_id      text,
    total              integer NOT NULL DEFAULT 0,
    completed          integer NOT NULL DEFAULT 0,
    failed             integer NOT NULL DEFAULT 0,
    created_at         timestamptz NOT NULL,
    expires_at         timestamptz NOT NULL,
    in_progress_at     timestamptz,
    finalizing_at      timestamptz,
    completed_at       timestamptz,
    failed_at          timestamptz,
    expired_at         timestamptz,
    cancelling_at      timestamptz,
    cancelled_at       timestamptz
);

CREATE INDEX batches_tenant_created ON batches (tenant, created_at DESC, id DESC);
-- The batches some session manager must run to their end.
CREATE INDEX batches_unfinished ON batches (id) WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling');
-- A key's enqueued batches (its batch queue limit, `AXON_BATCH_QUEUE_TOKENS`).
CREATE INDEX batches_key_enqueued ON batches (key_id) WHERE status IN ('validating', 'in_progress', 'cancelling');

CREATE TABLE batch_lines (
    batch_id    text NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    line        integer NOT NULL,
    custom_id   text NOT NULL,
    model       text NOT NULL,
    body        text NOT NULL,
    -- The most tokens the line may use (its prompt estimated from characters, and max_tokens x n):
    -- what it counts against its key's batch queue limit while unanswered.
    tokens      integer NOT NULL,
    -- The output line (`ok`) or error-file line, once answered.
    ok          boolean,
    result      jsonb,
    PRIMARY KEY (batch_id, line)
);

-- Bodies over 2 kB are compressed with lz4 where the server has it (PostgreSQL 14 and later, built
-- with it): pglz, the default, made storing a 200 MB file's lines 2.6 times slower.
DO $$ BEGIN
    ALTER TABLE batch_lines ALTER COLUMN body SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR syntax_error THEN NULL;
END $$;

CREATE INDEX batch_lines_unanswered ON batch_lines (batch_id, line) WHERE result IS NULL;

-- A batch line's usage row is marked, and the daily rollups count batch usage apart as well (its
-- share of each day's requests and tokens), which `/admin/usage` reports.
ALTER TABLE usage ADD COLUMN batch boolean NOT NULL DEFAULT false;
ALTER TABLE usage_daily
    ADD COLUMN batch_requests bigint NOT NULL DEFAULT 0,
    ADD COLUMN batch_prompt_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN batch_completion_tokens bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION usage_roll_up() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_daily AS d (day, tenant, key_id, model, requests, prompt_tokens, completion_tokens,
                                  batch_requests, batch_prompt_tokens, batch_completion_tokens)
    SELECT (created_at AT TIME ZONE 'UTC')::date, tenant, key_id, model,
           count(*), sum(prompt_tokens), sum(completion_tokens),
           count(*) FILTER (WHERE batch),
           coalesce(sum(prompt_tokens) FILTER (WHERE batch), 0),
           coalesce(sum(completion_tokens) FILTER (WHERE batch), 0)
    FROM inserted
    GROUP BY 1, 2, 3, 4
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (day, tenant, key_id, model) DO UPDATE SET
        requests = d.requests + excluded.requests,
        prompt_tokens = d.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = d.completion_tokens + excluded.completion_tokens,
        batch_requests = d.batch_requests + excluded.batch_requests,
        batch_prompt_tokens = d.batch_prompt_tokens + excluded.batch_prompt_tokens,
        batch_completion_tokens = d.batch_completion_tokens + excluded.batch_completion_tokens;
    RETURN NULL;
END
$$;
