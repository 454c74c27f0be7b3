// The job's hardware series, charted beside the loss: per rank, CPU % and GPU utilisation on one
// chart, resident memory and GPU memory on the other. The worker samples them every few seconds
// into metrics named hw.<what>.r<rank> (workers/hardware.py); a line appears when its first point does.
import type { Series } from "./api";
import { PALETTE, StepChart } from "./charts";

const USE = ["cpu_pct", "gpu_util"];
const MEM = ["rss_mb", "gpu_mem_mb"];
const LABEL: Record<string, string> = {
  cpu_pct: "CPU %",
  gpu_util: "GPU util %",
  rss_mb: "RSS MB",
  gpu_mem_mb: "GPU mem MB",
  gpu_power_w: "GPU W",
};

export const HW_NAME = /^hw\.([a-z_]+)\.r(\d+)$/;

/** The metric names to backfill for `ranks` ranks. */
export function hwNames(ranks: number): string[] {
  const out: string[] = [];
  for (let r = 0; r < ranks; r++) for (const w of [...USE, ...MEM]) out.push(`hw.${w}.r${r}`);
  return out;
}

export class HardwareCharts {
  readonly use: StepChart;
  readonly mem: StepChart;

  /** `section` holds both charts; it stays out of sight until the first sample (a job too short
   * to be sampled shows none). */
  constructor(
    private readonly section: HTMLElement,
    useEl: HTMLElement,
    memEl: HTMLElement,
  ) {
    section.style.display = "none";
    this.use = new StepChart(useEl, { title: "device use", yLabel: "%", lines: [] });
    this.mem = new StepChart(memEl, { title: "memory", yLabel: "MB", lines: [] });
  }

  /** A point of a hw.* metric; false for any other name. */
  add(name: string, step: number, value: number): boolean {
    const m = HW_NAME.exec(name);
    if (!m) return false;
    this.section.style.display = "";
    const [, what, rank] = m;
    const chart = MEM.includes(what) ? this.mem : USE.includes(what) ? this.use : null;
    if (!chart) return true; // power: kept in the metrics, not charted
    if (!chart.has(name)) {
      const i = (Number(rank) * 2 + (what.startsWith("gpu") ? 1 : 0)) % PALETTE.length;
      chart.addLine({
        key: name,
        label: `${LABEL[what] ?? what} r${rank}`,
        color: PALETTE[i],
        dash: what.startsWith("gpu") ? [6, 3] : undefined,
        // a sample every few seconds: few points, each worth seeing
        points: true,
      });
    }
    chart.add(name, step, value);
    return true;
  }

  addSeries(name: string, s: Series | undefined): void {
    if (!s) return;
    s.steps.forEach((st, i) => this.add(name, st, s.values[i]));
  }

  destroy(): void {
    this.use.destroy();
    this.mem.destroy();
  }
}

/** A selection batch's device use over time: its groups' samples (every trial of a group carries
 * the same sample, at the same time, so it is drawn once), x in seconds since the first sample. */
export class DeviceUseChart {
  readonly chart: StepChart;
  private t0: number | null = null;

  constructor(
    private readonly section: HTMLElement,
    el: HTMLElement,
  ) {
    section.style.display = "none";
    this.chart = new StepChart(el, {
      title: "device use over time (each group's process)",
      yLabel: "CPU % / GPU util %",
      xLabel: "seconds",
      lines: [],
    });
  }

  add(name: string, time: number, value: number): void {
    const m = HW_NAME.exec(name);
    if (!m || !USE.includes(m[1])) return;
    this.section.style.display = "";
    this.t0 = this.t0 ?? time;
    if (!this.chart.has(name)) {
      const i = (Number(m[2]) * 2 + (m[1].startsWith("gpu") ? 1 : 0)) % PALETTE.length;
      this.chart.addLine({ key: name, label: `${LABEL[m[1]]} r${m[2]}`, color: PALETTE[i], points: true });
    }
    this.chart.add(name, Math.round(time - this.t0), value);
  }

  destroy(): void {
    this.chart.destroy();
  }
}
