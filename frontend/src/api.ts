// The REST surface the dashboard reads (docs/architecture.md); the dashboard talks to nothing else.

export type JobStatus = "queued" | "running" | "succeeded" | "failed" | "cancelled";

export interface Job {
  id: number;
  name: string;
  status: JobStatus;
  priority: number;
  attempts: number;
  created_at: string | null;
  started_at: string | null;
  finished_at: string | null;
  worker: string | null;
  error: string | null;
  result: Record<string, unknown> | null;
  spec: JobSpec;
  cancel_requested: boolean;
  progress: { step: number; steps: number; loss?: number | null } | null;
  owner?: string | null;
  wait_reason?: string | null;
  /** 1-based place among queued jobs in the scheduler's order. */
  queue_position?: number | null;
  /** The slots the scheduler reserved, one entry per node. */
  reservation?: Reservation[];
  /** Set on a selection trial's job: the batch it belongs to. */
  selection_id?: number | null;
  world_size?: number;
  /** Wall time its attempts have run so far. */
  run_seconds?: number;
}

export interface Reservation {
  worker: string;
  node_rank: number;
  nnodes: number;
  slots: number;
  gpus: number;
  ram_bytes: number;
  claimed: boolean;
}

export interface User {
  id: number;
  name: string;
  is_admin: boolean;
  quotas: { running_jobs: number; ranks: number; gpus: number };
}

export interface Me {
  user: User;
  csrf_token: string | null;
}

export interface JobSpec {
  name?: string;
  parallel?: { pipeline?: { stages: number; microbatches: number; schedule: string } | null } | null;
  [key: string]: unknown;
}

export interface Series {
  steps: number[];
  values: number[];
}

export interface Metrics {
  job_id: number;
  series: Record<string, Series>;
}

export interface LogLine {
  id?: number;
  time: string | number;
  kind?: string;
  message: string;
  data?: unknown;
}

export interface Health {
  status: string;
  db: { ok: boolean };
  broker: { ok: boolean };
  workers: { name: string; devices: unknown; last_seen: string | number }[];
}

export type TimelineOp = "F" | "B" | "W" | "AR";

export interface TimelineAction {
  rank: number;
  op: TimelineOp;
  mb: number | null;
  stage: number | null;
  replica: number | null;
  start: number;
  end: number;
}

export interface Timeline {
  schedule: string;
  stages: number;
  microbatches: number;
  executed: TimelineAction[];
  simulated: TimelineAction[];
  bubble_executed: number | null;
  bubble_simulated: number | null;
}

export type TrialStatus =
  "queued" | "running" | "succeeded" | "stopped_early" | "stopped" | "failed" | "cancelled";

export interface Trial {
  id: number;
  index: number;
  params: Record<string, number | string | boolean>;
  status: TrialStatus;
  steps_done: number;
  steps_total: number;
  last_metric: number | null;
  best_metric: number | null;
  stopped_early: boolean;
  job_id: number | null;
  warm_start_from?: number | null;
  /** The executor's report once the trial ended; older servers leave it out (then the page reads
   * the trial's job result instead). */
  result?: TrialResult | null;
  compute_s?: number | null;
  copy_s?: number | null;
  stop_reason?: StopReason | null;
  /** A sampler's trial: earlier trials whose points the sampler asked again first (not run). */
  repeats_skipped?: number[] | null;
}

/** Why the rungs stopped a trial: its rung, its metric there, the last kept trial's metric. */
export interface StopReason {
  rung: number;
  value: number;
  cutoff: number;
  kept: number;
  of: number;
  bracket: number;
}

export interface TrialResult {
  status?: string;
  steps?: number;
  best_metric?: number | null;
  compute_s?: number;
  copy_s?: number;
  stop_reason?: StopReason | null;
  error?: string | null;
}

export type SpaceEntry = { low: number; high: number; log?: boolean } | (number | string | boolean)[];

export interface Selection {
  id: number;
  name: string;
  status: string;
  metric: string;
  mode: "min" | "max";
  scheduler: string;
  created_at: string | null;
  finished_at: string | null;
  space: Record<string, SpaceEntry>;
  /** The submitted request; `base` is the JobSpec every trial starts from. */
  request?: {
    base?: Record<string, unknown>;
    method?: string;
    seed?: number;
    trials?: number | null;
    parallel?: number | null;
    checkpoints?: string;
    early_stopping?: { kind: string; reduction_factor: number; min_steps: number } | null;
  };
  error?: string | null;
  trials?: Trial[];
  leaderboard?: number[];
}

