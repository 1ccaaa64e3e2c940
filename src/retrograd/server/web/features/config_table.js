// A run's effective configuration as a table: every value with where it came from
// (default, derived, measured, override) as a chip.

import { h, table } from "../lib/dom.js";
import { chip, leaves, show } from "../lib/format.js";

function origin(provenance, path) {
  for (let at = path; at; at = at.includes(".") ? at.slice(0, at.lastIndexOf(".")) : "") {
    if (provenance[at]) return provenance[at];
  }
  return { source: "default" };
}

export function configTable(config, provenance = {}) {
  const rows = leaves(config || {}).map(([path, value]) => {
    const from = origin(provenance || {}, path);
    return h(
      "tr",
      { "data-key": path },
      h("td", {}, h("code", {}, path)),
      h("td", { class: "value" }, show(value)),
      h("td", { title: from.reason || "" }, chip(from.source), from.reason ? h("span", { class: "muted small" }, ` ${from.reason}`) : null),
    );
  });
  return table(["key", "value", "source"], rows, { class: "config" });
}
