-- The Conversations API on sessions: a session's metadata (at most 16 string pairs, OpenAI's
-- limits checked by the session manager), and the items deleted from its messages. A message is
-- one or more items (its text, each tool call); an item deleted is a row here, (seq, part) of its
-- message, written at once, so it holds even for a message still waiting in the outbox.
ALTER TABLE conversations ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}';

CREATE TABLE deleted_items (
    conversation_id uuid NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             integer NOT NULL,
    part            integer NOT NULL,
    deleted_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, seq, part)
);
