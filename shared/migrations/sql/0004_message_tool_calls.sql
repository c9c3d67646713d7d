-- Sessions store tool calls: an assistant answer's calls (OpenAI's `tool_calls` array), and a
-- tool result's `tool_call_id` and the tool's `name`. NULL on every other message.
ALTER TABLE messages ADD COLUMN tool_calls jsonb;
ALTER TABLE messages ADD COLUMN tool_call_id text;
ALTER TABLE messages ADD COLUMN name text;
