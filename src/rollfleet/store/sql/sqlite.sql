-- rollfleet store, SQLite dialect. Named blocks: "-- name: X". Params are :name.
-- JSON values are stored as TEXT in both dialects (one decoding path).

-- name: schema
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    input TEXT NOT NULL,
    mode TEXT,
    status TEXT NOT NULL CHECK (status IN ('queuing','preparing','running','succeeded','failed','cancelled')),
    priority INTEGER NOT NULL DEFAULT 0,
    batch_id TEXT,
    group_id TEXT,
    config TEXT NOT NULL,
    timeout_s REAL,
    heartbeat_s REAL NOT NULL,
    max_attempts INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    result TEXT,
    reward REAL,
    error TEXT,
    num_attempts INTEGER NOT NULL DEFAULT 0,
    attempts_charged INTEGER NOT NULL DEFAULT 0,
    attempts_lost INTEGER NOT NULL DEFAULT 0,
    max_lost INTEGER NOT NULL DEFAULT 10,
    retry_delay_s REAL NOT NULL DEFAULT 0,
    available_at REAL NOT NULL DEFAULT 0,
    suspect INTEGER NOT NULL DEFAULT 0,
    num_steps INTEGER NOT NULL DEFAULT 0,
    current_attempt_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (priority DESC, seq) WHERE status = 'queuing';
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts (status, seq);
CREATE INDEX IF NOT EXISTS rollouts_batch ON rollouts (batch_id, seq);
-- No SQLite plan reads an index on updated_at (updated_after is a filter on a seq range), and
-- every claim and completion moved two entries of one: a database made before loses it.
DROP INDEX IF EXISTS rollouts_updated;
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id),
    sequence INTEGER NOT NULL,
    worker_id TEXT,
    status TEXT NOT NULL CHECK (status IN ('preparing','running','succeeded','failed','timeout','lost','cancelled')),
    charged INTEGER NOT NULL DEFAULT 1,
    started_at REAL NOT NULL,
    lease_expires_at REAL NOT NULL,
    deadline_at REAL,
    last_heartbeat_at REAL,
    finished_at REAL,
    error TEXT,
    UNIQUE (rollout_id, sequence)
);
-- The database itself refuses two live attempts on one rollout.
CREATE UNIQUE INDEX IF NOT EXISTS attempts_one_live ON attempts (rollout_id) WHERE status IN ('preparing','running');
CREATE INDEX IF NOT EXISTS attempts_lease ON attempts (lease_expires_at) WHERE status IN ('preparing','running');
DROP INDEX IF EXISTS attempts_deadline;  -- replaced by attempts_deadline_set (rollouts without timeout_s stay out)
CREATE INDEX IF NOT EXISTS attempts_deadline_set ON attempts (deadline_at)
    WHERE status IN ('preparing','running') AND deadline_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS attempts_worker ON attempts (worker_id, status);
DROP INDEX IF EXISTS attempts_rollout;  -- the same keys as UNIQUE (rollout_id, sequence)
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('idle','busy','offline')),
    registered_at REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL,
    lease_s REAL NOT NULL,
    rollouts_succeeded INTEGER NOT NULL DEFAULT 0,
    rollouts_failed INTEGER NOT NULL DEFAULT 0,
    metadata TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    timestamp REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_rollout ON steps (rollout_id, sequence);
CREATE TABLE IF NOT EXISTS resources (
    version INTEGER PRIMARY KEY AUTOINCREMENT,
    resources_id TEXT NOT NULL UNIQUE,
    vals TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_at REAL NOT NULL
);
-- Images of trajectories, once each by content (store/blobs.py); steps hold rollfleet-blob:<sha256>.
CREATE TABLE IF NOT EXISTS blobs (
    sha256 TEXT PRIMARY KEY,
    media_type TEXT NOT NULL,
    size INTEGER NOT NULL,
    data BLOB NOT NULL,
    created_at REAL NOT NULL
);

