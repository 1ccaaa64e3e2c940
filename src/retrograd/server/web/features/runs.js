// The runs table: status, progress, algorithm, name, creation time and the run's controls,
// refreshed every two seconds.

import { api } from "../lib/api.js";
import { attempt, fill, h, table } from "../lib/dom.js";
import { chip, progressBar, when } from "../lib/format.js";
import { controls } from "./controls.js";

const EVERY_MS = 2000;

export function render(view) {
  const filter = h("select", { id: "status-filter" }, ["", "queued", "running", "paused", "completed", "failed", "cancelled", "interrupted"].map((s) => h("option", { value: s }, s || "every status")));
  const message = h("div", { class: "message" });
  const body = h("div", { id: "runs" });
  fill(
    view,
    h("div", { class: "heading" }, h("h1", {}, "Runs"), h("a", { class: "button", href: "#/plan" }, "New run"), filter),
    message,
    body,
  );
  let timer = null;
  let stopped = false;
  let shown = null; // what the table shows: redrawn only when it changes, so a click lands

  // A summary has no plan: a run's view is read for its step count (the bar's total) once per
  // status it shows (a run's own count replaces the plan's when it starts).
  const plans = new Map();
  const key = (run) => `${run.id} ${run.status}`;
  async function plansOf(runs) {
    const missing = runs.filter((run) => !plans.has(key(run)) && run.status !== "completed");
    await Promise.all(
      missing.map((run) =>
        api(`/runs/${encodeURIComponent(run.id)}`)
          .then((view) => plans.set(key(run), view.plan || {}))
          .catch(() => plans.set(key(run), {})),
      ),
    );
    for (const run of runs) run.plan = plans.get(key(run));
  }

  async function refresh() {
    clearTimeout(timer);
    await load();
    if (!stopped) timer = setTimeout(refresh, EVERY_MS);
  }

  async function load() {
    try {
      const { runs } = await api("/runs", { query: { status: filter.value, limit: 100 } });
      await plansOf(runs);
      if (stopped) return;
      const seen = JSON.stringify(runs);
      if (seen === shown) return;
      shown = seen;
      fill(body, runs.length ? runsTable(runs) : h("p", { class: "muted" }, "No runs yet. ", h("a", { href: "#/plan" }, "Start one.")));
    } catch (error) {
      attempt(message, () => Promise.reject(error));
    }
  }

  function runsTable(runs) {
    const rows = runs.map((run) =>
      h(
        "tr",
        { "data-run": run.id },
        h("td", {}, chip(run.status)),
        h("td", { class: "wide" }, progressBar(run)),
        h("td", {}, run.algorithm),
        h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(run.id)}` }, run.name || run.id)),
        h("td", {}, when(run.created_at)),
        h("td", { class: "actions" }, controls(run, refresh, (error) => fill(message, error))),
      ),
    );
    return table(["status", "progress", "algorithm", "name", "created", ""], rows, { class: "runs" });
  }

  filter.addEventListener("change", refresh);
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
