//! Which workers a rank talks to: a pure function of (the discovered workers, the rank, the
//! world size, the links allowed per rank), so every rank computes its part of one global
//! assignment without talking to the others.
//!
//! - **Homes** carry a rank's requests. Rank slots (`homes_per_rank` per rank) are placed on a
//!   consistent-hash ring of the workers (32 points each) with bounded loads: a slot goes to
//!   the first worker clockwise that holds fewer than `capacity` slots. No worker is home to
//!   more than ⌈S/W⌉ + ⌊S/8W⌋ slots (S slots, W workers: at most 1.125× the mean when S ≥ 8W),
//!   and a worker that joins or leaves moves the slots near it on the ring, not all of them.
//! - **Spares** are the rank's next workers in rendezvous order (highest `hash(rank, worker)`
//!   first, homes left out): connected only when no home can take a request (it failed,
//!   drains, refuses) and released when idle, so a dead worker's load spreads over many
//!   workers instead of landing on one.
//! - Beyond the spares, the rest of the rendezvous order: a rank whose every spare refuses
//!   still finds capacity somewhere, one connection at a time.
//!
//! Hashes are fixed functions (FNV-1a and splitmix64), not the standard library's, so ranks
//! built by different compilers still agree.

use crate::discovery::WorkerSet;
use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

/// Ring points per worker: enough that arcs (and so the overflow a full worker passes on) are
/// even, few enough that a 1,024-worker ring is built in about a millisecond.
const POINTS_PER_WORKER: u64 = 32;

/// The links a rank may hold when neither the loader nor the workers say.
pub const DEFAULT_LINKS_PER_RANK: usize = 8;

/// Connection slots the ranks may fill: the rest is headroom for reconnects, spares and
/// scale events.
const SLOT_SHARE: f64 = 0.75;

/// One rank's workers, in the order it prefers them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Members {
    pub homes: Vec<String>,
    pub spares: Vec<String>,
    /// The rest of the rendezvous order, for when every home and spare fails.
    pub rest: Vec<String>,
    /// For lookups per event (a full mesh has a thousand homes).
    home_set: HashSet<String>,
}

impl Members {
    pub fn new(homes: Vec<String>, spares: Vec<String>, rest: Vec<String>) -> Self {
        let home_set = homes.iter().cloned().collect();
        Members {
            homes,
            spares,
            rest,
            home_set,
        }
    }

    pub fn is_home(&self, addr: &str) -> bool {
        self.home_set.contains(addr)
    }
}

/// How many workers one rank may be linked to: the loader's or the workers' choice (`wanted`,
/// 0 = none), never more than the workers, and small enough that all ranks' links fit in 75 %
/// of the workers' connection slots when the workers said how many they have (0 = unknown).
pub fn links_per_rank(
    workers: usize,
    world_size: u32,
    max_connections: u32,
    wanted: usize,
) -> usize {
    let wanted = if wanted == 0 {
        DEFAULT_LINKS_PER_RANK
    } else {
        wanted
    };
    let mut links = wanted.min(workers).max(1);
    if max_connections > 0 {
        let fit = SLOT_SHARE * workers as f64 * max_connections as f64 / world_size.max(1) as f64;
        links = links.min((fit.floor() as usize).max(1));
    }
    links
}

/// The members of `rank` among `workers` with `links` links per rank.
pub fn members(workers: &WorkerSet, rank: u32, world_size: u32, links: usize) -> Members {
    let all: Vec<&String> = workers.iter().collect();
    if all.is_empty() {
        return Members::default();
    }
    let links = links.clamp(1, all.len());
    if links == all.len() {
        // Every worker is a home: a small job spreads over all of them.
        return Members::new(all.into_iter().cloned().collect(), Vec::new(), Vec::new());
    }
    // Enough homes that every worker is some rank's home when ranks are fewer than workers.
    let per_rank = all
        .len()
        .div_ceil(world_size.max(1) as usize)
        .clamp(1, links);
    let table = home_table(workers, world_size, per_rank);
    let homes: Vec<String> = table.homes(rank).map(|w| all[w].clone()).collect();
    let mut order: Vec<(u64, &String)> = all
        .iter()
        .filter(|a| !homes.contains(a))
        .map(|a| (mix(fnv(a.as_bytes()) ^ mix(rank as u64 + 1)), *a))
        .collect();
    order.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(y.1)));
    let mut order = order.into_iter().map(|(_, a)| a.clone());
    let spares = order.by_ref().take(links - homes.len()).collect();
    Members::new(homes, spares, order.collect())
}

