-- Keys an operator can govern: an expiry, the models a key may use and a token budget per
-- UTC calendar day or month (enforced in Redis beside the rate limits; see shared/ratelimit.py).

ALTER TABLE api_keys
    ADD COLUMN expires_at     timestamptz,
    ADD COLUMN allowed_models text[],
    ADD COLUMN token_budget   bigint CHECK (token_budget > 0),
    ADD COLUMN budget_period  text NOT NULL DEFAULT 'month' CHECK (budget_period IN ('day', 'month'));
