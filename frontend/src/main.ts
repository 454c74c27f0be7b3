// Hash router and the health bar. Hash routes (#/jobs/12) let the API serve dist/ as plain static
// files with no server-side fallback.
import "./style.css";
import { api, type Health } from "./api";
import { errorText, fmtTime, h } from "./dom";
import { jobPage } from "./pages/job";
import { jobsPage } from "./pages/jobs";
import { selectionPage, selectionsPage } from "./pages/selections";

type Cleanup = () => void;
type Route = [RegExp, (root: HTMLElement, id: number) => Cleanup];

const ROUTES: Route[] = [
  [/^#?\/?$/, (root) => jobsPage(root)],
  [/^#\/jobs\/(\d+)$/, jobPage],
  [/^#\/selections\/?$/, (root) => selectionsPage(root)],
  [/^#\/selections\/(\d+)$/, selectionPage],
];

const app = document.getElementById("app")!;
let cleanup: Cleanup | null = null;

function route(): void {
  cleanup?.();
  cleanup = null;
  app.replaceChildren();
  const hash = window.location.hash;
  for (const [re, page] of ROUTES) {
    const m = re.exec(hash);
    if (m) {
      cleanup = page(app, Number(m[1]));
      highlightNav(hash);
      return;
    }
  }
  app.append(h("h1", {}, "Not found"), h("p", {}, h("a", { href: "#/" }, "Back to jobs")));
}

function highlightNav(hash: string): void {
  const section = hash.startsWith("#/selections") ? "#/selections" : "#/";
  for (const a of document.querySelectorAll<HTMLAnchorElement>("#topbar nav a")) {
    a.classList.toggle("active", a.getAttribute("href") === section);
  }
}

async function health(): Promise<void> {
  const el = document.getElementById("health")!;
  try {
    const hl = await api<Health>("/api/health");
    const dot = (ok: boolean, name: string) =>
      h("span", { class: ok ? "ok" : "bad", title: name }, `● ${name}`);
    const workers = hl.workers ?? [];
    el.replaceChildren(
      dot(hl.db?.ok, "db"),
      dot(hl.broker?.ok, "broker"),
      h(
        "span",
        {
          class: workers.length ? "ok" : "bad",
          title: workers
            .map((w) => `${w.name}: ${JSON.stringify(w.devices)} (seen ${fmtTime(w.last_seen)})`)
            .join("\n"),
        },
        `● ${workers.length} worker${workers.length === 1 ? "" : "s"}`,
      ),
    );
    el.dataset.status = hl.status;
  } catch (err) {
    el.replaceChildren(h("span", { class: "bad" }, `● API unreachable (${errorText(err)})`));
    el.dataset.status = "down";
  }
}

window.addEventListener("hashchange", route);
route();
void health();
window.setInterval(health, 10_000);
