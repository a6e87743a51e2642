//! The `store_roundtrip` fuzz target: an engine workload decoded from the bytes (a tree, its
//! provider facts interleaved with commands: [`engine_workload`]) committed to
//! the reference store and, batch by batch, to a real SQLite file: single commits, group commits
//! (`apply_many`), retries of the last committed step (they must change nothing and publish
//! nothing) and reopenings of
//! the file at random points. Then, and again after a last reopen, SQLite must equal memory:
//! every tree, the live trees, every read (sessions, details, turns, messages, interactions,
//! cancel operations) and the outbox row by row; and every stored tree must restore into an
//! engine unchanged.
//!
//! `tests/tests/fuzz_corpus.rs` replays its seeds on stable.

use crate::orderings::engine_workload;
use std::path::Path;
use tutti_core::store::{MemoryStore, Store};
use tutti_core::Engine;
use tutti_sqlite::SqliteStore;

/// The batch scheduling draws (FNV-1a of the input, then splitmix64).
struct Draws(u64);

impl Draws {
    fn new(data: &[u8]) -> Draws {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in data {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        Draws(h)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n.max(1)
    }
}

fn open(path: &Path) -> Result<SqliteStore, String> {
    SqliteStore::open(path).map_err(|e| format!("open: {e}"))
}

/// Where the database files go: `/dev/shm` when there is one (much faster), else the temp dir.
fn scratch() -> Result<tempfile::TempDir, String> {
    let shm = Path::new("/dev/shm");
    let b = tempfile::Builder::new()
        .prefix("tutti-roundtrip-")
        .tempdir_in(shm);
    b.or_else(|_| tempfile::tempdir())
        .map_err(|e| e.to_string())
}

/// The target; `Err` names what differs.
pub fn store_roundtrip(data: &[u8]) -> Result<(), String> {
    let (h, _) = engine_workload(data)?;
    let dir = scratch()?;
    let path = dir.path().join("tutti.db");
    let mut db = open(&path)?;
    let mut d = Draws::new(data);
    let batches = &h.batches;
    let mut i = 0;
    let mut last = 0..0;
    while i < batches.len() {
        match d.below(8) {
            0 | 1 => {
                let n = 1 + d.below(6) as usize;
                let end = (i + n).min(batches.len());
                db.apply_many(&batches[i..end])
                    .map_err(|e| format!("apply_many of batches {i}..{end}: {e}"))?;
                last = i..end;
                i = end;
            }
            2 => {
                db = open(&path)?;
            }
            3 if !last.is_empty() => {
                // A retry of the last step committed ("every batch is idempotent, so replaying a
                // step is harmless") changes nothing: it is a no-op or refused by its guards, and
                // publishes nothing. (Not a whole group: a group that appends a message and then
                // purges its session re-inserts and re-publishes the message when replayed.)
                let k = last.end - 1;
                let before = db.last_outbox_seq().map_err(|e| e.to_string())?;
                let snap = db.snapshot_all().map_err(|e| e.to_string())?;
                let _ = db.apply(&batches[k]);
                if db.last_outbox_seq().map_err(|e| e.to_string())? != before {
                    let again = db
                        .outbox_after(before, usize::MAX)
                        .map_err(|e| e.to_string())?;
                    let kinds: Vec<&str> = again.iter().map(|r| r.kind.as_str()).collect();
                    return Err(format!(
                        "retrying batch {k} of {} published outbox rows again: {kinds:?}",
                        batches.len()
                    ));
                }
                if db.snapshot_all().map_err(|e| e.to_string())? != snap {
                    return Err(format!("retrying batch {k} changed the stored state"));
                }
            }
            _ => {
                db.apply(&batches[i])
                    .map_err(|e| format!("apply of batch {i}: {e}"))?;
                last = i..i + 1;
                i += 1;
            }
        }
    }
    same(&h.store, &db).map_err(|e| format!("after {} batches: {e}", batches.len()))?;
    drop(db);
    let db = open(&path)?;
    same(&h.store, &db).map_err(|e| format!("after reopening: {e}"))
}

fn same(mem: &MemoryStore, db: &SqliteStore) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut roots = mem.root_ids();
    roots.sort();
    let mut stored: Vec<_> = db
        .snapshot_all()
        .map_err(|e| err(&e))?
        .iter()
        .filter_map(|t| t.root().map(|r| r.id.clone()))
        .collect();
    stored.sort();
    if roots != stored {
        return Err(format!("roots differ: memory {roots:?}, sqlite {stored:?}"));
    }
    for r in &roots {
        let a = mem.load_tree(r).map_err(|e| err(&e))?;
        let b = db.load_tree(r).map_err(|e| err(&e))?;
        if a != b {
            return Err(format!("tree {r} differs"));
        }
        if let Some(t) = b {
            let mut engine = Engine::new();
            engine
                .restore(t.clone())
                .map_err(|e| format!("stored tree {r} does not restore: {e}"))?;
            if engine.snapshot(r).as_ref() != Some(&t) {
                return Err(format!("tree {r} changes when restored into an engine"));
            }
            for s in &t.sessions {
                if mem.session(&s.id).map_err(|e| err(&e))?
                    != db.session(&s.id).map_err(|e| err(&e))?
                {
                    return Err(format!("session {} reads differently", s.id));
                }
                let (da, db_) = (
                    mem.session_detail(&s.id).map_err(|e| err(&e))?,
                    db.session_detail(&s.id).map_err(|e| err(&e))?,
                );
                if da != db_ {
                    return Err(format!("session detail {} differs", s.id));
                }
                if mem.messages(&s.id, None, usize::MAX).map_err(|e| err(&e))?
                    != db.messages(&s.id, None, usize::MAX).map_err(|e| err(&e))?
                {
                    return Err(format!("messages of {} differ", s.id));
                }
            }
            for x in &t.turns {
                if mem.turn(&x.id).map_err(|e| err(&e))? != db.turn(&x.id).map_err(|e| err(&e))? {
                    return Err(format!("turn {} reads differently", x.id));
                }
            }
            for x in &t.interactions {
                let a = mem
                    .interaction(&x.turn_id, &x.request_id)
                    .map_err(|e| err(&e))?;
                let b = db
                    .interaction(&x.turn_id, &x.request_id)
                    .map_err(|e| err(&e))?;
                if a != b {
                    return Err(format!("interaction {} reads differently", x.request_id));
                }
            }
            for o in &t.cancel_operations {
                if mem.cancel_operation(&o.id).map_err(|e| err(&e))?
                    != db.cancel_operation(&o.id).map_err(|e| err(&e))?
                {
                    return Err(format!("cancel operation {} reads differently", o.id));
                }
            }
        }
    }
    let mut live_a = mem.load_live_trees().map_err(|e| err(&e))?;
    let mut live_b = db.load_live_trees().map_err(|e| err(&e))?;
    let key = |t: &tutti_core::TreeSnapshot| t.root().map(|r| r.id.clone());
    live_a.sort_by_key(key);
    live_b.sort_by_key(key);
    if live_a != live_b {
        return Err("live trees differ".into());
    }
    let a = mem.outbox_after(0, usize::MAX).map_err(|e| err(&e))?;
    let b = db.outbox_after(0, usize::MAX).map_err(|e| err(&e))?;
    if a.len() != b.len() {
        return Err(format!(
            "outbox: memory has {} rows, sqlite {}",
            a.len(),
            b.len()
        ));
    }
    for (x, y) in a.iter().zip(&b) {
        if x != y {
            return Err(format!(
                "outbox row {} differs ({} vs {})",
                x.seq, x.kind, y.kind
            ));
        }
    }
    if let Some((i, r)) = b.iter().enumerate().find(|(i, r)| r.seq != *i as u64 + 1) {
        return Err(format!(
            "sqlite outbox has a gap at position {i}: seq {}",
            r.seq
        ));
    }
    Ok(())
}