-- name: insert_rollout
INSERT INTO rollouts (rollout_id, input, mode, status, priority, batch_id, group_id, config, timeout_s,
                      heartbeat_s, max_attempts, max_lost, retry_delay_s, metadata, created_at,
                      updated_at)
VALUES (:rollout_id, :input, :mode, :status, :priority, :batch_id, :group_id, :config, :timeout_s,
        :heartbeat_s, :max_attempts, :max_lost, :retry_delay_s, :metadata, :now, :now)
ON CONFLICT (rollout_id) DO NOTHING;

-- name: select_rollouts_by_ids
SELECT r.*, a.attempt_id AS a_attempt_id, a.sequence AS a_sequence, a.worker_id AS a_worker_id,
       a.status AS a_status, a.started_at AS a_started_at, a.lease_expires_at AS a_lease_expires_at,
       a.last_heartbeat_at AS a_last_heartbeat_at, a.finished_at AS a_finished_at, a.error AS a_error
FROM rollouts r LEFT JOIN attempts a ON a.attempt_id = r.current_attempt_id
WHERE r.rollout_id IN (SELECT value FROM json_each(:ids))
ORDER BY r.seq;

-- name: query_rollouts_asc
SELECT r.*, a.attempt_id AS a_attempt_id, a.sequence AS a_sequence, a.worker_id AS a_worker_id,
       a.status AS a_status, a.started_at AS a_started_at, a.lease_expires_at AS a_lease_expires_at,
       a.last_heartbeat_at AS a_last_heartbeat_at, a.finished_at AS a_finished_at, a.error AS a_error
FROM rollouts r LEFT JOIN attempts a ON a.attempt_id = r.current_attempt_id
WHERE r.seq > :cursor
  AND (:statuses IS NULL OR r.status IN (SELECT value FROM json_each(:statuses)))
  AND (:mode IS NULL OR r.mode = :mode)
  AND (:batch_id IS NULL OR r.batch_id = :batch_id)
  AND (:group_id IS NULL OR r.group_id = :group_id)
  AND (:worker_id IS NULL OR a.worker_id = :worker_id)
  AND (:updated_after IS NULL OR r.updated_at > :updated_after)
  AND (:search IS NULL OR r.rollout_id LIKE :search || '%')
ORDER BY r.seq ASC LIMIT :limit;

-- name: query_rollouts_desc
SELECT r.*, a.attempt_id AS a_attempt_id, a.sequence AS a_sequence, a.worker_id AS a_worker_id,
       a.status AS a_status, a.started_at AS a_started_at, a.lease_expires_at AS a_lease_expires_at,
       a.last_heartbeat_at AS a_last_heartbeat_at, a.finished_at AS a_finished_at, a.error AS a_error
FROM rollouts r LEFT JOIN attempts a ON a.attempt_id = r.current_attempt_id
WHERE r.seq < :cursor
  AND (:statuses IS NULL OR r.status IN (SELECT value FROM json_each(:statuses)))
  AND (:mode IS NULL OR r.mode = :mode)
  AND (:batch_id IS NULL OR r.batch_id = :batch_id)
  AND (:group_id IS NULL OR r.group_id = :group_id)
  AND (:worker_id IS NULL OR a.worker_id = :worker_id)
  AND (:updated_after IS NULL OR r.updated_at > :updated_after)
  AND (:search IS NULL OR r.rollout_id LIKE :search || '%')
ORDER BY r.seq DESC LIMIT :limit;

-- name: claim_rollouts
UPDATE rollouts
SET status = 'preparing', num_attempts = num_attempts + 1, updated_at = :now,
    current_attempt_id = 'at-' || printf('%012x', CAST(:now * 1000 AS INTEGER)) || lower(hex(randomblob(8)))
WHERE seq IN (SELECT seq FROM rollouts INDEXED BY rollouts_queue
              WHERE status = 'queuing' AND available_at <= :now
              ORDER BY priority DESC, seq LIMIT :max_n)
RETURNING *;

-- name: start_rollout
UPDATE rollouts
SET status = 'preparing', num_attempts = num_attempts + 1, updated_at = :now, current_attempt_id = :attempt_id
WHERE rollout_id = :rollout_id AND status = 'queuing'
RETURNING *;

