// Line charts over training steps, drawn by uPlot. Points arrive one at a time from SSE, possibly
// out of order and possibly twice (the REST backfill and the stream's replay overlap), so values
// are keyed by step and the aligned arrays uPlot wants are rebuilt at most a few times per second.
// What is drawn is derived from the stored points: EMA smoothing and the log scale change the
// drawing only, never the points kept.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import type { Series } from "./api";
import { h } from "./dom";

export interface LineSpec {
  key: string;
  label: string;
  color: string;
  dash?: number[];
  width?: number;
  /** Mark every point: for sparse series such as val_loss, measured only at eval steps. */
  points?: boolean;
  /** Points only, no line between them. */
  noLine?: boolean;
  /** A step line (the value holds until the next point): for running bests. */
  stepped?: boolean;
}

export const PALETTE = [
  "#1f77b4",
  "#d62728",
  "#2ca02c",
  "#9467bd",
  "#ff7f0e",
  "#17becf",
  "#8c564b",
  "#e377c2",
  "#7f7f7f",
  "#bcbd22",
];

const REDRAW_MS = 150;
const STEP_INCRS = Array.from({ length: 10 }, (_, k) => [1, 2, 5].map((m) => m * 10 ** k)).flat();

/** A tick label short enough for any range: a diverged loss of 3e9 reads "3e9", not "3,000,000,000". */
export function fmtTick(v: number | null): string {
  if (v === null || !Number.isFinite(v)) return "";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) {
    const [m, e] = v.toExponential(1).split("e");
    return `${m.replace(/\.0$/, "")}e${Number(e)}`;
  }
  return Number(v.toPrecision(4)).toString();
}

/** Exponential moving average over the points present, debiased so the first points are not
 * pulled towards zero (what TensorBoard's smoothing slider does). Gaps stay gaps. */
export function ema(values: (number | null)[], weight: number): (number | null)[] {
  if (weight <= 0) return values;
  let acc = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null) return null;
    acc = acc * weight + (1 - weight) * v;
    n += 1;
    return acc / (1 - weight ** n);
  });
}

export class StepChart {
  plot: uPlot;
  private readonly keys: string[] = [];
  // has() runs for every point added: a list's includes() over a batch's 1,000 lines was a third
  // of its page's drawing time
  private readonly keySet: Set<string>;
  private readonly lines: LineSpec[];
  private readonly byStep = new Map<number, Map<string, number>>();
  private timer: number | null = null;
  private readonly resize: ResizeObserver;
  private readonly host: HTMLElement;
  private readonly overlay: HTMLElement;
  private log = false;
  private smoothing = 0;
  /** What the empty chart says: "loading…" until the page has asked the server, then why. */
  private emptyText = "loading…";

  constructor(
    private readonly el: HTMLElement,
    private readonly opts: {
      title: string;
      lines: LineSpec[];
      yLabel: string;
      height?: number;
      legend?: boolean;
      /** Show the log-scale toggle and the smoothing slider. */
      controls?: boolean;
      /** The x axis's label: "step" unless the x values are something else (seconds). */
      xLabel?: string;
    },
  ) {
    this.lines = [...opts.lines];
    this.keys = opts.lines.map((l) => l.key);
    this.keySet = new Set(this.keys);
    el.classList.add("step-chart");
    if (opts.controls) el.append(this.toolbar());
    this.host = h("div", { class: "chart-host" });
    this.overlay = h("div", { class: "chart-empty", role: "status" }, this.emptyText);
    el.append(this.host, this.overlay);
    this.plot = this.build();
    el.dataset.points = "0";
    el.dataset.log = "0";
    el.dataset.smoothing = "0";
    this.resize = new ResizeObserver(() => {
      const w = this.host.clientWidth;
      if (w > 0 && Math.abs(w - this.plot.width) > 2)
        this.plot.setSize({ width: w, height: this.plot.height });
    });
    this.resize.observe(this.host);
  }

  has(key: string): boolean {
    return this.keySet.has(key);
  }

  /** Add a line after construction (a trial that joined a selection). */
  addLine(line: LineSpec): void {
    if (this.has(line.key)) return;
    this.keys.push(line.key);
    this.keySet.add(line.key);
    this.lines.push(line);
    this.plot.addSeries(this.seriesOpts(line));
    this.flush();
  }

  /** Many lines with one redraw, not one each (a batch's 1,000 trials: adding them one at a
   * time redrew the chart a thousand times, each with every line so far). */
  addLines(lines: LineSpec[]): void {
    const fresh = lines.filter((l) => !this.has(l.key));
    if (!fresh.length) return;
    this.plot.batch(() => {
      for (const line of fresh) {
        this.keys.push(line.key);
        this.keySet.add(line.key);
        this.lines.push(line);
        this.plot.addSeries(this.seriesOpts(line));
      }
      this.flush();
    });
  }

  add(key: string, step: number, value: number | null): void {
    if (!this.has(key) || value === null || !Number.isFinite(value)) return;
    let row = this.byStep.get(step);
    if (!row) this.byStep.set(step, (row = new Map()));
    row.set(key, value);
    this.schedule();
  }

  addSeries(key: string, s: Series | undefined): void {
    if (!s) return;
    for (let i = 0; i < s.steps.length; i++) this.add(key, s.steps[i], s.values[i]);
  }

  /** Points held across all lines: what a test or a user can count on the chart. */
  count(): number {
    let n = 0;
    for (const row of this.byStep.values()) n += row.size;
    return n;
  }

  /** Say why the chart is empty (shown only while it has no points). */
  setEmpty(text: string): void {
    this.emptyText = text;
    this.showOverlay();
  }