/// A per-rank order among equals: ranks that see the same costs still pick different workers.
pub fn tiebreak(rank: u32, addr: &str) -> u64 {
    mix(fnv(addr.as_bytes()).rotate_left(17) ^ (rank as u64).wrapping_mul(0x9e37_79b9))
}

/// The most slots one worker is home to: the mean rounded up plus an eighth of it (room
/// for a hedge or a spill within 1.25× the mean).
pub fn capacity(slots: usize, workers: usize) -> usize {
    slots.div_ceil(workers) + slots / (8 * workers)
}

/// Every rank's homes, as worker indexes into the sorted set.
struct HomeTable {
    per_rank: usize,
    homes: Vec<u32>,
}

impl HomeTable {
    fn homes(&self, rank: u32) -> impl Iterator<Item = usize> + '_ {
        let at = rank as usize * self.per_rank;
        self.homes[at..at + self.per_rank]
            .iter()
            .map(|w| *w as usize)
    }
}

type TableKey = (u64, u32, usize);

thread_local! {
    // Every rank in a process (the simulator's thousands, a multi-rank test) asks for the
    // same table after a membership change: computed once per (set, world, homes).
    static LAST_TABLE: RefCell<Option<(TableKey, Rc<HomeTable>)>> = const { RefCell::new(None) };
}

fn home_table(workers: &WorkerSet, world_size: u32, per_rank: usize) -> Rc<HomeTable> {
    let set_hash = workers
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, a| mix(h ^ fnv(a.as_bytes())));
    let key = (set_hash, world_size, per_rank);
    LAST_TABLE.with(|cell| {
        if let Some((k, t)) = &*cell.borrow() {
            if *k == key {
                return t.clone();
            }
        }
        let t = Rc::new(build_home_table(workers, world_size, per_rank));
        *cell.borrow_mut() = Some((key, t.clone()));
        t
    })
}

