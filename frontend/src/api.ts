// The REST surface the dashboard reads (docs/architecture.md); the dashboard talks to nothing else.

import type { components } from "./generated/api-schema";

// Every type of what the API sends is generated from its OpenAPI schema (`make api-types` writes
// generated/api-schema.ts; tests/unit/test_api_types.py fails while that file is stale): the names
// below are aliases of its components, never types written here.
type Schemas = components["schemas"];

export type Job = Schemas["JobPublic"];
export type JobsPage = Schemas["JobsPublic"];
export type Reservation = Schemas["ReservationPublic"];
export type Me = Schemas["Me"];
export type Health = Schemas["HealthPublic"];
export type Metrics = Schemas["MetricsPublic"];
export type Curves = Schemas["CurvesPublic"];
export type CheckpointInfo = Schemas["CheckpointPublic"];
export type Series = Schemas["Series"];
/** A stored log line or event (GET /api/jobs/{id}/logs) or a live one (the job stream's `log`). */
export type LogLine = Schemas["EventPublic"] | Schemas["LogFrame"];
export type LogPage = Schemas["EventsPublic"];
export type Timeline = Schemas["TimelinePublic"];
export type TimelineAction = Schemas["TimelineAction"];
export type TimelineOp = TimelineAction["op"];
export type Selection = Schemas["SelectionPublic"];
export type SelectionsPage = Schemas["SelectionsPublic"];
export type Trial = Schemas["TrialPublic"];
/** The selection executor's report of a trial: a trial's `result`, and its job's. */
export type TrialReport = Schemas["TrialReport"];
export type StopReason = Schemas["StopReason"];
export type Webhook = Schemas["WebhookPublic"];
export type WebhookIssued = Schemas["WebhookIssued"];
export type Webhooks = Schemas["WebhooksPublic"];
export type WebhookDelivery = Schemas["DeliveryPublic"];
export type WebhookDeliveries = Schemas["DeliveriesPublic"];
export type Workspace = Schemas["WorkspacePublic"];
/** A JobSpec (a job's `spec` and a batch's `request.base` are the ones submitted, as stored: one
 * stored by an older version lacks the fields added since, so read them with `?.` and `??`). */
export type JobSpec = Schemas["JobSpec"];
/** A selection batch's request (a batch's `request`, as submitted). */
export type SelectionRequest = Schemas["SelectionCreate"];
/** A 422: `detail` names each field with its rule; `errors` lists them one by one. */
export type ValidationRefusal = Schemas["ValidationRefusal"];
export type FieldProblem = Schemas["FieldProblem"];
export type QueueEntry = Schemas["QueueEntry"];
export type QueuePage = Schemas["QueuePublic"];
/** The events of each Server-Sent Events stream, by name. */
export type JobStreamEvents = Schemas["JobStreamEvents"];
export type JobsStreamEvents = Schemas["JobsStreamEvents"];
export type SelectionStreamEvents = Schemas["SelectionStreamEvents"];

/** A trial's job's result is its trial report (null for any other job). */
export function trialReportOf(job: Job): TrialReport | null {
  return job.selection_id != null ? ((job.result ?? null) as TrialReport | null) : null;
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

/** A non-2xx answer; `message` is already readable (422 field errors joined as "field: rule"). */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    /** The refusal's body as sent (a 422's ValidationRefusal lists its `errors` one by one). */
    readonly payload: unknown = null,
  ) {
    super(message);
  }
}

/** A refusal's `detail` as one readable text: the API sends a string (a 422's ValidationRefusal
 * names each field with its rule, "field: rule; field: rule"); anything else is shown as JSON. */
export function describeDetail(detail: unknown): string {
  return typeof detail === "string" ? detail : JSON.stringify(detail);
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
    throw new ApiError(res.status, describeDetail(detail), payload);
  }
  return payload as T;
}

export const post = <T>(path: string, body: unknown = {}) => api<T>(path, { method: "POST", body });

/** Subscribe to named SSE events with JSON payloads; returns the EventSource so callers can close it. */
export function subscribe<E>(
  url: string,
  handlers: { [K in keyof E & string]?: (data: E[K]) => void },
  onState?: (state: "open" | "error") => void,
): EventSource {
  const es = new EventSource(url);
  for (const [name, fn] of Object.entries(handlers) as [string, ((data: unknown) => void) | undefined][]) {
    if (!fn) continue;
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
