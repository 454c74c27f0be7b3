// The job page's Log panel: status lines and the trainer's own output (prints, warnings,
// tracebacks) per rank, as the REST backfill and the live stream deliver them. A search box and a
// rank filter hide lines without losing them; the panel follows the tail unless the user scrolled
// up (or unticked "follow").
import type { JobStreamEvents, LogLine } from "./api";
import { fmtTime, h } from "./dom";

interface Shown {
  li: HTMLLIElement;
  text: string;
  rank: number | null;
  kind: string;
  stream: string | null;
}

const TRACEBACK = "Traceback (most recent call last):";

export class LogPanel {
  readonly el: HTMLElement;
  private readonly list: HTMLOListElement;
  private readonly search: HTMLInputElement;
  private readonly rankSel: HTMLSelectElement;
  private readonly follow: HTMLInputElement;
  private readonly count: HTMLSpanElement;
  private readonly lines: Shown[] = [];
  private readonly seen = new Set<string>();
  private readonly ranks = new Set<number>();

  constructor() {
    this.list = h("ol", { class: "logs", id: "log-panel" });
    this.search = h("input", { type: "search", id: "log-search", placeholder: "search the log" });
    this.rankSel = h("select", { id: "log-rank" }, h("option", { value: "" }, "all ranks"));
    this.follow = h("input", { type: "checkbox", id: "log-follow", checked: true });
    this.count = h("span", { class: "muted", id: "log-count" });
    this.search.addEventListener("input", () => this.refilter());
    this.rankSel.addEventListener("change", () => this.refilter());
    this.follow.addEventListener("change", () => this.follow.checked && this.toBottom());
    this.list.addEventListener("scroll", () => {
      // scrolling up to read stops following; back at the bottom resumes it
      this.follow.checked = this.atBottom();
    });
    this.el = h(
      "section",
      { class: "card" },
      h(
        "div",
        { class: "title-row log-tools" },
        h("h2", {}, "Log"),
        this.search,
        this.rankSel,
        h("label", {}, this.follow, " follow"),
        this.count,
      ),
      this.list,
    );
  }

  /** A stored line (its rank and stream in `data`) or a live one (them beside its message). */
  add(line: LogLine): void {
    if ("kind" in line) {
      const rank = line.data?.rank;
      const stream = line.data?.stream;
      this.push(
        line.time,
        line.kind,
        line.message,
        typeof rank === "number" ? rank : null,
        typeof stream === "string" ? stream : null,
      );
    } else this.push(line.time, "log", line.message, line.rank, line.stream);
  }

  /** A status change from the job's stream. */
  addStatus(s: JobStreamEvents["status"]): void {
    this.push(s.time, "status", s.status, null, null);
  }

  private push(
    time: number,
    kind: string,
    message: string,
    rank: number | null,
    stream: string | null,
  ): void {
    const line = { time, message };
    const key = `${line.time}|${rank}|${line.message}`;
    if (this.seen.has(key)) return;
    this.seen.add(key);
    if (rank !== null && !this.ranks.has(rank)) {
      this.ranks.add(rank);
      const opts = [...this.ranks].sort((a, b) => a - b);
      this.rankSel.replaceChildren(
        h("option", { value: "" }, "all ranks"),
        ...opts.map((r) => h("option", { value: String(r) }, `rank ${r}`)),
      );
      this.rankSel.value = this.rankSel.dataset.want ?? "";
    }
    const text = kind === "status" ? `status → ${line.message}` : line.message;
    const li = h(
      "li",
      { class: `log-${kind}${stream ? ` log-${stream}` : ""}` },
      h("time", {}, fmtTime(line.time)),
      rank !== null ? h("span", { class: "log-rank" }, `r${rank}`) : null,
      h("span", { class: "log-text" }, text),
    );
    const shown: Shown = { li, text, rank, kind, stream };
    this.lines.push(shown);
    li.hidden = !this.matches(shown);
    this.list.append(li);
    this.updateCount();
    if (this.follow.checked) this.toBottom();
  }

  /** The last Python traceback in the trainer's stderr (one rank's), or null. */
  traceback(): string | null {
    for (let i = this.lines.length - 1; i >= 0; i--) {
      const start = this.lines[i];
      if (start.stream !== "stderr" || !start.text.includes(TRACEBACK)) continue;
      const out = this.lines
        .slice(i)
        .filter((l) => l.stream === "stderr" && l.rank === start.rank)
        .slice(0, 120)
        .map((l) => l.text);
      return out.join("\n");
    }
    return null;
  }

  private matches(l: Shown): boolean {
    const want = this.rankSel.value;
    if (want !== "" && l.rank !== Number(want)) return false;
    const q = this.search.value.trim().toLowerCase();
    return !q || l.text.toLowerCase().includes(q);
  }

  private refilter(): void {
    this.rankSel.dataset.want = this.rankSel.value;
    for (const l of this.lines) l.li.hidden = !this.matches(l);
    this.updateCount();
    if (this.follow.checked) this.toBottom();
  }

  private updateCount(): void {
    const shown = this.lines.filter((l) => !l.li.hidden).length;
    this.count.textContent =
      shown === this.lines.length ? `${shown} lines` : `${shown} of ${this.lines.length} lines`;
  }

  private atBottom(): boolean {
    return this.list.scrollTop + this.list.clientHeight >= this.list.scrollHeight - 4;
  }

  private toBottom(): void {
    this.list.scrollTop = this.list.scrollHeight;
  }
}
