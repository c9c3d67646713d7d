-- Axon's initial schema: keys, conversations, their messages, and usage records.

CREATE TABLE api_keys (
    id              text PRIMARY KEY,
    name            text NOT NULL,
    key_hash        bytea NOT NULL UNIQUE,
    display         text NOT NULL,
    tenant          text NOT NULL,
    rpm_limit       integer,
    tpm_limit       integer,
    max_concurrent  integer,
    priority        smallint NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_used_at    timestamptz,
    revoked_at      timestamptz
);

CREATE TABLE conversations (
    id              uuid PRIMARY KEY,
    tenant          text NOT NULL,
    title           text,
    system_prompt   text,
    model           text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    deleted_at      timestamptz
);
-- Listing a tenant's sessions, newest first.
CREATE INDEX conversations_tenant_created_idx ON conversations (tenant, created_at DESC, id);

CREATE TABLE messages (
    id              uuid PRIMARY KEY,
    conversation_id uuid NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             integer NOT NULL,
    role            text NOT NULL,
    content         text NOT NULL,
    status          text NOT NULL DEFAULT 'complete',
    created_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (conversation_id, seq)
);

CREATE TABLE usage (
    job_id            uuid PRIMARY KEY,
    tenant            text NOT NULL,
    model             text NOT NULL,
    prompt_tokens     integer NOT NULL,
    completion_tokens integer NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX usage_tenant_created_idx ON usage (tenant, created_at);
