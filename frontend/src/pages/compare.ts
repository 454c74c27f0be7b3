// Up to 8 jobs (or a selection's trials, which are jobs) on one chart: one line per job for the
// metric picked. The route carries the choice (#/compare?jobs=3,7&metric=loss) so a view can be
// shared by its address.
import {
  api,
  type Job,
  type JobStreamEvents,
  lookup,
  type Metrics,
  type Selection,
  type Series,
  subscribe,
  TERMINAL,
  type Trial,
  trialReportOf,
} from "../api";
import { PALETTE, StepChart } from "../charts";
import { badge, divergedBadge, errorText, fmtNum, h } from "../dom";

export const MAX_COMPARE = 8;
const METRICS = ["loss", "val_loss", "tokens_per_s"];

/** The hash that shows these jobs side by side (a selection's id names its trials by index). */
export function compareHref(jobs: number[], extra: Record<string, string | number> = {}): string {
  const q = new URLSearchParams({ jobs: jobs.join(",") });
  for (const [k, v] of Object.entries(extra)) q.set(k, String(v));
  return `#/compare?${q.toString().replace(/%2C/g, ",")}`;
}

function parseQuery(): URLSearchParams {
  const hash = window.location.hash;
  const i = hash.indexOf("?");
  return new URLSearchParams(i >= 0 ? hash.slice(i + 1) : "");
}

