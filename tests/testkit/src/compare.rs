//! Comparing an [`SqliteStore`] with the reference [`MemoryStore`]: every tree, every read, the
//! outbox. Shared by the tests and the crash loop binary.

use crate::workload::{Mix, Stream};
use std::collections::BTreeSet;
use tutti_core::model::SessionKind;
use tutti_core::store::{MemoryStore, Store};
use tutti_core::TreeSnapshot;
use tutti_sqlite::SqliteStore;

/// Every tree of the reference store, sorted by root id.
pub fn mem_trees(mem: &MemoryStore) -> Vec<TreeSnapshot> {
    mem.root_ids()
        .iter()
        .filter_map(|r| mem.load_tree(r).ok().flatten())
        .collect()
}

/// Trees and outbox equal.
pub fn compare_state(mem: &MemoryStore, db: &SqliteStore) -> Result<(), String> {
    let a = mem_trees(mem);
    let b = db.snapshot_all().map_err(|e| e.to_string())?;
    if a.len() != b.len() {
        return Err(format!(
            "{} trees in memory, {} in the file",
            a.len(),
            b.len()
        ));
    }
    for (x, y) in a.iter().zip(&b) {
        if x != y {
            let root = x.root().map(|s| s.id.to_string()).unwrap_or_default();
            return Err(format!(
                "tree {root} differs:\nmemory: {x:?}\nfile:   {y:?}"
            ));
        }
    }
    let oa = mem.outbox();
    let ob = db.outbox_after(0, usize::MAX).map_err(|e| e.to_string())?;
    if oa != ob.as_slice() {
        let first = oa
            .iter()
            .zip(&ob)
            .position(|(x, y)| x != y)
            .unwrap_or(oa.len().min(ob.len()));
        return Err(format!(
            "outbox differs ({} rows in memory, {} in the file), first difference at index {first}",
            oa.len(),
            ob.len()
        ));
    }
    Ok(())
}

