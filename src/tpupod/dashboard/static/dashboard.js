// tpupod dashboard: live updates over server-sent events, log follow, and the token for actions.
"use strict";
(() => {
  const KEY = "tpupod-dashboard-token";
  const say = (text) => { document.getElementById("action-result").textContent = text; };
  // `tpupod dashboard --open` passes the token in the fragment, which never reaches the
  // server; quoted there (URLSearchParams would read a base64 token's "+" as a space)
  function fragmentToken() {
    for (const part of location.hash.slice(1).split("&")) {
      if (!part.startsWith("token=")) continue;
      try { return decodeURIComponent(part.slice(6)); } catch (e) { return part.slice(6); }
    }
    return null;
  }
  // the token for a session cookie: every read of a dashboard bound beyond loopback needs
  // one (event streams cannot send a header), and actions from any tab can use it
  async function signIn(token) {
    sessionStorage.setItem(KEY, token);
    const r = await fetch("/api/session", { method: "POST", headers: { Authorization: "Bearer " + token } });
    return r.status;
  }
  const given = fragmentToken();
  if (given !== null) history.replaceState(null, "", location.pathname + location.search);
  const signin = document.getElementById("signin");
  if (signin) {  // a page that needs the token: trade it for the cookie, then load the page
    const attempt = async (token) => {
      const status = await signIn(token);
      if (status === 204) location.reload();
      else say(status === 401 ? "wrong token" : "could not sign in: " + status);
    };
    signin.addEventListener("submit", (e) => { e.preventDefault(); attempt(document.getElementById("signin-token").value); });
    if (given !== null) attempt(given);
    return;
  }
  if (given !== null) signIn(given);
  const tokenInput = document.getElementById("token");
  tokenInput.value = sessionStorage.getItem(KEY) || "";
  tokenInput.addEventListener("change", () => { if (tokenInput.value) signIn(tokenInput.value); });
  document.getElementById("token-form").addEventListener("submit", (e) => e.preventDefault());

  const content = document.getElementById("content");
  const topics = (document.body.dataset.topics || "").split(" ").filter(Boolean);
  let busy = false, again = false;
  async function refresh() {  // the page's live part, rendered again by the server
    if (busy) { again = true; return; }
    busy = true;
    try {
      const r = await fetch(location.href, { headers: { "X-Fragment": "1" } });
      if (r.ok) { content.innerHTML = await r.text(); content.dataset.updated = Date.now(); }
    } catch (e) { /* the next event tries again */ }
    busy = false;
    if (again) { again = false; refresh(); }
  }
  if (topics.length) {
    const events = new EventSource("/api/events");
    events.onmessage = (e) => { if (topics.includes(e.data)) refresh(); };
  }

  document.addEventListener("submit", async (e) => {
    const form = e.target;
    if (!form.hasAttribute("data-action")) return;
    e.preventDefault();
    const token = sessionStorage.getItem(KEY) || tokenInput.value;
    const headers = token ? { Authorization: "Bearer " + token } : {};  // else the cookie, if any
    const r = await fetch(form.action, { method: "POST", headers });
    const body = await r.json().catch(() => ({}));
    say(r.ok ? "done: " + form.action.split("/api/")[1] : r.status + ": " + (body.detail || r.statusText));
    if (r.ok) refresh();
  });

  const logs = document.querySelector("[data-follow]");
  if (logs) {
    const follow = new EventSource(logs.dataset.follow);
    follow.addEventListener("line", (e) => {
      const line = JSON.parse(e.data);
      const pre = logs.querySelector(`pre[data-worker="${line.worker}"]`) || logs.querySelector("pre");
      pre.append(line.line + "\n");
      while (pre.childNodes.length > 500) pre.firstChild.remove();
    });
    follow.addEventListener("end", () => { follow.close(); refresh(); });
  }
})();
