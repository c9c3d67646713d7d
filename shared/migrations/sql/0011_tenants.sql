-- Tenants' weights for fair share: a tenant (an API key's `tenant`) without a row has weight 1.
-- PostgreSQL holds them; every gateway copies them into Redis (`<ns>:tenant-weights`), which the
-- scheduler reads (shared/tenants.py).
CREATE TABLE tenants (
    tenant      text PRIMARY KEY,
    weight      double precision NOT NULL CHECK (weight > 0 AND weight <= 1000000),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
