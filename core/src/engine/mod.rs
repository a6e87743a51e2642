//! The engine: one state machine per root tree, fed [`Input`]s, producing [`Step`]s.

mod cancel;
mod child;
mod deletion;
mod exit;
mod gate;
mod guidance;
mod interaction;
mod provider_turns;
mod restore;
mod transcript;
mod tree;

pub use cancel::UNCONFIRMED;

use crate::error::{Rejected, RestoreError};
use crate::input::{Command, Input, NormalizedEvent, RuntimeAnswer, TimerId};
use crate::keyed::{Hint, IdMap};
use crate::model::{
    CancelOperation, CancelState, Id, Interaction, InteractionStatus, Millis, Session, ToolCall,
    Turn,
};
use crate::snapshot::TreeSnapshot;
use crate::step::Step;
pub(crate) use tree::Tree;

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// How long a provider cancel may take before its unconfirmed targets settle interrupted.
    pub cancel_timeout_ms: Millis,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            cancel_timeout_ms: 10_000,
        }
    }
}

/// The sans-I/O engine. See the crate docs for the driver loop.
///
/// Every session, turn, interaction and cancel operation belongs to exactly one root tree; trees
/// are independent, restored from snapshots and evicted when quiescent.
#[derive(Debug, Default)]
pub struct Engine {
    config: EngineConfig,
    /// Loaded trees; a session or operation finds its tree with one lookup of its own id.
    slots: Vec<Option<Tree>>,
    /// Free indexes of `slots`.
    free: Vec<u32>,
    /// Root session id -> slot.
    by_root: IdMap<u32>,
    /// Session id -> slot of its tree, for every loaded session.
    session_root: IdMap<Loc>,
    /// Cancel operation id -> slot of its tree.
    op_root: IdMap<u32>,
}

/// Where a loaded session lives: its tree's slot and its position in that tree's sessions (a
/// hint: every use checks it, see [`Hint`]).
#[derive(Debug, Clone, Copy)]
struct Loc {
    slot: u32,
    pos: Hint,
}

impl Engine {
    /// An engine with the default configuration.
    pub fn new() -> Engine {
        Engine::default()
    }

    /// An engine with this configuration.
    pub fn with_config(config: EngineConfig) -> Engine {
        Engine {
            config,
            ..Engine::default()
        }
    }

    /// The configuration.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Handles one input at time `now`. On `Err` nothing changed; on `Ok` the driver must commit
    /// `step.persist` before acting on anything else in the step. If the commit fails, the driver
    /// calls [`Engine::evict`] for the tree and reloads it from storage.
    pub fn handle(&mut self, now: Millis, input: &Input) -> Result<Step, Rejected> {
        match input {
            Input::Command(Command::CreateSession {
                agent_session_id,
                workspace_id,
                provider,
                title,
                capabilities,
            }) => {
                if self.session_root.contains_key(agent_session_id) {
                    return Err(Rejected::SessionExists(agent_session_id.clone()));
                }
                let (mut tree, mut tx) = guidance::create_root(
                    now,
                    agent_session_id,
                    workspace_id,
                    provider,
                    title.as_ref(),
                    *capabilities,
                );
                let step = tx.finish(&mut tree);
                let pos = tree
                    .sessions
                    .position(agent_session_id)
                    .map_or(Hint::NONE, Hint::at);
                let slot = self.insert_tree(tree);
                self.session_root
                    .insert(agent_session_id.clone(), Loc { slot, pos });
                Ok(step)
            }
            Input::Command(c) => self.command(now, c),
            Input::Event(e) => self.event(now, e),
            Input::Runtime(a) => self.runtime(now, a),
        }
    }

    fn tree_of_session(&mut self, session: &Id) -> Result<(u32, &mut Tree), Rejected> {
        self.session_tree(session)
            .map(|(loc, tree, _)| (loc.slot, tree))
    }

