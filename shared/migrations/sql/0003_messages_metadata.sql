-- Messages remember which job produced them; sessions list by recency of activity.
ALTER TABLE messages ADD COLUMN job_id uuid;
ALTER TABLE conversations DROP COLUMN deleted_at;
