// A small tuttid client typed by the TypeScript that openapi-typescript generates from
// GET /v1/openapi.json (issue 31). The test (tests/tests/openapi.rs) generates ./api.ts,
// type-checks this file with tsc (strict) and runs it with node against a live daemon.
import type { components, paths } from "./api";

type Session = components["schemas"]["WorkspaceAgentSession"];
type Turn = components["schemas"]["WorkspaceAgentTurn"];
type OutboxRow = components["schemas"]["OutboxRow"];
type CreateBody =
  paths["/v1/workspaces/{ws}/agent-sessions"]["post"]["requestBody"]["content"]["application/json"];
type Created =
  paths["/v1/workspaces/{ws}/agent-sessions"]["post"]["responses"]["201"]["content"]["application/json"];
type SubmitBody =
  paths["/v1/workspaces/{ws}/agent-sessions/{id}/submit"]["post"]["requestBody"]["content"]["application/json"];
type Submitted =
  paths["/v1/workspaces/{ws}/agent-sessions/{id}/submit"]["post"]["responses"]["200"]["content"]["application/json"];
type Detail =
  paths["/v1/workspaces/{ws}/agent-sessions/{id}"]["get"]["responses"]["200"]["content"]["application/json"];
type ApiError = components["schemas"]["ErrorEnvelope"];

declare const process: { env: Record<string, string | undefined>; exit(code: number): never };

const base = process.env.TUTTI_URL ?? "http://127.0.0.1:7777";
const headers = { authorization: `Bearer ${process.env.TUTTI_TOKEN ?? ""}` };

async function call<T>(method: string, path: string, body?: unknown): Promise<T> {
  const res = await fetch(base + path, {
    method,
    headers: body === undefined ? headers : { ...headers, "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const json: unknown = await res.json();
  if (!res.ok) {
    const e = json as ApiError;
    throw new Error(`${method} ${path}: ${res.status} ${e.error.code}: ${e.error.message}`);
  }
  return json as T;
}

/** Reads `n` rows of the event stream after `after` (each `data:` is one OutboxRow). */
async function follow(after: number, n: number): Promise<OutboxRow[]> {
  const res = await fetch(`${base}/v1/events?after=${after}`, { headers });
  if (!res.body) throw new Error("no event stream");
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  const rows: OutboxRow[] = [];
  let buffer = "";
  while (rows.length < n) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end: number;
    while ((end = buffer.indexOf("\n\n")) >= 0 && rows.length < n) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data:")) rows.push(JSON.parse(line.slice(5)) as OutboxRow);
      }
    }
  }
  await reader.cancel();
  return rows;
}

const lastTurn = (d: Detail, s: Session): Turn | undefined =>
  d.turns.find((t) => t.id === s.lastTurnId);

async function main(): Promise<void> {
  const ws = "ts";
  const create: CreateBody = { provider: "demo", title: "from TypeScript" };
  const { session } = await call<Created>("POST", `/v1/workspaces/${ws}/agent-sessions`, create);
  if (!session) throw new Error("no session");
  const submit: SubmitBody = { text: "children=2 permission=0 fail=0 late=0" };
  const sent = await call<Submitted>(
    "POST", `/v1/workspaces/${ws}/agent-sessions/${session.id}/submit`, submit);
  let detail: Detail;
  for (;;) {
    detail = await call<Detail>("GET", `/v1/workspaces/${ws}/agent-sessions/${session.id}`);
    if (lastTurn(detail, detail.session)?.phase === "settled") break;
    await new Promise((r) => setTimeout(r, 50));
  }
  const children = detail.childSessions.map((c) => ({
    id: c.id, kind: c.kind, parent: c.parentAgentSessionId, outcome: lastTurn(detail, c)?.outcome,
  }));
  const rows = await follow(0, 5);
  console.log(JSON.stringify({
    session: session.id, reply: sent.reply, turnId: sent.turnId,
    outcome: lastTurn(detail, detail.session)?.outcome, children,
    rows: rows.map((r) => ({ seq: r.seq, kind: r.kind })),
  }));
}

main().catch((e: unknown) => {
  console.error(String(e));
  process.exit(1);
});
