// tutti Claude sidecar: a thin JSON-lines relay around the Claude Agent SDK.
//
// stdin  (one JSON object a line):
//   {"op":"start","requestId"?,"prompt":string,"message"?:SDKUserMessage,"hooks"?:[HookEvent],
//    "options":{cwd, model?, env?, permissionMode?, settingSources?, persistSession?, ...}}
//   {"op":"input","text":string}            or {"op":"input","message":SDKUserMessage}
//   {"op":"interrupt"}
//   {"op":"stopTask","taskId":string}
//   {"op":"permission","requestId":string,"behavior":"allow"|"deny",
//    "message"?,"updatedInput"?,"updatedPermissions"?,"interrupt"?}
//   {"op":"endInput"}                       ends the streaming prompt (the query may then finish)
//   {"op":"close"}                          closes the query and exits the sidecar
// stdin EOF, SIGTERM and SIGINT close the same way.
// Any command may carry "id"; it is echoed in its ack (as are "requestId" and "taskId").
// One query runs at a time; after its "exited" line a new "start" is accepted.
// "options" are passed to query() as given (env replaces the CLI's environment); the sidecar adds
// canUseTool, hooks (for the events in "hooks", default DEFAULT_HOOKS below) and an stderr sink.
//
// stdout (one JSON object a line):
//   {"kind":"ready","sdkVersion":string}    once, at startup
//   {"kind":"message","message":SDKMessage} every SDK message, verbatim
//   {"kind":"canUseTool","requestId","toolName","input","toolUseID","agentID","options"}
//   {"kind":"canUseToolCancelled","requestId"} the SDK aborted a pending callback
//   {"kind":"hook","event","input","toolUseID"}
//   {"kind":"ack","op","ok",("error"),("id"),("requestId"),("taskId"),("result")}
//   {"kind":"exited",("error")}             the query ended
//
// The sidecar holds no lifecycle policy: it relays. stderr carries diagnostics with ids and lengths
// only, never prompt or message content (TUTTI_SIDECAR_TRACE=1 adds one line per relayed SDK
// message with its type/subtype/status/origin; TUTTI_SIDECAR_CLI_STDERR=1 passes the CLI's own
// stderr through).

