// The login screen, shown only when the server asks for a token (its auth_token is set).

import { api, setToken } from "../lib/api.js";
import { attempt, h } from "../lib/dom.js";

export function login(done) {
  const input = h("input", { type: "password", id: "token", autocomplete: "current-password", required: true });
  const remember = h("input", { type: "checkbox", id: "remember" });
  const message = h("p", { class: "message" });
  const form = h(
    "form",
    { class: "card login", id: "login" },
    h("h2", {}, "Sign in"),
    h("p", { class: "muted" }, "This server asks for its token (the auth_token of its configuration)."),
    h("label", {}, "Token ", input),
    h("label", { class: "inline" }, remember, " remember on this browser"),
    h("button", { type: "submit" }, "Sign in"),
    message,
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setToken(input.value.trim(), remember.checked);
    attempt(message, async () => {
      await api("/capabilities");
      done();
    });
  });
  setTimeout(() => input.focus(), 0);
  return form;
}