    /// The slot and tree of a session, and the session's canonical id: the engine's own
    /// allocation of it, which every row and index of the session shares, so that comparing it
    /// with them is a pointer comparison instead of reading both strings.
    fn session_tree(&mut self, session: &Id) -> Result<(Loc, &mut Tree, &Id), Rejected> {
        let (canonical, &loc) = self
            .session_root
            .get_key_value(session)
            .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
        let tree = self
            .slots
            .get_mut(loc.slot as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
        Ok((loc, tree, canonical))
    }

    /// Puts a tree into a free slot.
    fn insert_tree(&mut self, tree: Tree) -> u32 {
        let root = tree.root_id.clone();
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(tree);
                i
            }
            None => {
                self.slots.push(Some(tree));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_root.insert(root, slot);
        slot
    }

    fn tree(&self, root: &str) -> Option<&Tree> {
        let slot = *self.by_root.get(root)?;
        self.slots.get(slot as usize)?.as_ref()
    }

    fn tree_in(&self, slot: u32) -> Option<&Tree> {
        self.slots.get(slot as usize)?.as_ref()
    }

    fn tree_in_mut(&mut self, slot: u32) -> Option<&mut Tree> {
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    fn command(&mut self, now: Millis, c: &Command) -> Result<Step, Rejected> {
        let timeout = self.config.cancel_timeout_ms;
        match c {
            // `handle` creates roots itself; reaching here is the engine's own routing error.
            Command::CreateSession {
                agent_session_id, ..
            } => Err(Rejected::Internal {
                what: "createSession routed past Engine::handle",
                id: agent_session_id.clone(),
            }),
            Command::Submit {
                agent_session_id,
                turn_id,
                text,
            } => {
                let (_, tree) = self.tree_of_session(agent_session_id)?;
                let mut tx = guidance::submit(tree, now, agent_session_id, turn_id, text)?;
                Ok(tx.finish(tree))
            }
            Command::CancelTurn {
                operation_id,
                agent_session_id,
                turn_id,
            } => {
                let (root, tree) = self.tree_of_session(agent_session_id)?;
                let mut tx = cancel::cancel_turn(
                    tree,
                    now,
                    timeout,
                    operation_id,
                    agent_session_id,
                    turn_id,
                )?;
                let step = tx.finish(tree);
                self.op_root.insert(operation_id.clone(), root);
                Ok(step)
            }
            Command::RespondInteraction {
                agent_session_id,
                turn_id,
                request_id,
                response,
            } => {
                let (_, tree) = self.tree_of_session(agent_session_id)?;
                let mut tx = interaction::respond(
                    tree,
                    now,
                    agent_session_id,
                    turn_id,
                    request_id,
                    response,
                )?;
                Ok(tx.finish(tree))
            }
            Command::DeleteSession { agent_session_id } => {
                let (_, tree) = self.tree_of_session(agent_session_id)?;
                let mut tx = deletion::delete(tree, now, agent_session_id)?;
                Ok(tx.finish(tree))
            }
        }
    }

    fn event(&mut self, now: Millis, e: &NormalizedEvent) -> Result<Step, Rejected> {
        use NormalizedEvent::*;
        let (loc, tree, canonical) = self.session_tree(e.agent_session_id())?;
        // No `?` on the handlers: the transaction is finished where it lies (never moved).
        let mut r = match e {
            RootProviderTurnStarted {
                agent_session_id,
                turn_id,
                provider_turn_id,
            } => gate::provider_started(
                tree,
                now,
                agent_session_id,
                turn_id.as_ref(),
                provider_turn_id.clone(),
            ),
            RootProviderTurnCompleted {
                agent_session_id,
                turn_id,
                provider_turn_id,
                outcome,
                error,
            } => gate::provider_completed(
                tree,
                now,
                agent_session_id,
                turn_id.as_ref(),
                provider_turn_id.clone(),
                *outcome,
                error.clone(),
            ),
            ChildSessionCreated {
                agent_session_id,
                turn_id,
                parent_agent_session_id,
                parent_turn_id,
                parent_tool_call_id,
                root_agent_session_id,
                root_turn_id,
                title,
                provider_session_id,
                provider_aliases,
            } => {
                let child = child::NewChild {
                    agent_session_id,
                    turn_id,
                    parent_agent_session_id,
                    parent_turn_id,
                    parent_tool_call_id: parent_tool_call_id.as_ref(),
                    root_agent_session_id,
                    root_turn_id,
                    title: title.as_ref(),
                    provider_session_id: provider_session_id.as_ref(),
                    provider_aliases: provider_aliases.as_ref(),
                };
                let (mut tx, created) = child::create(tree, now, child)?;
                let step = tx.finish(tree);
                if let Some(pos) = created {
                    self.session_root.insert(
                        agent_session_id.clone(),
                        Loc {
                            slot: loc.slot,
                            pos: Hint::at(pos),
                        },
                    );
                }
                return Ok(step);
            }
            ChildSessionUpdated {
                agent_session_id,
                title,
                provider_session_id,
                provider_aliases,
            } => child::update(
                tree,
                now,
                agent_session_id,
                title.as_ref(),
                provider_session_id.as_ref(),
                provider_aliases.as_ref(),
            ),
            TurnStarted {
                turn_id,
                provider_turn_id,
                ..
            } => child::turn_started(
                tree,
                now,
                (canonical, loc.pos),
                turn_id,
                provider_turn_id.as_ref(),
            ),
            TurnWaiting { turn_id, .. } => {
                child::turn_waiting(tree, now, (canonical, loc.pos), turn_id)
            }
            TurnTerminal {
                turn_id,
                outcome,
                error,
                ..
            } => child::turn_terminal(
                tree,
                now,
                (canonical, loc.pos),
                turn_id,
                *outcome,
                error.clone(),
            ),
            MessageAppended {
                turn_id,
                message_id,
                role,
                text,
                ..
            } => {
                return transcript::message(
                    tree,
                    now,
                    (canonical, loc.pos),
                    turn_id,
                    message_id,
                    role,
                    text,
                )
            }
            ToolCallUpdated {
                turn_id,
                tool_call_id,
                name,
                status,
                kind,
                payload,
                ..
            } => {
                return transcript::tool_call(
                    tree,
                    now,
                    (canonical, loc.pos),
                    turn_id,
                    tool_call_id,
                    name.as_ref(),
                    status,
                    kind.as_ref(),
                    payload.as_ref(),
                )
            }
            InteractionRequested {
                agent_session_id,
                turn_id,
                request_id,
                provider_turn_id,
                kind,
                payload,
            } => interaction::requested(
                tree,
                now,
                agent_session_id,
                turn_id,
                request_id,
                provider_turn_id.as_ref(),
                kind,
                payload,
            ),
            InteractionResolved {
                agent_session_id,
                turn_id,
                request_id,
                resolution,
            } => {
                interaction::resolved(tree, now, agent_session_id, turn_id, request_id, resolution)
            }
            SessionMetadataUpdated {
                agent_session_id,
                goal,
                title,
                provider_session_id,
                usage,
            } => transcript::metadata(
                tree,
                now,
                agent_session_id,
                transcript::Metadata {
                    goal: goal.as_ref(),
                    title: title.as_ref(),
                    provider_session_id: provider_session_id.as_ref(),
                    usage: usage.as_ref(),
                },
            ),
        };
        match r {
            Ok(ref mut tx) => Ok(tx.finish(tree)),
            Err(e) => Err(e),
        }
    }

    fn runtime(&mut self, now: Millis, a: &RuntimeAnswer) -> Result<Step, Rejected> {
        let op_tree = |engine: &mut Engine, op: &Id| -> Result<u32, Rejected> {
            engine
                .op_root
                .get(op)
                .copied()
                .ok_or_else(|| Rejected::UnknownOperation(op.clone()))
        };
        match a {
            RuntimeAnswer::CancelResult {
                operation_id,
                acked,
            } => {
                let root = op_tree(self, operation_id)?;
                let tree = self.tree_mut(root, operation_id)?;
                let mut tx =
                    cancel::resolve(tree, now, operation_id, cancel::Resolution::Acked(acked))?;
                Ok(tx.finish(tree))
            }
            RuntimeAnswer::CancelFailed {
                operation_id,
                error,
            } => {
                let root = op_tree(self, operation_id)?;
                let tree = self.tree_mut(root, operation_id)?;
                let mut tx = cancel::resolve(
                    tree,
                    now,
                    operation_id,
                    cancel::Resolution::Failed(error.clone()),
                )?;
                Ok(tx.finish(tree))
            }
            RuntimeAnswer::TimerFired {
                timer: TimerId::CancelDeadline { operation_id },
            } => {
                let root = op_tree(self, operation_id)?;
                let tree = self.tree_mut(root, operation_id)?;
                let mut tx = cancel::deadline(tree, now, operation_id)?;
                Ok(tx.finish(tree))
            }
            RuntimeAnswer::GuideFailed {
                agent_session_id,
                turn_id,
                ..
            } => {
                let (_, tree) = self.tree_of_session(agent_session_id)?;
                let mut tx = guidance::guide_failed(tree, now, agent_session_id, turn_id)?;
                Ok(tx.finish(tree))
            }
            RuntimeAnswer::ProviderExited {
                root_agent_session_id,
                error,
            } => {
                let slot = self
                    .by_root
                    .get(root_agent_session_id)
                    .copied()
                    .ok_or_else(|| Rejected::UnknownSession(root_agent_session_id.clone()))?;
                let tree = self
                    .tree_in_mut(slot)
                    .ok_or_else(|| Rejected::UnknownSession(root_agent_session_id.clone()))?;
                let mut tx = exit::provider_exited(tree, now, error)?;
                Ok(tx.finish(tree))
            }
        }
    }

    fn tree_mut(&mut self, slot: u32, op: &Id) -> Result<&mut Tree, Rejected> {
        self.tree_in_mut(slot)
            .ok_or_else(|| Rejected::UnknownOperation(op.clone()))
    }

    /// Loads (or replaces) one root tree from storage.
    pub fn restore(&mut self, snapshot: TreeSnapshot) -> Result<(), RestoreError> {
        let tree = snapshot.into_tree()?;
        let root = tree.root_id.clone();
        self.evict(&root);
        let sessions: Vec<Id> = tree.sessions.keys().cloned().collect();
        let ops: Vec<Id> = tree.ops.keys().cloned().collect();
        let slot = self.insert_tree(tree);
        for (pos, id) in (0u32..).zip(sessions) {
            self.session_root.insert(
                id,
                Loc {
                    slot,
                    pos: Hint::at(pos),
                },
            );
        }
        for id in ops {
            self.op_root.insert(id, slot);
        }
        Ok(())
    }

    /// The current state of one root tree, in the canonical order storage returns it.
    pub fn snapshot(&self, root: &str) -> Option<TreeSnapshot> {
        self.tree(root).map(TreeSnapshot::from_tree)
    }

    /// Drops one tree from memory (after a failed commit, or when quiescent).
    pub fn evict(&mut self, root: &str) {
        let Some(slot) = self.by_root.remove(root) else {
            return;
        };
        if let Some(tree) = self.slots.get_mut(slot as usize).and_then(Option::take) {
            self.free.push(slot);
            for id in tree.sessions.keys() {
                self.session_root.remove(id);
            }
            for id in tree.ops.keys() {
                self.op_root.remove(id);
            }
        }
    }

    /// Whether a tree can be evicted without losing work (issue 17: "a runtime whose tree is
    /// quiescent (no active turn, no prepared cancel, no pending interaction)"): no session of the
    /// tree has an active turn, no cancel operation is prepared and no interaction is pending.
    /// An unloaded tree is quiescent.
    pub fn is_quiescent(&self, root: &str) -> bool {
        self.tree(root).is_none_or(|t| {
            no_active_turn(t)
                && t.ops.values().all(|o| o.state != CancelState::Prepared)
                && t.pending.values().all(Vec::is_empty)
        })
    }

    /// Root session ids of every loaded tree, sorted.
    pub fn roots(&self) -> Vec<Id> {
        let mut v: Vec<Id> = self.by_root.keys().cloned().collect();
        v.sort();
        v
    }

    /// The root session id of a loaded session.
    pub fn root_of(&self, session: &str) -> Option<&Id> {
        let slot = self.session_root.get(session)?.slot;
        self.tree_in(slot).map(|t| &t.root_id)
    }

    /// A loaded session (tombstones included).
    pub fn session(&self, id: &str) -> Option<&Session> {
        let slot = self.session_root.get(id)?.slot;
        self.tree_in(slot)?.sessions.get(id).map(|s| &**s)
    }

    /// A loaded turn of a loaded session.
    pub fn turn(&self, session: &str, turn: &str) -> Option<&Turn> {
        let slot = self.session_root.get(session)?.slot;
        self.tree_in(slot)?.turns.get(turn).map(|t| &**t)
    }

    /// A loaded cancel operation.
    pub fn cancel_operation(&self, id: &str) -> Option<&CancelOperation> {
        let slot = *self.op_root.get(id)?;
        self.tree_in(slot)?.ops.get(id).map(|o| &**o)
    }

    /// Cancel operations still prepared (to replay after a restart), sorted by id.
    pub fn prepared_cancels(&self) -> Vec<CancelOperation> {
        let mut v: Vec<CancelOperation> = self
            .trees()
            .flat_map(|t| t.ops.values())
            .filter(|o| o.state == CancelState::Prepared)
            .map(|o| (**o).clone())
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Pending interactions of one tree.
    pub fn pending_interactions(&self, root: &str) -> Vec<Interaction> {
        let Some(tree) = self.tree(root) else {
            return Vec::new();
        };
        let mut v: Vec<Interaction> = tree
            .interactions
            .values()
            .filter(|i| i.status == InteractionStatus::Pending)
            .map(|i| (**i).clone())
            .collect();
        v.sort_by(|a, b| (&a.turn_id, &a.request_id).cmp(&(&b.turn_id, &b.request_id)));
        v
    }

    /// A tool call of one session.
    pub fn tool_call(&self, session: &str, call: &str) -> Option<&ToolCall> {
        let slot = self.session_root.get(session)?.slot;
        let tree = self.tree_in(slot)?;
        tree.tool_calls.get(session, call).map(|c| &**c)
    }

    /// Number of active nested child turns under a root turn (the gate's count).
    pub fn active_child_turns(&self, root_session: &str, root_turn: &str) -> usize {
        self.tree(root_session)
            .map_or(0, |t| t.active_child_count(&Id::from(root_turn)))
    }

    pub(crate) fn trees(&self) -> impl Iterator<Item = &Tree> {
        self.slots.iter().flatten()
    }
}

/// Whether no session of the tree has an active turn. The root's turn is checked first, so an
/// active tree costs one lookup; a settled tree is scanned once. The root check is only a
/// shortcut: a child turn is active only under an active root turn (the gate), so the scan of
/// every session gives the same answer without it.
fn no_active_turn(t: &Tree) -> bool {
    if t.root().is_some_and(|s| s.active_turn_id.is_some()) {
        return false;
    }
    t.sessions.values().all(|s| s.active_turn_id.is_none())
}
