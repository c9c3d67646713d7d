-- OpenAI's Files API (`services/sessions/files/`): one row a file, its bytes in `file_parts` as
-- pieces of about 1 MiB in order (or in S3 with AXON_FILE_STORE=s3, then no parts here). A file
-- being uploaded is `uploading` and seen by no one; it becomes `processed` once all its pieces are
-- written, or is deleted with them (a process that died mid-upload leaves one whose `touched_at`
-- stops moving: removed by the session managers' sweep, as are files past `expires_at`).
CREATE TABLE files (
    id          text PRIMARY KEY,
    tenant      text NOT NULL,
    purpose     text NOT NULL,
    filename    text NOT NULL,
    bytes       bigint NOT NULL DEFAULT 0,
    status      text NOT NULL,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz,
    touched_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX files_tenant_created ON files (tenant, created_at, id);
CREATE INDEX files_expires_at ON files (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX files_uploading ON files (touched_at) WHERE status = 'uploading';

CREATE TABLE file_parts (
    file_id  text NOT NULL REFERENCES files (id) ON DELETE CASCADE,
    seq      integer NOT NULL,
    data     bytea NOT NULL,
    PRIMARY KEY (file_id, seq)
);

-- Pieces compressed with lz4 where the server has it (PostgreSQL 14 and later, built with it):
-- faster to write and read than pglz, the default.
DO $$ BEGIN
    ALTER TABLE file_parts ALTER COLUMN data SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR syntax_error THEN NULL;
END $$;
