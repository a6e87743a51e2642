//! Interactions: "persist, render, submit, and settle the interaction by its canonical child
//! session/turn/request tuple, but send the provider's original turn id back".

use super::child::turn_of;
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::Hint;
use crate::model::{Id, Interaction, InteractionStatus};
use crate::step::{Ignored, ProviderRequest, Reply};
use serde_json::Value;
use std::sync::Arc;

/// `interactionRequested` on the exact session/turn.
#[allow(clippy::too_many_arguments)]
pub(crate) fn requested(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: &Id,
    request: &Id,
    provider_turn_id: Option<&String>,
    kind: &Value,
    payload: &Value,
) -> Result<Tx, Rejected> {
    let (_, t) = turn_of(tree, (session, Hint::NONE), turn)?;
    if tree.interactions.contains_key(turn, request) {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    if !t.is_active() {
        return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
    }
    if tree.inflight.contains_key(turn) {
        return Ok(Tx::ignore(now, Ignored::ClosedCancelTarget));
    }
    let mut tx = Tx::new(now);
    tree.interactions.insert(
        turn.clone(),
        request.clone(),
        Arc::new(Interaction {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            request_id: request.clone(),
            provider_turn_id: provider_turn_id.cloned(),
            kind: kind.clone(),
            payload: payload.clone(),
            status: InteractionStatus::Pending,
            response: None,
            resolution: None,
            created_at: now,
            updated_at: now,
            version: 0,
        }),
    );
    tree.pending
        .get_or_insert_with(turn, Default::default)
        .push(request.clone());
    tx.interaction(turn, request);
    Ok(tx)
}

fn find<'t>(
    tree: &'t Tree,
    session: &Id,
    turn: &Id,
    request: &Id,
) -> Result<&'t Interaction, Rejected> {
    match tree.interactions.get(turn, request) {
        Some(i) if i.agent_session_id == *session => Ok(i),
        _ => Err(Rejected::UnknownInteraction {
            session: session.clone(),
            turn: turn.clone(),
            request: request.clone(),
        }),
    }
}

fn unpend(tree: &mut Tree, turn: &Id, request: &Id) {
    if let Some(v) = tree.pending.get_mut(turn) {
        v.retain(|r| r != request);
    }
}

/// `respondInteraction`: only the exact canonical tuple is accepted.
pub(crate) fn respond(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: &Id,
    request: &Id,
    response: &Value,
) -> Result<Tx, Rejected> {
    let i = find(tree, session, turn, request)?;
    if i.status != InteractionStatus::Pending {
        return Err(Rejected::InteractionNotPending(request.clone()));
    }
    let provider_turn_id = i.provider_turn_id.clone();
    let mut tx = Tx::new(now);
    if let Some(i) = tree.interactions.get_mut(turn, request).map(Arc::make_mut) {
        i.status = InteractionStatus::Answered;
        i.response = (!response.is_null()).then(|| response.clone());
    }
    unpend(tree, turn, request);
    tx.interaction(turn, request);
    tx.provider.push(ProviderRequest::RespondInteraction {
        root_agent_session_id: tree.root_id.clone(),
        agent_session_id: session.clone(),
        turn_id: turn.clone(),
        request_id: request.clone(),
        provider_turn_id,
        response: response.clone(),
    });
    tx.reply = Some(Reply::Responded);
    Ok(tx)
}

/// `interactionResolved` from the provider.
pub(crate) fn resolved(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: &Id,
    request: &Id,
    resolution: &Value,
) -> Result<Tx, Rejected> {
    let i = find(tree, session, turn, request)?;
    if matches!(
        i.status,
        InteractionStatus::Resolved | InteractionStatus::Superseded
    ) {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    if let Some(i) = tree.interactions.get_mut(turn, request).map(Arc::make_mut) {
        i.status = InteractionStatus::Resolved;
        i.resolution = (!resolution.is_null()).then(|| resolution.clone());
    }
    unpend(tree, turn, request);
    tx.interaction(turn, request);
    Ok(tx)
}
