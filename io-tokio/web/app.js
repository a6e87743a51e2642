// tutti web view: a live view of agent trees built only from the HTTP API and /v1/events.
//
// Spec (AgentGUI): "Root transcript rows remain root-only. Child-session rows are lanes or
// nested progress sections under the spawn/delegate card. Nested child sessions follow
// recorded parent/root fields rather than being flattened into the root transcript."
// "Spawn tool success means delegation was accepted, not that the child completed."
// "Child terminal state comes from its canonical child turn, not from the parent tool call
// status." "An interaction action routes by the exact child (agentSessionId, turnId,
// requestId) tuple."
//
// Issue 32, how the page stays usable while a tree works:
// - A session page reads its tree twice (the detail and `tree-messages`, bounded per session),
//   then applies the event rows themselves: every outbox row carries its whole entity, so a
//   change costs no request at all. Only a `reset`, a reconnect after a failure or an unknown
//   row kind reloads (the same two reads).
// - Rendering patches DOM nodes kept per entity (session lane, message, tool call,
//   interaction), keyed by id (`data-k`): a node is created once and updated in place, so a
//   button being pressed or holding focus is never replaced, and text changes only where it
//   changed. Scroll position stays.
//
// Everything is rendered with textContent (never innerHTML), so provider text cannot inject
// markup. No framework, no build step, nothing loaded from elsewhere.
"use strict";
(function () {
  const ROW_KINDS = ["session", "turn", "message", "interaction", "toolCall",
    "cancelOperation", "sessionDeleted", "sessionPurged", "redacted"];
  const PAGE = 1000;
  const TREE_PAGE = 200;
  const NOTICE_MS = 8000;

  const app = {
    ws: null,          // workspace of the current view
    view: null,        // {kind: "sessions"|"session", ws, id?, root?}
    seq: null,         // highest outbox sequence applied (null: stream not started)
    es: null,          // the EventSource
    live: false,       // the stream is open
    reconnectTimer: null,
    refreshTimer: null,
    renderQueued: false,
    refreshing: false,
    again: false,
    signedOut: false,
    tree: null,        // the session page's state (see emptyTree)
    loading: false,    // the session page is reading its tree
    buffer: [],        // rows that arrived meanwhile
    closed: new Set(), // lanes the user collapsed
    folded: new Set(), // lanes of earlier root turns folded once (the user may open them again)
    notice: null,
    noticeTimer: null,
    deleteArmed: false,
  };

  // ---- DOM helpers ---------------------------------------------------------------------

  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "class") el.className = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }
  const enc = encodeURIComponent;
  const main = () => document.getElementById("main");
  const byId = (id) => document.getElementById(id);

  function setText(el, text) {
    if (el && el.textContent !== text) el.textContent = text;
  }
  function setData(el, key, value) {
    if (!el) return;
    const v = value === null || value === undefined ? null : String(value);
    if (v === null) { if (key in el.dataset) delete el.dataset[key]; } else if (el.dataset[key] !== v) el.dataset[key] = v;
  }
  function show(el, visible) {
    if (el && el.hidden === visible) el.hidden = !visible;
  }

  // Keeps `parent`'s children equal to `items`, keyed by `data-k`: an existing node is
  // updated in place (never replaced), new ones are created, stale ones removed, and a node is
  // moved only when it is out of order (a focused or pressed control stays where it is).
  function sync(parent, items, key, make, update) {
    const have = new Map();
    for (const el of [...parent.children]) if (el.dataset.k !== undefined) have.set(el.dataset.k, el);
    const want = new Set();
    let prev = null;
    for (const it of items) {
      const k = key(it);
      want.add(k);
      let el = have.get(k);
      if (!el) { el = make(it); el.dataset.k = k; }
      update(el, it);
      const at = prev ? prev.nextSibling : parent.firstChild;
      if (el !== at) parent.insertBefore(el, at);
      prev = el;
    }
    for (const [k, el] of have) if (!want.has(k)) el.remove();
  }

  function setConn(state, text) {
    const c = byId("conn");
    c.dataset.state = state;
    c.textContent = text;
    app.live = state === "live";
    // Actions that need the daemon wait for the stream (issue 32: "Cancel/Send stay enabled
    // while disconnected").
    for (const el of document.querySelectorAll("[data-needs-live]")) el.disabled = !app.live;
  }

  // ---- API -----------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function api(method, path, body) {
    const init = { method, headers: {}, credentials: "same-origin" };
    if (body !== undefined) {
      init.headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    let v = null;
    try { v = await r.json(); } catch (_) { v = null; }
    if (!r.ok) {
      const e = (v && v.error) || {};
      if (r.status === 401) showSignedOut();
      throw new ApiError(r.status, e.code || "error", e.message || `HTTP ${r.status}`);
    }
    return v;
  }

  const sessionPath = (ws, id) => `/v1/workspaces/${enc(ws)}/agent-sessions/${enc(id)}`;

  // ---- Routing -------------------------------------------------------------------------

  function parseHash() {
    const hash = location.hash.replace(/^#/, "");
    if (hash.startsWith("login=")) {
      const p = new URLSearchParams(hash);
      return { kind: "login", code: p.get("login"), ws: p.get("ws") };
    }
    const parts = hash.split("/").filter(Boolean).map(decodeURIComponent);
    if (parts[0] === "w" && parts[1]) {
      if (parts[2] === "s" && parts[3]) return { kind: "session", ws: parts[1], id: parts[3] };
      return { kind: "sessions", ws: parts[1] };
    }
    return { kind: "sessions", ws: localStorage.getItem("tutti.ws") || "default" };
  }

  async function route() {
    const r = parseHash();
    if (r.kind === "login") return login(r.code, r.ws);
    app.ws = r.ws;
    localStorage.setItem("tutti.ws", r.ws);
    byId("ws-input").value = r.ws;
    app.view = r;
    app.tree = null;
    app.buffer = [];
    app.deleteArmed = false;
    setNotice(null);
    if (r.kind === "sessions") renderSessionsShell(r.ws);
    else renderSessionShell(r.ws, r.id);
    main().focus();
    await refresh();
  }

  // The code is in the fragment (never sent to the server); it leaves the URL before anything
  // else happens, and is exchanged for the HttpOnly cookie. A link used twice is refused, but
  // the cookie the first use set may still be good: then the page goes on signed in.
  async function login(code, ws) {
    const target = ws ? `#/w/${enc(ws)}` : "#/";
    history.replaceState(null, "", location.pathname + target);
    let ok = false;
    try {
      const r = await fetch("/login", {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ code }),
      });
      ok = r.ok;
    } catch (e) {
      showSignedOut("The daemon could not be reached to sign in.");
      return;
    }
    if (!ok) {
      const still = await fetch("/v1/providers", { credentials: "same-origin" })
        .then((r) => r.ok).catch(() => false);
      if (!still) {
        showSignedOut("This login link is unknown or was already used.");
        return;
      }
    }
    app.signedOut = false;
    await route();
  }

  function showSignedOut(why) {
    app.signedOut = true;
    if (app.es) { app.es.close(); app.es = null; }
    clearTimeout(app.reconnectTimer);
    setConn("signed-out", "Not signed in");
    main().replaceChildren(
      h("h1", { text: "Not signed in" }),
      h("p", { id: "signed-out", text: why || "This page has no valid login cookie." }),
      h("p", {}, "Open the one-time login link that ", h("code", { text: "tuttid" }),
        " printed when it started (a new one comes from ",
        h("code", { text: "POST /v1/login-links" }), " with the bearer token)."));
  }

  // ---- Event stream --------------------------------------------------------------------

  function startStream(eventSeq) {
    if (app.es || app.signedOut || typeof eventSeq !== "number") return;
    if (app.seq === null) app.seq = eventSeq;
    connect();
  }

  function connect() {
    clearTimeout(app.reconnectTimer);
    if (app.es) app.es.close();
    const es = new EventSource(`/v1/events?after=${app.seq}`);
    app.es = es;
    const conn = byId("conn");
    conn.dataset.connects = String(Number(conn.dataset.connects || 0) + 1);
    let failed = false;
    for (const k of ROW_KINDS) es.addEventListener(k, onRow);
    es.addEventListener("reset", (e) => {
      // Retention deleted rows we never saw: reload everything shown.
      const n = Number(e.lastEventId);
      if (Number.isFinite(n)) app.seq = n;
      reload();
    });
    es.onopen = () => {
      app.failures = 0;
      setConn("live", "Live");
      if (app.wasDown) {
        app.wasDown = false;
        reload();
      }
    };
    es.onerror = () => {
      if (failed) return;
      failed = true;
      es.close();
      if (app.es === es) app.es = null;
      app.wasDown = true;
      app.failures = (app.failures || 0) + 1;
      setConn("reconnecting", "Reconnecting…");
      // A stream refused for want of the cookie looks like any other failure: ask the API
      // (a 401 there shows the signed-out page and stops reconnecting).
      if (app.failures >= 3) api("GET", "/v1/providers").catch(() => {});
      // Resume after the last row applied (the same position Last-Event-ID would carry).
      const delay = Math.min(500 * 2 ** Math.min(app.failures - 1, 4), 5000);
      app.reconnectTimer = setTimeout(() => { if (!app.signedOut) connect(); }, delay);
    };
  }

  function onRow(e) {
    const seq = Number(e.lastEventId);
    if (Number.isFinite(seq)) {
      if (app.seq !== null && seq <= app.seq) return; // already applied
      app.seq = seq;
    }
    let row;
    try { row = JSON.parse(e.data); } catch (_) { return; }
    const v = app.view;
    if (!v) return;
    if (v.kind === "sessions" && row.workspaceId === v.ws) schedule(300);
    if (v.kind === "session") {
      // Rows that arrive while the page reads its tree wait for the read, then apply over it
      // (those the read already reflects are skipped by their seq).
      if (app.loading || !app.tree) { app.buffer.push(row); return; }
      if (row.rootAgentSessionId !== app.tree.root) return;
      if (!applyRow(app.tree, row)) reload();
      else queueRender();
    }
  }

  // A full read of what the page shows (after a reset, a reconnect, an unknown row).
  function reload() {
    if (app.tree) app.tree.stale = true;
    schedule(0);
  }

  function schedule(delay) {
    clearTimeout(app.refreshTimer);
    app.refreshTimer = setTimeout(refresh, delay === undefined ? 60 : delay);
  }

  async function refresh() {
    if (app.refreshing) { app.again = true; return; }
    app.refreshing = true;
    try {
      const v = app.view;
      if (v && v.kind === "sessions") await loadSessions(v);
      else if (v && v.kind === "session") await loadSession(v);
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 401)) showError(e);
    } finally {
      app.refreshing = false;
      if (app.again) { app.again = false; schedule(0); }
    }
  }

  function queueRender() {
    if (app.renderQueued) return;
    app.renderQueued = true;
    requestAnimationFrame(() => {
      app.renderQueued = false;
      if (app.view && app.view.kind === "session" && app.tree) renderSession(app.view, app.tree);
    });
  }

  function showError(e) {
    const box = byId("load-error");
    if (box) box.textContent = `Could not load: ${e.message}`;
  }

  // ---- State words (never colour alone) ------------------------------------------------

  function turnState(t, pending) {
    if (!t) return { key: "submitted", label: "○ starting" };
    if (t.phase === "settled") {
      const o = t.outcome || "settled";
      const sym = { completed: "✓", failed: "✗", canceled: "⊘", interrupted: "⚠" }[o] || "•";
      return { key: o, label: `${sym} ${o}` };
    }
    if (pending > 0) return { key: "waiting", label: "‖ waiting for your answer" };
    const words = {
      submitted: ["submitted", "○ starting"], running: ["running", "● running"],
      waiting: ["waiting", "‖ waiting"], settling: ["settling", "… settling"],
    };
    const [key, label] = words[t.phase] || [t.phase, t.phase];
    return { key, label };
  }

  const plural = (n, one, many) => `${n} ${n === 1 ? one : many}`;

  // A session's token use as the provider reported it (`usage`: contextTokens, contextWindow,
  // totalTokens, cost), or "" when it reported none.
  function usageText(u) {
    if (!u) return "";
    const n = (x) => (x >= 1e6 ? `${+(x / 1e6).toFixed(1)}M` : x >= 1e4 ? `${+(x / 1e3).toFixed(1)}k` : `${x}`);
    const parts = [];
    if (u.totalTokens != null) parts.push(`${n(u.totalTokens)} tokens`);
    if (u.contextTokens != null) {
      parts.push(u.contextWindow ? `${n(u.contextTokens)} of ${n(u.contextWindow)} context` : `${n(u.contextTokens)} in context`);
    }
    if (u.cost) parts.push(`${u.cost.currency} ${u.cost.amount.toFixed(4)}`);
    return parts.join(" · ");
  }

  function duration(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m ${s % 60}s`;
    return `${Math.floor(m / 60)}h ${m % 60}m`;
  }
  const clock = (ms) => new Date(ms).toLocaleTimeString();

  // ---- Notices -------------------------------------------------------------------------

  // A notice says what the last action did; it clears itself (issue 32: "notices never
  // clear").
  function setNotice(text) {
    app.notice = text;
    clearTimeout(app.noticeTimer);
    const n = byId("notice");
    if (n) {
      n.textContent = text || "";
      n.hidden = !text;
    }
    if (text) app.noticeTimer = setTimeout(() => setNotice(null), NOTICE_MS);
  }

  // ---- Sessions page -------------------------------------------------------------------

  function renderSessionsShell(ws) {
    main().replaceChildren(
      h("h1", { text: `Sessions in ${ws}` }),
      h("form", { class: "create", id: "create-form", onsubmit: onCreate },
        h("label", {}, "Provider", h("select", { id: "provider", name: "provider", required: true })),
        h("label", {}, "Title", h("input", { id: "title", name: "title", maxlength: "1000" })),
        h("button", { type: "submit", class: "primary", id: "create" }, "Create session")),
      h("p", { id: "notice", class: "notice", role: "status", "aria-live": "polite", hidden: true }),
      h("p", { id: "load-error", class: "error", role: "alert" }),
      h("h2", { text: "Root sessions, newest first" }),
      h("ul", { class: "sessions", id: "sessions" }));
    api("GET", "/v1/providers").then((v) => {
      const sel = byId("provider");
      if (!sel) return;
      sel.replaceChildren(...(v.providers || []).map((p) => h("option", { value: p, text: p })));
    }).catch(() => {});
  }

  async function onCreate(ev) {
    ev.preventDefault();
    const provider = byId("provider").value;
    const title = byId("title").value.trim();
    const body = { provider };
    if (title) body.title = title;
    try {
      const v = await api("POST", `/v1/workspaces/${enc(app.ws)}/agent-sessions`, body);
      location.hash = `#/w/${enc(app.ws)}/s/${enc(v.session.id)}`;
    } catch (e) {
      setNotice(`Create failed: ${e.message}`);
    }
  }

  async function loadSessions(v) {
    // Newest first, as the API pages them; "Show more" adds pages.
    let roots = [];
    let cursor = null;
    let more = false;
    for (let page = 0; page < (v.pages || 1); page += 1) {
      const q = cursor ? `&cursor=${enc(cursor)}` : "";
      const list = await api("GET", `/v1/workspaces/${enc(v.ws)}/agent-sessions?limit=50${q}`);
      if (page === 0) startStream(list.eventSeq);
      roots = roots.concat(list.sessions || []);
      cursor = list.nextCursor;
      more = Boolean(cursor);
      if (!cursor) break;
    }
    // The state of an active root needs its turn and children (one detail read each).
    const details = await Promise.all(roots.map((s) => s.activeTurnId
      ? api("GET", sessionPath(v.ws, s.id)).catch(() => null) : Promise.resolve(null)));
    if (app.view !== v) return;
    const ul = byId("sessions");
    if (!ul) return;
    const items = roots.map((s, i) => ({ s, st: rootState(s, details[i]) }));
    if (items.length === 0) items.push({ empty: true });
    if (more) items.push({ more: true });
    sync(ul, items, (it) => it.empty ? "empty" : it.more ? "more" : `s:${it.s.id}`,
      (it) => {
        if (it.empty) return h("li", { class: "empty", text: "No sessions yet." });
        if (it.more) {
          return h("li", {}, h("button", { type: "button", id: "more",
            onclick: () => { v.pages = (v.pages || 1) + 1; schedule(0); } }, "Show more"));
        }
        return h("li", { "data-session-id": it.s.id },
          h("a", { href: `#/w/${enc(v.ws)}/s/${enc(it.s.id)}` }),
          h("span", { class: "meta" }), h("span", { class: "state" }));
      },
      (el, it) => {
        if (!it.s) return;
        setText(el.querySelector("a"), it.s.title || it.s.id);
        setText(el.querySelector(".meta"), `provider: ${it.s.provider}`);
        const st = el.querySelector(".state");
        setData(st, "state", it.st.key);
        setText(st, it.st.label);
      });
  }

  // Idle / running / waiting on N children / waiting for your answer, from the root turn, the
  // children's own turns and the tree's pending interactions.
  function rootState(s, d) {
    if (!s.activeTurnId) return { key: "idle", label: "idle" };
    if (!d) return { key: "running", label: "● running" };
    const t = (d.turns || []).find((x) => x.id === s.activeTurnId);
    const n = (d.childSessions || []).filter((c) => c.parentAgentSessionId === s.id
      && isActive((d.turns || []).find((x) => x.id === c.lastTurnId))).length;
    const asks = (d.interactions || []).filter((i) => i.status === "pending").length;
    if (t && t.phase === "settling") return { key: "settling", label: "… canceling" };
    if (asks > 0) return { key: "input", label: "‖ waiting for your answer" };
    const providerDone = t && t.rootProviderTurn && t.rootProviderTurn.phase === "completed";
    if (providerDone || (t && t.phase === "waiting")) {
      return { key: "waiting", label: `‖ waiting on ${plural(n, "child", "children")}` };
    }
    return { key: "running", label: n ? `● running (${plural(n, "child", "children")} active)` : "● running" };
  }

  const isActive = (t) => !t || t.phase !== "settled";

  // ---- Session page: state -------------------------------------------------------------

  function emptyTree(id) {
    return {
      id,                  // the viewed session
      root: null,          // its tree's root
      sessions: new Map(), // id -> session (the viewed one and its nested children)
      turns: new Map(),    // turn id -> turn
      tools: new Map(),    // "session|toolCallId" -> tool call
      asks: new Map(),     // "session|turn|request" -> interaction
      msgs: new Map(),     // session id -> Map(seq -> message)
      more: new Map(),     // session id -> true when messages beyond those loaded exist
      stale: false,
    };
  }

  function fill(tree, d, tm) {
    tree.root = d.session.rootAgentSessionId || d.session.id;
    tree.sessions.clear();
    tree.turns.clear();
    tree.tools.clear();
    tree.asks.clear();
    for (const s of [d.session, ...(d.childSessions || [])]) tree.sessions.set(s.id, s);
    for (const t of d.turns || []) tree.turns.set(t.id, t);
    for (const tc of d.toolCalls || []) tree.tools.set(`${tc.agentSessionId}|${tc.toolCallId}`, tc);
    for (const i of d.interactions || []) tree.asks.set(`${i.agentSessionId}|${i.turnId}|${i.requestId}`, i);
    for (const x of tm.sessions || []) {
      let m = tree.msgs.get(x.agentSessionId);
      if (!m) { m = new Map(); tree.msgs.set(x.agentSessionId, m); }
      for (const msg of x.messages || []) m.set(msg.seq, msg);
      tree.more.set(x.agentSessionId, Boolean(x.more));
    }
    tree.stale = false;
  }

  // Whether a session id belongs to what this page shows (the viewed session's subtree).
  function inView(tree, s) {
    return s.id === tree.id || tree.sessions.has(s.parentAgentSessionId);
  }

  function dropSubtree(tree, id) {
    const gone = [id];
    for (let i = 0; i < gone.length; i += 1) {
      for (const s of tree.sessions.values()) if (s.parentAgentSessionId === gone[i]) gone.push(s.id);
    }
    for (const g of gone) {
      tree.sessions.delete(g);
      tree.msgs.delete(g);
    }
  }

  // Applies one outbox row (its payload is the whole entity). False: the page cannot apply it
  // and must reload.
  function applyRow(tree, row) {
    const p = row.payload || {};
    switch (row.kind) {
      case "session":
        if (tree.sessions.has(p.id) || inView(tree, p)) tree.sessions.set(p.id, p);
        return true;
      case "sessionDeleted":
        if (p.id === tree.id) { tree.deleted = true; return true; }
        dropSubtree(tree, p.id);
        return true;
      case "turn":
        if (tree.sessions.has(p.agentSessionId)) tree.turns.set(p.id, p);
        return true;
      case "message": {
        if (!tree.sessions.has(p.agentSessionId)) return true;
        let m = tree.msgs.get(p.agentSessionId);
        if (!m) { m = new Map(); tree.msgs.set(p.agentSessionId, m); }
        m.set(p.seq, p); // keyed: a row seen twice is shown once
        return true;
      }
      case "toolCall":
        if (tree.sessions.has(p.agentSessionId)) tree.tools.set(`${p.agentSessionId}|${p.toolCallId}`, p);
        return true;
      case "interaction":
        if (tree.sessions.has(p.agentSessionId)) tree.asks.set(`${p.agentSessionId}|${p.turnId}|${p.requestId}`, p);
        return true;
      case "sessionPurged":
        if (p.agentSessionId === tree.id) { tree.deleted = true; return true; }
        dropSubtree(tree, p.agentSessionId);
        return true;
      case "cancelOperation":
      case "redacted":
        return true;
      default:
        return false;
    }
  }

  // ---- Session page: reads -------------------------------------------------------------

  async function loadSession(v) {
    let d;
    let tm;
    app.loading = true;
    try {
      d = await api("GET", sessionPath(v.ws, v.id));
      tm = await api("GET", `${sessionPath(v.ws, v.id)}/tree-messages?limit=${TREE_PAGE}`);
    } catch (e) {
      app.loading = false;
      app.buffer = [];
      // The page may have moved on while this read was in flight (a delete navigates to the
      // sessions list, and the read of the deleted tree answers 404): never draw over it.
      if (app.view !== v) return;
      if (e instanceof ApiError && e.status === 404) return showGone(v);
      throw e;
    }
    app.loading = false;
    const waiting = app.buffer;
    app.buffer = [];
    if (app.view !== v) return;
    if (!app.tree || app.tree.id !== v.id) app.tree = emptyTree(v.id);
    fill(app.tree, d, tm);
    v.root = app.tree.root;
    for (const row of waiting) {
      if (row.seq > d.eventSeq && row.rootAgentSessionId === app.tree.root && !applyRow(app.tree, row)) {
        reload();
      }
    }
    startStream(d.eventSeq);
    renderSession(v, app.tree);
  }

  function showGone(v) {
    main().replaceChildren(h("h1", { text: "Session not found" }),
      h("p", { id: "gone", text: "It does not exist in this workspace, or it was deleted." }),
      h("p", {}, h("a", { href: `#/w/${enc(v.ws)}`, text: "Back to the sessions" })));
    app.view = { kind: "sessions-gone", ws: v.ws };
    app.tree = null;
  }

  // The next page of one session's messages (a lane with more than the first page).
  async function loadMore(ws, sid) {
    const tree = app.tree;
    if (!tree) return;
    const m = tree.msgs.get(sid) || new Map();
    let max = -1;
    for (const k of m.keys()) if (k > max) max = k;
    const after = max >= 0 ? `&after=${max}` : "";
    const v = await api("GET", `${sessionPath(ws, sid)}/messages?limit=${PAGE}${after}`);
    for (const msg of v.messages || []) m.set(msg.seq, msg);
    tree.msgs.set(sid, m);
    tree.more.set(sid, (v.messages || []).length >= PAGE);
    queueRender();
  }

  // ---- Session page: rendering ---------------------------------------------------------

  function renderSessionShell(ws, id) {
    main().replaceChildren(
      h("nav", { class: "breadcrumb", id: "breadcrumb", "aria-label": "Breadcrumb" },
        h("a", { href: `#/w/${enc(ws)}`, text: `← Sessions in ${ws}`, "data-k": "list", id: "crumb-list" })),
      h("h1", { id: "session-title", text: id }),
      h("p", { class: "meta", id: "session-meta" }),
      h("p", { id: "load-error", class: "error", role: "alert" }),
      h("section", { class: "overview", id: "overview", "aria-label": "Overview" },
        h("p", { class: "counts", id: "overview-counts" }),
        h("ul", { class: "jumps", id: "overview-jumps" }),
        h("div", { class: "actions" },
          h("button", { type: "button", id: "expand-all", onclick: () => setAllLanes(true) }, "Expand all"),
          h("button", { type: "button", id: "collapse-all", onclick: () => setAllLanes(false) }, "Collapse all"))),
      h("section", { "aria-labelledby": "turn-heading" },
        h("h2", { id: "turn-heading", text: "Root turn" }),
        h("p", { class: "root-status", id: "root-status", role: "status" }),
        h("div", { id: "root-interactions" }),
        h("div", { class: "actions", id: "actions" })),
      h("form", { id: "composer", onsubmit: onSubmit },
        h("label", { for: "composer-text", id: "composer-label", text: "Message" }),
        h("textarea", { id: "composer-text", name: "text", required: true }),
        h("div", { class: "actions" },
          h("button", { type: "submit", class: "primary", id: "send", text: "Send", "data-needs-live": true, disabled: !app.live }))),
      h("p", { id: "notice", class: "notice", role: "status", "aria-live": "polite", hidden: true }),
      h("section", { "aria-labelledby": "transcript-heading" },
        h("h2", { id: "transcript-heading", text: "Transcript" }),
        h("div", { id: "transcript" }, h("ol", { class: "transcript", "data-session-id": id }))));
  }

  function ctxOf(v, tree) {
    const childrenOf = new Map();
    for (const c of tree.sessions.values()) {
      if (!c.parentAgentSessionId || !tree.sessions.has(c.parentAgentSessionId)) continue;
      if (!childrenOf.has(c.parentAgentSessionId)) childrenOf.set(c.parentAgentSessionId, []);
      childrenOf.get(c.parentAgentSessionId).push(c);
    }
    for (const list of childrenOf.values()) list.sort((a, b) => a.createdAt - b.createdAt || (a.id < b.id ? -1 : 1));
    const toolsOf = new Map();
    for (const tc of tree.tools.values()) {
      if (!toolsOf.has(tc.agentSessionId)) toolsOf.set(tc.agentSessionId, []);
      toolsOf.get(tc.agentSessionId).push(tc);
    }
    const pendingOf = new Map();
    for (const i of tree.asks.values()) {
      if (i.status !== "pending") continue;
      if (!pendingOf.has(i.agentSessionId)) pendingOf.set(i.agentSessionId, []);
      pendingOf.get(i.agentSessionId).push(i);
    }
    const lastTurn = (s) => (s && s.lastTurnId ? tree.turns.get(s.lastTurnId) || null : null);
    return { v, tree, childrenOf, toolsOf, pendingOf, lastTurn };
  }

  function renderSession(v, tree) {
    if (tree.deleted) return showGone(v);
    const s = tree.sessions.get(tree.id);
    if (!s) return;
    const ctx = ctxOf(v, tree);
    const isChild = s.kind === "child";
    setText(byId("session-title"), s.title || s.id);
    const used = usageText(s.usage);
    setText(byId("session-meta"), `${s.kind} session · provider ${s.provider} · ${s.id}${used ? ` · ${used}` : ""}`);
    setText(byId("load-error"), "");
    renderBreadcrumb(v, s);
    setText(byId("turn-heading"), isChild ? "This child's turn" : "Root turn");
    const t = ctx.lastTurn(s);
    renderStatus(ctx, s, t);
    renderOverview(ctx, s);
    syncInteractions(ctx, byId("root-interactions"), s.id);
    renderActions(v, ctx, s, t);
    // A child takes no message from the user: the daemon refuses it.
    show(byId("composer"), !isChild);
    const guiding = Boolean(s.activeTurnId);
    setText(byId("composer-label"), guiding ? "Guidance for the running turn" : "Message");
    setText(byId("send"), guiding ? "Send guidance" : "Send");
    const ol = byId("transcript").querySelector("ol.transcript");
    syncTranscript(ctx, ol, s.id);
  }

  function renderBreadcrumb(v, s) {
    const nav = byId("breadcrumb");
    const items = [{ k: "list", href: `#/w/${enc(v.ws)}`, text: `← Sessions in ${v.ws}` }];
    if (s.kind === "child") {
      items.push({ k: "root", href: `#/w/${enc(v.ws)}/s/${enc(s.rootAgentSessionId)}`, text: "Root session" });
      if (s.parentAgentSessionId !== s.rootAgentSessionId) {
        items.push({ k: "parent", href: `#/w/${enc(v.ws)}/s/${enc(s.parentAgentSessionId)}`, text: "Parent session" });
      }
    }
    sync(nav, items, (it) => it.k, (it) => h("a", { href: it.href, id: `crumb-${it.k}` }),
      (el, it) => { setText(el, it.text); if (el.getAttribute("href") !== it.href) el.setAttribute("href", it.href); });
  }

  // Why the viewed turn is still active; "waiting for your answer" when anything in the tree
  // asks.
  function renderStatus(ctx, s, t) {
    const status = byId("root-status");
    const kids = ctx.childrenOf.get(s.id) || [];
    const n = kids.filter((c) => isActive(ctx.lastTurn(c))).length;
    const nested = [...ctx.tree.sessions.values()].filter((c) => c.id !== s.id
      && c.parentAgentSessionId !== s.id && isActive(ctx.lastTurn(c))).length;
    const more = nested ? ` (and ${nested} nested)` : "";
    const asks = [...ctx.pendingOf.values()].reduce((a, l) => a + l.length, 0);
    let state;
    let text;
    if (!s.activeTurnId) {
      state = "idle";
      text = t ? `Idle. The last turn ${t.outcome || t.phase}${t.error ? `: ${t.error}` : ""}.` : "Idle. No turn yet.";
    } else if (t && t.phase === "settling") {
      state = "settling";
      text = `Canceling: the cancel is settling; ${plural(n, "child is", "children are")} still active${more}.`;
    } else if (asks > 0) {
      state = "input";
      text = `Waiting for your answer: ${plural(asks, "request", "requests")} below; ${plural(n, "child", "children")} active${more}.`;
    } else if ((t && t.phase === "waiting") || (t && t.rootProviderTurn && t.rootProviderTurn.phase === "completed")) {
      state = "waiting";
      text = `Waiting: the root provider turn ended; ${plural(n, "child", "children")} still running${more}.`;
    } else {
      state = "running";
      text = `Running: the ${s.kind === "child" ? "child" : "root"} agent is working${n ? `; ${plural(n, "child", "children")} running` : ""}${more}.`;
    }
    setData(status, "active", s.activeTurnId ? "true" : "false");
    setData(status, "state", state);
    let span = status.querySelector("span.state");
    if (!span) { span = h("span", { class: "state" }); status.replaceChildren(span); }
    setData(span, "state", state);
    setText(span, text);
  }

  // Counts of the lanes by state, and jump links to the lanes that need the user or failed.
  function renderOverview(ctx, s) {
    const lanes = [...ctx.tree.sessions.values()].filter((c) => c.id !== s.id);
    const count = { running: 0, input: 0, failed: 0, done: 0, stopped: 0 };
    const jumps = [];
    for (const c of lanes) {
      const t = ctx.lastTurn(c);
      const asks = (ctx.pendingOf.get(c.id) || []).length;
      if (asks > 0) { count.input += 1; jumps.push({ c, why: "waiting for you" }); } else if (isActive(t)) count.running += 1;
      else if (t.outcome === "completed") count.done += 1;
      else if (t.outcome === "failed") { count.failed += 1; jumps.push({ c, why: "failed" }); } else count.stopped += 1;
    }
    const box = byId("overview");
    show(box, lanes.length > 0);
    const counts = byId("overview-counts");
    setData(counts, "running", count.running);
    setData(counts, "input", count.input);
    setData(counts, "failed", count.failed);
    setData(counts, "done", count.done);
    setText(counts, `${plural(lanes.length, "child session", "child sessions")}: ${count.running} running · `
      + `${count.input} waiting for you · ${count.failed} failed · ${count.done} done`
      + (count.stopped ? ` · ${count.stopped} canceled or interrupted` : ""));
    sync(byId("overview-jumps"), jumps, (j) => `${j.why}:${j.c.id}`,
      (j) => h("li", {}, h("button", { type: "button", class: "jump", "data-jump": j.c.id,
        onclick: () => jumpTo(j.c.id) })),
      (el, j) => setText(el.querySelector("button"), `${j.why}: ${j.c.title || "subagent"}`));
  }

  function jumpTo(id) {
    const lane = [...document.querySelectorAll("details.lane")].find((e) => e.dataset.sessionId === id);
    if (!lane) return;
    for (let p = lane; p; p = p.parentElement && p.parentElement.closest("details.lane")) {
      p.open = true;
    }
    lane.scrollIntoView({ block: "start" });
    const target = lane.querySelector(".interaction button") || lane.querySelector("summary");
    if (target) target.focus();
  }

  function setAllLanes(open) {
    for (const l of document.querySelectorAll("details.lane")) {
      l.open = open;
      const id = l.dataset.sessionId;
      if (open) app.closed.delete(id); else app.closed.add(id);
    }
  }

  function renderActions(v, ctx, s, t) {
    const items = [];
    if (s.activeTurnId) {
      items.push({ k: "cancel", label: s.kind === "child" ? "Cancel this child's turn" : "Cancel the root turn",
        cls: "danger", on: () => onCancel(v, s), live: true });
    } else if (s.kind === "child") {
      // A child is deleted with its root: deleting it alone would turn the parent's delegation
      // card back into a plain tool row.
    } else if (app.deleteArmed) {
      items.push({ k: "delete-confirm", label: "Yes, delete this session and its children", cls: "danger",
        on: () => onDelete(v, s), live: true });
      items.push({ k: "delete-cancel", label: "Keep it", on: () => { app.deleteArmed = false; queueRender(); } });
    } else {
      items.push({ k: "delete", label: "Delete session",
        on: () => { app.deleteArmed = true; queueRender(); } });
    }
    sync(byId("actions"), items, (it) => it.k,
      (it) => h("button", { type: "button", id: it.k, class: it.cls || null,
        "data-needs-live": it.live || null, disabled: it.live && !app.live, onclick: () => it.on() }),
      (el, it) => setText(el, it.label));
  }

  // A session's own rows (messages and tool calls, in time order); a tool call that spawned
  // children is a delegation card with their lanes under it.
  function syncTranscript(ctx, ol, sid) {
    const msgs = [...(ctx.tree.msgs.get(sid) || new Map()).values()];
    const tools = ctx.toolsOf.get(sid) || [];
    const kids = ctx.childrenOf.get(sid) || [];
    const rows = [
      ...msgs.map((m) => ({ at: m.createdAt, order: 0, seq: m.seq, m })),
      ...tools.map((tc) => ({ at: tc.createdAt, order: 1, seq: 0, tc, id: tc.toolCallId })),
    ].sort((a, b) => a.at - b.at || a.order - b.order || a.seq - b.seq || (a.id < b.id ? -1 : 1));
    const placed = new Set();
    const items = rows.map((r) => {
      if (r.m) return { k: `m:${r.m.seq}`, m: r.m };
      const lanes = kids.filter((c) => c.parentToolCallId === r.tc.toolCallId);
      lanes.forEach((c) => placed.add(c.id));
      return { k: `t:${r.tc.toolCallId}`, tc: r.tc, lanes };
    });
    const rest = kids.filter((c) => !placed.has(c.id));
    if (ctx.tree.more.get(sid)) items.push({ k: "more", more: sid });
    if (rest.length) items.push({ k: "rest", tc: null, lanes: rest });
    if (items.length === 0) items.push({ k: "empty", empty: true });
    sync(ol, items, (it) => it.k, (it) => {
      if (it.m) {
        return h("li", {}, h("div", { class: "msg", "data-role": it.m.role, "data-message-seq": it.m.seq },
          h("span", { class: "role", text: it.m.role }), h("span", { class: "text" })));
      }
      if (it.empty) return h("li", { class: "empty", text: "Nothing yet." });
      if (it.more) {
        return h("li", {}, h("button", { type: "button", class: "load-more",
          onclick: () => loadMore(ctx.v.ws, it.more).catch((e) => setNotice(`Could not load: ${e.message}`)) },
        "Load more messages"));
      }
      return h("li", {});
    }, (el, it) => {
      if (it.m) { setText(el.querySelector(".text"), it.m.text); return; }
      if (it.empty || it.more) return;
      updateToolRow(ctx, el, it.tc, it.lanes);
    });
  }

  // A tool call row: a plain tool (opens to show what the provider sent) or, when it spawned
  // children, a delegation card with their lanes.
  function updateToolRow(ctx, li, tc, lanes) {
    const kind = lanes.length ? "card" : "tool";
    if (li.dataset.kind !== kind) {
      li.dataset.kind = kind;
      li.className = kind === "tool" ? "tool" : "";
      if (kind === "tool") {
        li.replaceChildren(h("details", { class: "tool-details" },
          h("summary", {}, h("span", { class: "tool-name" }), " — ", h("span", { class: "tool-status" })),
          h("pre", { class: "tool-payload" })));
      } else {
        li.replaceChildren(h("section", { class: "card" },
          h("div", { class: "card-head" }, h("span", { class: "card-name" }), " ",
            h("span", { class: "tool-status" }),
            h("span", { class: "note", text: " — each lane shows its child's own turn" })),
          h("div", { class: "lanes" })));
      }
    }
    if (kind === "tool") {
      setData(li, "toolCallId", tc.toolCallId);
      setText(li.querySelector(".tool-name"), `Tool: ${tc.name || tc.toolCallId}`);
      setText(li.querySelector(".tool-status"), tc.status);
      const detail = { kind: tc.kind, payload: tc.payload };
      const shown = tc.kind === undefined && tc.payload === undefined ? "The provider sent no details."
        : JSON.stringify(detail, null, 2);
      setText(li.querySelector(".tool-payload"), shown);
      return;
    }
    const card = li.querySelector("section.card");
    const name = tc ? (tc.name || tc.toolCallId) : "Delegated work";
    setData(card, "toolCallId", tc ? tc.toolCallId : "");
    if (card.getAttribute("aria-label") !== `Delegation: ${name}`) card.setAttribute("aria-label", `Delegation: ${name}`);
    setText(card.querySelector(".card-name"), `⇢ ${name}`);
    setText(card.querySelector(".tool-status"), `(tool call: ${tc ? tc.status : "no tool call recorded"})`);
    sync(card.querySelector(".lanes"), lanes, (c) => `lane:${c.id}`, (c) => makeLane(ctx, c),
      (el, c) => updateLane(ctx, el, c));
  }

  function makeLane(ctx, c) {
    const lane = h("details", { class: "lane", "data-session-id": c.id, id: `lane-${c.id}` },
      h("summary", {},
        h("span", { class: "lane-title" }),
        h("span", { class: "state" }),
        h("span", { class: "lane-meta meta" }, h("span", { class: "elapsed" }), h("span", { class: "counts" }),
          h("span", { class: "usage" })),
        h("span", { class: "lane-summary meta" })),
      h("p", { class: "lane-error", hidden: true }),
      h("div", { class: "lane-interactions" }),
      h("p", { class: "meta lane-actions" },
        h("a", { href: `#/w/${enc(ctx.v.ws)}/s/${enc(c.id)}`, text: "Open this child session" }),
        " ",
        h("button", { type: "button", class: "lane-cancel danger", "data-needs-live": true, disabled: !app.live,
          onclick: () => onCancelChild(c.id) }, "Cancel this child")),
      h("ol", { class: "transcript", "data-session-id": c.id }));
    lane.open = !app.closed.has(c.id);
    lane.addEventListener("toggle", () => {
      if (lane.open) app.closed.delete(c.id); else app.closed.add(c.id);
    });
    return lane;
  }

  // A settled lane of an earlier root turn folds once ("old turns fold"); opened again by the
  // user, it stays open.
  function foldIfOld(ctx, lane, c, t) {
    const root = ctx.tree.sessions.get(ctx.tree.root);
    const old = Boolean(root && c.rootTurnId && c.rootTurnId !== root.lastTurnId && !isActive(t));
    if (old && !app.folded.has(c.id)) {
      app.folded.add(c.id);
      lane.open = false;
    }
  }

  function updateLane(ctx, lane, c) {
    const t = ctx.lastTurn(c);
    const pending = ctx.pendingOf.get(c.id) || [];
    const st = turnState(t, pending.length);
    foldIfOld(ctx, lane, c, t);
    setData(lane, "state", st.key);
    setText(lane.querySelector(".lane-title"), c.title || "subagent");
    const s = lane.querySelector("summary > .state");
    setData(s, "state", st.key);
    setText(s, st.label);
    const el = lane.querySelector(".elapsed");
    if (t) {
      setData(el, "since", isActive(t) ? t.createdAt : null);
      setText(el, isActive(t) ? `started ${clock(t.createdAt)} · ${duration(Date.now() - t.createdAt)}`
        : `took ${duration(t.updatedAt - t.createdAt)}`);
    }
    const msgs = ctx.tree.msgs.get(c.id) || new Map();
    const tools = ctx.toolsOf.get(c.id) || [];
    const kids = ctx.childrenOf.get(c.id) || [];
    setText(lane.querySelector(".counts"), ` · ${plural(msgs.size, "message", "messages")} · `
      + `${plural(tools.length, "tool call", "tool calls")}${kids.length ? ` · ${plural(kids.length, "child", "children")}` : ""}`);
    const used = usageText(c.usage);
    const usage = lane.querySelector(".usage");
    setData(usage, "tokens", c.usage ? (c.usage.totalTokens ?? c.usage.contextTokens ?? null) : null);
    setText(usage, used ? ` · ${used}` : "");
    // One line for a folded lane: its current tool, else its latest message.
    const open = tools.filter((x) => !["completed", "failed", "interrupted", "canceled", "cancelled"].includes(x.status));
    let last = null;
    for (const m of msgs.values()) if (!last || m.seq > last.seq) last = m;
    const line = open.length ? `working: ${open[open.length - 1].name || open[open.length - 1].toolCallId}`
      : last ? last.text.replace(/\s+/g, " ").slice(0, 120) : "";
    setText(lane.querySelector(".lane-summary"), line);
    const err = lane.querySelector(".lane-error");
    show(err, Boolean(t && t.error));
    setText(err, t && t.error ? `Error: ${t.error}` : "");
    syncInteractions(ctx, lane.querySelector(".lane-interactions"), c.id);
    show(lane.querySelector(".lane-cancel"), Boolean(c.activeTurnId) && !(t && t.phase === "settling"));
    syncTranscript(ctx, lane.querySelector("ol.transcript"), c.id);
  }

  // Pending interactions of one session, answered by their exact (session, turn, request).
  function syncInteractions(ctx, box, sid) {
    const list = ctx.pendingOf.get(sid) || [];
    sync(box, list, (i) => `${i.agentSessionId}|${i.turnId}|${i.requestId}`, (i) => {
      const p = i.payload || {};
      const what = (p.toolCall && (p.toolCall.title || p.toolCall.toolCallId)) || i.kind;
      const choices = Array.isArray(p.options) && p.options.length
        ? p.options.map((o) => ({ label: `${o.name || o.optionId} (${o.kind || "option"})`,
          id: o.optionId, response: { optionId: o.optionId } }))
        : [{ label: "Allow", id: "allow", response: "allow" }, { label: "Deny", id: "deny", response: "deny" }];
      return h("div", { class: "interaction", role: "group", "aria-label": `Request: ${what}`,
        "data-session-id": i.agentSessionId, "data-turn-id": i.turnId, "data-request-id": i.requestId },
      h("p", {}, h("strong", { text: `${i.kind === "permission" ? "Permission requested" : "Request"}: ` }), what),
      h("div", { class: "buttons" }, choices.map((ch) => h("button", {
        type: "button", "data-option-id": ch.id,
        onclick: (ev) => respond(i, ch.response, ev.currentTarget),
      }, ch.label))));
    }, () => {});
  }

  // Live elapsed times: only the text of running lanes' clocks changes.
  setInterval(() => {
    for (const el of document.querySelectorAll(".elapsed[data-since]")) {
      const since = Number(el.dataset.since);
      setText(el, `started ${clock(since)} · ${duration(Date.now() - since)}`);
    }
  }, 1000);

  // ---- Actions -------------------------------------------------------------------------

  async function respond(i, response, button) {
    button.disabled = true;
    const path = `${sessionPath(app.ws, i.agentSessionId)}/turns/${enc(i.turnId)}/interactions/${enc(i.requestId)}`;
    try {
      await api("POST", path, { response });
      setNotice("Answer sent.");
    } catch (e) {
      button.disabled = false;
      setNotice(`Answer refused: ${e.message}`);
    }
  }

  async function onSubmit(ev) {
    ev.preventDefault();
    const v = app.view;
    const box = byId("composer-text");
    const text = box.value;
    if (!text.trim()) return;
    try {
      const r = await api("POST", `${sessionPath(v.ws, v.id)}/submit`, { text });
      box.value = "";
      const words = {
        started: "Started a new turn.",
        appended: "Appended to the running turn as guidance.",
        pendingUnsupported: "Pending: this provider cannot take guidance now; the text is kept on the running turn.",
      };
      setNotice(words[r.reply] || r.reply);
    } catch (e) {
      setNotice(`Submit refused: ${e.message}`);
    }
  }

  async function onCancel(v, s) {
    try {
      await api("POST", `${sessionPath(v.ws, s.id)}/turns/${enc(s.activeTurnId)}/cancel`);
      setNotice(s.kind === "child" ? "Cancel requested for this child."
        : "Cancel requested: each lane shows canceled or interrupted as the cancel settles.");
    } catch (e) {
      setNotice(`Cancel refused: ${e.message}`);
    }
  }

  // The API's child-only cancel: that child's active turn, nothing else.
  async function onCancelChild(id) {
    const c = app.tree && app.tree.sessions.get(id);
    if (!c || !c.activeTurnId) return;
    try {
      await api("POST", `${sessionPath(app.ws, id)}/turns/${enc(c.activeTurnId)}/cancel`);
      setNotice(`Cancel requested for ${c.title || "the child"}.`);
    } catch (e) {
      setNotice(`Cancel refused: ${e.message}`);
    }
  }

  async function onDelete(v, s) {
    try {
      await api("DELETE", sessionPath(v.ws, s.id));
      location.hash = `#/w/${enc(v.ws)}`;
    } catch (e) {
      app.deleteArmed = false;
      setNotice(`Delete refused: ${e.message}`);
      queueRender();
    }
  }

  // ---- Start ---------------------------------------------------------------------------

  byId("ws-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const ws = byId("ws-input").value.trim();
    if (ws) location.hash = `#/w/${enc(ws)}`;
  });
  // The skip link moves focus to the content without touching the router's hash.
  const skip = document.querySelector("a.skip");
  if (skip) {
    skip.addEventListener("click", (ev) => {
      ev.preventDefault();
      main().focus();
    });
  }
  window.addEventListener("hashchange", route);
  route();
})();
