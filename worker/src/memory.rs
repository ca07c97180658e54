//! What a worker holds, bounded: the bytes of samples being prepared (objects fetched, images
//! decoded, pixels prepared) and of batches waiting to be sent (`--max-worker-bytes`), each
//! held by the request it belongs to until its answer is on the socket; and the samples
//! started and not yet built into a batch (`--max-inflight-samples`).
//!
//! A request starts when both have room for it at once: its samples (all of them up to the
//! limit), and what it is expected to hold (its samples times the bytes per sample of the last
//! batch built) within what the worker has left of the budget and what its connection has
//! left of its share (the budget over the connections open plus one), so a rank that stops
//! reading fills its own share and the others keep being served. It holds both from the
//! start, and waits for neither once started: bytes are charged as they come into being, so
//! the worker cannot deadlock, and what it can hold past the budget is what its samples in
//! preparation hold beyond what was expected (docs/reliability.md gives the formula).

use prometheus::IntGauge;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

pub struct MemoryPool {
    max: u64,
    held: AtomicU64,
    /// Samples started and not yet built, and the most there may be.
    samples: AtomicU64,
    max_samples: u64,
    connections: AtomicU64,
    /// Bytes a sample is expected to hold: the last batch built's, per sample.
    per_sample: AtomicU64,
    /// Taken to look and take at once, so two requests never both take the last room.
    admitting: Mutex<()>,
    freed: Notify,
    gauge: IntGauge,
}

impl MemoryPool {
    /// A budget of `max` bytes and of `samples` samples started and not yet built.
    pub fn new(max: u64, samples: usize, gauge: IntGauge) -> Arc<Self> {
        Arc::new(MemoryPool {
            max,
            held: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            max_samples: samples.max(1) as u64,
            connections: AtomicU64::new(0),
            per_sample: AtomicU64::new(0),
            admitting: Mutex::new(()),
            freed: Notify::new(),
            gauge,
        })
    }

    /// Bytes held now, across connections.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// A connection's account of its requests' bytes, open until dropped.
    pub fn connection(self: &Arc<Self>) -> Arc<ConnMemory> {
        self.connections.fetch_add(1, Ordering::SeqCst);
        Arc::new(ConnMemory {
            pool: self.clone(),
            held: AtomicU64::new(0),
        })
    }

    fn add(&self, conn: &ConnMemory, bytes: u64) {
        conn.held.fetch_add(bytes, Ordering::SeqCst);
        let now = self.held.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.gauge.set(now as i64);
    }

    fn release(&self, conn: &ConnMemory, bytes: u64) {
        if bytes == 0 {
            return;
        }
        conn.held.fetch_sub(bytes, Ordering::SeqCst);
        let now = self.held.fetch_sub(bytes, Ordering::SeqCst) - bytes;
        self.gauge.set(now as i64);
        self.freed.notify_waiters();
    }

    fn release_samples(&self, samples: u64) {
        if samples > 0 {
            self.samples.fetch_sub(samples, Ordering::SeqCst);
            self.freed.notify_waiters();
        }
    }
}

/// One connection's bytes.
pub struct ConnMemory {
    pool: Arc<MemoryPool>,
    held: AtomicU64,
}

impl ConnMemory {
    /// Bytes this connection's requests hold now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Its share of the budget: one part more than there are connections, so that one
    /// arriving finds room even when every other has filled its own.
    fn share(&self) -> u64 {
        let pool = &self.pool;
        pool.max / (pool.connections.load(Ordering::SeqCst) + 1)
    }

    /// Whether `samples` more samples and `expected` more bytes fit; an empty worker or
    /// connection takes a request of any size, so that one always goes on.
    fn fits(&self, samples: u64, expected: u64) -> bool {
        let pool = &self.pool;
        let started = pool.samples.load(Ordering::SeqCst);
        let (held, all) = (self.held(), pool.held());
        (started == 0 || started + samples <= pool.max_samples)
            && (all == 0 || all + expected <= pool.max)
            && (held == 0 || held + expected <= self.share())
    }

