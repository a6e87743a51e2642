//! One root tree's in-memory state (a cache of the database) and the per-step transaction
//! builder that turns its mutations into one [`PersistBatch`].

use super::provider_turns::ProviderTurns;
use crate::hash::FxSet;
use crate::keyed::{hash_id, same, Hint, IdMap, IdSet, PairMap, PairTable, Table};
use crate::model::{CancelOperation, Id, Interaction, Message, Millis, Session, ToolCall, Turn};
use crate::step::{Guard, Ignored, PersistBatch, ProviderRequest, Reply, Row, Step, TimerRequest};
use smallvec::SmallVec;
use std::sync::Arc;

/// A root session, every nested child session, their turns, interactions, tool calls and cancel
/// operations. Indexes keep per-event work independent of the tree's size.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tree {
    pub root_id: Id,
    pub workspace_id: Id,
    pub sessions: Table<Arc<Session>>,
    pub turns: Table<Arc<Turn>>,
    /// Direct children of each session, in creation order.
    pub children: IdMap<Vec<Id>>,
    /// For each root turn: its active nested child turns (turn id -> session id), any depth.
    pub active_children: IdMap<IdMap<Id>>,
    /// Interactions keyed by (turn id, request id).
    pub interactions: PairMap<Arc<Interaction>>,
    /// Pending interaction request ids per turn.
    pub pending: IdMap<Vec<Id>>,
    /// What the common events of a session need, by the session's position in `sessions`
    /// (sessions are tombstoned, never removed, so positions never change). Reached only
    /// through [`Tree::hot`], which finds the session's position by its id.
    hot: Vec<SessionHot>,
    /// Tool calls keyed by (session id, tool call id).
    pub tool_calls: PairTable<Arc<ToolCall>>,
    /// Tool calls of each active turn whose status is not terminal (turn id -> tool call ids of
    /// that turn's session), kept as tool calls change, so settling a turn closes its open tool
    /// calls without scanning the tree's ([`crate::model::ToolCall::status`], issue 23).
    pub open_tool_calls: IdMap<Vec<Id>>,
    /// Cancel operations.
    pub ops: IdMap<Arc<CancelOperation>>,
    /// Turns that are targets of a prepared cancel operation (turn id -> operation id).
    pub inflight: IdMap<Id>,
    /// The root session's provider turn ids -> the root turn each is recorded on.
    pub provider_turns: ProviderTurns,
}

/// The per-session record that message, tool call and turn progress events read: found by the
/// session's position, so such an event hashes and probes no index for its session's latest turn
/// or its message ids.
#[derive(Debug, Clone)]
pub(crate) struct SessionHot {
    /// Message ids seen (a repeat is a no-op); their count is the next message's `seq`.
    pub message_ids: IdSet,
    /// Where the session's latest turn is in `turns`: a hint, checked by every use (positions
    /// move when a deletion removes turns).
    pub turn: Hint,
}

impl Default for SessionHot {
    fn default() -> Self {
        SessionHot {
            message_ids: IdSet::default(),
            turn: Hint::NONE,
        }
    }
}

impl Tree {
    /// An empty tree of the root `root_id`.
    pub fn new(root_id: Id, workspace_id: Id) -> Tree {
        Tree {
            root_id,
            workspace_id,
            ..Tree::default()
        }
    }

    /// The hot record of `session` (`None` if the tree has no such session). The record is
    /// found by the session's position, through `hint` when it is right: a wrong hint is
    /// detected and never yields another session's record (whose message count would become
    /// this session's next `seq`).
    #[inline]
    pub fn hot(&mut self, session: &str, hint: Hint) -> Option<&mut SessionHot> {
        let pos = self.sessions.locate(session, hint)? as usize;
        if self.hot.len() <= pos {
            self.hot.resize_with(pos + 1, SessionHot::default);
        }
        self.hot.get_mut(pos)
    }

