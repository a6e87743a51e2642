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
// Everything is rendered with textContent (never innerHTML), so provider text cannot inject
// markup. No framework, no build step, nothing loaded from elsewhere.
"use strict";
(function () {
  const ROW_KINDS = ["session", "turn", "message", "interaction", "toolCall",
    "cancelOperation", "sessionDeleted"];
  const PAGE = 1000;

  const app = {
    ws: null,          // workspace of the current view
    view: null,        // {kind: "sessions"|"session", ws, id?, root?}
    seq: null,         // highest outbox sequence applied (null: stream not started)
    es: null,          // the EventSource
    reconnectTimer: null,
    refreshTimer: null,
    refreshing: false,
    again: false,
    signedOut: false,
    msgs: new Map(),   // session id -> Map(seq -> message)
    closed: new Set(), // lanes the user collapsed
    notice: null,
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

  function setConn(state, text) {
    const c = document.getElementById("conn");
    c.dataset.state = state;
    c.textContent = text;
  }

  // Re-rendering keeps keyboard focus on the element with the same data-key.
  function replaceKeepingFocus(container, nodes) {
    const active = document.activeElement;
    const key = active && container.contains(active) ? active.dataset.key : null;
    container.replaceChildren(...nodes);
    if (key) {
      const again = container.querySelector(`[data-key="${CSS.escape(key)}"]`);
      if (again) again.focus();
    }
  }

  // Re-renders only when what the container shows changed (a click on a button that was just
  // replaced by an identical one would be lost).
  function replaceIfChanged(container, sig, build) {
    if (container.dataset.sig === sig) return;
    container.dataset.sig = sig;
    replaceKeepingFocus(container, build());
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
    document.getElementById("ws-input").value = r.ws;
    app.view = r;
    app.notice = null;
    app.deleteArmed = false;
    if (r.kind === "sessions") renderSessionsShell(r.ws);
    else renderSessionShell(r.ws, r.id);
    main().focus();
    await refresh();
  }

  // The code is in the fragment (never sent to the server); it leaves the URL before anything
  // else happens, and is exchanged for the HttpOnly cookie.
  async function login(code, ws) {
    const target = ws ? `#/w/${enc(ws)}` : "#/";
    history.replaceState(null, "", location.pathname + target);
    try {
      const r = await fetch("/login", {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ code }),
      });
      if (!r.ok) {
        showSignedOut("This login link is unknown or was already used.");
        return;
      }
    } catch (e) {
      showSignedOut("The daemon could not be reached to sign in.");
      return;
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
    const conn = document.getElementById("conn");
    conn.dataset.connects = String(Number(conn.dataset.connects || 0) + 1);
    let failed = false;
    for (const k of ROW_KINDS) es.addEventListener(k, onRow);
    es.addEventListener("reset", (e) => {
      // Retention deleted rows we never saw: reload everything shown.
      const n = Number(e.lastEventId);
      if (Number.isFinite(n)) app.seq = n;
      app.msgs.clear();
      schedule(0);
    });
    es.onopen = () => {
      app.failures = 0;
      setConn("live", "Live");
      if (app.wasDown) {
        app.wasDown = false;
        schedule(0);
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
    if (v.kind === "sessions" && row.workspaceId === v.ws) schedule();
    if (v.kind === "session" && v.root && row.rootAgentSessionId === v.root) schedule();
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

  function showError(e) {
    const box = document.getElementById("load-error");
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

  // ---- Sessions page -------------------------------------------------------------------

  function renderSessionsShell(ws) {
    main().replaceChildren(
      h("h1", { text: `Sessions in ${ws}` }),
      h("form", { class: "create", id: "create-form", onsubmit: onCreate },
        h("label", {}, "Provider", h("select", { id: "provider", name: "provider", required: true })),
        h("label", {}, "Title", h("input", { id: "title", name: "title", maxlength: "1000" })),
        h("button", { type: "submit", class: "primary", id: "create" }, "Create session")),
      h("p", { id: "notice", role: "status", "aria-live": "polite" }),
      h("p", { id: "load-error", class: "error", role: "alert" }),
      h("h2", { text: "Root sessions, newest first" }),
      h("ul", { class: "sessions", id: "sessions", "aria-live": "polite" }));
    api("GET", "/v1/providers").then((v) => {
      const sel = document.getElementById("provider");
      if (!sel) return;
      sel.replaceChildren(...(v.providers || []).map((p) => h("option", { value: p, text: p })));
    }).catch(() => {});
  }

  async function onCreate(ev) {
    ev.preventDefault();
    const provider = document.getElementById("provider").value;
    const title = document.getElementById("title").value.trim();
    const body = { provider };
    if (title) body.title = title;
    try {
      const v = await api("POST", `/v1/workspaces/${enc(app.ws)}/agent-sessions`, body);
      location.hash = `#/w/${enc(app.ws)}/s/${enc(v.session.id)}`;
    } catch (e) {
      document.getElementById("notice").textContent = `Create failed: ${e.message}`;
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
    const ul = document.getElementById("sessions");
    if (!ul) return;
    const items = roots.map((s, i) => {
      const st = rootState(s, details[i]);
      return h("li", { "data-session-id": s.id },
        h("a", { href: `#/w/${enc(v.ws)}/s/${enc(s.id)}`, "data-key": `open:${s.id}` }, s.title || s.id),
        h("span", { class: "meta", text: `provider: ${s.provider}` }),
        h("span", { class: "state", "data-state": st.key, text: st.label }));
    });
    if (items.length === 0) items.push(h("li", { class: "empty", text: "No sessions yet." }));
    if (more) {
      items.push(h("li", {}, h("button", { type: "button", id: "more", "data-key": "more",
        onclick: () => { v.pages = (v.pages || 1) + 1; schedule(0); } }, "Show more")));
    }
    replaceKeepingFocus(ul, items);
  }

  // Idle / running / waiting on N children, from the root turn and the children's own turns.
  function rootState(s, d) {
    if (!s.activeTurnId) return { key: "idle", label: "idle" };
    if (!d) return { key: "running", label: "● running" };
    const t = (d.turns || []).find((x) => x.id === s.activeTurnId);
    const n = activeChildren(d).length;
    const providerDone = t && t.rootProviderTurn && t.rootProviderTurn.phase === "completed";
    if (t && t.phase === "settling") return { key: "settling", label: "… canceling" };
    if (providerDone || (t && t.phase === "waiting")) {
      return { key: "waiting", label: `‖ waiting on ${plural(n, "child", "children")}` };
    }
    return { key: "running", label: n ? `● running (${plural(n, "child", "children")} active)` : "● running" };
  }

  function lastTurnOf(d, s) {
    return (d.turns || []).find((t) => t.id === s.lastTurnId) || null;
  }

  function activeChildren(d) {
    return (d.childSessions || []).filter((c) => {
      const t = lastTurnOf(d, c);
      return !t || t.phase !== "settled";
    });
  }

  // ---- Session page --------------------------------------------------------------------

  function renderSessionShell(ws, id) {
    main().replaceChildren(
      h("p", {}, h("a", { href: `#/w/${enc(ws)}`, text: `← Sessions in ${ws}` })),
      h("h1", { id: "session-title", text: id }),
      h("p", { class: "meta", id: "session-meta" }),
      h("p", { id: "load-error", class: "error", role: "alert" }),
      h("section", { "aria-labelledby": "turn-heading" },
        h("h2", { id: "turn-heading", text: "Root turn" }),
        h("p", { class: "root-status", id: "root-status", role: "status", "aria-live": "polite" }),
        h("div", { id: "root-interactions" }),
        h("div", { class: "actions", id: "actions" })),
      h("form", { id: "composer", onsubmit: onSubmit },
        h("label", { for: "composer-text", id: "composer-label", text: "Message" }),
        h("textarea", { id: "composer-text", name: "text", required: true }),
        h("div", { class: "actions" },
          h("button", { type: "submit", class: "primary", id: "send", text: "Send" }))),
      h("p", { id: "notice", class: "notice", role: "status", "aria-live": "polite", hidden: true }),
      h("section", { "aria-labelledby": "transcript-heading" },
        h("h2", { id: "transcript-heading", text: "Transcript" }),
        h("div", { id: "transcript" })));
  }

  function setNotice(text) {
    app.notice = text;
    const n = document.getElementById("notice");
    if (!n) return;
    n.textContent = text || "";
    n.hidden = !text;
  }

  async function loadMessages(ws, id) {
    let cache = app.msgs.get(id);
    if (!cache) { cache = new Map(); app.msgs.set(id, cache); }
    for (;;) {
      let max = -1;
      for (const k of cache.keys()) if (k > max) max = k;
      const after = max >= 0 ? `&after=${max}` : "";
      const v = await api("GET", `${sessionPath(ws, id)}/messages?limit=${PAGE}${after}`);
      const got = v.messages || [];
      for (const m of got) cache.set(m.seq, m); // keyed: a row seen twice is shown once
      if (got.length < PAGE) return;
    }
  }

  async function loadSession(v) {
    let d;
    try {
      d = await api("GET", sessionPath(v.ws, v.id));
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) {
        main().replaceChildren(h("h1", { text: "Session not found" }),
          h("p", { id: "gone", text: "It does not exist in this workspace, or it was deleted." }),
          h("p", {}, h("a", { href: `#/w/${enc(v.ws)}`, text: "Back to the sessions" })));
        app.view = { kind: "sessions-gone", ws: v.ws };
        return;
      }
      throw e;
    }
    v.root = d.session.rootAgentSessionId || d.session.id;
    startStream(d.eventSeq);
    const ids = [d.session.id, ...(d.childSessions || []).map((c) => c.id)];
    await Promise.all(ids.map((id) => loadMessages(v.ws, id)));
    if (app.view !== v) return;
    renderSession(v, d);
  }

  function renderSession(v, d) {
    const s = d.session;
    document.getElementById("session-title").textContent = s.title || s.id;
    document.getElementById("session-meta").textContent =
      `${s.kind} session · provider ${s.provider} · ${s.id}`;
    const err = document.getElementById("load-error");
    if (err) err.textContent = "";
    const ctx = context(v, d);
    const t = lastTurnOf(d, s);
    // Why the root turn is still active.
    const status = document.getElementById("root-status");
    const n = activeChildren(d).length;
    const st = document.createDocumentFragment();
    status.dataset.active = s.activeTurnId ? "true" : "false";
    let text;
    if (!s.activeTurnId) {
      status.dataset.state = "idle";
      text = t ? `Idle. The last turn ${t.outcome || t.phase}${t.error ? `: ${t.error}` : ""}.` : "Idle. No turn yet.";
    } else if (t && t.phase === "settling") {
      status.dataset.state = "settling";
      text = `Canceling: the cancel is settling; ${plural(n, "child is", "children are")} still active.`;
    } else if ((t && t.phase === "waiting") || (t && t.rootProviderTurn && t.rootProviderTurn.phase === "completed")) {
      status.dataset.state = "waiting";
      text = `Waiting: the root provider turn ended; ${plural(n, "child", "children")} still running.`;
    } else {
      status.dataset.state = "running";
      text = `Running: the root agent is working${n ? `; ${plural(n, "child", "children")} running` : ""}.`;
    }
    st.append(h("span", { class: "state", "data-state": status.dataset.state, text }));
    status.replaceChildren(st);
    const own = (ctx.pendingOf.get(s.id) || []).map((i) => [i.turnId, i.requestId]);
    replaceIfChanged(document.getElementById("root-interactions"), JSON.stringify(own),
      () => renderInteractions(ctx, s.id));
    // Actions.
    const actions = [];
    if (s.activeTurnId) {
      actions.push(h("button", { type: "button", id: "cancel", class: "danger", "data-key": "cancel",
        onclick: () => onCancel(v, s) }, "Cancel the root turn"));
    } else if (app.deleteArmed) {
      actions.push(h("button", { type: "button", id: "delete-confirm", class: "danger", "data-key": "delete-confirm",
        onclick: () => onDelete(v, s) }, "Yes, delete this session and its children"),
      h("button", { type: "button", id: "delete-cancel", "data-key": "delete-cancel",
        onclick: () => { app.deleteArmed = false; renderSession(v, d); } }, "Keep it"));
    } else {
      actions.push(h("button", { type: "button", id: "delete", "data-key": "delete",
        onclick: () => { app.deleteArmed = true; renderSession(v, d); } }, "Delete session"));
    }
    replaceIfChanged(document.getElementById("actions"),
      `${s.activeTurnId || ""}|${app.deleteArmed}`, () => actions);
    const guiding = Boolean(s.activeTurnId);
    document.getElementById("composer-label").textContent =
      guiding ? "Guidance for the running turn" : "Message";
    document.getElementById("send").textContent = guiding ? "Send guidance" : "Send";
    setNotice(app.notice);
    const shown = JSON.stringify([d.session, d.childSessions, d.turns, d.interactions,
      d.toolCalls, ids(ctx).map((id) => (app.msgs.get(id) || new Map()).size)]);
    replaceIfChanged(document.getElementById("transcript"), shown,
      () => [renderTranscript(ctx, s.id)]);
  }

  const ids = (ctx) => ctx.all.map((x) => x.id);

  function context(v, d) {
    const all = [d.session, ...(d.childSessions || [])];
    const childrenOf = new Map();
    for (const c of d.childSessions || []) {
      const p = c.parentAgentSessionId;
      if (!childrenOf.has(p)) childrenOf.set(p, []);
      childrenOf.get(p).push(c);
    }
    for (const list of childrenOf.values()) list.sort((a, b) => a.createdAt - b.createdAt);
    const toolsOf = new Map();
    for (const tc of d.toolCalls || []) {
      if (!toolsOf.has(tc.agentSessionId)) toolsOf.set(tc.agentSessionId, []);
      toolsOf.get(tc.agentSessionId).push(tc);
    }
    const pendingOf = new Map();
    for (const i of d.interactions || []) {
      if (i.status !== "pending") continue;
      if (!pendingOf.has(i.agentSessionId)) pendingOf.set(i.agentSessionId, []);
      pendingOf.get(i.agentSessionId).push(i);
    }
    return { v, d, all, childrenOf, toolsOf, pendingOf };
  }

  // A session's own rows (messages and tool calls, in time order); a tool call that spawned
  // children is a delegation card with their lanes under it.
  function renderTranscript(ctx, sid) {
    const msgs = [...(app.msgs.get(sid) || new Map()).values()].sort((a, b) => a.seq - b.seq);
    const tools = ctx.toolsOf.get(sid) || [];
    const kids = ctx.childrenOf.get(sid) || [];
    const rows = [
      ...msgs.map((m) => ({ at: m.createdAt, order: 0, seq: m.seq, m })),
      ...tools.map((tc) => ({ at: tc.createdAt, order: 1, seq: 0, tc })),
    ].sort((a, b) => a.at - b.at || a.order - b.order || a.seq - b.seq);
    const placed = new Set();
    const items = rows.map((r) => {
      if (r.m) {
        return h("li", {},
          h("div", { class: "msg", "data-role": r.m.role, "data-message-seq": r.m.seq },
            h("span", { class: "role", text: r.m.role }), r.m.text));
      }
      const tc = r.tc;
      const lanes = kids.filter((c) => c.parentToolCallId === tc.toolCallId);
      if (lanes.length === 0) {
        return h("li", { class: "tool", "data-tool-call-id": tc.toolCallId },
          h("span", { text: `Tool: ${tc.name || tc.toolCallId}` }), " — ",
          h("span", { class: "tool-status", text: tc.status }));
      }
      lanes.forEach((c) => placed.add(c.id));
      return h("li", {}, delegationCard(ctx, tc.name || tc.toolCallId, tc, lanes));
    });
    const rest = kids.filter((c) => !placed.has(c.id));
    if (rest.length) items.push(h("li", {}, delegationCard(ctx, "Delegated work", null, rest)));
    if (items.length === 0) items.push(h("li", { class: "empty", text: "Nothing yet." }));
    return h("ol", { class: "transcript", "data-session-id": sid }, items);
  }

  function delegationCard(ctx, name, tc, lanes) {
    const status = tc ? tc.status : "no tool call recorded";
    return h("section", { class: "card", "data-tool-call-id": tc ? tc.toolCallId : "",
      "aria-label": `Delegation: ${name}` },
    h("div", { class: "card-head" }, `⇢ ${name} `,
      h("span", { class: "tool-status", text: `(tool call: ${status})` }),
      h("span", { class: "note", text: " — each lane shows its child's own turn" })),
    h("div", { class: "lanes" }, lanes.map((c) => renderLane(ctx, c))));
  }

  function renderLane(ctx, c) {
    const t = lastTurnOf(ctx.d, c);
    const pending = ctx.pendingOf.get(c.id) || [];
    const st = turnState(t, pending.length);
    const lane = h("details", { class: "lane", "data-session-id": c.id, "data-state": st.key,
      open: !app.closed.has(c.id) },
    h("summary", { "data-key": `lane:${c.id}` },
      h("span", { class: "lane-title", text: c.title || "subagent" }),
      h("span", { class: "state", "data-state": st.key, text: st.label })),
    t && t.error ? h("p", { class: "lane-error", text: `Error: ${t.error}` }) : null,
    renderInteractions(ctx, c.id),
    h("p", { class: "meta" }, h("a", { href: `#/w/${enc(ctx.v.ws)}/s/${enc(c.id)}`,
      text: "Open this child session" })),
    renderTranscript(ctx, c.id));
    lane.addEventListener("toggle", () => {
      if (lane.open) app.closed.delete(c.id); else app.closed.add(c.id);
    });
    return lane;
  }

  // Pending interactions of one session, answered by their exact (session, turn, request).
  function renderInteractions(ctx, sid) {
    return (ctx.pendingOf.get(sid) || []).map((i) => {
      const p = i.payload || {};
      const what = (p.toolCall && (p.toolCall.title || p.toolCall.toolCallId)) || i.kind;
      const key = `${i.agentSessionId}|${i.turnId}|${i.requestId}`;
      const choices = Array.isArray(p.options) && p.options.length
        ? p.options.map((o) => ({ label: `${o.name || o.optionId} (${o.kind || "option"})`,
          id: o.optionId, response: { optionId: o.optionId } }))
        : [{ label: "Allow", id: "allow", response: "allow" }, { label: "Deny", id: "deny", response: "deny" }];
      return h("div", { class: "interaction", role: "group", "aria-label": `Request: ${what}`,
        "data-session-id": i.agentSessionId, "data-turn-id": i.turnId, "data-request-id": i.requestId },
      h("p", {}, h("strong", { text: `${i.kind === "permission" ? "Permission requested" : "Request"}: ` }), what),
      h("div", { class: "buttons" }, choices.map((ch) => h("button", {
        type: "button", "data-option-id": ch.id, "data-key": `${key}|${ch.id}`,
        onclick: (ev) => respond(i, ch.response, ev.currentTarget),
      }, ch.label))));
    });
  }

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
    schedule(0);
  }

  async function onSubmit(ev) {
    ev.preventDefault();
    const v = app.view;
    const box = document.getElementById("composer-text");
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
    schedule(0);
  }

  async function onCancel(v, s) {
    try {
      await api("POST", `${sessionPath(v.ws, s.id)}/turns/${enc(s.activeTurnId)}/cancel`);
      setNotice("Cancel requested: each lane shows canceled or interrupted as the cancel settles.");
    } catch (e) {
      setNotice(`Cancel refused: ${e.message}`);
    }
    schedule(0);
  }

  async function onDelete(v, s) {
    try {
      await api("DELETE", sessionPath(v.ws, s.id));
      for (const c of [s.id]) app.msgs.delete(c);
      location.hash = `#/w/${enc(v.ws)}`;
    } catch (e) {
      app.deleteArmed = false;
      setNotice(`Delete refused: ${e.message}`);
    }
  }

  // ---- Start ---------------------------------------------------------------------------

  document.getElementById("ws-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const ws = document.getElementById("ws-input").value.trim();
    if (ws) location.hash = `#/w/${enc(ws)}`;
  });
  window.addEventListener("hashchange", route);
  route();
})();
