//! The handshake budget: connections that have not yet said a valid Hello, counted apart from
//! the trainers' connection slots (a slot is taken only after the Hello), at most
//! [`MAX_HANDSHAKES`] at once and [`MAX_HANDSHAKES_PER_ADDRESS`] from one address.
//!
//! A newcomer from an address at its share is refused at once: that address is the one
//! flooding. A newcomer while the whole budget is taken evicts the oldest handshake instead:
//! an honest client completes its handshake within milliseconds, so the oldest is the one
//! that is silent, and a flood from many addresses cannot keep a rank out either.

use prometheus::IntGauge;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a connection has to complete its TLS handshake and say Hello: a client does both
/// as soon as it connects.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once (each holds a socket and, under TLS, tens of KiB).
pub const MAX_HANDSHAKES: usize = 512;
/// ... from one address: above the ranks of one node dialling one worker at once.
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 64;

/// The handshakes in progress.
pub struct Handshakes {
    limit: usize,
    per_address: usize,
    book: Mutex<Book>,
    /// `stoker_worker_handshakes`.
    gauge: IntGauge,
}

#[derive(Default)]
struct Book {
    next: u64,
    /// By age: the first entry is the oldest.
    open: BTreeMap<u64, (IpAddr, Arc<Notify>)>,
    by_address: HashMap<IpAddr, usize>,
}

impl Book {
    /// Forgets handshake `id` (if it is still counted).
    fn remove(&mut self, id: u64) -> Option<Arc<Notify>> {
        let (address, evict) = self.open.remove(&id)?;
        if let Some(n) = self.by_address.get_mut(&address) {
            *n -= 1;
            if *n == 0 {
                self.by_address.remove(&address);
            }
        }
        Some(evict)
    }
}

/// Why a handshake could not start.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{count} connections from {address} are not yet authenticated (the most one address may have)"
)]
pub struct OverShare {
    pub address: IpAddr,
    pub count: usize,
}

/// One handshake in progress: counted until it is dropped (or evicted).
pub struct Ticket {
    handshakes: Arc<Handshakes>,
    id: u64,
    evict: Arc<Notify>,
}

impl Ticket {
    /// Resolves if a newer handshake evicted this one: the connection should close.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut book = self.handshakes.book();
        book.remove(self.id);
        self.handshakes.gauge.set(book.open.len() as i64);
    }
}

impl Handshakes {
    pub fn new(limit: usize, per_address: usize, gauge: IntGauge) -> Arc<Self> {
        Arc::new(Handshakes {
            limit: limit.max(1),
            per_address: per_address.max(1),
            book: Mutex::default(),
            gauge,
        })
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        // The book holds only counts: a panic elsewhere cannot leave it inconsistent.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a handshake from `address`: refused when the address has its share, else
    /// admitted, evicting the oldest handshake when the budget is full (whether one was).
    pub fn enter(self: &Arc<Self>, address: IpAddr) -> Result<(Ticket, bool), OverShare> {
        let mut book = self.book();
        let count = book.by_address.get(&address).copied().unwrap_or(0);
        if count >= self.per_address {
            return Err(OverShare { address, count });
        }
        let evicted = match book.open.len() >= self.limit {
            true => {
                let oldest = *book.open.keys().next().expect("the budget is full");
                // notify_one keeps the wake-up for a ticket not yet waiting on it.
                book.remove(oldest)
                    .map(|evict| evict.notify_one())
                    .is_some()
            }
            false => false,
        };
        let id = book.next;
        book.next += 1;
        let evict = Arc::new(Notify::new());
        book.open.insert(id, (address, evict.clone()));
        *book.by_address.entry(address).or_default() += 1;
        self.gauge.set(book.open.len() as i64);
        let ticket = Ticket {
            handshakes: self.clone(),
            id,
            evict,
        };
        Ok((ticket, evicted))
    }

    /// Handshakes in progress.
    pub fn in_progress(&self) -> usize {
        self.book().open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge() -> IntGauge {
        IntGauge::new("handshakes", "test").unwrap()
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[tokio::test]
    async fn an_address_at_its_share_is_refused_and_a_full_budget_evicts_the_oldest() {
        let h = Handshakes::new(3, 2, gauge());
        let (a1, _) = h.enter(ip(2)).unwrap();
        let (_a2, _) = h.enter(ip(2)).unwrap();
        assert_eq!(
            h.enter(ip(2)).err(),
            Some(OverShare {
                address: ip(2),
                count: 2
            })
        );
        let (_b1, evicted) = h.enter(ip(3)).unwrap();
        assert!(!evicted);
        // Full: the next one evicts the oldest, a1, which learns it (also before it waits).
        let (_c1, evicted) = h.enter(ip(4)).unwrap();
        assert!(evicted);
        tokio::time::timeout(Duration::from_secs(1), a1.evicted())
            .await
            .expect("a1 was told");
        assert_eq!(h.in_progress(), 3);
        // a1 left its address's count when evicted: dropping it now changes nothing.
        drop(a1);
        assert_eq!(h.in_progress(), 3);
        assert!(
            h.enter(ip(2)).is_ok(),
            "ip 2 holds one handshake of its two"
        );
    }

    #[test]
    fn every_ticket_dropped_leaves_nothing_counted() {
        let h = Handshakes::new(4, 4, gauge());
        let tickets: Vec<_> = (0..10).map(|i| h.enter(ip(i % 3)).map(|t| t.0)).collect();
        assert_eq!(h.in_progress(), 4);
        drop(tickets);
        assert_eq!(h.in_progress(), 0);
        assert_eq!(h.gauge.get(), 0);
        assert!(h.book().by_address.is_empty());
    }
}