-- name: insert_attempt
INSERT INTO attempts (attempt_id, rollout_id, sequence, worker_id, status, started_at, lease_expires_at, deadline_at)
VALUES (:attempt_id, :rollout_id, :sequence, :worker_id, 'preparing', :now, :lease_expires_at, :deadline_at);

-- name: select_attempts_by_ids
SELECT a.*, r.status AS rollout_status, r.current_attempt_id, r.max_attempts, r.attempts_charged,
       r.heartbeat_s, r.max_lost, r.attempts_lost, r.retry_delay_s
FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id
WHERE a.attempt_id IN (SELECT value FROM json_each(:ids));

-- name: heartbeat_attempts
UPDATE attempts
SET status = 'running', last_heartbeat_at = :now,
    lease_expires_at = :now + (SELECT heartbeat_s FROM rollouts r WHERE r.rollout_id = attempts.rollout_id)
WHERE attempt_id IN (SELECT value FROM json_each(:ids)) AND status IN ('preparing', 'running');

-- name: run_rollouts
UPDATE rollouts SET status = 'running', updated_at = :now
WHERE current_attempt_id IN (SELECT value FROM json_each(:ids)) AND status = 'preparing';

-- name: heartbeat_replies
SELECT a.attempt_id, a.status, a.lease_expires_at, r.status AS rollout_status
FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id
WHERE a.attempt_id IN (SELECT value FROM json_each(:ids));

-- name: finish_attempt
UPDATE attempts SET status = :attempt_status, finished_at = :now, error = :error, charged = :charged
WHERE attempt_id = :attempt_id AND status IN ('preparing', 'running');

-- name: finish_rollout
UPDATE rollouts
SET status = :status, result = COALESCE(:result, result), reward = COALESCE(:reward, reward),
    error = :error, attempts_charged = attempts_charged + :charged_own,
    attempts_lost = attempts_lost + :charged_lost, available_at = :available_at,
    suspect = MAX(suspect, :suspect), updated_at = :now, finished_at = :finished_at
WHERE rollout_id = :rollout_id AND status IN ('queuing', 'preparing', 'running')
  AND (:attempt_id IS NULL OR current_attempt_id = :attempt_id);

-- name: rollout_columns
SELECT name FROM pragma_table_info('rollouts');

-- name: add_retry_columns
-- A database made before retry scheduling (issue 21) gets its columns; new ones have them already.
ALTER TABLE rollouts ADD COLUMN attempts_lost INTEGER NOT NULL DEFAULT 0;
ALTER TABLE rollouts ADD COLUMN max_lost INTEGER NOT NULL DEFAULT 10;
ALTER TABLE rollouts ADD COLUMN retry_delay_s REAL NOT NULL DEFAULT 0;
ALTER TABLE rollouts ADD COLUMN available_at REAL NOT NULL DEFAULT 0;
ALTER TABLE rollouts ADD COLUMN suspect INTEGER NOT NULL DEFAULT 0;

-- name: recent_attempts
-- The latest attempts of one rollout, newest first: its streak of attempts lost with their runner.
SELECT worker_id, status, charged FROM attempts WHERE rollout_id = :rollout_id
ORDER BY sequence DESC LIMIT 10;

-- name: live_attempts_of_worker
SELECT attempt_id FROM attempts WHERE worker_id = :worker_id AND status IN ('preparing', 'running');

-- name: next_available
-- When the first rollout held back by its retry delay may be claimed (NULL: none is held back).
SELECT MIN(available_at) AS at FROM rollouts WHERE status = 'queuing' AND available_at > :now;

-- name: expired_attempts
-- Two index range scans (lapsed leases, passed deadlines), never a scan of every live attempt.
SELECT attempt_id, rollout_id,
       CASE WHEN deadline_at + :grace < :now THEN 'timeout' ELSE 'lost' END AS outcome
FROM attempts
WHERE attempt_id IN (
    SELECT attempt_id FROM attempts WHERE status IN ('preparing', 'running') AND lease_expires_at < :now
    UNION
    SELECT attempt_id FROM attempts WHERE status IN ('preparing', 'running') AND deadline_at < :now - :grace)
