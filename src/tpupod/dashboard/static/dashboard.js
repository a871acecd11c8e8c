// tpupod dashboard: live updates over server-sent events, logs followed, the token.
"use strict";
(() => {
  const KEY = "tpupod-dashboard-token";
  const say = (text) => { document.getElementById("action-result").textContent = text; };

  // -- the token --------------------------------------------------------------------------
  // `tpupod dashboard --open` passes it in the fragment, which never reaches the server;
  // quoted there (URLSearchParams would read a base64 token's "+" as a space)
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

  // -- the connection: shown when a stream is down (the browser reconnects by itself) --
  const connection = document.getElementById("connection");
  const down = new Set();
  function watch(source, onBack) {
    source.addEventListener("open", () => {
      const was = down.delete(source);
      connection.hidden = down.size === 0;
      if (was && onBack) onBack();
    });
    source.addEventListener("error", () => { down.add(source); connection.hidden = false; });
  }

  // -- the page's live part, rendered again by the server when its data changes ---------
  const content = document.getElementById("content");
  const topics = (document.body.dataset.topics || "").split(" ").filter(Boolean);
  let busy = false, again = false;
  async function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    try {
      const r = await fetch(location.href, { headers: { "X-Fragment": "1" } });
      if (r.ok) { content.innerHTML = await r.text(); content.dataset.updated = Date.now(); tick(); }
    } catch (e) { /* the next event tries again */ }
    busy = false;
    if (again) { again = false; refresh(); }
  }
  if (topics.length) {
    const events = new EventSource("/api/events");
    events.onmessage = (e) => { if (topics.includes(e.data)) refresh(); };
    watch(events, refresh);  // back after a gap: what changed meanwhile
  }

  // -- what still runs: its time so far, ticking ---------------------------------------
  function duration(seconds) {
    seconds = Math.max(0, seconds);
    if (seconds < 60) return seconds.toFixed(1) + " s";
    const pad = (n) => String(n).padStart(2, "0");
    let minutes = Math.floor(seconds / 60);
    if (minutes < 60) return minutes + " min " + pad(Math.floor(seconds % 60)) + " s";
    let hours = Math.floor(minutes / 60);
    minutes %= 60;
    if (hours < 48) return hours + " h " + pad(minutes) + " min";
    return Math.floor(hours / 24) + " d " + (hours % 24) + " h";
  }
  function tick() {
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll("[data-since]")) el.textContent = duration(now - Number(el.dataset.since));
  }
  setInterval(tick, 1000);

  // -- actions: confirmed, then sent with the token (or the session cookie) -------------
  document.addEventListener("submit", async (e) => {
    const form = e.target;
    if (!form.hasAttribute("data-action")) return;
    e.preventDefault();
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
    const token = sessionStorage.getItem(KEY) || tokenInput.value;
    const headers = token ? { Authorization: "Bearer " + token } : {};  // else the cookie, if any
    const button = form.querySelector("button");
    if (button) button.disabled = true;  // an action may take seconds (stacks: py-spy on every worker)
    say("working: " + form.action.split("/api/")[1]);
    let r, body;
    try {
      r = await fetch(form.action, { method: "POST", headers });
      body = await r.json().catch(() => ({}));
    } catch (err) {
      say("could not reach the dashboard: " + err);
      return;
    } finally {
      if (button) button.disabled = false;
    }
    const done = body.digest ? "stacks taken in " + body.seconds + " s, saved in " + body.saved : "done: " + form.action.split("/api/")[1];
    say(r.ok ? done : r.status + ": " + (body.detail || r.statusText));
    if (r.ok) refresh();
  });

  // -- logs: each pane keeps its last KEEP lines, follows the end unless scrolled up, and
  // shows only the lines that hold the search's text ------------------------------------
  const logs = document.querySelector("[data-follow]");
  if (!logs) return;
  const KEEP = 500;
  const panes = new Map();
  for (const pre of logs.querySelectorAll("pre.log")) {
    const pane = { lines: [], following: true };
    panes.set(pre, pane);
    pre.addEventListener("scroll", () => { pane.following = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4; });
  }
  const search = document.getElementById("log-search");
  const matches = document.getElementById("log-matches");
  let needle = "";
  function draw(pre) {
    const pane = panes.get(pre);
    const shown = needle ? pane.lines.filter((l) => l.toLowerCase().includes(needle)) : pane.lines;
    pre.textContent = shown.length ? shown.join("\n") + "\n" : "";
    if (pane.following) pre.scrollTop = pre.scrollHeight;
    return shown.length;
  }
  function drawAll() {
    let count = 0;
    for (const pre of panes.keys()) count += draw(pre);
    if (matches) matches.textContent = needle ? count + " matching line" + (count === 1 ? "" : "s") + " shown" : "";
  }
  if (search) search.addEventListener("input", () => { needle = search.value.toLowerCase(); drawAll(); });
  const paneOf = (worker) => logs.querySelector(`pre.log[data-worker="${worker}"]`) || logs.querySelector("pre.log");
  const follow = new EventSource(logs.dataset.follow);  // reconnects with the last batch's id
  watch(follow);
  follow.addEventListener("lines", (e) => {
    const batch = JSON.parse(e.data);
    const touched = new Set();
    for (const worker of batch.reset || []) { const pre = paneOf(worker); panes.get(pre).lines = []; touched.add(pre); }
    for (const [worker, line] of batch.lines) {
      const pre = paneOf(worker);
      panes.get(pre).lines.push(line);
      touched.add(pre);
    }
    for (const pre of touched) {
      const pane = panes.get(pre);
      if (pane.lines.length > KEEP) pane.lines.splice(0, pane.lines.length - KEEP);
    }
    if (needle) drawAll(); else touched.forEach(draw);
  });
  // each worker's step, steps/s and last progress, sent when they change
  const SOURCES = { heartbeat: "step", line: "line", start: "no output yet" };
  follow.addEventListener("progress", (e) => {
    for (const p of JSON.parse(e.data)) {
      const row = document.querySelector(`#run-workers tr[data-worker="${p.worker}"]`);
      if (!row) continue;
      row.querySelector("td.step").textContent = p.step === null ? "–" : p.step;
      row.querySelector("td.rate").textContent = p.steps_per_s === null ? "–" : p.steps_per_s.toFixed(2) + (p.stalled ? " (before)" : "");
      const cell = row.querySelector("td.progress");
      cell.classList.toggle("stalled", p.stalled);
      cell.title = p.text;
      const since = cell.querySelector("[data-since]");
      if (since) since.dataset.since = p.last_progress;
      const source = cell.querySelector(".source");
      if (source) source.textContent = SOURCES[p.source] || p.source;
    }
    tick();
  });
  follow.addEventListener("end", () => {
    follow.close();
    down.delete(follow);
    connection.hidden = down.size === 0;
    refresh();
  });
})();
