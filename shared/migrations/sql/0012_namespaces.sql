-- Deployments sharing one database (each its own AXON_NAMESPACE) stay apart: every row that a
-- sweep, a lease or a listing reads names the deployment that wrote it, and each deployment reads
-- only its own. Batches (and through them their lines) were the fault: every session manager leased
-- every unfinished batch in the database and failed the lines of models it did not serve. Files and
-- conversations are listed by tenant, and API keys (so tenants) are shared by the deployments of
-- one database: their rows are the deployment's as well.
--
-- Rows written before this migration get the default namespace, `axon` (AXON_NAMESPACE's default):
-- a deployment that ran under another namespace moves its rows with an UPDATE of its own.
ALTER TABLE batches ADD COLUMN namespace text NOT NULL DEFAULT 'axon';
ALTER TABLE files ADD COLUMN namespace text NOT NULL DEFAULT 'axon';
ALTER TABLE conversations ADD COLUMN namespace text NOT NULL DEFAULT 'axon';

DROP INDEX batches_tenant_created;
CREATE INDEX batches_tenant_created ON batches (namespace, tenant, created_at DESC, id DESC);
DROP INDEX batches_unfinished;
CREATE INDEX batches_unfinished ON batches (namespace, id)
    WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling');
DROP INDEX files_tenant_created;
CREATE INDEX files_tenant_created ON files (namespace, tenant, created_at, id);
DROP INDEX conversations_tenant_created_idx;
CREATE INDEX conversations_tenant_created_idx ON conversations (namespace, tenant, created_at DESC, id);