LIMIT 1000;

-- name: active_attempts_of
SELECT a.attempt_id, a.rollout_id, a.worker_id, r.max_attempts, r.attempts_charged
FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id
WHERE a.status IN ('preparing', 'running') AND r.rollout_id IN (SELECT value FROM json_each(:ids));

-- name: stale_workers
UPDATE workers SET status = 'offline'
WHERE status != 'offline' AND last_heartbeat_at + lease_s < :now
RETURNING worker_id;

-- name: requeue_candidates
SELECT rollout_id FROM rollouts
WHERE status IN (SELECT value FROM json_each(:statuses))
  AND (:ids IS NULL OR rollout_id IN (SELECT value FROM json_each(:ids)))
  AND updated_at <= :older_than
ORDER BY seq LIMIT 10000;

-- name: upsert_worker
INSERT INTO workers (worker_id, status, registered_at, last_heartbeat_at, lease_s, metadata)
VALUES (:worker_id, 'idle', :now, :now, :lease_s, :metadata)
ON CONFLICT (worker_id) DO UPDATE SET status = 'idle', last_heartbeat_at = :now, lease_s = :lease_s,
                                      metadata = :metadata;

-- name: touch_worker
UPDATE workers SET last_heartbeat_at = :now,
    rollouts_succeeded = rollouts_succeeded + :succeeded, rollouts_failed = rollouts_failed + :failed,
    status = CASE WHEN :status IS NULL THEN (CASE WHEN status = 'offline' THEN 'idle' ELSE status END) ELSE :status END
WHERE worker_id = :worker_id;

-- name: count_worker_outcome
UPDATE workers SET rollouts_succeeded = rollouts_succeeded + :succeeded, rollouts_failed = rollouts_failed + :failed
WHERE worker_id = :worker_id;

-- name: select_workers
SELECT * FROM workers WHERE (:worker_id IS NULL OR worker_id = :worker_id) AND worker_id > :cursor
ORDER BY worker_id LIMIT :limit;

-- name: live_attempts_by_worker
SELECT worker_id, attempt_id FROM attempts
WHERE status IN ('preparing', 'running') AND worker_id IN (SELECT value FROM json_each(:ids))
ORDER BY started_at;

-- name: select_attempts
SELECT * FROM attempts
WHERE (:rollout_id IS NULL OR rollout_id = :rollout_id) AND (:worker_id IS NULL OR worker_id = :worker_id)
  AND (:statuses IS NULL OR status IN (SELECT value FROM json_each(:statuses)))
  AND rowid > :cursor
ORDER BY rowid LIMIT :limit;

-- name: attempt_cursor_column
SELECT rowid AS pos FROM attempts WHERE attempt_id = :attempt_id;

-- name: bump_steps
UPDATE rollouts SET num_steps = num_steps + :n WHERE rollout_id = :rollout_id RETURNING num_steps;

-- name: insert_step
INSERT INTO steps (rollout_id, attempt_id, sequence, kind, payload, timestamp)
VALUES (:rollout_id, :attempt_id, :sequence, :kind, :payload, :timestamp);

-- name: insert_blob
INSERT INTO blobs (sha256, media_type, size, data, created_at)
VALUES (:sha256, :media_type, :size, :data, :now)
ON CONFLICT (sha256) DO NOTHING;

-- name: select_blob
SELECT sha256, media_type, data FROM blobs WHERE sha256 = :sha256;

-- name: select_steps
SELECT * FROM steps
WHERE rollout_id = :rollout_id AND (:attempt_id IS NULL OR attempt_id = :attempt_id) AND sequence > :cursor
ORDER BY sequence LIMIT :limit;

-- name: select_steps_many
SELECT * FROM steps
WHERE rollout_id IN (SELECT value FROM json_each(:ids))
  AND (rollout_id, sequence) > (:after_id, :after_sequence)
ORDER BY rollout_id, sequence LIMIT :limit;

