// Building the page from data without ever parsing it as HTML: text always goes in as text.

const SVG = "http://www.w3.org/2000/svg";

function build(element, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      element.addEventListener(key.slice(2), value);
    } else if (key === "value" && "value" in element) {
      element.value = value;
    } else if (key === "checked" || key === "disabled" || key === "selected") {
      element[key] = Boolean(value);
    } else {
      element.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// h("tr", {class: "row", onclick: f}, "text", node, [more]) -> an element.
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG, tag), attrs, children);
}

// Replace what `element` holds.
export function fill(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

// A value others can watch: the page's one reactive helper.
export function cell(value) {
  const watchers = new Set();
  return {
    get value() {
      return value;
    },
    set value(next) {
      value = next;
      for (const watcher of watchers) watcher(next);
    },
    watch(watcher) {
      watchers.add(watcher);
      watcher(value);
      return () => watchers.delete(watcher);
    },
  };
}

export function table(headings, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, headings.map((text) => h("th", {}, text)))),
    h("tbody", {}, rows),
  );
}

export function button(label, onclick, attrs = {}) {
  return h("button", { type: "button", ...attrs, onclick }, label);
}

// The answer of `work()` or its error, shown in `where`; `work` may return nodes to show.
export async function attempt(where, work) {
  fill(where);
  where.classList.remove("error");
  try {
    const shown = await work();
    if (shown !== undefined) fill(where, shown);
  } catch (error) {
    where.classList.add("error");
    fill(where, describeError(error));
  }
}

export function describeError(error) {
  const problem = error && error.problem;
  if (!problem) return String(error && error.message ? error.message : error);
  const lines = (problem.errors || []).map((e) =>
    h("li", {}, h("code", {}, e.pointer || "/"), " ", e.message || e.code, e.hint ? ` (${e.hint})` : ""),
  );
  const meta = problem.meta || {};
  const posts = (meta.dominant_posts || []).map((p) => `${p.post} ${(p.bytes / 2 ** 20).toFixed(1)} MiB`);
  const unlocks = (meta.unlocks || []).map((u) => `${u.path} = ${JSON.stringify(u.value)}`);
  return h(
    "div",
    {},
    h("strong", {}, problem.title || `HTTP ${error.status}`),
    ": ",
    problem.detail || "",
    lines.length ? h("ul", {}, lines) : null,
    posts.length ? h("p", {}, "largest: ", posts.join(", ")) : null,
    unlocks.length ? h("p", {}, "would fit with: ", unlocks.join(", ")) : null,
  );
}
