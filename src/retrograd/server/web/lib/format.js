// Small pieces shared by the views: sizes, times, status chips, progress bars.

import { h } from "./dom.js";

export const TERMINAL = ["completed", "failed", "cancelled"];
export const FINISHED = [...TERMINAL, "interrupted"];

export function bytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

export function when(iso) {
  if (!iso) return "";
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleString();
}

export function number(value, digits = 4) {
  if (value === undefined || value === null) return "";
  return typeof value === "number" ? String(Number(value.toPrecision(digits))) : String(value);
}

export function chip(text, kind = text) {
  return h("span", { class: `chip chip-${String(kind).replace(/[^a-z0-9-]/gi, "")}` }, text);
}

// The share of the run done: steps of the plan where known, else iterations.
export function progressBar(run) {
  const p = run.progress || {};
  const total = run.plan && run.plan.total_steps;
  let share = 0;
  let text = "";
  if (total && p.global_step !== undefined) {
    share = p.global_step / total;
    text = `step ${p.global_step}/${total}`;
  } else if (p.iterations) {
    share = (p.iteration || 0) / p.iterations;
    text = `iteration ${p.iteration || 0}/${p.iterations}` + (p.global_step !== undefined ? ` · step ${p.global_step}` : "");
  }
  if (run.status === "completed") share = 1;
  const percent = Math.max(0, Math.min(100, share * 100));
  return h(
    "div",
    { class: "progress", title: text },
    h("div", { class: "bar", style: `width: ${percent.toFixed(1)}%` }),
    h("span", {}, text || run.status),
  );
}

export function runName(run) {
  return run.name || run.id;
}

// A nested object's leaves as [["a.b", value], ...].
export function leaves(value, prefix = "") {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return [[prefix, value]];
  const out = [];
  for (const [key, inner] of Object.entries(value)) out.push(...leaves(inner, prefix ? `${prefix}.${key}` : key));
  return out;
}

export function show(value) {
  if (value === undefined || value === null) return "";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}