export function comparePage(root: HTMLElement): () => void {
  const q = parseQuery();
  const ids = [
    ...new Set(
      (q.get("jobs") ?? "")
        .split(",")
        .map((s) => Number(s.trim()))
        .filter((n) => Number.isInteger(n) && n > 0),
    ),
  ];
  const selectionId = Number(q.get("selection")) || null;
  const note = h("p", { class: "muted", id: "compare-note", hidden: true });
  const list = h("ul", { class: "compare-list", id: "compare-jobs" });
  const chartEl = h("div", { class: "chart", id: "compare-chart" });
  const table = h("table", { class: "grid", id: "compare-table" });
  root.append(h("section", {}, h("div", { class: "title-row" }, h("h1", {}, "Compare runs"))), note);
  if (!ids.length) {
    note.textContent =
      "Nothing picked yet: tick up to 8 jobs in the jobs table, or trials in a selection's leaderboard, then press Compare.";
    note.id = "compare-empty";
    note.hidden = false;
    return () => undefined;
  }
  if (ids.length > MAX_COMPARE) {
    note.className = "error";
    note.hidden = false;
    note.textContent = `At most ${MAX_COMPARE} runs on one chart; showing the first ${MAX_COMPARE} of ${ids.length}.`;
    ids.length = MAX_COMPARE;
  }
  const picked = ids;
  const metricSel = h("select", {
    id: "compare-metric",
    onchange: () => go({ metric: metricSel.value }),
  }) as HTMLSelectElement;
  root.append(
    h("div", { class: "filters" }, h("label", {}, "metric ", metricSel), list),
    h(
      "div",
      { class: "side-by-side even" },
      h("section", { class: "card" }, chartEl),
      h("section", { class: "card table-scroll" }, h("h2", {}, "Runs"), table),
    ),
  );

  let chart: StepChart | null = null;
  let closed = false;
  const streams: EventSource[] = [];

  /** Change the view through the address, so the back button undoes it. */
  const go = (change: { metric?: string; drop?: number }) => {
    const jobs = picked.filter((j) => j !== change.drop);
    const extra: Record<string, string | number> = { metric: change.metric ?? metricSel.value };
    if (selectionId) extra.selection = selectionId;
    window.location.hash = compareHref(jobs, extra);
  };

  const start = async () => {
    const [jobs, sel] = await Promise.all([
      Promise.all(picked.map((j) => api<Job>(`/api/jobs/${j}`).catch((err) => err as Error))),
      selectionId ? api<Selection>(`/api/selections/${selectionId}`).catch(() => null) : null,
    ]);
    // every trial's batch (its parameters, its true status), not only the one the address names
    const sels = new Map<number, Selection>(sel ? [[sel.id, sel]] : []);
    const more = [
      ...new Set(jobs.flatMap((j) => (j instanceof Error || j.selection_id == null ? [] : [j.selection_id]))),
    ].filter((sid) => !sels.has(sid));
    for (const got of await Promise.all(
      more.map((sid) => api<Selection>(`/api/selections/${sid}`).catch(() => null)),
    ))
      if (got) sels.set(got.id, got);
    if (closed) return;
    const trialOfJob = new Map<number, { trial: Trial; sel: Selection }>();
    for (const s of sels.values())
      for (const t of s.trials ?? []) trialOfJob.set(t.job_id, { trial: t, sel: s });
    const metrics = [...METRICS];
    if (sel && !metrics.includes(sel.metric)) metrics.unshift(sel.metric);
    const metric = q.get("metric") ?? sel?.metric ?? "loss";
    if (!metrics.includes(metric)) metrics.push(metric);
    metricSel.replaceChildren(...metrics.map((m) => h("option", { value: m, selected: m === metric }, m)));
    const label = (j: Job) => {
      const t = trialOfJob.get(j.id);
      if (!t) return `#${j.id} ${j.name}`;
      return t.sel.id === selectionId
        ? `trial ${t.trial.index} (#${j.id})`
        : `batch ${t.sel.id} trial ${t.trial.index} (#${j.id})`;
    };

    chart = new StepChart(chartEl, {
      title: `${metric}: ${picked.length} run${picked.length === 1 ? "" : "s"}`,
      yLabel: metric,
      lines: [],
      height: 360,
      controls: true,
    });
    list.replaceChildren();
    const found: Job[] = [];
    jobs.forEach((j, i) => {
      const colour = PALETTE[i % PALETTE.length];
      if (j instanceof Error) {
        list.append(h("li", { class: "error" }, `#${picked[i]}: ${errorText(j)}`));
        return;
      }
      found.push(j);
      chart!.addLine({ key: `j${j.id}`, label: label(j), color: colour, points: metric === "val_loss" });
      list.append(
        h(
          "li",
          { "data-job-id": j.id },
          h("span", { class: "swatch", style: `background:${colour}` }),
          h("a", { href: `#/jobs/${j.id}` }, label(j)),
          " ",
          badge(trueStatus(j, trialOfJob.get(j.id)?.trial)),
          " ",
          h(
            "button",
            { class: "small secondary", title: "take off the chart", onclick: () => go({ drop: j.id }) },
            "×",
          ),
        ),
      );
    });
    const colourOf = new Map(
      jobs.map((j, i) => [j instanceof Error ? -i : j.id, PALETTE[i % PALETTE.length]]),
    );
    const showTable = (series: Map<number, Series | undefined>) =>
      table.replaceChildren(
        ...runsTable({ jobs: found, metric, trialOf: trialOfJob, series, colour: colourOf, label }),
      );
    showTable(new Map());
    const series = await Promise.all(
      found.map((j) =>
        api<Metrics>(`/api/jobs/${j.id}/metrics?names=${encodeURIComponent(metric)}&max_points=2000`).catch(
          () => null,
        ),
      ),
    );
    if (closed) return;
    found.forEach((j, i) => chart?.addSeries(`j${j.id}`, series[i]?.series[metric]));
    showTable(new Map(found.map((j, i) => [j.id, series[i]?.series[metric]])));
    // runs still going draw on as they report (the chart keys points by step, so the stream's
    // replay of what the backfill already has adds nothing)
    for (const j of found.filter((f) => !TERMINAL.has(f.status))) {
      const es = subscribe<JobStreamEvents>(`/api/jobs/${j.id}/stream`, {
        metric: (m) => {
          if (m.name === metric) chart?.add(`j${j.id}`, m.step, m.value);
        },
        status: (st) => {
          if (TERMINAL.has(st.status)) es.close();
        },
      });
      streams.push(es);
    }
    chart.setEmpty(
      found.length
        ? `None of these runs recorded ${metric} yet.`
        : "None of the picked jobs could be loaded.",
    );
  };
  void start();

  return () => {
    closed = true;
    for (const es of streams) es.close();
    chart?.destroy();
  };
}

/** A run's true status: a trial's own (its job ends "succeeded" when the rungs stopped it early). */
export function trueStatus(job: Job, trial: Trial | undefined): string {
  if (job.stopped_early) return "stopped_early";
  return trial?.status ?? trialReportOf(job)?.status ?? job.status;
}