/// Every read of the `Store` trait plus the root lists, for every id either store has ever
/// published (deleted and purged ones included).
pub fn compare_reads(mem: &MemoryStore, db: &SqliteStore) -> Result<(), String> {
    let e = |x: tutti_sqlite::SqliteError| x.to_string();
    let mut sessions = BTreeSet::new();
    let mut turns = BTreeSet::new();
    let mut interactions = BTreeSet::new();
    let mut ops = BTreeSet::new();
    let mut workspaces = BTreeSet::new();
    for row in mem.outbox() {
        workspaces.insert(row.workspace_id.to_string());
        let p = &row.payload;
        let s = |k: &str| p.get(k).and_then(|v| v.as_str()).map(str::to_string);
        match row.kind.as_str() {
            "session" | "sessionDeleted" => sessions.extend(s("id")),
            "turn" => turns.extend(s("id")),
            "interaction" => {
                if let (Some(t), Some(r)) = (s("turnId"), s("requestId")) {
                    interactions.insert((t, r));
                }
            }
            "cancelOperation" => ops.extend(s("id")),
            "message" => sessions.extend(s("agentSessionId")),
            _ => {}
        }
    }
    for t in mem_trees(mem) {
        sessions.extend(t.sessions.iter().map(|s| s.id.to_string()));
        turns.extend(t.turns.iter().map(|x| x.id.to_string()));
        interactions.extend(
            t.interactions
                .iter()
                .map(|i| (i.turn_id.to_string(), i.request_id.to_string())),
        );
        ops.extend(t.cancel_operations.iter().map(|o| o.id.to_string()));
        workspaces.extend(t.sessions.iter().map(|s| s.workspace_id.to_string()));
    }
    sessions.insert("no-such-session".to_string());
    turns.insert("no-such-turn".to_string());
    for id in &sessions {
        let (a, b) = (mem.session(id).ok().flatten(), db.session(id).map_err(e)?);
        if a != b {
            return Err(format!("session({id}): {a:?} != {b:?}"));
        }
        let (a, b) = (
            mem.session_detail(id).ok().flatten(),
            db.session_detail(id).map_err(e)?,
        );
        if a != b {
            return Err(format!("session_detail({id}) differs"));
        }
        let all = mem.messages(id, None, usize::MAX).ok().unwrap_or_default();
        let got = db.messages(id, None, usize::MAX).map_err(e)?;
        if all != got {
            return Err(format!(
                "messages({id}) differ: {} vs {}",
                all.len(),
                got.len()
            ));
        }
        // Pages of 3 by seq cursor.
        let mut after = None;
        let mut paged = Vec::new();
        loop {
            let a = mem.messages(id, after, 3).ok().unwrap_or_default();
            let b = db.messages(id, after, 3).map_err(e)?;
            if a != b {
                return Err(format!("messages({id}, {after:?}, 3) differ"));
            }
            let Some(last) = b.last() else { break };
            after = Some(last.seq);
            paged.extend(b);
        }
        if paged != all {
            return Err(format!("paged messages of {id} differ from all"));
        }
        let (a, b) = (
            mem.session(id).ok().flatten().map(|s| s.kind()),
            db.root_of(id).map_err(e)?,
        );
        if a == Some(SessionKind::Root) && b.as_deref() != Some(id.as_str()) {
            return Err(format!("root_of({id}) = {b:?}"));
        }
    }
    for id in &turns {
        let (a, b) = (mem.turn(id).ok().flatten(), db.turn(id).map_err(e)?);
        if a != b {
            return Err(format!("turn({id}): {a:?} != {b:?}"));
        }
    }
    for (t, r) in &interactions {
        let (a, b) = (
            mem.interaction(t, r).ok().flatten(),
            db.interaction(t, r).map_err(e)?,
        );
        if a != b {
            return Err(format!("interaction({t}, {r}): {a:?} != {b:?}"));
        }
    }
    for id in &ops {
        let (a, b) = (
            mem.cancel_operation(id).ok().flatten(),
            db.cancel_operation(id).map_err(e)?,
        );
        if a != b {
            return Err(format!("cancel_operation({id}): {a:?} != {b:?}"));
        }
        let root = a.map(|o| o.root_agent_session_id);
        if db.root_of_cancel_operation(id).map_err(e)? != root {
            return Err(format!("root_of_cancel_operation({id})"));
        }
    }
    for ws in &workspaces {
        let want = mem.roots(ws);
        for page_size in [1usize, 2, 1000] {
            let mut got = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let (page, next) = db.roots(ws, page_size, cursor.as_deref()).map_err(e)?;
                if page.len() > page_size {
                    return Err(format!("roots({ws}) page larger than {page_size}"));
                }
                got.extend(page);
                match next {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            if got != want {
                return Err(format!(
                    "roots({ws}) by {page_size}: {} vs {} sessions",
                    got.len(),
                    want.len()
                ));
            }
        }
    }
    let (a, b) = (
        mem.load_live_trees().map_err(|x| x.to_string())?,
        db.load_live_trees().map_err(e)?,
    );
    if a != b {
        return Err(format!("load_live_trees: {} vs {} trees", a.len(), b.len()));
    }
    // Outbox paging.
    let all = mem.outbox();
    for (after, limit) in [
        (0u64, 1usize),
        (1, 5),
        (all.len() as u64 / 2, 7),
        (u64::MAX, 3),
    ] {
        let want: Vec<_> = all
            .iter()
            .filter(|r| r.seq > after)
            .take(limit)
            .cloned()
            .collect();
        if db.outbox_after(after, limit).map_err(e)? != want {
            return Err(format!("outbox_after({after}, {limit}) differs"));
        }
    }
    Ok(())
}

/// The crash-loop history: which prefix of the deterministic batch stream of `seed` the file
/// holds. Replays the stream into a MemoryStore batch by batch and returns the number of whole
/// batches `k` whose state (every tree and the whole outbox) equals the file's, together with
/// the stream positioned right after batch `k`. `Err` if no prefix matches: a batch was torn.
pub fn locate(seed: u64, db: &SqliteStore) -> Result<(u64, Stream, MemoryStore), String> {
    let want = db.last_outbox_seq().map_err(|e| e.to_string())?;
    let mut stream = Stream::new(seed, Mix::ALL);
    let mut mem = MemoryStore::new();
    let mut k = 0u64;
    let mut last_err = String::from("no candidate prefix");
    loop {
        let have = mem.outbox().len() as u64;
        if have == want {
            match compare_state(&mem, db) {
                Ok(()) => return Ok((k, stream, mem)),
                Err(e) => last_err = e,
            }
        }
        if have > want {
            return Err(format!(
                "no prefix of whole batches matches the file (outbox {want}); last mismatch: {last_err}"
            ));
        }
        let step = stream.next_step();
        mem.apply(&step.persist)
            .map_err(|e| format!("reference store refused batch {}: {e}", k + 1))?;
        k += 1;
    }
}
