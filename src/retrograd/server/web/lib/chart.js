// Line charts drawn as SVG by hand: one chart, a few named series of (x, y) points.

import { h, s, fill } from "./dom.js";

const W = 560;
const H = 220;
const PAD = { left: 56, right: 12, top: 12, bottom: 28 };
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed"];

function label(value) {
  if (!Number.isFinite(value)) return "";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 0.01 || abs >= 100000)) return value.toExponential(1);
  return String(Number(value.toPrecision(4)));
}

// lineChart("loss", ["train", "eval"]) -> {element, add(series, x, y), count()}.
export function lineChart(title, names) {
  const series = new Map(names.map((name) => [name, []]));
  const plot = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img", "aria-label": title });
  const legend = h("div", { class: "legend" });
  const element = h("figure", { class: "chart", "data-points": "0" }, h("figcaption", {}, title), plot, legend);
  let pending = false;

  function draw() {
    pending = false;
    const all = [...series.values()].flat();
    element.dataset.points = String(all.length);
    if (!all.length) {
      fill(plot, s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no points yet"));
      fill(legend);
      return;
    }
    const xs = all.map((p) => p[0]);
    const ys = all.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    if (y0 === y1) [y0, y1] = [y0 - 1, y1 + 1];
    const px = (x) => PAD.left + ((x - x0) / (x1 - x0)) * (W - PAD.left - PAD.right);
    const py = (y) => H - PAD.bottom - ((y - y0) / (y1 - y0)) * (H - PAD.top - PAD.bottom);
    const parts = [
      s("line", { x1: PAD.left, y1: H - PAD.bottom, x2: W - PAD.right, y2: H - PAD.bottom, class: "axis" }),
      s("line", { x1: PAD.left, y1: PAD.top, x2: PAD.left, y2: H - PAD.bottom, class: "axis" }),
    ];
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      parts.push(s("text", { x: PAD.left - 6, y: py(y) + 4, "text-anchor": "end", class: "tick" }, label(y)));
    }
    for (const x of [x0, x1]) {
      parts.push(s("text", { x: px(x), y: H - 8, "text-anchor": "middle", class: "tick" }, label(x)));
    }
    let index = 0;
    const keys = [];
    for (const [name, points] of series) {
      const color = COLORS[index++ % COLORS.length];
      if (!points.length) continue;
      keys.push(h("span", { style: `color: ${color}` }, `● ${name} (${label(points.at(-1)[1])})`));
      const path = points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
      parts.push(s("polyline", { points: path, fill: "none", stroke: color, "stroke-width": 1.5 }));
      if (points.length <= 200) {
        for (const [x, y] of points) {
          parts.push(s("circle", { cx: px(x).toFixed(1), cy: py(y).toFixed(1), r: 2.2, fill: color }, s("title", {}, `${name} ${x}: ${label(y)}`)));
        }
      }
    }
    parts.push(s("text", { x: (W + PAD.left) / 2, y: H - 8, "text-anchor": "middle", class: "tick" }, "step"));
    fill(plot, parts);
    fill(legend, keys);
  }

  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(draw);
  }

  draw();
  return {
    element,
    add(name, x, y) {
      if (!Number.isFinite(x) || !Number.isFinite(y)) return;
      const points = series.get(name);
      const last = points.at(-1);
      if (last && last[0] === x) points[points.length - 1] = [x, y];
      else points.push([x, y]);
      element.dataset.points = String(this.count()); // at once; the drawing waits for a frame
      schedule();
    },
    count() {
      return [...series.values()].reduce((n, p) => n + p.length, 0);
    },
  };
}