    /// Waits until a request of `samples` samples may start, then opens its account, holding
    /// its samples (at most the limit) and what it is expected to hold.
    pub async fn admit(self: &Arc<Self>, samples: usize) -> Arc<Account> {
        let pool = &self.pool;
        let expected = |per_sample| (samples as u64).saturating_mul(per_sample);
        let samples = (samples as u64).clamp(1, pool.max_samples);
        loop {
            let freed = pool.freed.notified();
            tokio::pin!(freed);
            // Registered before looking, so a release in between is not missed.
            freed.as_mut().enable();
            {
                let _one_at_a_time = pool.admitting.lock().expect("not poisoned");
                let expected = expected(pool.per_sample.load(Ordering::SeqCst));
                if self.fits(samples, expected) {
                    pool.samples.fetch_add(samples, Ordering::SeqCst);
                    pool.add(self, expected);
                    return Arc::new(Account {
                        conn: self.clone(),
                        kept: Mutex::new(Kept {
                            bytes: expected,
                            unused: expected,
                            samples,
                        }),
                    });
                }
            }
            freed.await;
        }
    }
}

impl Drop for ConnMemory {
    fn drop(&mut self) {
        self.pool.connections.fetch_sub(1, Ordering::SeqCst);
        // A smaller count gives every other connection a larger share.
        self.pool.freed.notify_waiters();
    }
}

/// One request's bytes and samples: the samples go when its batch is built, the bytes it
/// keeps (what it was expected to hold, its prepared samples) when it is dropped, after its
/// answer is written or thrown away.
pub struct Account {
    conn: Arc<ConnMemory>,
    kept: Mutex<Kept>,
}

struct Kept {
    bytes: u64,
    /// What was held from the start and no sample has kept yet.
    unused: u64,
    /// Samples held until the batch is built.
    samples: u64,
}

impl Account {
    /// Bytes held until the account is dropped (taken first from what it holds already).
    pub fn keep(&self, bytes: u64) {
        let mut k = self.kept.lock().expect("not poisoned");
        let covered = bytes.min(k.unused);
        k.unused -= covered;
        k.bytes += bytes - covered;
        self.conn.pool.add(&self.conn, bytes - covered);
    }

    /// The batch is built, of `samples` samples and `bytes` bytes: its samples go, it keeps
    /// exactly its bytes from now on, and the next requests are expected to hold as much per
    /// sample.
    pub fn settle(&self, samples: usize, bytes: u64) {
        let pool = &self.conn.pool;
        let mut k = self.kept.lock().expect("not poisoned");
        let before = std::mem::replace(&mut k.bytes, bytes);
        k.unused = 0;
        if bytes >= before {
            pool.add(&self.conn, bytes - before);
        } else {
            pool.release(&self.conn, before - bytes);
        }
        pool.release_samples(std::mem::take(&mut k.samples));
        let per_sample = bytes / samples.max(1) as u64;
        pool.per_sample.store(per_sample, Ordering::SeqCst);
    }

    /// Bytes held until the charge is dropped.
    pub fn charge(self: &Arc<Self>, bytes: u64) -> Charge {
        self.conn.pool.add(&self.conn, bytes);
        Charge {
            account: Some(self.clone()),
            bytes,
        }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        let k = self.kept.get_mut().expect("not poisoned");
        let pool = &self.conn.pool;
        pool.release(&self.conn, k.bytes);
        pool.release_samples(k.samples);
    }
}

/// Bytes charged to an account for a while (a fetched object, a decoded image); with no
/// account (a sample loaded outside a request) it counts nothing.
#[must_use = "the bytes are held as long as the charge"]
pub struct Charge {
    account: Option<Arc<Account>>,
    bytes: u64,
}