const MAX_PARAM_COLUMNS = 12;
/** Spec paths never shown as parameters: they differ between any two runs and say nothing. */
const NOT_PARAMS = new Set(["name", "train.seed"]);

/** A spec's leaves as dotted paths (lists kept whole). */
function leaves(spec: unknown, prefix = "", out = new Map<string, string>()): Map<string, string> {
  if (spec !== null && typeof spec === "object" && !Array.isArray(spec)) {
    for (const [k, v] of Object.entries(spec as Record<string, unknown>))
      leaves(v, prefix ? `${prefix}.${k}` : k, out);
  } else out.set(prefix, JSON.stringify(spec ?? null));
  return out;
}

/** The parameters to tabulate: every searched path of the trials' batches, then every spec path whose
 * value differs between the runs. */
export function paramColumns(jobs: Job[], batches: Selection[]): string[] {
  const cols = new Set(batches.flatMap((s) => Object.keys(s.space ?? {})));
  const flat = jobs.map((j) => leaves(j.spec));
  const paths = new Set(flat.flatMap((f) => [...f.keys()]));
  for (const p of [...paths].sort()) {
    if (NOT_PARAMS.has(p) || cols.has(p)) continue;
    const values = new Set(flat.map((f) => f.get(p) ?? "null"));
    if (values.size > 1) cols.add(p);
  }
  return [...cols].slice(0, MAX_PARAM_COLUMNS);
}

function runsTable(o: {
  jobs: Job[];
  metric: string;
  trialOf: Map<number, { trial: Trial; sel: Selection }>;
  series: Map<number, Series | undefined>;
  colour: Map<number, string>;
  label: (j: Job) => string;
}): HTMLElement[] {
  const batches = [...new Set([...o.trialOf.values()].map((t) => t.sel))];
  const params = paramColumns(o.jobs, batches);
  // the way a run's metric is better: its batch's mode for the batch's metric, else lower
  const modeOf = (j: Job) => {
    const t = o.trialOf.get(j.id);
    return t && t.sel.metric === o.metric ? t.sel.mode : "min";
  };
  const best = (j: Job): number | null => {
    const t = o.trialOf.get(j.id);
    if (t && t.sel.metric === o.metric && t.trial.best_metric !== null) return t.trial.best_metric;
    const values = o.series.get(j.id)?.values ?? [];
    if (!values.length) return null;
    return modeOf(j) === "max" ? Math.max(...values) : Math.min(...values);
  };
  const steps = (j: Job) => {
    const t = o.trialOf.get(j.id)?.trial;
    if (t) return `${t.steps_done}/${t.steps_total}`;
    return j.progress ? `${j.progress.step}/${j.progress.steps}` : "—";
  };
  return [
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", {}, "run"),
        h("th", {}, "status"),
        h("th", {}, `best ${o.metric}`),
        h("th", {}, "steps"),
        ...params.map((p) => h("th", { "data-param": p }, p)),
      ),
    ),
    h(
      "tbody",
      {},
      ...o.jobs.map((j) => {
        const trial = o.trialOf.get(j.id)?.trial;
        const status = trueStatus(j, trial);
        return h(
          "tr",
          { "data-job-id": j.id, "data-status": status },
          h(
            "td",
            {},
            h("span", { class: "swatch", style: `background:${o.colour.get(j.id) ?? "#999"}` }),
            h("a", { href: `#/jobs/${j.id}` }, o.label(j)),
          ),
          h("td", { "data-col": "status" }, badge(status), j.diverged ? " " : null, divergedBadge(j)),
          h("td", { class: "num", "data-col": "best", title: `${modeOf(j)} is better` }, fmtNum(best(j))),
          h("td", { class: "num", "data-col": "steps" }, steps(j)),
          ...params.map((p) => {
            const v = trial && p in trial.params ? trial.params[p] : lookup(j.spec, p);
            return h(
              "td",
              { class: typeof v === "number" ? "num" : "", "data-col": `p:${p}` },
              typeof v === "number"
                ? fmtNum(v)
                : v === undefined
                  ? "—"
                  : typeof v === "string"
                    ? v
                    : JSON.stringify(v),
            );
          }),
        );
      }),
    ),
  ];
}