    /// Every (session, message id) of the tree.
    pub fn message_ids(&self) -> impl Iterator<Item = (&Id, &Id)> + '_ {
        // The hot records are by session position: zipped with the sessions in order.
        self.sessions
            .keys()
            .zip(&self.hot)
            .flat_map(|(s, hot)| hot.message_ids.iter().map(move |m| (s, m)))
    }

    /// Inserts a new turn of `session` and makes it that session's latest; returns the turn's
    /// position in `turns`.
    pub fn insert_turn(&mut self, (session, hint): (&Id, Hint), turn: Turn) -> u32 {
        let pos = self.turns.insert(turn.id.clone(), Arc::new(turn));
        if let Some(hot) = self.hot(session, hint) {
            hot.turn = Hint::at(pos);
        }
        pos
    }

    /// The position in `turns` and the turn `turn` of exactly `session` (canonical id; `hint`:
    /// the session's position). The session's latest turn (the one nearly every event is
    /// about) is tried first, from the hot record; any other turn is found through the index.
    #[inline]
    pub fn turn_of_session(
        &self,
        (session, hint): (&Id, Hint),
        turn: &str,
    ) -> Option<(u32, &Turn)> {
        let latest = self
            .sessions
            .locate(session, hint)
            .and_then(|pos| self.hot.get(pos as usize))
            .map_or(Hint::NONE, |h| h.turn);
        let (pos, t) = self.turns.get_hinted(turn, latest)?;
        // The session's id is the canonical allocation: a pointer comparison.
        same(&t.agent_session_id, session).then_some((pos, &**t))
    }

    /// Rebuilds the provider turn index from the turns (after a load or a deletion).
    pub fn rebuild_provider_turns(&mut self) {
        self.provider_turns
            .rebuild_from(self.turns.values().map(|t| &**t));
    }

    /// Whether the provider turn index is the one derived from the turns.
    pub fn provider_turns_consistent(&self) -> bool {
        self.provider_turns
            .matches(self.turns.values().map(|t| &**t))
    }

    pub fn root(&self) -> Option<&Session> {
        self.sessions.get(&self.root_id).map(|s| &**s)
    }

    /// Number of active nested child turns under a root turn.
    pub fn active_child_count(&self, root_turn: &Id) -> usize {
        self.active_child_count_hashed(hash_id(root_turn), root_turn)
    }

    /// [`Tree::active_child_count`] for a root turn id whose [`hash_id`] is `hash`.
    pub fn active_child_count_hashed(&self, hash: u64, root_turn: &str) -> usize {
        self.active_children
            .get_hashed(hash, root_turn)
            .map_or(0, |m| m.len())
    }

    /// The root turn a turn belongs to (itself for a root turn).
    pub fn root_turn_of(&self, turn: &Turn) -> Option<Id> {
        let s = self.sessions.get(&turn.agent_session_id)?;
        Some(s.root_turn_id().unwrap_or(&turn.id).clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Session(Id),
    Turn(Id),
    Interaction(Id, Id),
    /// A tool call, by (session id, tool call id).
    ToolCall(Id, Id),
    Op(Id),
}

#[derive(Debug)]
enum Touch {
    /// An entity, whether it is published, and where the handler found it in its table, if it
    /// did (checked by `finish`).
    Entity(Key, bool, Hint),
    /// A message (boxed: only a submit records one through a transaction, and a transaction is
    /// returned by value, so its inline touches stay small).
    Message(Box<Message>),
    Purge(Id),
}

/// Collects what one input changed; `finish` bumps versions once per entity and builds the Step.
#[derive(Debug)]
pub(crate) struct Tx {
    pub now: Millis,
    /// Most steps touch one to three entities (a child creation touches the child, its turn and
    /// the root turn): kept inline (no allocation).
    touches: SmallVec<[Touch; 3]>,
    seen: Option<FxSet<Key>>,
    guards: Vec<Guard>,
    pub provider: Vec<ProviderRequest>,
    pub timers: Vec<TimerRequest>,
    pub reply: Option<Reply>,
    pub ignored: Option<Ignored>,
}

const LINEAR: usize = 16;

impl Tx {
    pub fn new(now: Millis) -> Tx {
        Tx {
            now,
            touches: SmallVec::new(),
            seen: None,
            guards: Vec::new(),
            provider: Vec::new(),
            timers: Vec::new(),
            reply: None,
            ignored: None,
        }
    }

    /// An accepted input that changes nothing.
    pub fn ignore(now: Millis, why: Ignored) -> Tx {
        let mut tx = Tx::new(now);
        tx.ignored = Some(why);
        tx
    }

    fn touch(&mut self, key: Key, publish: bool, hint: Hint) {
        if self.touches.len() >= LINEAR && self.seen.is_none() {
            let set: FxSet<Key> = self
                .touches
                .iter()
                .filter_map(|t| match t {
                    Touch::Entity(k, ..) => Some(k.clone()),
                    _ => None,
                })
                .collect();
            self.seen = Some(set);
        }
        let known = match &self.seen {
            Some(set) => set.contains(&key),
            None => self
                .touches
                .iter()
                .any(|t| matches!(t, Touch::Entity(k, ..) if *k == key)),
        };
        if known {
            // Merged into the first touch: published if any touch publishes it; its hint kept,
            // else this one's. (No shortcut for a touch that adds nothing: a re-touch is rare,
            // and the loop is then a no-op.)
            for t in self.touches.iter_mut() {
                if let Touch::Entity(k, p, h) = t {
                    if *k == key {
                        *p |= publish;
                        if *h == Hint::NONE {
                            *h = hint;
                        }
                        break;
                    }
                }
            }
            return;
        }
        if let Some(set) = &mut self.seen {
            set.insert(key.clone());
        }
        self.touches.push(Touch::Entity(key, publish, hint));
    }

    /// Folds another transaction on the same tree into this one.
    pub fn absorb(&mut self, other: Tx) {
        for t in other.touches {
            match t {
                Touch::Entity(k, p, hint) => self.touch(k, p, hint),
                other => self.touches.push(other),
            }
        }
        self.guards.extend(other.guards);
        self.provider.extend(other.provider);
        self.timers.extend(other.timers);
        if self.reply.is_none() {
            self.reply = other.reply;
        }
    }

    /// A session the step changed; `hint`: where the handler found it in `sessions`, if it
    /// did (`finish` then need not look it up).
    pub fn session(&mut self, id: &Id, hint: Hint, publish: bool) {
        self.touch(Key::Session(id.clone()), publish, hint);
    }
    /// A turn the step changed; `hint`: where the handler found it in `turns`, if it did.
    pub fn turn(&mut self, id: &Id, hint: Hint, publish: bool) {
        self.touch(Key::Turn(id.clone()), publish, hint);
    }
    pub fn interaction(&mut self, turn: &Id, request: &Id) {
        self.touch(
            Key::Interaction(turn.clone(), request.clone()),
            true,
            Hint::NONE,
        );
    }
    /// A tool call the step changed (published).
    pub fn tool_call(&mut self, session: &Id, call: &Id) {
        self.touch(
            Key::ToolCall(session.clone(), call.clone()),
            true,
            Hint::NONE,
        );
    }
    pub fn op(&mut self, id: &Id) {
        self.touch(Key::Op(id.clone()), true, Hint::NONE);
    }
    pub fn message(&mut self, m: Message) {
        self.touches.push(Touch::Message(Box::new(m)));
    }
    pub fn purge(&mut self, session: &Id) {
        self.touches.push(Touch::Purge(session.clone()));
    }
    pub fn guard(&mut self, g: Guard) {
        self.guards.push(g);
    }

    /// Bumps each touched entity's version once, stamps `updated_at`, and builds the step.
    ///
    /// Rows are pushed straight into the step, so no row and no batch is moved after it is
    /// made; the transaction is drained by reference, so it is not moved either (it is large:
    /// its touches are kept inline). A drained transaction finishes as an empty step.
    #[inline(always)]
    pub fn finish(&mut self, tree: &mut Tree) -> Step {
        let now = self.now;
        let mut step = Step {
            persist: PersistBatch {
                guards: SmallVec::from_vec(std::mem::take(&mut self.guards)),
                ..PersistBatch::default()
            },
            provider: std::mem::take(&mut self.provider),
            timers: std::mem::take(&mut self.timers),
            reply: self.reply.take(),
            ignored: self.ignored.take(),
        };
        let batch = &mut step.persist;
        // One allocation at most for a step of several rows (none for one row). The outbox
        // indexes are not reserved: most steps publish at most two rows, which fit inline.
        batch.rows.reserve_exact(self.touches.len());
        for t in self.touches.drain(..) {
            let publish = match t {
                Touch::Entity(Key::Session(id), p, hint) => {
                    match tree.sessions.get_mut_hinted(&id, hint) {
                        Some((_, s)) => {
                            batch.guards.push(Guard::SessionVersion {
                                id,
                                version: s.version,
                                next: s.version + 1,
                            });
                            let m = Arc::make_mut(s);
                            m.version += 1;
                            m.updated_at = now;
                            batch.rows.push(Row::Session(Arc::clone(s)));
                            p
                        }
                        None => continue,
                    }
                }
                Touch::Entity(Key::Turn(id), p, hint) => {
                    match tree.turns.get_mut_hinted(&id, hint) {
                        Some((_, t)) => {
                            batch.guards.push(Guard::TurnVersion {
                                id,
                                version: t.version,
                                next: t.version + 1,
                            });
                            let m = Arc::make_mut(t);
                            m.version += 1;
                            m.updated_at = now;
                            batch.rows.push(Row::Turn(Arc::clone(t)));
                            p
                        }
                        None => continue,
                    }
                }
                Touch::Entity(Key::Interaction(turn, req), p, _) => {
                    match tree.interactions.get_mut(&turn, &req) {
                        Some(i) => {
                            let m = Arc::make_mut(i);
                            m.version += 1;
                            m.updated_at = now;
                            batch.rows.push(Row::Interaction(Arc::clone(i)));
                            p
                        }
                        None => continue,
                    }
                }
                Touch::Entity(Key::ToolCall(session, call), p, _) => {
                    match tree.tool_calls.get_mut(&session, &call) {
                        Some(c) => {
                            let m = Arc::make_mut(c);
                            m.version += 1;
                            m.updated_at = now;
                            batch.rows.push(Row::ToolCall(Arc::clone(c)));
                            p
                        }
                        None => continue,
                    }
                }
                Touch::Entity(Key::Op(id), p, _) => match tree.ops.get_mut(&id) {
                    Some(o) => {
                        batch.guards.push(Guard::CancelVersion {
                            id,
                            version: o.version,
                            next: o.version + 1,
                        });
                        let m = Arc::make_mut(o);
                        m.version += 1;
                        m.updated_at = now;
                        batch.rows.push(Row::CancelOperation(Arc::clone(o)));
                        p
                    }
                    None => continue,
                },
                Touch::Message(m) => {
                    batch.rows.push(Row::Message(*m));
                    true
                }
                Touch::Purge(id) => {
                    batch.rows.push(Row::PurgeSession {
                        agent_session_id: id,
                    });
                    false
                }
            };
            if publish {
                batch.outbox.push((batch.rows.len() - 1) as u32);
            }
        }
        if batch.rows.is_empty() {
            batch.guards.clear();
        } else {
            batch.root_agent_session_id = Some(tree.root_id.clone());
            batch.workspace_id = Some(tree.workspace_id.clone());
        }
        step
    }
}

#[cfg(test)]
mod tests {
    use super::{Tree, Tx};
    use crate::keyed::Hint;
    use crate::model::Id;
    use crate::step::Row;
    use crate::{Engine, Input};
    use serde_json::json;

    /// A tree of root `R` (turn `T`) with `n` children `C0..` (turns `CT0..`), built by the
    /// engine.
    fn tree_with(n: usize) -> Tree {
        let mut e = Engine::new();
        let mut inputs = vec![
            json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
            json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
        ];
        inputs.extend((0..n).map(|i| {
            json!({"type": "childSessionCreated", "agentSessionId": format!("C{i}"),
                "turnId": format!("CT{i}"), "parentAgentSessionId": "R", "parentTurnId": "T",
                "rootAgentSessionId": "R", "rootTurnId": "T"})
        }));
        for (now, v) in inputs.into_iter().enumerate() {
            let input: Input = serde_json::from_value(v).expect("input");
            e.handle(now as i64 + 1, &input).expect("accepted");
        }
        let tree = e.trees().next().expect("one tree").clone();
        tree
    }

    /// "The durable cancel operation, every target transition, pending interaction
    /// supersession, and outbox data commit together": however many entities a step touches,
    /// each is written once (one version bump, one guard, one row) and published if any of its
    /// touches published it. Checked past the point where a step stops scanning its inline list
    /// of touches and keeps a set instead, with entities first touched before that point touched
    /// again after it.
    #[test]
    fn a_step_writes_each_entity_once_however_many_it_touches() {
        let n = 40;
        let mut tree = tree_with(n);
        let ids: Vec<Id> = (0..n).map(|i| Id::from(format!("CT{i}"))).collect();
        let versions: Vec<u64> = ids
            .iter()
            .map(|id| tree.turns.get(id).expect("turn").version)
            .collect();
        let mut tx = Tx::new(100);
        for id in &ids {
            tx.turn(id, Hint::NONE, false);
        }
        // Touched again, now published: the first touch's row is published, not a second row.
        for id in &ids {
            tx.turn(id, Hint::NONE, true);
            tx.turn(id, Hint::NONE, false);
        }
        let step = tx.finish(&mut tree);
        let rows: Vec<(&str, u64)> = step
            .persist
            .rows
            .iter()
            .map(|r| match r {
                Row::Turn(t) => (&*t.id, t.version),
                other => panic!("only turns were touched: {other:?}"),
            })
            .collect();
        let expected: Vec<(&str, u64)> = ids
            .iter()
            .zip(&versions)
            .map(|(id, v)| (&**id, v + 1))
            .collect();
        assert_eq!(
            rows, expected,
            "each turn once, in first-touch order, one version up"
        );
        assert_eq!(step.persist.guards.len(), n, "one version guard per turn");
        assert_eq!(
            step.outbox_turns().map(|t| &**t).collect::<Vec<_>>(),
            ids.iter().map(|t| &**t).collect::<Vec<_>>(),
            "each turn published once"
        );
    }

    /// The invariant "provider turn index names the root turn each provider turn id is recorded
    /// on" is checked against the turns: an index that lost a recorded provider turn (or was
    /// never rebuilt after a load) is reported, and a rebuilt one passes.
    #[test]
    fn the_provider_turn_index_check_detects_an_index_out_of_step_with_the_turns() {
        let mut e = Engine::new();
        for (now, v) in [
            json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
            json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
            json!({"type": "rootProviderTurnStarted", "agentSessionId": "R", "providerTurnId": "p1"}),
        ]
        .into_iter()
        .enumerate()
        {
            let input: Input = serde_json::from_value(v).expect("input");
            e.handle(now as i64 + 1, &input).expect("accepted");
        }
        let mut tree = e.trees().next().expect("one tree").clone();
        assert!(tree.provider_turns_consistent(), "as the engine keeps it");
        tree.provider_turns.rebuild_from(std::iter::empty());
        assert!(
            !tree.provider_turns_consistent(),
            "p1 is recorded on T but missing from the index"
        );
        tree.rebuild_provider_turns();
        assert!(tree.provider_turns_consistent(), "rebuilt from the turns");
    }
}
