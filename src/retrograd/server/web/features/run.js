// One run: its status and controls, live loss and reward charts over its event stream, the
// event journal, evaluate, the PATCH form, checkpoints and artifacts (signed downloads).

import { api, follow } from "../lib/api.js";
import { lineChart } from "../lib/chart.js";
import { attempt, button, cell, describeError, fill, h, table } from "../lib/dom.js";
import { bytes, chip, number, progressBar, show, when } from "../lib/format.js";
import { configTable } from "./config_table.js";
import { controls } from "./controls.js";

const JOURNAL_MAX = 500;
const PATCHABLE = [
  { path: "training.lr", type: "number", step: "any" },
  { path: "evaluation.every_iterations", type: "number", step: 1 },
  { path: "evaluation.patience", type: "number", step: 1 },
  { path: "checkpoint.every_steps", type: "number", step: 1 },
  { path: "checkpoint.mode", options: ["", "steps", "best_eval", "steps_and_best_eval"] },
];

function summary(event) {
  const { seq, at, type, ...rest } = event;
  if (type === "status" || type === "terminal") return rest.error ? `${rest.status}: ${rest.error}` : rest.status;
  if (type === "progress") {
    return Object.entries(rest).map(([k, v]) => `${k} ${number(v)}`).join(" · ");
  }
  if (type === "metrics") return Object.entries(rest.values || {}).map(([k, v]) => `${k} ${number(v)}`).join(" · ");
  if (type === "log") return rest.message;
  if (type === "checkpoint") return `${rest.path || ""}${rest.global_step !== undefined ? ` (step ${rest.global_step})` : ""}`;
  return show(rest);
}

