// Hash router and the health bar. Hash routes (#/jobs/12) let the API serve dist/ as plain static
// files with no server-side fallback.
import "./style.css";
import { api, type Health, type Me, post, SIGNED_OUT } from "./api";
import { errorText, fmtTime, h } from "./dom";
import { comparePage } from "./pages/compare";
import { jobPage } from "./pages/job";
import { jobsPage } from "./pages/jobs";
import { newSelectionPage } from "./pages/newselection";
import { queuePage } from "./pages/queue";
import { selectionPage, selectionsPage } from "./pages/selections";
import { webhooksPage } from "./pages/webhooks";

type Cleanup = () => void;
type Route = [RegExp, (root: HTMLElement, id: number) => Cleanup];

const ROUTES: Route[] = [
  // ?clone=ID: the submit form filled with that job's spec
  [/^#?\/?(\?.*)?$/, (root) => jobsPage(root)],
  [/^#\/jobs\/(\d+)$/, jobPage],
  [/^#\/queue\/?$/, (root) => queuePage(root)],
  [/^#\/selections\/?$/, (root) => selectionsPage(root)],
  // ?from=ID: a batch's request to start again; ?job=ID: a job's spec as the base
  [/^#\/selections\/new(\?.*)?$/, (root) => newSelectionPage(root)],
  [/^#\/selections\/(\d+)$/, selectionPage],
  [/^#\/webhooks\/?$/, (root) => webhooksPage(root)],
  [/^#\/compare(\?.*)?$/, (root) => comparePage(root)],
];

const app = document.getElementById("app")!;
let cleanup: Cleanup | null = null;
let me: Me | null = null;

/** Who is signed in, shown in the top bar; null until /api/auth/me answers. */
export function currentUser(): Me | null {
  return me;
}

function showUser(): void {
  const el = document.getElementById("whoami")!;
  if (!me) {
    el.replaceChildren();
    return;
  }
  el.replaceChildren(
    h("span", { id: "whoami-name" }, me.user.name + (me.user.is_admin ? " (admin)" : "")),
    " ",
    h("button", { class: "small secondary", id: "sign-out", onclick: () => void signOut() }, "Sign out"),
  );
}

async function signOut(): Promise<void> {
  try {
    await api("/api/auth/session", { method: "DELETE" });
  } catch {
    // already gone: show the form anyway
  }
  me = null;
  showSignIn();
}

function showSignIn(reason?: string): void {
  cleanup?.();
  cleanup = null;
  me = null;
  showUser();
  const input = h("input", {
    id: "token-input",
    type: "password",
    autocomplete: "off",
    placeholder: "sy_…",
    size: 52,
  });
  const out = h("div", { id: "signin-result", role: "status" });
  if (reason) {
    out.className = "error";
    out.textContent = `Signed out: ${reason}`;
  }
  const submit = async (ev: Event) => {
    ev.preventDefault();
    out.className = "";
    out.textContent = "";
    try {
      me = await post<Me>("/api/auth/session", { token: input.value.trim() });
      input.value = "";
      showUser();
      route();
    } catch (err) {
      out.className = "error";
      out.textContent = errorText(err);
    }
  };
  app.replaceChildren(
    h(
      "form",
      { class: "card", id: "signin-form", onsubmit: submit },
      h("h1", {}, "Sign in"),
      h(
        "p",
        { class: "muted" },
        "Paste an API token: `shardyard stack` prints the local admin's, `shardyard admin create-user` makes one.",
      ),
      input,
      h("div", { class: "form-row" }, h("button", { type: "submit" }, "Sign in")),
      out,
    ),
  );
}

function route(): void {
  if (!me) return;
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
  const section = ["#/selections", "#/queue", "#/webhooks"].find((s) => hash.startsWith(s)) ?? "#/";
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
      dot(hl.db.ok, "db"),
      dot(hl.broker.ok, "broker"),
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
    // users' code runs unsandboxed (or jobs with it are refused) on some worker: say so
    if (workers.length && hl.sandbox !== "on") {
      const why = workers
        .filter((w) => w.sandbox !== "on")
        .map((w) => `${w.name}: sandbox ${w.sandbox}${w.sandbox_why ? ` (${w.sandbox_why})` : ""}`)
        .join("\n");
      el.append(h("span", { class: "bad", id: "sandbox-state", title: why }, `● sandbox ${hl.sandbox}`));
    }
    el.dataset.status = hl.status;
    el.dataset.sandbox = hl.sandbox ?? "unknown";
  } catch (err) {
    el.replaceChildren(h("span", { class: "bad" }, `● API unreachable (${errorText(err)})`));
    el.dataset.status = "down";
  }
}

async function start(): Promise<void> {
  try {
    me = await api<Me>("/api/auth/me");
    showUser();
    route();
  } catch {
    showSignIn();
  }
}

window.addEventListener("hashchange", route);
window.addEventListener(SIGNED_OUT, (ev) => {
  if (me) showSignIn((ev as CustomEvent<string>).detail);
});
void start();
void health();
window.setInterval(health, 10_000);
