// tpupod dashboard: live updates over server-sent events, log follow, and the token for actions.
"use strict";
(() => {
  const KEY = "tpupod-dashboard-token";
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("token")) {  // `tpupod dashboard --open` passes it here, never to the server
    sessionStorage.setItem(KEY, hash.get("token"));
    history.replaceState(null, "", location.pathname + location.search);
  }
  const tokenInput = document.getElementById("token");
  tokenInput.value = sessionStorage.getItem(KEY) || "";
  tokenInput.addEventListener("change", () => sessionStorage.setItem(KEY, tokenInput.value));
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

  const say = (text) => { document.getElementById("action-result").textContent = text; };
  document.addEventListener("submit", async (e) => {
    const form = e.target;
    if (!form.hasAttribute("data-action")) return;
    e.preventDefault();
    const token = sessionStorage.getItem(KEY) || tokenInput.value;
    const r = await fetch(form.action, { method: "POST", headers: { Authorization: "Bearer " + token } });
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
