//! One root tree's in-memory state (a cache of the database) and the per-step transaction
//! builder that turns its mutations into one [`PersistBatch`].

use crate::hash::FxSet;
use crate::keyed::{hash_id, IdMap, IdSet, PairMap, PairTable, Table};
use crate::model::{CancelOperation, Id, Interaction, Message, Millis, Session, ToolCall, Turn};
use crate::step::{Guard, Ignored, PersistBatch, ProviderRequest, Reply, Row, Step, TimerRequest};
use smallvec::SmallVec;

/// A root session, every nested child session, their turns, interactions, tool calls and cancel
/// operations. Indexes keep per-event work independent of the tree's size.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tree {
    pub root_id: Id,
    pub workspace_id: Id,
    pub sessions: Table<Session>,
    pub turns: Table<Turn>,
    /// Direct children of each session, in creation order.
    pub children: IdMap<Vec<Id>>,
    /// For each root turn: its active nested child turns (turn id -> session id), any depth.
    pub active_children: IdMap<IdMap<Id>>,
    /// Interactions keyed by (turn id, request id).
    pub interactions: PairMap<Interaction>,
    /// Pending interaction request ids per turn.
    pub pending: IdMap<Vec<Id>>,
    /// Message ids seen per session (a repeat is a no-op), by the session's position in
    /// `sessions` (sessions are tombstoned, never removed, so positions never change).
    pub message_ids: Vec<IdSet>,
    /// Tool calls keyed by (session id, tool call id).
    pub tool_calls: PairTable<ToolCall>,
    /// Cancel operations.
    pub ops: IdMap<CancelOperation>,
    /// Turns that are targets of a prepared cancel operation (turn id -> operation id).
    pub inflight: IdMap<Id>,
}

impl Tree {
    /// The message ids of the session at `pos` in `sessions`.
    pub fn message_ids_at(&mut self, pos: u32) -> &mut IdSet {
        let pos = pos as usize;
        if self.message_ids.len() <= pos {
            self.message_ids.resize_with(pos + 1, IdSet::default);
        }
        &mut self.message_ids[pos]
    }

    /// The message ids of a session of this tree.
    pub fn message_ids_of(&mut self, session: &str) -> Option<&mut IdSet> {
        let pos = self.sessions.position(session)?;
        Some(self.message_ids_at(pos))
    }

    pub fn root(&self) -> Option<&Session> {
        self.sessions.get(&self.root_id)
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
        if s.is_child() {
            s.root_turn_id.clone()
        } else {
            Some(turn.id.clone())
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Session(Id),
    Turn(Id),
    Interaction(Id, Id),
    Op(Id),
}

#[derive(Debug)]
enum Touch {
    Entity(Key, bool),
    Message(Message),
    /// A tool call row its handler built (and versioned) itself; always published.
    ToolCall(ToolCall),
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

    fn touch(&mut self, key: Key, publish: bool) {
        if self.touches.len() >= LINEAR && self.seen.is_none() {
            let set: FxSet<Key> = self
                .touches
                .iter()
                .filter_map(|t| match t {
                    Touch::Entity(k, _) => Some(k.clone()),
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
                .any(|t| matches!(t, Touch::Entity(k, _) if *k == key)),
        };
        if known {
            if publish {
                for t in self.touches.iter_mut() {
                    if let Touch::Entity(k, p) = t {
                        if *k == key {
                            *p = true;
                            break;
                        }
                    }
                }
            }
            return;
        }
        if let Some(set) = &mut self.seen {
            set.insert(key.clone());
        }
        self.touches.push(Touch::Entity(key, publish));
    }

    /// Folds another transaction on the same tree into this one.
    pub fn absorb(&mut self, other: Tx) {
        for t in other.touches {
            match t {
                Touch::Entity(k, p) => self.touch(k, p),
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

    pub fn session(&mut self, id: &Id, publish: bool) {
        self.touch(Key::Session(id.clone()), publish);
    }
    pub fn turn(&mut self, id: &Id, publish: bool) {
        self.touch(Key::Turn(id.clone()), publish);
    }
    pub fn interaction(&mut self, turn: &Id, request: &Id) {
        self.touch(Key::Interaction(turn.clone(), request.clone()), true);
    }
    pub fn op(&mut self, id: &Id) {
        self.touch(Key::Op(id.clone()), true);
    }
    pub fn message(&mut self, m: Message) {
        self.touches.push(Touch::Message(m));
    }
    /// A finished tool call row (its version already bumped by the caller), touched once in
    /// this step. (Kept apart from [`Row`] so that a [`Touch`] stays small.)
    pub fn tool_call_row(&mut self, call: ToolCall) {
        self.touches.push(Touch::ToolCall(call));
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
                guards: std::mem::take(&mut self.guards),
                ..PersistBatch::default()
            },
            provider: std::mem::take(&mut self.provider),
            timers: std::mem::take(&mut self.timers),
            reply: self.reply.take(),
            ignored: self.ignored.take(),
        };
        let batch = &mut step.persist;
        // One allocation at most for a step of several rows (none for one row).
        batch.rows.reserve_exact(self.touches.len());
        batch.outbox.reserve_exact(self.touches.len());
        for t in self.touches.drain(..) {
            let publish = match t {
                Touch::Entity(Key::Session(id), p) => match tree.sessions.get_mut(&id) {
                    Some(s) => {
                        batch.guards.push(Guard::SessionVersion {
                            id,
                            version: s.version,
                            next: s.version + 1,
                        });
                        s.version += 1;
                        s.updated_at = now;
                        batch.rows.push(Row::Session(Box::new(s.clone())));
                        p
                    }
                    None => continue,
                },
                Touch::Entity(Key::Turn(id), p) => match tree.turns.get_mut(&id) {
                    Some(t) => {
                        batch.guards.push(Guard::TurnVersion {
                            id,
                            version: t.version,
                            next: t.version + 1,
                        });
                        t.version += 1;
                        t.updated_at = now;
                        batch.rows.push(Row::Turn(t.clone()));
                        p
                    }
                    None => continue,
                },
                Touch::Entity(Key::Interaction(turn, req), p) => {
                    match tree.interactions.get_mut(&turn, &req) {
                        Some(i) => {
                            i.version += 1;
                            i.updated_at = now;
                            batch.rows.push(Row::Interaction(i.clone()));
                            p
                        }
                        None => continue,
                    }
                }
                Touch::Entity(Key::Op(id), p) => match tree.ops.get_mut(&id) {
                    Some(o) => {
                        batch.guards.push(Guard::CancelVersion {
                            id,
                            version: o.version,
                            next: o.version + 1,
                        });
                        o.version += 1;
                        o.updated_at = now;
                        batch.rows.push(Row::CancelOperation(o.clone()));
                        p
                    }
                    None => continue,
                },
                Touch::Message(m) => {
                    batch.rows.push(Row::Message(m));
                    true
                }
                Touch::ToolCall(c) => {
                    batch.rows.push(Row::ToolCall(c));
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
