-- Anthropic's Message Batches (`/v1/messages/batches`) on the Batch API's tables: a message batch
-- is a row of `batches` whose endpoint is `/v1/messages`, created with its lines (the requests
-- come inline, not in an uploaded file: no input file), and whose results file is its
-- `output_file_id`. Anthropic counts the lines a batch never ran (`canceled`, `expired`) apart from
-- those that failed (`errored`): `unrun` counts them, within `failed`.
ALTER TABLE batches ALTER COLUMN input_file_id DROP NOT NULL;
ALTER TABLE batches ADD COLUMN unrun integer NOT NULL DEFAULT 0;