impl Charge {
    pub fn on(account: Option<&Arc<Account>>, bytes: u64) -> Charge {
        match account {
            Some(a) => a.charge(bytes),
            None => Charge {
                account: None,
                bytes: 0,
            },
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(a) = &self.account {
            a.conn.pool.release(&a.conn, self.bytes);
        }
    }
}

tokio::task_local! {
    /// The account of the request whose task this is: the pipeline charges what it fetches
    /// and prepares to it without every call in between passing it along.
    static ACCOUNT: Arc<Account>;
}

/// The account of the request being prepared on this task, if any.
pub fn current() -> Option<Arc<Account>> {
    ACCOUNT.try_with(Arc::clone).ok()
}

/// Runs `f` with `account` as the task's account.
pub async fn with_account<F: std::future::Future>(account: Arc<Account>, f: F) -> F::Output {
    ACCOUNT.scope(account, f).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A pool of `max` bytes and 100 samples, expecting nothing of a sample until a batch is
    /// built.
    fn pool(max: u64) -> Arc<MemoryPool> {
        MemoryPool::new(max, 100, IntGauge::new("held", "held").unwrap())
    }

    async fn admitted(conn: &Arc<ConnMemory>, samples: usize) -> Option<Arc<Account>> {
        tokio::time::timeout(Duration::from_millis(50), conn.admit(samples))
            .await
            .ok()
    }

    #[tokio::test]
    async fn a_connection_over_its_share_waits_and_others_go_on() {
        let pool = pool(300);
        let (slow, fast) = (pool.connection(), pool.connection());
        // Three parts for two connections: a share is 100. A batch of 100 bytes, one sample.
        let a = admitted(&slow, 1).await.unwrap();
        a.keep(100);
        a.settle(1, 100);
        assert_eq!(slow.held(), 100);
        assert!(admitted(&slow, 1).await.is_none(), "over its share");
        let b = admitted(&fast, 1).await.unwrap();
        assert_eq!(
            (pool.held(), fast.held()),
            (200, 100),
            "expected: 100 a sample"
        );
        let charge = b.charge(50);
        assert!(admitted(&fast, 1).await.is_none(), "over its share");
        drop(charge);
        drop(b);
        drop(admitted(&fast, 1).await.unwrap());
        // The slow one waits until its answer is written (its account dropped).
        let waiting = tokio::spawn({
            let slow = slow.clone();
            async move { slow.admit(1).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        drop(a);
        drop(waiting.await.unwrap());
        assert_eq!(pool.held(), 0);
    }

    #[tokio::test]
    async fn a_full_worker_admits_nobody_until_bytes_are_freed() {
        let pool = pool(100);
        let (one, two) = (pool.connection(), pool.connection());
        let a = admitted(&one, 1).await.unwrap();
        a.keep(100);
        a.settle(1, 100);
        assert!(admitted(&two, 1).await.is_none(), "the worker is full");
        drop(a);
        assert!(admitted(&two, 1).await.is_some());
        // No account, nothing counted.
        let free = Charge::on(None, 1 << 40);
        assert_eq!(pool.held(), 0);
        drop(free);
    }

    #[tokio::test]
    async fn samples_started_are_bounded_until_their_batch_is_built() {
        let pool = MemoryPool::new(1 << 30, 4, IntGauge::new("held", "held").unwrap());
        let (one, two) = (pool.connection(), pool.connection());
        let a = admitted(&one, 3).await.unwrap();
        assert!(admitted(&two, 2).await.is_none(), "5 samples of 4");
        let b = admitted(&two, 1).await.unwrap();
        // Built, a's samples go though its bytes stay until it is sent.
        a.settle(3, 30);
        let c = admitted(&two, 3).await.unwrap();
        // A request of more samples than the limit waits for all of them to be free.
        let d = tokio::spawn({
            let one = one.clone();
            async move { one.admit(9).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!d.is_finished());
        drop((b, c));
        drop(d.await.unwrap());
        drop(a);
        assert_eq!(pool.held(), 0);
    }

    #[tokio::test]
    async fn a_request_holds_what_it_is_expected_to_from_the_start() {
        let pool = pool(1000);
        let (one, two) = (pool.connection(), pool.connection());
        let a = one.admit(2).await;
        a.keep(50);
        a.settle(2, 80);
        assert_eq!(pool.held(), 80);
        // 40 bytes a sample expected from now on.
        let b = two.admit(2).await;
        assert_eq!(pool.held(), 160);
        b.keep(50);
        assert_eq!(pool.held(), 160, "within what was expected");
        b.keep(50);
        assert_eq!(pool.held(), 180);
        b.settle(2, 300);
        assert_eq!(pool.held(), 380);
        drop((a, b));
        assert_eq!(pool.held(), 0);
    }
}
