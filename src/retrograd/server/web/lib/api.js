// The server's /v1 routes: the bearer token, problem documents, and event streams read with
// fetch() (EventSource cannot send a header), one path whether or not the server has a token.

const KEY = "retrograd-token";
const listeners = new Set();

export function token() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY);
}

export function setToken(value, remember) {
  forgetToken();
  (remember ? localStorage : sessionStorage).setItem(KEY, value);
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
}

// `listener()` runs when the server answers 401: the page shows its login screen.
export function onUnauthorized(listener) {
  listeners.add(listener);
}

export class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

function headers(extra) {
  const out = { ...(extra || {}) };
  const t = token();
  if (t) out.Authorization = `Bearer ${t}`;
  return out;
}

export function url(path, query) {
  const u = new URL(`v1${path}`, document.baseURI);
  for (const [k, v] of Object.entries(query || {})) {
    if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, v);
  }
  return u.toString();
}

// api("/runs", {method: "POST", json: {...}}) -> the answer's JSON (null for 204).
// `body` with `type` sends other bodies (TOML, an uploaded file).
export async function api(path, { method = "GET", json, body, type, query, signal } = {}) {
  const extra = {};
  if (json !== undefined) {
    extra["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (type) {
    extra["Content-Type"] = type;
  }
  const response = await fetch(url(path, query), { method, body, headers: headers(extra), signal });
  if (response.status === 401) for (const listener of listeners) listener();
  if (response.status === 204) return null;
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = { detail: text };
  }
  if (!response.ok) throw new ApiError(response.status, data && data.error ? { detail: data.error.message } : data);
  return data;
}

// The frames of one SSE response: {id, event, data}, data parsed as JSON.
export async function* frames(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const frame = { id: null, event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") frame.data += (frame.data ? "\n" : "") + text;
        else if (field === "event") frame.event = text;
        else if (field === "id") frame.id = text;
      }
      if (!frame.data) continue;
      try {
        frame.data = JSON.parse(frame.data);
      } catch {
        continue;
      }
      yield frame;
    }
  }
}

// Follow a run's events from `since` until `terminal` (or `signal` aborts): `onEvent(event)`
// for each. A lagged stream or a dropped connection continues from the last seq seen.
export async function follow(runId, onEvent, signal, since = 0) {
  while (!signal.aborted) {
    try {
      const response = await fetch(url(`/runs/${encodeURIComponent(runId)}/events`, { since }), {
        headers: headers({ Accept: "text/event-stream" }),
        signal,
      });
      if (response.status === 401) for (const listener of listeners) listener();
      if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
      for await (const frame of frames(response)) {
        if (frame.event === "lagged") {
          since = frame.data.since;
          break;
        }
        since = frame.data.seq;
        onEvent(frame.data);
        if (frame.event === "terminal") return;
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && error.status < 500) throw error;
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}
