// Per-rank Gantt chart of a pipeline schedule, built as SVG from the timeline's actions: one row per
// rank, one bar per action from start to end, coloured by op, the micro-batch number on the bar.
// No charting library draws horizontal range bars per category without custom paint code, and the
// chart is only a few hundred rectangles, so plain SVG elements keep it inspectable and testable.
import type { TimelineAction, TimelineOp } from "./api";
import { h, svg } from "./dom";

export const OP_COLOURS: Record<TimelineOp, string> = {
  F: "#4e79a7", // forward
  B: "#59a14f", // backward (input gradient when W is split off)
  W: "#f28e2b", // deferred weight gradient (chimera-zb)
  AR: "#9c755f", // gradient all-reduce between Chimera's two stage copies
};

const OP_NAMES: Record<TimelineOp, string> = {
  F: "forward",
  B: "backward",
  W: "weight grad",
  AR: "all-reduce",
};

const W = 640;
const LEFT = 56;
const RIGHT = 12;
const ROW = 26;
const AXIS = 28;

export function ganttLegend(): HTMLElement {
  return h(
    "div",
    { class: "legend" },
    ...(Object.keys(OP_COLOURS) as TimelineOp[]).map((op) => {
      const sw = h("span", { class: "swatch" });
      sw.style.background = OP_COLOURS[op];
      return h("span", { class: "legend-item" }, sw, `${op} ${OP_NAMES[op]}`);
    }),
    h("span", { class: "legend-item muted" }, "faded: Chimera's up-pipeline replica"),
  );
}

/** `unit` labels the time axis: executed timelines are in seconds, simulated ones in cost units. */
export function gantt(
  actions: TimelineAction[],
  opts: { ranks: number; unit: "s" | "cost"; label: string },
): SVGElement {
  const ranks = Math.max(opts.ranks, 1 + Math.max(-1, ...actions.map((a) => a.rank)));
  const height = ranks * ROW + AXIS;
  const root = svg("svg", {
    viewBox: `0 0 ${W} ${height}`,
    class: "gantt",
    role: "img",
    "aria-label": opts.label,
    "data-actions": actions.length,
  });
  const t0 = Math.min(...actions.map((a) => a.start));
  const t1 = Math.max(...actions.map((a) => a.end));
  const span = t1 > t0 ? t1 - t0 : 1;
  const x = (t: number) => LEFT + ((t - t0) / span) * (W - LEFT - RIGHT);

  // rows and their labels
  for (let r = 0; r < ranks; r++) {
    root.append(
      svg("rect", {
        x: LEFT,
        y: r * ROW,
        width: W - LEFT - RIGHT,
        height: ROW,
        class: r % 2 ? "row odd" : "row",
      }),
      svg(
        "text",
        { x: LEFT - 6, y: r * ROW + ROW / 2 + 4, "text-anchor": "end", class: "rank" },
        `rank ${r}`,
      ),
    );
  }

  // time axis with a handful of round ticks
  const { scale, suffix } = timeUnit(span, opts.unit);
  const axisY = ranks * ROW;
  root.append(svg("line", { x1: LEFT, x2: W - RIGHT, y1: axisY, y2: axisY, class: "axis" }));
  for (const t of niceTicks(0, span, 6)) {
    const tx = x(t0 + t);
    root.append(
      svg("line", { x1: tx, x2: tx, y1: 0, y2: axisY + 4, class: "tick" }),
      svg("text", { x: tx, y: axisY + 16, "text-anchor": "middle", class: "tick-label" }, fmtTick(t * scale)),
    );
  }
  root.append(
    svg("text", { x: W - RIGHT, y: axisY + 27, "text-anchor": "end", class: "tick-label" }, suffix),
  );

  for (const a of actions) {
    const bx = x(a.start);
    const bw = Math.max(1, x(a.end) - bx);
    const g = svg("g", { class: `bar op-${a.op}`, "data-op": a.op, "data-rank": a.rank });
    const rect = svg("rect", {
      x: bx,
      y: a.rank * ROW + 3,
      width: bw,
      height: ROW - 6,
      rx: 2,
      fill: OP_COLOURS[a.op] ?? "#999",
      "fill-opacity": a.replica === 1 ? 0.55 : 1,
    });
    const where = [
      hasMb(a) ? `mb ${a.mb}` : null,
      a.stage !== null && a.stage !== undefined ? `stage ${a.stage}` : null,
      a.replica !== null && a.replica !== undefined ? `replica ${a.replica}` : null,
    ].filter(Boolean);
    const dur = (a.end - a.start) * scale;
    rect.append(svg("title", {}, `${a.op} ${where.join(", ")} · ${fmtTick(dur)} ${suffix}`));
    g.append(rect);
    // the micro-batch number only where it fits
    if (hasMb(a) && bw >= 11) {
      g.append(
        svg(
          "text",
          { x: bx + bw / 2, y: a.rank * ROW + ROW / 2 + 4, "text-anchor": "middle", class: "mb" },
          String(a.mb),
        ),
      );
    }
    root.append(g);
  }
  return root;
}

function timeUnit(span: number, unit: "s" | "cost"): { scale: number; suffix: string } {
  if (unit === "cost") return { scale: 1, suffix: "cost units" };
  return span < 1 ? { scale: 1000, suffix: "ms" } : { scale: 1, suffix: "s" };
}

function niceTicks(lo: number, hi: number, count: number): number[] {
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? raw;
  const ticks: number[] = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return ticks;
}

function fmtTick(v: number): string {
  return Number(v.toPrecision(3)).toString();
}

/** All-reduce actions carry no micro-batch (null, or -1 in the executor's records). */
function hasMb(a: TimelineAction): boolean {
  return a.mb !== null && a.mb !== undefined && a.mb >= 0;
}