/** A dotted JobSpec path ("train.lr") looked up in a spec; undefined when absent. */
export function lookup(spec: Record<string, unknown> | undefined, path: string): unknown {
  let cur: unknown = spec;
  for (const part of path.split(".")) {
    if (cur === null || typeof cur !== "object") return undefined;
    cur = (cur as Record<string, unknown>)[part];
  }
  return cur;
}

export interface Page<T> {
  items: T[];
  total: number;
}

/** A non-2xx answer; `message` is already readable (422 field errors joined as "field: rule"). */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}

/** FastAPI answers 422 with a list of {loc, msg}; our own errors with a string. Name the field. */
export function describeDetail(detail: unknown): string {
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail
      .map((d: { loc?: (string | number)[]; msg?: string }) => {
        const loc = (d.loc ?? []).filter((p) => p !== "body").join(".");
        return loc ? `${loc}: ${d.msg ?? ""}` : String(d.msg ?? JSON.stringify(d));
      })
      .join("\n");
  }
  return JSON.stringify(detail);
}

/** The session's CSRF token, from the readable cookie the sign-in set (the session cookie itself is
 * HttpOnly). Every POST and DELETE sends it back; another site's page cannot read it. */
export function csrfToken(): string {
  const m = /(?:^|;\s*)shardyard_csrf=([^;]+)/.exec(document.cookie);
  return m ? decodeURIComponent(m[1]) : "";
}

/** Fired when the API answers 401: the page shows the sign-in form, with the reason
 * (a CustomEvent's `detail`: the session expired, was ended, or its token was revoked). */
export const SIGNED_OUT = "shardyard:signed-out";

export function signedOut(reason: string): void {
  window.dispatchEvent(new CustomEvent(SIGNED_OUT, { detail: reason }));
}

export async function api<T>(path: string, init?: { method?: string; body?: unknown }): Promise<T> {
  const method = init?.method ?? "GET";
  const headers: Record<string, string> = {};
  if (init?.body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET") headers["X-CSRF-Token"] = csrfToken();
  const res = await fetch(path, {
    method,
    headers,
    credentials: "same-origin",
    body: init?.body !== undefined ? JSON.stringify(init.body) : undefined,
  });
  const text = await res.text();
  let payload: unknown = null;
  try {
    payload = text ? JSON.parse(text) : null;
  } catch {
    payload = text;
  }
  if (res.status === 401 && path !== "/api/auth/session") {
    signedOut(String((payload as { detail?: unknown } | null)?.detail ?? "signed out"));
  }
  if (!res.ok) {
    const detail = (payload as { detail?: unknown } | null)?.detail ?? payload ?? res.statusText;
    throw new ApiError(res.status, describeDetail(detail));
  }
  return payload as T;
}

export const post = <T>(path: string, body: unknown = {}) => api<T>(path, { method: "POST", body });

/** Subscribe to named SSE events with JSON payloads; returns the EventSource so callers can close it. */
export function subscribe(
  url: string,
  handlers: Record<string, (data: any) => void>,
  onState?: (state: "open" | "error") => void,
): EventSource {
  const es = new EventSource(url);
  for (const [name, fn] of Object.entries(handlers)) {
    es.addEventListener(name, (ev) => {
      try {
        fn(JSON.parse((ev as MessageEvent<string>).data));
      } catch (err) {
        console.warn(`bad ${name} event from ${url}`, err);
      }
    });
  }
  es.onopen = () => onState?.("open");
  es.onerror = (ev) => {
    // the server's last frame when the session or token is gone (revoked, expired): not a
    // dropped connection to retry, but the end of the sign-in
    const data = (ev as MessageEvent<string>).data;
    if (typeof data === "string") {
      es.close();
      let detail = "the session has ended";
      try {
        detail = String(JSON.parse(data).detail ?? detail);
      } catch {
        // keep the generic reason
      }
      signedOut(detail);
    }
    onState?.("error");
  };
  return es;
}

/** Final states of jobs, batches and trials (a trial also ends stopped early by ASHA, or stopped by a user). */
export const TERMINAL: ReadonlySet<string> = new Set([
  "succeeded",
  "failed",
  "cancelled",
  "stopped_early",
  "stopped",
]);

export interface Webhook {
  id: number;
  user_id: number;
  url: string;
  events: "all" | "failures";
  created_at: string;
}

export interface WebhookAttempt {
  at: string;
  status_code: number | null;
  error: string | null;
  seconds: number;
}

export interface WebhookDelivery {
  id: number;
  event: string;
  object_id: number;
  status: string;
  state: "pending" | "delivered" | "failed";
  attempts: WebhookAttempt[];
  created_at: string;
  next_at: string | null;
  delivered_at: string | null;
}
