-- Stored responses of OpenAI's Responses API (`POST /v1/responses` with `store`), written behind
-- through the outbox. `body` is what Redis keeps under `<ns>:response:<id>` (tenant, Response
-- object, input items, context messages); a deleted response keeps its row with `body` NULL, so
-- that an outbox entry of it committed later cannot bring it back. Rows past `expires_at` are
-- neither read nor kept: the persister deletes them as it writes new ones.
CREATE TABLE responses (
    id          text PRIMARY KEY,
    tenant      text NOT NULL,
    body        jsonb,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);

CREATE INDEX responses_expires_at ON responses (expires_at);
