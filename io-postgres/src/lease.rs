//! Tree ownership and fencing (issue 21): "Exactly one daemon runs the provider process of a
//! root tree at a time: a lease row per live root (owner, epoch, expiry), claimed before the
//! provider starts and renewed while it runs. Every batch a daemon commits for a tree carries a
//! fencing guard on the lease epoch, so a daemon that lost its lease (paused, partitioned) can
//! never commit for that tree again."
//!
//! A lease is a row of `tree_leases`: the root, the owner's name and address (where other daemons
//! forward commands), the epoch and the expiry (milliseconds of the caller's clock: the store has
//! no clock; every daemon must pass comparable times, e.g. wall-clock milliseconds).
//!
//! - [`PostgresStore::claim_lease`] takes a lease that is free, expired or already this owner's;
//!   every claim of a lease that was free or expired gets a new, higher epoch.
//! - [`PostgresStore::renew_lease`] extends it, only while the stored epoch is still the caller's
//!   ([`PostgresStore::renew_leases`]: many at once, as a daemon renews every lease it holds).
//! - Fencing is store-side, per tree, instead of a new [`Guard`](tutti_core::step::Guard) kind
//!   (a choice: the engine and the other stores stay as they are): a successful claim registers
//!   the tree's epoch on this store handle, and every batch this handle applies for that tree
//!   reads the lease row `FOR SHARE` inside its transaction and is refused
//!   ([`PgError::Fenced`], nothing written) unless the stored epoch is
//!   still the registered one. A concurrent claim updates that row, so it waits for the commit
//!   and the commit waits for it: a commit is either before the takeover or refused.
//! - A lease that expired but that nobody else claimed is not lost: its owner may still commit
//!   (no other daemon owns the tree) and renews it with its epoch.

use crate::error::{to_i64, to_u64, PgError};
use crate::PostgresStore;
use tutti_core::model::Id;

/// One tree's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The root session of the tree.
    pub root_agent_session_id: Id,
    /// The owning daemon's name.
    pub owner: String,
    /// Where the owner takes forwarded commands.
    pub owner_address: String,
    /// Incremented by every claim of a free or expired lease.
    pub epoch: u64,
    /// When it expires unless renewed (caller's milliseconds).
    pub expires_at_ms: i64,
}

/// What [`PostgresStore::claim_lease`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller owns the tree now (a new epoch, or its own live lease extended).
    Owned(Lease),
    /// Another owner's lease is live: forward to it.
    HeldBy(Lease),
}

/// The expiry of a released lease (the smallest `BIGINT`): expired for every clock.
pub const RELEASED: i64 = i64::MIN;

impl Lease {
    /// Whether the owner gave the lease up (no provider of the tree runs anywhere), as opposed
    /// to a lease that expired because its owner stopped renewing it.
    pub fn is_released(&self) -> bool {
        self.expires_at_ms == RELEASED
    }
}

/// The most leases [`PostgresStore::renew_leases`] and [`PostgresStore::release_leases`] write
/// with one statement (each statement is its own transaction, so a few thousand leases do not
/// hold their rows locked in one long one).
pub const LEASES_PER_STATEMENT: usize = 1000;

/// A list of (root, epoch) as the two arrays the batched lease statements take.
fn lease_arrays(held: &[(&str, u64)]) -> Result<(Vec<String>, Vec<i64>), PgError> {
    let mut roots = Vec::with_capacity(held.len());
    let mut epochs = Vec::with_capacity(held.len());
    for (root, epoch) in held {
        roots.push((*root).to_string());
        epochs.push(to_i64("lease epoch", *epoch)?);
    }
    Ok((roots, epochs))
}

const LEASE: &str = "SELECT root_agent_session_id, owner, owner_address, epoch, expires_at_ms \
     FROM tree_leases WHERE root_agent_session_id = $1";

fn lease_of(r: &postgres::Row) -> Result<Lease, PgError> {
    Ok(Lease {
        root_agent_session_id: Id::from(r.get::<_, &str>(0)),
        owner: r.get(1),
        owner_address: r.get(2),
        epoch: to_u64("lease epoch", r.get(3))?,
        expires_at_ms: r.get(4),
    })
}

