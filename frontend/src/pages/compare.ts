// Up to 8 jobs (or a selection's trials, which are jobs) on one chart: one line per job for the
// metric picked. The route carries the choice (#/compare?jobs=3,7&metric=loss) so a view can be
// shared by its address.
import {
  api,
  type Job,
  type JobStreamEvents,
  type Metrics,
  type Selection,
  subscribe,
  TERMINAL,
} from "../api";
import { PALETTE, StepChart } from "../charts";
import { badge, errorText, h } from "../dom";

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
    h("section", { class: "card" }, chartEl),
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
    if (closed) return;
    const metrics = [...METRICS];
    if (sel && !metrics.includes(sel.metric)) metrics.unshift(sel.metric);
    const metric = q.get("metric") ?? sel?.metric ?? "loss";
    if (!metrics.includes(metric)) metrics.push(metric);
    metricSel.replaceChildren(...metrics.map((m) => h("option", { value: m, selected: m === metric }, m)));
    const trialOf = new Map((sel?.trials ?? []).map((t) => [t.job_id, t]));
    const label = (j: Job) => {
      const t = trialOf.get(j.id);
      return t ? `trial ${t.index} (#${j.id})` : `#${j.id} ${j.name}`;
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
          badge(j.status),
          " ",
          h(
            "button",
            { class: "small secondary", title: "take off the chart", onclick: () => go({ drop: j.id }) },
            "×",
          ),
        ),
      );
    });
    const series = await Promise.all(
      found.map((j) =>
        api<Metrics>(`/api/jobs/${j.id}/metrics?names=${encodeURIComponent(metric)}&max_points=2000`).catch(
          () => null,
        ),
      ),
    );
    if (closed) return;
    found.forEach((j, i) => chart?.addSeries(`j${j.id}`, series[i]?.series[metric]));
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
