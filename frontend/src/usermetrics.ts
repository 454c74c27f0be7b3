// The metrics a job's own code reports (trainer/report.py: accuracy, perplexity, BLEU, ...): one
// chart each, made when the name first shows up (in the REST backfill or on the stream), under
// the loss and throughput charts. The names the trainer and the worker report themselves are
// charted elsewhere.
import type { Series } from "./api";
import { PALETTE, StepChart } from "./charts";
import { h } from "./dom";

// jobrules/user_metrics.py's BUILT_IN
const BUILT_IN = new Set([
  "loss",
  "val_loss",
  "step_time_ms",
  "tokens_per_s",
  "peak_mem_mb",
  "ledger_peak_mb",
  "resident_shards",
]);

/** A name the job's own code reported (not the trainer's, not the worker's `hw.*` samples). */
export function isUserMetric(name: string): boolean {
  return !BUILT_IN.has(name) && !name.startsWith("hw.");
}

export class UserMetricCharts {
  private readonly charts = new Map<string, StepChart>();

  /** `section`: the page's container for the charts, hidden while there is none. */
  constructor(private readonly section: HTMLElement) {
    section.hidden = true;
  }

  private chart(name: string): StepChart {
    let chart = this.charts.get(name);
    if (chart) return chart;
    const el = h("div", {
      class: "chart user-metric-chart",
      id: `metric-chart-${name.replace(/[^A-Za-z0-9_-]/g, "_")}`,
      "data-metric": name,
    });
    this.section.append(h("div", { class: "card" }, el));
    this.section.hidden = false;
    const color = PALETTE[(this.charts.size + 2) % PALETTE.length];
    chart = new StepChart(el, {
      title: name,
      yLabel: name,
      lines: [{ key: name, label: name, color, points: true }],
      controls: true,
    });
    this.charts.set(name, chart);
    return chart;
  }

  /** A backfilled series; false for a name that is not a user metric. */
  addSeries(name: string, s: Series | undefined): boolean {
    if (!isUserMetric(name)) return false;
    if (s?.steps.length) this.chart(name).addSeries(name, s);
    return true;
  }

  /** A point from the stream; false for a name that is not a user metric. */
  add(name: string, step: number, value: number | null): boolean {
    if (!isUserMetric(name)) return false;
    this.chart(name).add(name, step, value);
    return true;
  }

  names(): string[] {
    return [...this.charts.keys()];
  }

  destroy(): void {
    for (const c of this.charts.values()) c.destroy();
    this.charts.clear();
  }
}