impl PostgresStore {
    /// Claims the lease of `root` for `owner` (reachable at `address`) until `now_ms + ttl_ms`.
    /// A free or expired lease gets the next epoch; the caller's own live lease is extended with
    /// its epoch; another owner's live lease is left alone ([`Claim::HeldBy`]). On success the
    /// epoch is registered for fencing on this handle.
    pub fn claim_lease(
        &mut self,
        root: &str,
        owner: &str,
        address: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<Claim, PgError> {
        Ok(self
            .claim_lease_after(root, owner, address, now_ms, ttl_ms)?
            .0)
    }

    /// [`PostgresStore::claim_lease`], also returning the lease row as it was before the claim
    /// (`None`: the tree never had one). A claim whose previous lease was another owner's, or
    /// not released ([`Lease::is_released`]), took the tree from an owner that stopped renewing
    /// (failover: the tree must be settled as a restart does).
    pub fn claim_lease_after(
        &mut self,
        root: &str,
        owner: &str,
        address: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(Claim, Option<Lease>), PgError> {
        let expires = now_ms.saturating_add(ttl_ms);
        // One transaction; run again on a new connection when the connection broke (a claim
        // that committed is this owner's live lease by then: it is extended, same epoch).
        let (lease, previous) = self.with_client(|c, _| {
            let mut tx = c.transaction()?;
            let current = match tx.query_opt(&format!("{LEASE} FOR UPDATE"), &[&root])? {
                Some(r) => Some(lease_of(&r)?),
                None => None,
            };
            let previous = current.clone();
            let lease = match current {
                Some(l) if l.owner != owner && l.expires_at_ms > now_ms => {
                    tx.commit()?;
                    return Ok((Err(l), previous));
                }
                Some(l) => {
                    let epoch = if l.owner == owner && l.expires_at_ms > now_ms {
                        l.epoch
                    } else {
                        l.epoch + 1
                    };
                    tx.execute(
                        "UPDATE tree_leases SET owner = $2, owner_address = $3, epoch = $4, \
                         expires_at_ms = $5 WHERE root_agent_session_id = $1",
                        &[
                            &root,
                            &owner,
                            &address,
                            &to_i64("lease epoch", epoch)?,
                            &expires,
                        ],
                    )?;
                    epoch
                }
                None => {
                    tx.execute(
                        "INSERT INTO tree_leases (root_agent_session_id, owner, owner_address, \
                         epoch, expires_at_ms) VALUES ($1, $2, $3, 1, $4)",
                        &[&root, &owner, &address, &expires],
                    )?;
                    1
                }
            };
            tx.commit()?;
            Ok((Ok(lease), previous))
        })?;
        let lease = match lease {
            Ok(epoch) => epoch,
            Err(held) => return Ok((Claim::HeldBy(held), previous)),
        };
        self.fences.insert(Id::from(root), lease);
        Ok((
            Claim::Owned(Lease {
                root_agent_session_id: Id::from(root),
                owner: owner.to_string(),
                owner_address: address.to_string(),
                epoch: lease,
                expires_at_ms: expires,
            }),
            previous,
        ))
    }

    /// Extends `owner`'s lease of `root` at `epoch` until `now_ms + ttl_ms`. `false`: the lease
    /// was taken over (another epoch) or removed; the caller no longer owns the tree.
    pub fn renew_lease(
        &mut self,
        root: &str,
        owner: &str,
        epoch: u64,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, PgError> {
        let epoch = to_i64("lease epoch", epoch)?;
        let n = self.with_client(|c, _| {
            Ok(c.execute(
                "UPDATE tree_leases SET expires_at_ms = $4 WHERE root_agent_session_id = $1 \
                 AND owner = $2 AND epoch = $3",
                &[&root, &owner, &epoch, &now_ms.saturating_add(ttl_ms)],
            )?)
        })?;
        Ok(n == 1)
    }

    /// [`PostgresStore::renew_lease`] for many trees at once: extends each of `owner`'s leases
    /// in `held` (root, epoch) until `now_ms + ttl_ms`, in one statement per
    /// [`LEASES_PER_STATEMENT`] leases, and returns the roots whose lease was extended; a root
    /// left out was taken over or removed (the caller no longer owns that tree).
    ///
    /// A daemon renews every lease it holds each third of the lease time; one statement (one
    /// round trip and one commit) for each lease held stalled its engine thread for the sum of
    /// those commits (about 50 ms with 100 trees on a local server, so every renewal tick put
    /// about one row in a hundred over 5 ms; the knee bench found it). On an error the caller
    /// counts none as renewed (the statements that went through before it did extend their
    /// leases; the next renewal extends them again).
    pub fn renew_leases(
        &mut self,
        owner: &str,
        held: &[(&str, u64)],
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<Vec<Id>, PgError> {
        self.set_expiries(owner, held, now_ms.saturating_add(ttl_ms))
    }

    /// [`PostgresStore::release_lease`] for many trees at once: gives up each of `owner`'s
    /// leases in `held` (root, epoch), in one statement per [`LEASES_PER_STATEMENT`] leases, and
    /// stops fencing those trees on this handle. Returns the roots whose lease was released (a
    /// root left out was no longer `owner`'s at that epoch).
    pub fn release_leases(
        &mut self,
        owner: &str,
        held: &[(&str, u64)],
    ) -> Result<Vec<Id>, PgError> {
        for (root, _) in held {
            self.fences.remove(*root);
        }
        self.set_expiries(owner, held, RELEASED)
    }

    /// Sets the expiry of each of `owner`'s leases in `held` (root, epoch) that is still at that
    /// epoch, one statement per [`LEASES_PER_STATEMENT`] leases; returns the roots it set.
    fn set_expiries(
        &mut self,
        owner: &str,
        held: &[(&str, u64)],
        expires_at_ms: i64,
    ) -> Result<Vec<Id>, PgError> {
        let mut set = Vec::with_capacity(held.len());
        for chunk in held.chunks(LEASES_PER_STATEMENT) {
            let (roots, epochs) = lease_arrays(chunk)?;
            let rows = self.with_client(|c, _| {
                Ok(c.query(
                    "UPDATE tree_leases AS l SET expires_at_ms = $4 \
                     FROM unnest($1::text[], $2::bigint[]) AS h (root, epoch) \
                     WHERE l.root_agent_session_id = h.root AND l.epoch = h.epoch \
                     AND l.owner = $3 RETURNING l.root_agent_session_id",
                    &[&roots, &epochs, &owner, &expires_at_ms],
                )?)
            })?;
            set.extend(rows.iter().map(|r| Id::from(r.get::<_, &str>(0))));
        }
        Ok(set)
    }

    /// Gives up `owner`'s lease of `root` at `epoch` (it expires at once; the epoch stays, so the
    /// next claim gets a higher one) and stops fencing the tree on this handle.
    pub fn release_lease(&mut self, root: &str, owner: &str, epoch: u64) -> Result<bool, PgError> {
        self.fences.remove(root);
        let epoch = to_i64("lease epoch", epoch)?;
        let n = self.with_client(|c, _| {
            Ok(c.execute(
                "UPDATE tree_leases SET expires_at_ms = $4 \
                 WHERE root_agent_session_id = $1 AND owner = $2 AND epoch = $3",
                &[&root, &owner, &epoch, &RELEASED],
            )?)
        })?;
        Ok(n == 1)
    }

    /// Up to `limit` roots whose lease expired (not released: a released lease's tree has no
    /// provider running anywhere) and that `owner` does not hold: their owner stopped renewing
    /// (it died or was cut off), so their trees may be taken over (issue 21, failover).
    pub fn expired_leases(&self, owner: &str, now_ms: i64, limit: i64) -> Result<Vec<Id>, PgError> {
        Ok(self
            .query(
                "SELECT root_agent_session_id FROM tree_leases WHERE expires_at_ms <= $1 \
                 AND expires_at_ms > -9223372036854775808 AND owner <> $2 \
                 ORDER BY root_agent_session_id LIMIT $3",
                &[&now_ms, &owner, &limit],
            )?
            .iter()
            .map(|r| Id::from(r.get::<_, &str>(0)))
            .collect())
    }

    /// The lease of `root`, if it was ever claimed.
    pub fn lease(&self, root: &str) -> Result<Option<Lease>, PgError> {
        match self.query(LEASE, &[&root])?.first() {
            Some(r) => Ok(Some(lease_of(r)?)),
            None => Ok(None),
        }
    }

    /// The epoch this handle fences `root` at (its last claim of the tree, until released):
    /// what a batch of the tree decided now is fenced by (issue 34, per-batch fencing).
    pub fn fenced_at(&self, root: &str) -> Option<u64> {
        self.fences.get(root).copied()
    }

    /// Fences `root` at `epoch` on this handle (what a successful claim does): from now on every
    /// batch for that tree commits only while the stored lease epoch is `epoch`.
    pub fn fence(&mut self, root: &str, epoch: u64) {
        self.fences.insert(Id::from(root), epoch);
    }
}