import { createInterface } from 'node:readline';
import { randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { query } from '@anthropic-ai/claude-agent-sdk';

const DEFAULT_HOOKS = [
  'SubagentStart',
  'SubagentStop',
  'TaskCreated',
  'TaskCompleted',
  'PreToolUse',
  'PostToolUse',
  'PostToolUseFailure',
  'PermissionRequest',
  'PermissionDenied',
  'Notification',
  'Stop',
  'StopFailure',
];

const CLI_STDERR = process.env.TUTTI_SIDECAR_CLI_STDERR === '1';
// TUTTI_SIDECAR_TRACE=1: one stderr line per relayed SDK message with its shape only (type,
// subtype, status, origin kind, whether it is scoped to a subagent), never its content.
const TRACE = process.env.TUTTI_SIDECAR_TRACE === '1';

function shape(m) {
  const parts = [`type=${m?.type ?? '-'}`];
  if (typeof m?.subtype === 'string') parts.push(`subtype=${m.subtype}`);
  const status = m?.status ?? m?.patch?.status;
  if (typeof status === 'string') parts.push(`status=${status}`);
  if (typeof m?.origin?.kind === 'string') parts.push(`origin=${m.origin.kind}`);
  if (typeof m?.task_id === 'string') parts.push(`task=${m.task_id}`);
  parts.push(`scope=${typeof m?.parent_tool_use_id === 'string' ? 'subagent' : 'root'}`);
  return parts.join(' ');
}

function sdkVersion() {
  try {
    const url = new URL('./node_modules/@anthropic-ai/claude-agent-sdk/package.json', import.meta.url);
    return JSON.parse(readFileSync(url, 'utf8')).version ?? null;
  } catch {
    return null;
  }
}

function emit(obj) {
  let line;
  try {
    line = JSON.stringify(obj);
  } catch (e) {
    line = JSON.stringify({ kind: 'ack', op: obj?.op ?? null, ok: false, error: `unserializable output: ${e?.message}` });
  }
  process.stdout.write(line + '\n');
}

function log(msg) {
  process.stderr.write(`[claude-sidecar] ${msg}\n`);
}

function errText(e) {
  return (e && (e.message || String(e))) || 'unknown error';
}

// A push-driven async iterable used as the query's streaming prompt.
class InputQueue {
  constructor() {
    this.items = [];
    this.waiters = [];
    this.ended = false;
  }
  push(item) {
    if (this.ended) return false;
    const w = this.waiters.shift();
    if (w) w({ value: item, done: false });
    else this.items.push(item);
    return true;
  }
  end() {
    this.ended = true;
    for (const w of this.waiters.splice(0)) w({ value: undefined, done: true });
  }
  [Symbol.asyncIterator]() {
    return {
      next: () => {
        if (this.items.length) return Promise.resolve({ value: this.items.shift(), done: false });
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((r) => this.waiters.push(r));
      },
      return: () => {
        this.end();
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}

function userMessage(cmd, textKey) {
  if (cmd.message && typeof cmd.message === 'object') return cmd.message;
  const text = cmd[textKey];
  if (typeof text !== 'string') return null;
  return { type: 'user', message: { role: 'user', content: text }, parent_tool_use_id: null, session_id: '' };
}

let current = null; // { q, input, done }
const pendingPermissions = new Map(); // requestId -> { resolve, input }
let permSeq = 0;

function startQuery(cmd) {
  if (current && !current.done) throw new Error('a query is already running');
  const first = userMessage(cmd, 'prompt');
  if (!first) throw new Error('start needs "prompt" (string) or "message" (object)');
  const given = cmd.options ?? {};
  if (typeof given !== 'object' || Array.isArray(given)) throw new Error('"options" must be an object');
  const hookNames = Array.isArray(cmd.hooks) ? cmd.hooks : DEFAULT_HOOKS;

  const input = new InputQueue();
  input.push(first);

  const hooks = {};
  for (const event of hookNames) {
    if (typeof event !== 'string') continue;
    hooks[event] = [
      {
        hooks: [
          async (hookInput, toolUseID) => {
            emit({ kind: 'hook', event, input: hookInput, toolUseID: toolUseID ?? null });
            return {};
          },
        ],
      },
    ];
  }

  const canUseTool = (toolName, toolInput, opts) =>
    new Promise((resolve) => {
      const { signal, ...rest } = opts ?? {};
      let requestId = typeof rest.requestId === 'string' && rest.requestId ? rest.requestId : null;
      if (!requestId || pendingPermissions.has(requestId)) requestId = `perm-${++permSeq}-${randomUUID()}`;
      pendingPermissions.set(requestId, { resolve, input: toolInput });
      log(`canUseTool requestId=${requestId} tool=${toolName} agent=${rest.agentID ?? '-'} toolUse=${rest.toolUseID ?? '-'}`);
      if (signal) {
        const onAbort = () => {
          if (pendingPermissions.delete(requestId)) {
            emit({ kind: 'canUseToolCancelled', requestId });
            resolve({ behavior: 'deny', message: 'aborted' });
          }
        };
        if (signal.aborted) {
          queueMicrotask(onAbort);
        } else {
          signal.addEventListener('abort', onAbort, { once: true });
        }
      }
      emit({
        kind: 'canUseTool',
        requestId,
        toolName,
        input: toolInput,
        toolUseID: rest.toolUseID ?? null,
        agentID: rest.agentID ?? null,
        options: rest,
      });
    });

  const options = {
    ...given,
    canUseTool,
    hooks,
    stderr: (data) => {
      if (CLI_STDERR) process.stderr.write(data);
      else log(`cli stderr ${String(data).length} bytes`);
    },
  };

  const q = query({ prompt: input, options });
  const state = { q, input, done: false };
  current = state;
  log(`query started requestId=${cmd.requestId ?? '-'} promptLength=${JSON.stringify(first.message?.content ?? '').length}`);

  (async () => {
    let error;
    try {
      for await (const m of q) {
        if (TRACE) log(`message ${shape(m)}`);
        emit({ kind: 'message', message: m });
      }
    } catch (e) {
      error = errText(e);
      log(`query error: ${error.length} chars`);
    }
    state.done = true;
    input.end();
    for (const [id, p] of pendingPermissions) {
      pendingPermissions.delete(id);
      p.resolve({ behavior: 'deny', message: 'query ended' });
    }
    emit(error === undefined ? { kind: 'exited' } : { kind: 'exited', error });
    log('query exited');
  })();
}

function ack(cmd, ok, extra = {}) {
  const out = { kind: 'ack', op: typeof cmd?.op === 'string' ? cmd.op : null, ok };
  if (cmd && cmd.id !== undefined) out.id = cmd.id;
  if (cmd && typeof cmd.requestId === 'string') out.requestId = cmd.requestId;
  if (cmd && typeof cmd.taskId === 'string') out.taskId = cmd.taskId;
  emit({ ...out, ...extra });
}

function needQuery() {
  if (!current || current.done) throw new Error('no running query');
  return current;
}

let closing = false;
function shutdown(code = 0) {
  if (closing) return;
  closing = true;
  try {
    if (current && !current.done) {
      current.input.end();
      current.q.close();
    }
  } catch (e) {
    log(`close failed: ${errText(e).length} chars`);
  }
  // Let the relay loop emit its "exited" line, then leave.
  const deadline = Date.now() + 3000;
  const wait = () => {
    if (!current || current.done || Date.now() > deadline) process.exit(code);
    else setTimeout(wait, 20);
  };
  wait();
}

async function handle(cmd) {
  if (TRACE) log(`command op=${typeof cmd.op === 'string' ? cmd.op : '-'} id=${typeof cmd.id === 'string' ? cmd.id : '-'}`);
  switch (cmd.op) {
    case 'start':
      startQuery(cmd);
      return ack(cmd, true);
    case 'input': {
      const st = needQuery();
      const msg = userMessage(cmd, 'text');
      if (!msg) throw new Error('input needs "text" (string) or "message" (object)');
      if (!st.input.push(msg)) throw new Error('input already ended');
      log(`input pushed length=${JSON.stringify(msg.message?.content ?? '').length}`);
      return ack(cmd, true);
    }
    case 'interrupt': {
      const st = needQuery();
      const result = await st.q.interrupt();
      return ack(cmd, true, result === undefined ? {} : { result });
    }
    case 'stopTask': {
      if (typeof cmd.taskId !== 'string' || !cmd.taskId) throw new Error('stopTask needs "taskId"');
      const st = needQuery();
      log(`stopTask taskId=${cmd.taskId}`);
      await st.q.stopTask(cmd.taskId);
      return ack(cmd, true);
    }
    case 'permission': {
      if (typeof cmd.requestId !== 'string') throw new Error('permission needs "requestId"');
      const p = pendingPermissions.get(cmd.requestId);
      if (!p) throw new Error(`no pending permission ${cmd.requestId}`);
      let result;
      if (cmd.behavior === 'allow') {
        result = { behavior: 'allow', updatedInput: cmd.updatedInput ?? p.input };
        if (Array.isArray(cmd.updatedPermissions)) result.updatedPermissions = cmd.updatedPermissions;
      } else if (cmd.behavior === 'deny') {
        result = { behavior: 'deny', message: typeof cmd.message === 'string' ? cmd.message : 'Permission denied' };
        if (typeof cmd.interrupt === 'boolean') result.interrupt = cmd.interrupt;
      } else {
        throw new Error('permission "behavior" must be "allow" or "deny"');
      }
      pendingPermissions.delete(cmd.requestId);
      log(`permission requestId=${cmd.requestId} behavior=${cmd.behavior}`);
      p.resolve(result);
      return ack(cmd, true);
    }
    case 'endInput': {
      const st = needQuery();
      st.input.end();
      return ack(cmd, true);
    }
    case 'close':
      ack(cmd, true);
      return shutdown(0);
    default:
      throw new Error(`unknown op ${JSON.stringify(cmd.op ?? null)}`);
  }
}

process.on('unhandledRejection', (e) => log(`unhandled rejection: ${errText(e).length} chars`));
process.on('uncaughtException', (e) => log(`uncaught exception: ${errText(e).length} chars`));
process.stdout.on('error', () => process.exit(0));
process.on('SIGTERM', () => shutdown(0));
process.on('SIGINT', () => shutdown(0));

emit({ kind: 'ready', sdkVersion: sdkVersion() });

const rl = createInterface({ input: process.stdin, crlfDelay: Infinity });
rl.on('line', (line) => {
  if (!line.trim()) return;
  let cmd;
  try {
    cmd = JSON.parse(line);
  } catch (e) {
    log(`malformed input line (${line.length} bytes)`);
    return ack(null, false, { error: `malformed JSON: ${errText(e)}` });
  }
  if (!cmd || typeof cmd !== 'object' || Array.isArray(cmd)) {
    return ack(null, false, { error: 'command must be a JSON object' });
  }
  Promise.resolve()
    .then(() => handle(cmd))
    .catch((e) => ack(cmd, false, { error: errText(e) }));
});
rl.on('close', () => shutdown(0));
