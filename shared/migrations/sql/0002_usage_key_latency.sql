-- Usage records name the API key and the request's latency; /admin/usage sums per key and day.
ALTER TABLE usage ADD COLUMN key_id text;
ALTER TABLE usage ADD COLUMN latency_ms integer;
CREATE INDEX usage_key_created_idx ON usage (key_id, created_at);
-- Key lookups by hash are the gateway's hot path (UNIQUE already indexes key_hash).
CREATE INDEX api_keys_tenant_idx ON api_keys (tenant);
