-- What each role of the compose deployment may do (docker/postgres/init-roles.sh makes the roles).
-- Applied by the `migrate` service after the migrations, as the owner of the tables; run again it
-- changes nothing. A new table gets nothing until it is named here. docs/security.md, "The broker".
--
--   shardyard_api        the API: users and tokens, submits, cancels and deletes, streams and
--                        pages (reads), workspaces and webhooks, retention (deletes ended jobs)
--   shardyard_scheduler  placement (reservations, its lock, jobs' wait reasons) and webhook
--                        delivery (reads the webhooks' secrets, updates the outbox)
--   shardyard_worker     runs what was placed: claims reservations, writes jobs' progress,
--                        events, points and trials, heartbeats; adds a search's trials
--
-- No role but the API can create a user or touch a token, and none may make anyone an admin: the
-- scheduler and the workers may only take a user's row lock (UPDATE of the id column, which the
-- quota checks use as a lock). A worker, which runs users' code, cannot read tokens or webhooks'
-- secrets, delete anything but its finished reservations, or change the schema.

REVOKE ALL ON ALL TABLES IN SCHEMA public FROM shardyard_api, shardyard_scheduler, shardyard_worker;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM shardyard_api, shardyard_scheduler, shardyard_worker;
GRANT USAGE ON SCHEMA public TO shardyard_api, shardyard_scheduler, shardyard_worker;
-- every process checks the schema is current before it starts (db/migrate.py)
GRANT SELECT ON alembic_version TO shardyard_api, shardyard_scheduler, shardyard_worker;

-- the API
GRANT SELECT, INSERT, UPDATE ON users TO shardyard_api;
GRANT SELECT, INSERT, UPDATE, DELETE ON api_tokens, jobs, selections, trials, workspaces, webhooks
    TO shardyard_api;
GRANT SELECT, INSERT, DELETE ON job_events TO shardyard_api;
GRANT SELECT, DELETE ON metric_points, reservations, webhook_deliveries, webhook_attempts TO shardyard_api;
GRANT SELECT ON workers TO shardyard_api;
-- a long series' stored summary, written by the API after its first full read (api/series.py)
GRANT SELECT, INSERT, DELETE ON metric_summaries TO shardyard_api;

-- the scheduler
GRANT SELECT, UPDATE (id) ON users TO shardyard_scheduler;
GRANT SELECT, UPDATE ON jobs, selections, trials, workers, webhook_deliveries TO shardyard_scheduler;
GRANT SELECT, INSERT ON job_events, webhook_attempts TO shardyard_scheduler;
GRANT SELECT, INSERT, UPDATE, DELETE ON reservations, scheduler_locks TO shardyard_scheduler;
GRANT SELECT ON webhooks TO shardyard_scheduler;

-- the workers
GRANT SELECT, UPDATE (id) ON users TO shardyard_worker;
GRANT SELECT, INSERT, UPDATE ON jobs, trials, metric_points, workers TO shardyard_worker;
GRANT SELECT, UPDATE ON selections TO shardyard_worker;
GRANT SELECT, INSERT ON job_events TO shardyard_worker;
GRANT SELECT, UPDATE, DELETE ON reservations TO shardyard_worker;
GRANT SELECT ON workspaces TO shardyard_worker;

-- new rows' ids (serial columns)
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO shardyard_api, shardyard_scheduler, shardyard_worker;

-- The outbox triggers (migration 0013) write webhook_deliveries from the webhooks table in the
-- transaction that ends a job or a batch, whoever ends it: they run as their owner, so ending a
-- job needs neither a read of the webhooks (their secrets) nor a write of the outbox.
ALTER FUNCTION notify_jobs_ended() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION notify_selections_ended() SECURITY DEFINER SET search_path = public, pg_temp;
