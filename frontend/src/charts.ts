// Line charts over training steps, drawn by uPlot. Points arrive one at a time from SSE, possibly
// out of order and possibly twice (the REST backfill and the stream's replay overlap), so values
// are keyed by step and the aligned arrays uPlot wants are rebuilt at most a few times per second.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

export interface LineSpec {
  key: string;
  label: string;
  color: string;
  dash?: number[];
  width?: number;
  /** Mark every point: for sparse series such as val_loss, measured only at eval steps. */
  points?: boolean;
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

export class StepChart {
  readonly plot: uPlot;
  private readonly keys: string[] = [];
  private readonly byStep = new Map<number, Map<string, number>>();
  private timer: number | null = null;
  private readonly resize: ResizeObserver;

  constructor(
    private readonly el: HTMLElement,
    opts: {
      title: string;
      lines: LineSpec[];
      yLabel: string;
      height?: number;
      legend?: boolean;
      /** The x axis's label: "step" unless the x values are something else (seconds). */
      xLabel?: string;
    },
  ) {
    this.keys = opts.lines.map((l) => l.key);
    const width = Math.max(320, el.clientWidth || 600);
    this.plot = new uPlot(
      {
        title: opts.title,
        width,
        height: opts.height ?? 260,
        scales: { x: { time: false } },
        axes: [{ label: opts.xLabel ?? "step" }, { label: opts.yLabel, size: 60 }],
        legend: { show: opts.legend ?? true },
        cursor: { drag: { x: true, y: false } },
        series: [{ label: "step" }, ...opts.lines.map(seriesOpts)],
      },
      this.data(),
      el,
    );
    // tests and curious users can reach the instance from the DOM
    (el as HTMLElement & { uplot?: uPlot }).uplot = this.plot;
    el.dataset.points = "0";
    this.resize = new ResizeObserver(() => {
      const w = el.clientWidth;
      if (w > 0 && Math.abs(w - this.plot.width) > 2)
        this.plot.setSize({ width: w, height: this.plot.height });
    });
    this.resize.observe(el);
  }

  has(key: string): boolean {
    return this.keys.includes(key);
  }

  /** Add a line after construction (a trial that joined a selection). */
  addLine(line: LineSpec): void {
    if (this.has(line.key)) return;
    this.keys.push(line.key);
    this.plot.addSeries(seriesOpts(line));
    this.flush();
  }

  add(key: string, step: number, value: number | null): void {
    if (!this.has(key) || value === null || !Number.isFinite(value)) return;
    let row = this.byStep.get(step);
    if (!row) this.byStep.set(step, (row = new Map()));
    row.set(key, value);
    this.schedule();
  }

  addSeries(key: string, s: { steps: number[]; values: number[] } | undefined): void {
    if (!s) return;
    for (let i = 0; i < s.steps.length; i++) this.add(key, s.steps[i], s.values[i]);
  }

  /** Points held across all lines: what a test or a user can count on the chart. */
  count(): number {
    let n = 0;
    for (const row of this.byStep.values()) n += row.size;
    return n;
  }

  destroy(): void {
    if (this.timer !== null) window.clearTimeout(this.timer);
    this.resize.disconnect();
    this.plot.destroy();
  }

  private schedule(): void {
    if (this.timer === null) this.timer = window.setTimeout(() => this.flush(), REDRAW_MS);
  }

  private flush(): void {
    this.timer = null;
    this.plot.setData(this.data());
    this.el.dataset.points = String(this.count());
  }

  private data(): uPlot.AlignedData {
    const steps = [...(this.byStep?.keys() ?? [])].sort((a, b) => a - b);
    const cols = this.keys.map((k) => steps.map((s) => this.byStep.get(s)?.get(k) ?? null));
    return [steps, ...cols] as uPlot.AlignedData;
  }
}

function seriesOpts(line: LineSpec): uPlot.Series {
  return {
    label: line.label,
    stroke: line.color,
    width: line.width ?? 1.5,
    dash: line.dash,
    // val_loss exists only at eval steps: join its points across the steps where loss alone exists
    spanGaps: true,
    points: line.points ? { show: true, size: 5, fill: line.color } : { show: false },
    value: (_u, v) => (v === null || v === undefined ? "—" : Number(v.toPrecision(4)).toString()),
  };
}