-- name: insert_resources
INSERT INTO resources (resources_id, vals, created_at) VALUES (:resources_id, :vals, :now);

-- name: select_resources
SELECT * FROM resources WHERE (:resources_id IS NULL OR resources_id = :resources_id)
ORDER BY version DESC LIMIT 1;

-- name: count_rollouts_by_status
SELECT status, COUNT(*) AS n FROM rollouts GROUP BY status;

-- name: count_workers_by_status
SELECT status, COUNT(*) AS n FROM workers GROUP BY status;

-- name: rollout_totals
SELECT COALESCE(SUM(num_steps), 0) AS steps, AVG(reward) AS reward_mean,
       COALESCE(SUM(CASE WHEN suspect = 1 AND status != 'succeeded' THEN 1 ELSE 0 END), 0) AS suspects
FROM rollouts;

-- name: suspect_rollouts
SELECT rollout_id FROM rollouts WHERE suspect = 1 AND status != 'succeeded' ORDER BY seq DESC LIMIT 20;

-- name: notify_queued
SELECT 1;

-- name: kv_put
INSERT INTO kv (key, value, updated_at) VALUES (:key, :value, :now)
ON CONFLICT (key) DO UPDATE SET value = :value, updated_at = :now;

-- name: kv_get
SELECT value FROM kv WHERE key = :key;

-- name: kv_scan
SELECT key, value FROM kv WHERE substr(key, 1, length(:prefix)) = :prefix ORDER BY key;

-- ---- pool leases (issue 19): a lease granted by one control-plane replica, honoured by all ----
-- Created on first use (pool_leases_table, pool_leases_index), so an existing database gains it.
-- "owner" is the replica process that holds the instance; "ended" says why a lease ended (NULL
-- while held); "settled" says the owner has given the instance back to its pool.

-- name: pool_leases_lock
SELECT 1;

-- name: pool_leases_table
CREATE TABLE IF NOT EXISTS pool_leases (
    lease_id TEXT PRIMARY KEY,
    pool TEXT NOT NULL,
    owner TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    endpoint TEXT,
    generation INTEGER NOT NULL,
    attempt_id TEXT,
    ticket INTEGER NOT NULL,
    serial INTEGER NOT NULL,
    lease_s REAL NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL,
    ended TEXT,
    broken INTEGER NOT NULL DEFAULT 0,
    settled INTEGER NOT NULL DEFAULT 0
);

-- name: pool_leases_index
CREATE INDEX IF NOT EXISTS pool_leases_unsettled ON pool_leases (owner, settled);

-- name: pool_lease_insert
INSERT INTO pool_leases (lease_id, pool, owner, instance_id, endpoint, generation, attempt_id,
    ticket, serial, lease_s, expires_at, created_at)
VALUES (:lease_id, :pool, :owner, :instance_id, :endpoint, :generation, :attempt_id,
    :ticket, :serial, :lease_s, :expires_at, :now);

-- name: pool_lease_renew
UPDATE pool_leases SET expires_at = :expires_at, lease_s = :lease_s
WHERE lease_id = :lease_id AND ended IS NULL AND expires_at > :now
RETURNING *;

-- name: pool_lease_end
UPDATE pool_leases SET ended = :why, broken = :broken
WHERE lease_id = :lease_id AND ended IS NULL
RETURNING *;

-- name: pool_lease_get
SELECT * FROM pool_leases WHERE lease_id = :lease_id;

-- name: pool_leases_expire
UPDATE pool_leases SET ended = 'expired'
WHERE ended IS NULL AND expires_at <= :now
RETURNING *;

-- name: pool_leases_held
SELECT * FROM pool_leases WHERE ended IS NULL AND (CAST(:pool AS TEXT) IS NULL OR pool = :pool)
ORDER BY created_at, lease_id;

-- name: pool_leases_unsettled
SELECT * FROM pool_leases WHERE owner = :owner AND ended IS NOT NULL AND settled = 0;

-- name: pool_lease_settle
UPDATE pool_leases SET settled = 1 WHERE lease_id = :lease_id;