  setLog(on: boolean): void {
    if (on === this.log) return;
    this.log = on;
    this.el.dataset.log = on ? "1" : "0";
    const box = this.el.querySelector<HTMLInputElement>("input.chart-log");
    if (box) box.checked = on;
    // uPlot fixes a scale's distribution when the plot is built: rebuild it
    this.plot.destroy();
    this.plot = this.build();
  }

  /** EMA weight in [0, 1): 0 draws the points as stored. */
  setSmoothing(weight: number): void {
    this.smoothing = Math.min(0.99, Math.max(0, weight));
    this.el.dataset.smoothing = String(this.smoothing);
    this.flush();
  }

  destroy(): void {
    if (this.timer !== null) window.clearTimeout(this.timer);
    this.resize.disconnect();
    this.plot.destroy();
  }

  private build(): uPlot {
    const width = Math.max(320, this.host.clientWidth || this.el.clientWidth || 600);
    const plot = new uPlot(
      {
        title: this.opts.title,
        width,
        height: this.opts.height ?? 260,
        scales: { x: { time: false }, y: this.log ? { distr: 3, log: 10 } : {} },
        axes: [
          // steps are whole numbers: no tick at step 2.5
          { label: this.opts.xLabel ?? "step", incrs: STEP_INCRS, values: (_u, ticks) => ticks.map(fmtTick) },
          {
            label: this.opts.yLabel,
            values: (_u, ticks) => ticks.map(fmtTick),
            size: fitAxis,
          },
        ],
        legend: { show: this.opts.legend ?? true },
        cursor: { drag: { x: true, y: false } },
        series: [{ label: this.opts.xLabel ?? "step" }, ...this.lines.map((l) => this.seriesOpts(l))],
      },
      this.data(),
      this.host,
    );
    // tests and curious users can reach the instance from the DOM
    (this.el as HTMLElement & { uplot?: uPlot }).uplot = plot;
    return plot;
  }

  private toolbar(): HTMLElement {
    const log = h("input", { type: "checkbox", class: "chart-log" }) as HTMLInputElement;
    log.addEventListener("change", () => this.setLog(log.checked));
    const shown = h("output", { class: "chart-smooth-value" }, "0");
    const slider = h("input", {
      type: "range",
      class: "chart-smooth",
      min: 0,
      max: 0.99,
      step: 0.01,
      value: 0,
      "aria-label": "smoothing",
    }) as HTMLInputElement;
    slider.addEventListener("input", () => {
      shown.textContent = slider.value;
      this.setSmoothing(Number(slider.value));
    });
    return h(
      "div",
      { class: "chart-tools" },
      h("label", {}, log, " log scale"),
      h("label", {}, "smoothing ", slider, " ", shown),
    );
  }

  private showOverlay(): void {
    const empty = this.count() === 0;
    this.overlay.hidden = !empty;
    this.overlay.textContent = this.emptyText;
    this.el.dataset.empty = empty ? this.emptyText : "";
  }

  private schedule(): void {
    if (this.timer === null) this.timer = window.setTimeout(() => this.flush(), REDRAW_MS);
  }

  /** Draw what is held now, not at the next scheduled redraw. */
  drawNow(): void {
    this.flush();
  }

  private flush(): void {
    if (this.timer !== null) window.clearTimeout(this.timer);
    this.timer = null;
    this.plot.setData(this.data());
    this.el.dataset.points = String(this.count());
    this.showOverlay();
  }

  private data(): uPlot.AlignedData {
    const steps = [...(this.byStep?.keys() ?? [])].sort((a, b) => a - b);
    const cols = this.keys.map((k) => {
      let col: (number | null)[] = steps.map((s) => this.byStep.get(s)?.get(k) ?? null);
      col = ema(col, this.smoothing);
      // a log axis has no place for zero or below: leave those points out rather than break the scale
      if (this.log) col = col.map((v) => (v !== null && v > 0 ? v : null));
      return col;
    });
    return [steps, ...cols] as uPlot.AlignedData;
  }

  private seriesOpts(line: LineSpec): uPlot.Series {
    return {
      label: line.label,
      stroke: line.color,
      width: line.width ?? 1.5,
      dash: line.dash,
      // val_loss exists only at eval steps: join its points across the steps where loss alone exists
      spanGaps: true,
      points: line.points ? { show: true, size: 5, fill: line.color } : { show: false },
      ...(line.noLine ? { paths: () => null } : {}),
      ...(line.stepped ? { paths: uPlot.paths.stepped?.({ align: 1 }) } : {}),
      value: (_u, v) => (v === null || v === undefined ? "—" : Number(v.toPrecision(4)).toString()),
    };
  }
}

/** The y axis as wide as its longest tick label (uPlot's fixed default clips long ones into the
 * axis title and off the card). uPlot calls this again as the ticks change. */
function fitAxis(u: uPlot, values: string[] | null, axisIdx: number, cycleNum: number): number {
  const axis = u.axes[axisIdx] as uPlot.Axis & { _size?: number; font?: string[] };
  if (cycleNum > 1 && axis._size) return axis._size;
  const ticks = (axis.ticks as { size?: number } | undefined)?.size ?? 10;
  let size = ticks + (axis.gap ?? 5) + 4;
  const longest = (values ?? []).reduce((a, v) => (v.length > a.length ? v : a), "");
  if (longest) {
    u.ctx.font = axis.font?.[0] ?? "12px system-ui";
    size += u.ctx.measureText(longest).width / devicePixelRatio;
  }
  return Math.ceil(Math.max(40, size));
}