export function render(view, { parts, features }) {
  const id = parts[1];
  const path = `/runs/${encodeURIComponent(id)}`;
  const run = cell(null);
  const stop = new AbortController();
  const head = h("div", { class: "run-head" });
  const message = h("div", { class: "message", id: "run-message" });
  const loss = lineChart("loss", ["train", "eval"]);
  loss.element.id = "loss-chart";
  const reward = lineChart("reward", ["reward"]);
  reward.element.id = "reward-chart";
  reward.element.hidden = true;
  // Any metric the run reports (metrics events, docs/metrics.md), one at a time by a picker.
  const metrics = new Map(); // name -> [[step, value], ...]
  const picker = h("select", { id: "metric-picker" });
  const picked = h("div", {});
  const metricCard = h("div", { class: "metric", hidden: true }, h("label", { class: "inline" }, "Metric ", picker), picked);
  let metricChart = null;
  picker.addEventListener("change", drawMetric);

  function drawMetric() {
    metricChart = lineChart(picker.value, [picker.value]);
    for (const [x, y] of metrics.get(picker.value) || []) metricChart.add(picker.value, x, y);
    fill(picked, metricChart.element);
  }

  function addMetrics(step, values) {
    for (const [name, value] of Object.entries(values || {})) {
      if (typeof value !== "number") continue;
      if (!metrics.has(name)) {
        metrics.set(name, []);
        picker.append(h("option", { value: name }, name));
        metricCard.hidden = false;
        if (metrics.size === 1) drawMetric();
      }
      metrics.get(name).push([step, value]);
      if (name === picker.value && metricChart) metricChart.add(name, step, value);
    }
  }
  const journal = h("ol", { class: "journal", id: "journal" });
  const checkpoints = h("div", { id: "checkpoints" });
  const artifacts = h("div", { id: "artifacts" });
  const evaluation = h("div", { class: "message" });
  const patchMessage = h("div", { class: "message" });
  const config = h("details", {}, h("summary", {}, "Effective configuration"));

  fill(
    view,
    h("p", {}, h("a", { href: "#/runs" }, "← runs")),
    head,
    message,
    h("div", { class: "charts" }, loss.element, reward.element, metricCard),
    h("div", { class: "columns" },
      h("section", { class: "card" }, h("h2", {}, "Journal"), journal),
      h("section", {},
        h("div", { class: "card" }, h("h2", {}, "Evaluate"), h("p", { class: "muted" }, "Measures the run on its [evaluation] data at its next step, leaving its best checkpoint and patience alone."), button("Evaluate", evaluate, { id: "evaluate" }), evaluation),
        h("div", { class: "card" }, h("h2", {}, "Change while it runs"), patchForm(), patchMessage),
      ),
    ),
    h("section", { class: "card" }, h("h2", {}, "Checkpoints ", button("Refresh", loadCheckpoints, { class: "small" }), " ", button("Checkpoint now", checkpointNow, { class: "small" })), checkpoints),
    h("section", { class: "card" }, h("h2", {}, "Artifacts ", button("Refresh", loadArtifacts, { class: "small" })), artifacts),
    config,
  );

  // The heading (its buttons with it) is drawn again only when the status changes, so that a
  // click is not lost to a redraw; the progress bar on every change.
  const bar = h("div", {});
  let drawnKey = null;
  run.watch((r) => {
    if (!r) return;
    fill(bar, progressBar(r));
    const key = [r.status, r.error, r.finished_at, r.queue_position].join("|");
    if (key === drawnKey) return;
    drawnKey = key;
    const links = [
      features.serving_enabled ? h("a", { href: `#/compare?run=${encodeURIComponent(r.id)}` }, "Chat with it") : null,
      r.observed ? h("a", { href: `#/runs/${encodeURIComponent(r.id)}/rollouts` }, "Rollouts") : null,
    ].filter(Boolean);
    fill(
      head,
      h("div", { class: "heading" }, h("h1", {}, r.name || r.id), h("span", { id: "run-status" }, chip(r.status)), h("span", { class: "actions" }, controls(r, accepted, (e) => fill(message, e)))),
      h("p", { class: "muted" }, `${r.id} · ${r.algorithm} · ${r.model}`, r.created_at ? ` · created ${when(r.created_at)}` : "", r.finished_at ? ` · finished ${when(r.finished_at)}` : ""),
      bar,
      r.error ? h("p", { class: "error" }, r.error) : null,
      r.queue_position ? h("p", {}, `queued: position ${r.queue_position}`) : null,
      links.length ? h("p", { class: "links" }, links.flatMap((a) => [a, " "])) : null,
    );
  });

  function accepted(answer) {
    fill(message);
    if (answer && answer.status) run.value = { ...run.value, status: answer.status };
  }

  function onEvent(event) {
    const r = { ...run.value };
    const { seq, at, type, ...rest } = event;
    if (type === "status" || type === "terminal") r.status = rest.status;
    if (type === "terminal" && rest.error) r.error = rest.error;
    if (type === "progress") {
      r.progress = rest;
      if (rest.train_loss !== undefined) loss.add("train", rest.global_step, rest.train_loss);
      if (rest.eval_loss !== undefined) loss.add("eval", rest.global_step, rest.eval_loss);
      if (rest.reward !== undefined) {
        reward.element.hidden = false;
        reward.add("reward", rest.global_step, rest.reward);
      }
    }
    if (type === "metrics") addMetrics(rest.global_step, rest.values);
    if (type === "evaluation") {
      const key = Object.keys(rest.values || {}).find((k) => k.endsWith("loss"));
      if (key) loss.add("eval", rest.global_step, rest.values[key]);
    }
    if (type === "checkpoint") loadCheckpoints();
    if (type === "terminal") {
      loadCheckpoints();
      loadArtifacts();
      api(path).then((fresh) => (run.value = fresh)).catch(() => {});
    }
    run.value = r;
    journal.append(h("li", { "data-type": type }, h("span", { class: "muted" }, `${seq} · ${new Date(at).toLocaleTimeString()} `), chip(type, "event"), " ", summary(event)));
    while (journal.children.length > JOURNAL_MAX) journal.firstElementChild.remove();
    journal.scrollTop = journal.scrollHeight;
  }

  async function evaluate() {
    await attempt(evaluation, async () => {
      fill(evaluation, "waiting for the run's next step…");
      const answer = await api(`${path}/evaluate`, { method: "POST", json: {} });
      return table(["", ""], Object.entries(answer).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, number(v)))));
    });
  }

  function patchForm() {
    const inputs = PATCHABLE.map((field) => {
      const input = field.options
        ? h("select", { name: field.path }, field.options.map((o) => h("option", { value: o }, o || "(unchanged)")))
        : h("input", { name: field.path, type: field.type, step: field.step, placeholder: "(unchanged)" });
      return [field, input];
    });
    const form = h("form", { id: "patch", class: "grid" }, inputs.map(([field, input]) => h("label", {}, h("code", {}, field.path), input)), h("button", { type: "submit" }, "Apply"));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const body = {};
      for (const [field, input] of inputs) {
        if (input.value === "") continue;
        const [section, key] = field.path.split(".");
        body[section] = body[section] || {};
        body[section][key] = field.type === "number" ? Number(input.value) : input.value;
      }
      attempt(patchMessage, async () => {
        const answer = await api(path, { method: "PATCH", json: body });
        return `applied ${answer.applied.join(", ") || "nothing"}` + (answer.applies_at_iteration !== undefined ? ` from iteration ${answer.applies_at_iteration}` : "");
      });
    });
    return form;
  }

  async function checkpointNow() {
    try {
      await api(`${path}/checkpoints`, { method: "POST" });
      fill(message, "a checkpoint is written at the run's next step");
    } catch (error) {
      fill(message, describeError(error));
    }
  }

  function loadCheckpoints() {
    return attempt(checkpoints, async () => {
      const answer = await api(`${path}/checkpoints`);
      if (!answer.checkpoints.length) return h("p", { class: "muted" }, "none yet");
      const rows = answer.checkpoints.map((c) =>
        h("tr", {}, h("td", {}, c.id, c.id === answer.latest ? chip("latest") : null), h("td", {}, c.kind), h("td", {}, c.global_step), h("td", {}, bytes(c.bytes)), h("td", {}, c.complete ? "yes" : "no"), h("td", {}, when(c.written_at))),
      );
      return table(["checkpoint", "kind", "step", "size", "complete", "written"], rows);
    });
  }

  function loadArtifacts() {
    return attempt(artifacts, async () => {
      const answer = await api(`${path}/artifacts`);
      const rows = answer.artifacts.map((a) =>
        h("tr", { "data-artifact": a.name }, h("td", {}, a.name), h("td", {}, a.kind), h("td", {}, a.present ? bytes(a.bytes) || "present" : "not written"), h("td", {}, a.downloadable ? button("Download", () => download(a.name)) : null)),
      );
      return table(["artifact", "kind", "size", ""], rows);
    });
  }

  // A signed link (60 s, this artifact only) opened by the browser: no header needed.
  async function download(name) {
    try {
      const link = await api(`${path}/artifacts/${encodeURIComponent(name)}/link`, { method: "POST" });
      const anchor = h("a", { href: new URL(link.href, document.baseURI).toString(), download: "" });
      document.body.append(anchor);
      anchor.click();
      anchor.remove();
    } catch (error) {
      fill(message, describeError(error));
    }
  }

  (async () => {
    try {
      run.value = await api(path);
    } catch (error) {
      fill(message, describeError(error));
      return;
    }
    config.append(configTable(run.value.effective_config, run.value.provenance));
    loadCheckpoints();
    loadArtifacts();
    try {
      await follow(id, onEvent, stop.signal);
    } catch (error) {
      fill(message, describeError(error));
    }
  })();

  return () => stop.abort();
}