/// Consistent hashing with bounded loads: slot (rank, j) hashes to a ring position and goes to
/// the first worker clockwise below `capacity` that is not already one of this rank's homes.
fn build_home_table(workers: &WorkerSet, world_size: u32, per_rank: usize) -> HomeTable {
    let n = workers.len();
    let mut ring: Vec<(u64, u32)> = workers
        .iter()
        .enumerate()
        .flat_map(|(w, a)| {
            let h = fnv(a.as_bytes());
            (0..POINTS_PER_WORKER).map(move |v| (mix(h ^ mix(v + 1)), w as u32))
        })
        .collect();
    ring.sort_unstable();
    let points = ring.len();
    let mut points_of: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, (_, w)) in ring.iter().enumerate() {
        points_of[*w as usize].push(i);
    }
    let slots = world_size as usize * per_rank;
    let cap = capacity(slots, n);
    let mut load = vec![0usize; n];
    // next[i]: the first live point at or after i (path-compressed; full workers' points die).
    let mut next: Vec<usize> = (0..points).collect();
    fn live(next: &mut [usize], mut i: usize) -> usize {
        let start = i;
        while next[i] != i {
            i = next[i];
        }
        let mut j = start;
        while next[j] != j {
            let up = next[j];
            next[j] = i;
            j = up;
        }
        i
    }
    let mut homes = Vec::with_capacity(slots);
    for rank in 0..world_size as u64 {
        let first = homes.len();
        for j in 0..per_rank as u64 {
            let key = mix(0x5374_6f6b_6572 ^ mix(rank * 64 + j + 1));
            let mut i = ring.partition_point(|p| p.0 < key) % points;
            let mut seen = 0;
            let w = loop {
                i = live(&mut next, i);
                let w = ring[i].1;
                // Another of this rank's homes: step past it (at most per_rank - 1 times per
                // worker); `seen` ends a walk around a ring of only this rank's homes.
                if !homes[first..].contains(&w) || seen > points {
                    break w;
                }
                seen += 1;
                i = (i + 1) % points;
            };
            homes.push(w);
            load[w as usize] += 1;
            if load[w as usize] == cap {
                for &p in &points_of[w as usize] {
                    // Point p now forwards to the next point; the last wraps to the first.
                    next[p] = (p + 1) % points;
                }
                if load.iter().all(|l| *l >= cap) {
                    // Only when capacity × workers == slots and this was the last slot.
                    next.iter_mut().enumerate().for_each(|(i, x)| *x = i);
                }
            }
        }
    }
    HomeTable { per_rank, homes }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(n: usize) -> WorkerSet {
        (0..n)
            .map(|i| format!("10.0.{}.{}:7700", i / 250, i % 250))
            .collect()
    }

    fn home_loads(workers: &WorkerSet, world: u32, links: usize) -> Vec<usize> {
        let index: Vec<&String> = workers.iter().collect();
        let mut load = vec![0; workers.len()];
        for r in 0..world {
            for h in members(workers, r, world, links).homes {
                load[index.iter().position(|a| **a == h).unwrap()] += 1;
            }
        }
        load
    }

    #[test]
    fn homes_are_bounded_at_a_quarter_over_the_mean() {
        for (world, workers) in [(4096u32, 1024usize), (4096, 256), (512, 100), (24, 6)] {
            let w = set(workers);
            let load = home_loads(&w, world, 2);
            let total: usize = load.iter().sum();
            assert_eq!(total, world as usize, "one home per rank");
            let cap = capacity(world as usize, workers);
            assert!(
                load.iter().all(|l| *l <= cap),
                "{world}x{workers}: {load:?}"
            );
            let mean = total as f64 / workers as f64;
            assert!(*load.iter().max().unwrap() as f64 <= 1.25 * mean.ceil());
        }
    }

    #[test]
    fn fewer_ranks_than_workers_still_cover_every_worker() {
        let w = set(12);
        // 3 ranks, 4 links each: 4 homes per rank, 12 slots on 12 workers of capacity 1.
        let load = home_loads(&w, 3, 4);
        assert!(load.iter().all(|l| *l == 1), "{load:?}");
        for r in 0..3 {
            let m = members(&w, r, 3, 4);
            assert_eq!(m.homes.len(), 4);
            assert!(m.spares.is_empty());
            assert_eq!(m.rest.len(), 8);
        }
    }

    #[test]
    fn a_small_job_uses_every_worker_as_a_home() {
        let w = set(3);
        let m = members(&w, 0, 2, DEFAULT_LINKS_PER_RANK);
        assert_eq!(m.homes.len(), 3);
        assert!(m.spares.is_empty() && m.rest.is_empty());
    }

    #[test]
    fn a_worker_joining_or_leaving_moves_few_ranks() {
        let before = set(256);
        let mut after = before.clone();
        after.remove(&format!("10.0.0.{}:7700", 17));
        let mut grown = before.clone();
        for i in 0..64 {
            grown.insert(format!("10.9.0.{i}:7700"));
        }
        let home = |w: &WorkerSet, r| members(w, r, 4096, 4).homes[0].clone();
        let moved = |w: &WorkerSet| {
            (0..4096)
                .filter(|r| home(&before, *r) != home(w, *r))
                .count()
        };
        let removed = moved(&after);
        // The removed worker's 16 ranks must move; bounded loads cascade a few more.
        assert!((16..=400).contains(&removed), "{removed} ranks moved");
        // +25 % workers: at least their share (20 %) moves, and far from all.
        let grew = moved(&grown);
        assert!((800..=2400).contains(&grew), "{grew} ranks moved");
    }

    #[test]
    fn spares_differ_between_ranks_and_exclude_homes() {
        let w = set(64);
        let a = members(&w, 1, 256, 4);
        let b = members(&w, 2, 256, 4);
        assert_eq!(a.homes.len(), 1);
        assert_eq!(a.spares.len(), 3);
        assert!(!a.spares.contains(&a.homes[0]));
        assert_ne!(a.spares, b.spares);
        assert_eq!(a.homes.len() + a.spares.len() + a.rest.len(), 64);
    }

    #[test]
    fn links_fit_the_workers_slots_with_headroom() {
        assert_eq!(links_per_rank(1024, 4096, 1024, 0), 8);
        // 6 workers of 8 slots for 24 ranks: 36 usable slots, one link each.
        assert_eq!(links_per_rank(6, 24, 8, 0), 1);
        assert_eq!(links_per_rank(3, 2, 0, 0), 3);
        assert_eq!(links_per_rank(100, 10, 0, 2), 2);
    }
}
