//! The deterministic plan: which samples form global batch `g` of epoch `e`, and which slice
//! of it rank `r` of `W` gets. A pure function of (dataset index, seed, epoch), so any worker
//! answers any request with no coordinator, and a trainer resumes from `(epoch, next g)`.
//! Several datasets can be mixed by weight (`--mix`). With sample costs, three optional
//! shapings: `--balance-ranks` keeps the global batch but hands its samples to ranks by cost
//! (stoker-balance), so no rank draws a heavier slice; `--bucket-by-length` makes each global batch's samples similar in length (less padding for
//! trainers that cannot take packed input); `--pack-max-tokens` hands each rank the same
//! number of packs, each at most that many tokens, balanced by cost.
//!
//! Two orders (`--order`): `shuffle` holds each epoch's permutation (4 bytes per sample,
//! seconds to build at 10^8), `feistel` computes each position's sample on its own (nothing
//! held, nothing built at an epoch boundary). A server asks through [`Plan::serve_slice`],
//! which builds what a request needs on the blocking pool and the next epoch's order ahead of
//! the boundary: the serving threads (and the health probes) never wait on a build.

use crate::dataset::le_u32s::LeU32s;
use rand::{RngCore, SeedableRng};
use std::sync::{Arc, Mutex, OnceLock};
pub use stoker_config::SampleOrder;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("global batch {g} is beyond the {n} batches of an epoch")]
    BatchOutOfRange { g: u64, n: u64 },
    #[error("world size {world} is larger than the global batch size {global}")]
    WorldTooLarge { world: u32, global: u32 },
}

pub struct Plan {
    pub num_samples: u64,
    pub global_batch_size: u32,
    pub seed: u64,
    order: SampleOrder,
    /// Each sample's length (by id), and what the plan does with it.
    costs: Option<(SampleCosts, Shaping)>,
    /// Several datasets mixed by weight (their ids follow each other).
    mix: Option<Mix>,
    /// `shuffle`: the current epoch's permutation, and the next one from the current's last
    /// tenth (built ahead) to the next's first tenth (then the older is dropped): 4 bytes a
    /// sample each, twice that only around a boundary.
    perms: Recent<u64, Arc<Vec<u32>>>,
    /// `feistel` with length bucketing: recent windows of [`BUCKET_WINDOW`] global batches.
    windows: Recent<(u64, u64), Arc<Vec<u32>>>,
    /// Recently shaped global batches, by (epoch, batch, world size): all ranks'.
    shaped: Recent<(u64, u64, usize), Arc<Vec<RankSlice>>>,
}

const CACHED_EPOCHS: usize = 2;
/// Shaped global batches kept: a worker serves a few batches ahead of the slowest rank.
const CACHED_SHAPES: usize = 16;
const CACHED_WINDOWS: usize = 4;
/// Length bucketing sorts windows of this many global batches of the shuffled order.
pub const BUCKET_WINDOW: usize = 32;
/// A request within this fraction of an epoch's end has the next epoch's order built ahead.
const AHEAD_FRACTION: u64 = 10;

/// A small cache whose values are built once, outside its lock: requests for a value being
/// built wait for that build (on their own thread), others go on.
struct Recent<K, V> {
    capacity: usize,
    entries: Mutex<Vec<(K, Arc<OnceLock<V>>)>>,
}

impl<K: PartialEq + Copy, V: Clone> Recent<K, V> {
    fn new(capacity: usize) -> Self {
        Recent {
            capacity,
            entries: Mutex::new(Vec::new()),
        }
    }

    fn slot(&self, key: K) -> Arc<OnceLock<V>> {
        let mut entries = self.entries.lock().expect("plan cache");
        if let Some((_, slot)) = entries.iter().find(|(k, _)| *k == key) {
            return slot.clone();
        }
        if entries.len() >= self.capacity {
            entries.remove(0);
        }
        let slot = Arc::new(OnceLock::new());
        entries.push((key, slot.clone()));
        slot
    }

    fn get_or_build(&self, key: K, build: impl FnOnce() -> V) -> V {
        self.slot(key).get_or_init(build).clone()
    }

    /// Built (not just being built).
    fn is_built(&self, key: K) -> bool {
        let entries = self.entries.lock().expect("plan cache");
        entries
            .iter()
            .any(|(k, slot)| *k == key && slot.get().is_some())
    }

    /// Drops the values whose key `keep` refuses (a build under way finishes for whoever
    /// waits on it).
    fn retain(&self, keep: impl Fn(&K) -> bool) {
        (self.entries.lock().expect("plan cache")).retain(|(k, _)| keep(k));
    }

    /// Built or being built.
    fn has(&self, key: K) -> bool {
        let entries = self.entries.lock().expect("plan cache");
        entries.iter().any(|(k, _)| *k == key)
    }
}

/// What a plan with sample costs does with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shaping {
    /// Hand each global batch's samples to ranks by cost (equal counts).
    pub balance_ranks: bool,
    /// Make each global batch's samples similar in length.
    pub bucket_by_length: bool,
    /// Pack each rank's samples into sequences of at most this many tokens.
    pub pack_max_tokens: Option<u32>,
}

/// Per sample id: tokens (4 bytes a sample, where the lengths file's bytes are); costs follow
/// from them by the cost model.
struct SampleCosts {
    lengths: LeU32s,
    model: stoker_balance::CostModel,
}

impl SampleCosts {
    fn tokens(&self, id: u32) -> u32 {
        self.lengths.get(id as usize)
    }

    fn cost(&self, id: u32) -> u64 {
        self.model.cost(self.tokens(id).into())
    }
}

/// One rank's share of a global batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSlice {
    /// Sample ids in plan order (packed: pack after pack).
    pub samples: Vec<u64>,
    /// Packed: how many of `samples` each pack holds, in order. Every rank gets the same
    /// number of packs (a pack is empty only when a final partial batch has fewer samples).
    pub packs: Option<Vec<usize>>,
}

impl Plan {
    pub fn new(num_samples: u64, global_batch_size: u32, seed: u64) -> Self {
        assert!(
            num_samples <= u32::MAX as u64,
            "sample ids are u32 in the permutation"
        );
        Plan {
            num_samples,
            global_batch_size: global_batch_size.max(1),
            seed,
            order: SampleOrder::Shuffle,
            costs: None,
            mix: None,
            perms: Recent::new(CACHED_EPOCHS),
            windows: Recent::new(CACHED_WINDOWS),
            shaped: Recent::new(CACHED_SHAPES),
        }
    }

    /// The same plan drawing its order another way (another plan unless `Shuffle`).
    pub fn with_order(mut self, order: SampleOrder) -> Self {
        self.order = order;
        self
    }

    pub fn order(&self) -> SampleOrder {
        self.order
    }

    /// The same plan shaped by the samples' token lengths (one per sample id); costs are the
    /// default cost model's. Packing needs every length to fit a pack.
    pub fn with_lengths(mut self, lengths: impl Into<LeU32s>, shaping: Shaping) -> Self {
        let lengths = lengths.into();
        assert_eq!(
            lengths.len() as u64,
            self.num_samples,
            "a length per sample"
        );
        if let Some(max) = shaping.pack_max_tokens {
            assert!(lengths.iter().all(|t| t <= max), "a sample over {max}");
        }
        let model = stoker_balance::CostModel::default();
        self.costs = Some((SampleCosts { lengths, model }, shaping));
        self
    }

    /// The same plan over several datasets mixed by weight: ids `0..sizes[0]` are the first
    /// dataset's, the next `sizes[1]` the second's, and so on.
    pub fn with_mix(mut self, sizes: &[u64], weights: &[u32]) -> Self {
        assert_eq!(
            sizes.iter().sum::<u64>(),
            self.num_samples,
            "the datasets' ids"
        );
        self.mix = Some(Mix::new(sizes, weights));
        self
    }

    /// Draws per epoch from each mixed dataset (one entry without a mix).
    pub fn draws_per_epoch(&self) -> Vec<u64> {
        self.mix
            .as_ref()
            .map_or(vec![self.num_samples], |m| m.draws.clone())
    }

    /// How costs shape this plan (nothing without costs).
    pub fn shaping(&self) -> Shaping {
        self.costs.as_ref().map_or(Shaping::default(), |(_, s)| *s)
    }

    fn bucketing(&self) -> Option<&SampleCosts> {
        self.costs
            .as_ref()
            .filter(|(_, s)| s.bucket_by_length)
            .map(|(c, _)| c)
    }

    /// Batches per epoch; the last one is smaller when the sizes do not divide (nothing is
    /// dropped).
    pub fn batches_per_epoch(&self) -> u64 {
        self.num_samples.div_ceil(self.global_batch_size as u64)
    }

    /// The epoch's sample order under `shuffle`: a Fisher–Yates shuffle over ChaCha8's u32
    /// stream seeded from (seed, epoch). rand_chacha keeps that stream's values stable; the
    /// shuffle and its bounded sampling are written out here (the values rand 0.8's
    /// `shuffle` gave, pinned by a test), since rand may change `shuffle`'s values in any
    /// release: a dependency upgrade never changes a plan under a stored resume state.
    pub fn permutation(&self, epoch: u64) -> Arc<Vec<u32>> {
        self.perms.get_or_build(epoch, || {
            let mut rng = stream(SHUFFLE, self.seed, epoch, 0);
            let mut perm = match &self.mix {
                None => shuffled(self.num_samples, &mut rng),
                Some(mix) => mix.order(self.seed, epoch, &mut rng),
            };
            if let Some(sample) = self.bucketing() {
                let batch = self.global_batch_size as usize;
                bucket(&mut perm, sample, batch, &mut rng);
            }
            Arc::new(perm)
        })
    }

    /// The samples at positions `range` of epoch `epoch` under `feistel`, before bucketing.
    fn feistel_ids(&self, epoch: u64, range: std::ops::Range<u64>) -> Vec<u32> {
        let order = Feistel::new(self.num_samples, stream(FEISTEL, self.seed, epoch, 0));
        match &self.mix {
            None => range.map(|p| order.permute(p) as u32).collect(),
            Some(mix) => {
                // Each dataset's own order keyed once per batch, not once per sample.
                let mut own = vec![None; mix.sizes.len()];
                range
                    .map(|p| mix.draw(self.seed, epoch, order.permute(p), &mut own))
                    .collect()
            }
        }
    }

    /// `feistel` with bucketing: window `w` of epoch `epoch` (its positions' samples sorted
    /// by cost, cut into global batches, and those shuffled, as `shuffle` does).
    fn feistel_window(&self, epoch: u64, w: u64, sample: &SampleCosts) -> Arc<Vec<u32>> {
        self.windows.get_or_build((epoch, w), || {
            let batch = self.global_batch_size as u64;
            let start = w * batch * BUCKET_WINDOW as u64;
            let end = (start + batch * BUCKET_WINDOW as u64).min(self.num_samples);
            let mut ids = self.feistel_ids(epoch, start..end);
            let mut rng = stream(FEISTEL, self.seed, epoch, w + 1);
            bucket(&mut ids, sample, batch as usize, &mut rng);
            Arc::new(ids)
        })
    }

    /// The sample ids of global batch `g` (in range) of epoch `epoch`, in plan order.
    fn global_batch(&self, epoch: u64, g: u64) -> Vec<u32> {
        let batch = self.global_batch_size as u64;
        let (start, end) = (g * batch, ((g + 1) * batch).min(self.num_samples));
        match (self.order, self.bucketing()) {
            (SampleOrder::Shuffle, _) => {
                self.permutation(epoch)[start as usize..end as usize].to_vec()
            }
            (SampleOrder::Feistel, None) => self.feistel_ids(epoch, start..end),
            (SampleOrder::Feistel, Some(sample)) => {
                let w = g / BUCKET_WINDOW as u64;
                let at = (start - w * batch * BUCKET_WINDOW as u64) as usize;
                self.feistel_window(epoch, w, sample)[at..at + (end - start) as usize].to_vec()
            }
        }
    }

    /// What cutting global batch `g` of `epoch` needs built first.
    fn needs(&self, epoch: u64, g: u64) -> Needs {
        match (self.order, self.bucketing()) {
            (SampleOrder::Shuffle, _) => Needs::Epoch(epoch),
            (SampleOrder::Feistel, None) => Needs::Nothing,
            (SampleOrder::Feistel, Some(_)) => Needs::Window(epoch, g / BUCKET_WINDOW as u64),
        }
    }

    /// Built (`started`: built or being built).
    fn has_built(&self, needs: Needs, started: bool) -> bool {
        match needs {
            Needs::Nothing => true,
            Needs::Epoch(e) if started => self.perms.has(e),
            Needs::Epoch(e) => self.perms.is_built(e),
            Needs::Window(e, w) if started => self.windows.has((e, w)),
            Needs::Window(e, w) => self.windows.is_built((e, w)),
        }
    }

    fn build(&self, needs: Needs) {
        match (needs, self.bucketing()) {
            (Needs::Epoch(e), _) => {
                self.permutation(e);
            }
            (Needs::Window(e, w), Some(sample)) => {
                self.feistel_window(e, w, sample);
            }
            _ => {}
        }
    }

    fn check(&self, g: u64, world: u32) -> Result<(), PlanError> {
        let n = self.batches_per_epoch();
        if g >= n {
            return Err(PlanError::BatchOutOfRange { g, n });
        }
        if world > self.global_batch_size {
            return Err(PlanError::WorldTooLarge {
                world,
                global: self.global_batch_size,
            });
        }
        Ok(())
    }

    /// Rank `rank`'s share of global batch `g`: contiguous, near-equal slices; with costs the
    /// same counts chosen by cost (`balance_ranks`), or the rank's packs. Either way the
    /// global batch is the same for any world size. Builds what it needs on the calling
    /// thread: a server calls [`Plan::serve_slice`].
    pub fn rank_slice(
        &self,
        epoch: u64,
        g: u64,
        rank: u32,
        world: u32,
    ) -> Result<RankSlice, PlanError> {
        self.check(g, world)?;
        let (rank, world) = (rank as usize, world as usize);
        let Some((sample, shaping)) = &self.costs else {
            let batch = self.global_batch(epoch, g);
            let contiguous = stoker_balance::even_slice(batch.len(), world, rank);
            return Ok(RankSlice {
                samples: batch[contiguous].iter().map(|&id| id as u64).collect(),
                packs: None,
            });
        };
        // Every rank of the batch asks: shape it once for all of them.
        let all = self.shaped.get_or_build((epoch, g, world), || {
            Arc::new(shape(&self.global_batch(epoch, g), sample, *shaping, world))
        });
        Ok(all[rank].clone())
    }

    /// [`Plan::rank_slice`] for a server on tokio: anything costly (an epoch's order, a
    /// window, shaping a batch) is built on the blocking pool, never on the calling thread;
    /// a request in the last tenth of an epoch has the next epoch's order built ahead, so no
    /// request waits for it at the boundary.
    pub async fn serve_slice(
        self: &Arc<Self>,
        epoch: u64,
        g: u64,
        rank: u32,
        world: u32,
    ) -> Result<RankSlice, PlanError> {
        self.check(g, world)?;
        self.build_ahead(epoch, g);
        let shaped = self.costs.is_none() || self.shaped.is_built((epoch, g, world as usize));
        if self.has_built(self.needs(epoch, g), false) && shaped {
            return self.rank_slice(epoch, g, rank, world);
        }
        let plan = self.clone();
        tokio::task::spawn_blocking(move || plan.rank_slice(epoch, g, rank, world))
            .await
            .expect("the plan never panics on a checked request")
    }

    /// Starts building, on the blocking pool, what requests after (epoch, g) will need:
    /// `shuffle`, the next epoch's order once g is in the last tenth of the epoch; `feistel`
    /// with bucketing, the next window. Past an epoch's first tenth, `shuffle` drops the
    /// earlier epochs' orders: ranks are in step within a tenth of an epoch, as the build
    /// ahead assumes (one further behind has its epoch's order built again).
    fn build_ahead(self: &Arc<Self>, epoch: u64, g: u64) {
        let n = self.batches_per_epoch();
        let tenth = n.div_ceil(AHEAD_FRACTION);
        let needs = self.needs(epoch, g);
        if let Needs::Epoch(e) = needs {
            if e > 0 && g >= tenth {
                self.perms.retain(|&k| k >= e);
            }
        }
        let next = match needs {
            Needs::Epoch(e) if g + tenth >= n => Needs::Epoch(e + 1),
            Needs::Window(e, w) if (w + 1) * (BUCKET_WINDOW as u64) < n => Needs::Window(e, w + 1),
            Needs::Window(e, _) => Needs::Window(e + 1, 0),
            _ => return,
        };
        if !self.has_built(next, true) {
            let plan = self.clone();
            tokio::task::spawn_blocking(move || plan.build(next));
        }
    }

    /// Builds what epoch `epoch` starts with: its permutation, or its first window.
    pub fn prepare(&self, epoch: u64) {
        self.build(self.needs(epoch, 0));
    }
}

/// What cutting a global batch needs built before it: nothing (`feistel`), an epoch's
/// permutation (`shuffle`), or a bucketing window of `feistel` (epoch, window).
#[derive(Debug, Clone, Copy)]
enum Needs {
    Nothing,
    Epoch(u64),
    Window(u64, u64),
}

/// Every rank's share of a global batch (`batch`: its sample ids) under `shaping`.
fn shape(batch: &[u32], sample: &SampleCosts, shaping: Shaping, world: usize) -> Vec<RankSlice> {
    let ids = |positions: &[usize]| positions.iter().map(|&p| batch[p] as u64).collect();
    let costs: Vec<u64> = batch.iter().map(|&i| sample.cost(i)).collect();
    if let Some(max) = shaping.pack_max_tokens {
        let lengths: Vec<u64> = batch.iter().map(|&i| sample.tokens(i).into()).collect();
        let ranks = stoker_balance::pack_ranks(&lengths, &costs, world, max.into());
        return ranks
            .iter()
            .map(|packs| RankSlice {
                samples: ids(&packs.concat()),
                packs: Some(packs.iter().map(Vec::len).collect()),
            })
            .collect();
    }
    let ranks = if shaping.balance_ranks {
        let counts = stoker_balance::even_counts(batch.len(), world);
        stoker_balance::balance(&costs, world, Some(&counts))
    } else {
        stoker_balance::slice_evenly(batch.len(), world)
    };
    ranks
        .iter()
        .map(|positions| RankSlice {
            samples: ids(positions),
            packs: None,
        })
        .collect()
}

/// Length bucketing of a shuffled order: within each window of [`BUCKET_WINDOW`] global
/// batches, samples sorted by cost (ties by id; cost grows with length) are cut into global
/// batches, and those are shuffled (so steps do not run short to long). A final partial batch
/// stays last, so every global batch keeps its place in the epoch. In place: a window's
/// copy is all it allocates.
fn bucket(perm: &mut [u32], sample: &SampleCosts, batch: usize, rng: &mut rand_chacha::ChaCha8Rng) {
    let mut sorted = Vec::with_capacity(batch * BUCKET_WINDOW);
    for window in perm.chunks_mut(batch * BUCKET_WINDOW) {
        window.sort_unstable_by_key(|&i| (sample.cost(i), i));
        sorted.clear();
        sorted.extend_from_slice(window);
        let mut batches: Vec<&[u32]> = sorted.chunks(batch).collect();
        let full = window.len() / batch;
        fisher_yates(&mut batches[..full], rng);
        let mut at = 0;
        for b in batches {
            window[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
    }
}

/// The streams of the `shuffle` order (tag "stokerv1", its values pinned since the first
/// release) and of the `feistel` order (round keys, and bucketing windows' shuffles).
const SHUFFLE: &[u8; 8] = b"stokerv1";
const FEISTEL: &[u8; 8] = b"feistel2";

/// The ChaCha8 stream of (order, seed, epoch, part). `shuffle`: part 0 orders an epoch, part
/// s + 1 shuffles mixed dataset s's own epoch `epoch`. `feistel`: part 0 keys an epoch's
/// order, part w + 1 shuffles its bucketing window w; mixed dataset s's own epochs are keyed
/// by part `MIXED_PART + s`.
fn stream(order: &[u8; 8], seed: u64, epoch: u64, part: u64) -> rand_chacha::ChaCha8Rng {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&epoch.to_le_bytes());
    bytes[16..24].copy_from_slice(order);
    bytes[24..].copy_from_slice(&part.to_le_bytes());
    rand_chacha::ChaCha8Rng::from_seed(bytes)
}

const MIXED_PART: u64 = 1 << 63;

/// A keyed permutation of `0..n` computed per position: a balanced Feistel network on the
/// smallest even number of bits that holds `n` (so under 4n values), walking the cycle until
/// the value falls in range (a bijection of `0..n`, fewer than 4 steps expected).
#[derive(Clone)]
struct Feistel {
    n: u64,
    half: u32,
    keys: [u64; FEISTEL_ROUNDS],
}

const FEISTEL_ROUNDS: usize = 6;

impl Feistel {
    fn new(n: u64, mut rng: rand_chacha::ChaCha8Rng) -> Self {
        let bits = (64 - n.saturating_sub(1).leading_zeros())
            .max(2)
            .next_multiple_of(2);
        let mut keys = [0; FEISTEL_ROUNDS];
        keys.iter_mut().for_each(|k| *k = rng.next_u64());
        Feistel {
            n,
            half: bits / 2,
            keys,
        }
    }

    fn permute(&self, mut x: u64) -> u64 {
        debug_assert!(x < self.n);
        let mask = (1u64 << self.half) - 1;
        loop {
            let (mut left, mut right) = (x >> self.half, x & mask);
            for k in self.keys {
                (left, right) = (right, left ^ (mix64(right ^ k) & mask));
            }
            x = (left << self.half) | right;
            if x < self.n {
                return x;
            }
        }
    }
}

/// SplitMix64's finalizer: every input bit flips about half the output bits.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `0..n` in Fisher–Yates order.
fn shuffled(n: u64, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    fisher_yates(&mut v, rng);
    v
}

fn fisher_yates<T>(v: &mut [T], rng: &mut rand_chacha::ChaCha8Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, below(rng, i as u32 + 1) as usize);
    }
}

/// Datasets mixed by weight. An epoch draws as many samples as the datasets hold; dataset s
/// gets `draws[s]` of them (its weight's share, largest remainders rounded up, ties to the
/// earlier dataset). Its k-th draw over the whole run (`epoch · draws[s] + j`) is position
/// `k mod n` of its own shuffle number `k div n`: every dataset walks its own epochs, each a
/// fresh shuffle, across the plan's epochs — no sample of it repeats before all of it came.
struct Mix {
    sizes: Vec<u64>,
    draws: Vec<u64>,
}

impl Mix {
    fn new(sizes: &[u64], weights: &[u32]) -> Mix {
        assert_eq!(sizes.len(), weights.len(), "a weight per dataset");
        assert!(sizes.iter().all(|&n| n > 0), "no empty dataset");
        let total: u64 = sizes.iter().sum();
        let w_sum: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let shares: Vec<(u64, u64)> = weights
            .iter()
            .map(|&w| {
                let x = u128::from(total) * u128::from(w);
                (
                    (x / u128::from(w_sum)) as u64,
                    (x % u128::from(w_sum)) as u64,
                )
            })
            .collect();
        let mut draws: Vec<u64> = shares.iter().map(|s| s.0).collect();
        let mut by_remainder: Vec<usize> = (0..sizes.len()).collect();
        by_remainder.sort_by_key(|&s| (std::cmp::Reverse(shares[s].1), s));
        let short = total - draws.iter().sum::<u64>();
        for &s in by_remainder.iter().take(short as usize) {
            draws[s] += 1;
        }
        Mix {
            sizes: sizes.to_vec(),
            draws,
        }
    }

    /// Epoch `epoch`'s sample ids: which dataset each draw takes is shuffled by `rng`.
    fn order(&self, seed: u64, epoch: u64, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<u32> {
        let mut which: Vec<u32> = (0..self.draws.len() as u32)
            .flat_map(|s| std::iter::repeat_n(s, self.draws[s as usize] as usize))
            .collect();
        fisher_yates(&mut which, rng);
        let offsets: Vec<u64> = self
            .sizes
            .iter()
            .scan(0, |acc, &n| {
                *acc += n;
                Some(*acc - n)
            })
            .collect();
        let mut taken = vec![0u64; self.sizes.len()];
        let mut own: Vec<(u64, Vec<u32>)> = vec![(u64::MAX, Vec::new()); self.sizes.len()];
        which
            .into_iter()
            .map(|s| {
                let s = s as usize;
                let k = epoch * self.draws[s] + taken[s];
                taken[s] += 1;
                let (own_epoch, at) = (k / self.sizes[s], k % self.sizes[s]);
                if own[s].0 != own_epoch {
                    let mut rng = stream(SHUFFLE, seed, own_epoch, s as u64 + 1);
                    own[s] = (own_epoch, shuffled(self.sizes[s], &mut rng));
                }
                (offsets[s] + u64::from(own[s].1[at as usize])) as u32
            })
            .collect()
    }

    /// `feistel`: the sample of draw slot `q` (of `0..num_samples`) of epoch `epoch`. Slots
    /// are laid out dataset after dataset, `draws[s]` each; dataset s's j-th slot is its draw
    /// `k = epoch · draws[s] + j` over the run: position `k mod n` of its own Feistel order
    /// number `k div n`: every own epoch is whole, as under `shuffle` (though within one
    /// epoch an oversampled dataset's own epochs interleave).
    /// `own` keeps each dataset's last own order (its own epoch and the permutation).
    fn draw(&self, seed: u64, epoch: u64, q: u64, own: &mut [Option<(u64, Feistel)>]) -> u32 {
        let (mut first_slot, mut first_id) = (0, 0);
        for (s, (&n, &draws)) in self.sizes.iter().zip(&self.draws).enumerate() {
            if q < first_slot + draws {
                let k = epoch * draws + (q - first_slot);
                let own_epoch = k / n;
                let order = match &own[s] {
                    Some((e, order)) if *e == own_epoch => order,
                    _ => {
                        let part = MIXED_PART + s as u64;
                        let order = Feistel::new(n, stream(FEISTEL, seed, own_epoch, part));
                        &own[s].insert((own_epoch, order)).1
                    }
                };
                return (first_id + order.permute(k % n)) as u32;
            }
            first_slot += draws;
            first_id += n;
        }
        unreachable!("draw slot {q} is beyond the epoch")
    }
}

/// Uniform in `0..n` (n > 0): Lemire's widening multiply with rand 0.8's rejection zone, so
/// no value is favoured and the values are those of rand 0.8's `gen_range(0..n)` on u32.
fn below(rng: &mut rand_chacha::ChaCha8Rng, n: u32) -> u32 {
    let zone = (n << n.leading_zeros()).wrapping_sub(1);
    loop {
        let m = u64::from(rng.next_u32()) * u64::from(n);
        if m as u32 <= zone {
            return (m >> 32) as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_once_per_epoch_for_any_world_size() {
        let plan = Plan::new(103, 16, 7);
        for world in [1, 3, 4, 16] {
            let mut seen = Vec::new();
            for g in 0..plan.batches_per_epoch() {
                let mut global = Vec::new();
                for r in 0..world {
                    global.extend(plan.rank_slice(0, g, r, world).unwrap().samples);
                }
                // The global batch does not depend on the world size.
                let mut one = plan.rank_slice(0, g, 0, 1).unwrap().samples;
                assert_eq!(global, one);
                seen.append(&mut one);
            }
            seen.sort();
            assert_eq!(seen, (0..103).collect::<Vec<u64>>());
        }
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        let a = Plan::new(50, 8, 1);
        let b = Plan::new(50, 8, 1);
        assert_eq!(a.permutation(3), b.permutation(3));
        assert_ne!(a.permutation(3), a.permutation(4));
        assert_ne!(a.permutation(3), Plan::new(50, 8, 2).permutation(3));
        // Pinned: a change here breaks every stored resume state.
        assert_eq!(
            &Plan::new(10, 4, 0).permutation(0)[..],
            &[8, 3, 9, 2, 5, 4, 1, 6, 0, 7][..]
        );
    }

    #[test]
    fn shuffle_holds_one_epochs_order_but_around_a_boundary() {
        // 100 global batches an epoch: the next order from batch 90, the older dropped at 10.
        let plan = Arc::new(Plan::new(1000, 10, 3));
        let held = |e| plan.perms.has(e);
        plan.permutation(0);
        plan.permutation(1);
        plan.build_ahead(1, 9);
        assert!(held(0) && held(1));
        plan.build_ahead(1, 10);
        assert!(!held(0) && held(1));
        // A rank an epoch behind still gets its order, built again.
        assert_eq!(plan.rank_slice(0, 5, 0, 1).unwrap().samples.len(), 10);
        assert!(held(0));
    }

    #[test]
    fn out_of_range_requests_are_refused() {
        let plan = Plan::new(10, 4, 0);
        assert_eq!(plan.batches_per_epoch(), 3);
        assert_eq!(plan.rank_slice(0, 2, 0, 1).unwrap().samples.len(), 2);
        assert!(matches!(
            plan.rank_slice(0, 3, 0, 1),
            Err(PlanError::BatchOutOfRange { .. })
        ));
        assert!(matches!(
            plan.rank_slice(0, 0, 0, 5),
            Err(PlanError::WorldTooLarge { .. })
        ));
    }

    #[test]
    fn with_costs_every_sample_once_the_same_global_batches_and_lighter_heaviest_ranks() {
        // Every eighth sample is heavy, as multi-image samples among VQA ones.
        let lengths: Vec<u32> = (0..203)
            .map(|i| if i % 8 == 0 { 9000 } else { 400 + i })
            .collect();
        let model = stoker_balance::CostModel::default();
        let costs: Vec<u64> = lengths.iter().map(|&t| model.cost(t.into())).collect();
        let plain = Plan::new(203, 32, 5);
        let shaping = Shaping {
            balance_ranks: true,
            ..Shaping::default()
        };
        let balanced = Plan::new(203, 32, 5).with_lengths(lengths.clone(), shaping);
        let heaviest = |plan: &Plan, g: u64, world: u32| {
            (0..world)
                .map(|r| {
                    plan.rank_slice(1, g, r, world)
                        .unwrap()
                        .samples
                        .iter()
                        .map(|&i| costs[i as usize])
                        .sum::<u64>()
                })
                .max()
                .unwrap()
        };
        let (mut plain_total, mut balanced_total) = (0, 0);
        for g in 0..balanced.batches_per_epoch() {
            for world in [1, 3, 4, 32] {
                let mut global = Vec::new();
                for r in 0..world {
                    let mine = balanced.rank_slice(1, g, r, world).unwrap().samples;
                    // Same counts as the contiguous slices; plan order within a rank.
                    assert_eq!(
                        mine.len(),
                        plain.rank_slice(1, g, r, world).unwrap().samples.len()
                    );
                    global.extend(mine);
                }
                global.sort_unstable();
                let mut want = plain.rank_slice(1, g, 0, 1).unwrap().samples;
                want.sort_unstable();
                assert_eq!(
                    global, want,
                    "batch {g}, world {world}: the same global batch"
                );
            }
            plain_total += heaviest(&plain, g, 4);
            balanced_total += heaviest(&balanced, g, 4);
        }
        assert!(
            balanced_total < plain_total,
            "{balanced_total} vs {plain_total}"
        );
        assert_eq!(
            (balanced.shaping(), plain.shaping()),
            (shaping, Shaping::default())
        );
    }

    #[test]
    fn bucketing_keeps_every_sample_once_and_makes_batches_even_in_length() {
        let lengths: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % 5000 + 100).collect();
        let shaping = Shaping {
            bucket_by_length: true,
            ..Shaping::default()
        };
        let plain = Plan::new(1000, 16, 3);
        let bucketed = Plan::new(1000, 16, 3).with_lengths(lengths.clone(), shaping);
        let mut all = bucketed.permutation(0).to_vec();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<u32>>());
        // Deterministic in (seed, epoch), and another order per epoch.
        assert_eq!(
            bucketed.permutation(0),
            Plan::new(1000, 16, 3)
                .with_lengths(lengths.clone(), shaping)
                .permutation(0)
        );
        assert_ne!(bucketed.permutation(0), bucketed.permutation(1));
        // Spread of length within a global batch: far smaller than unbucketed.
        let spread = |plan: &Plan| {
            (0..plan.batches_per_epoch())
                .map(|g| {
                    let ids = plan.rank_slice(0, g, 0, 1).unwrap().samples;
                    let c: Vec<u32> = ids.iter().map(|&i| lengths[i as usize]).collect();
                    c.iter().max().unwrap() - c.iter().min().unwrap()
                })
                .sum::<u32>()
        };
        assert!(
            spread(&bucketed) * 5 < spread(&plain),
            "{} vs {}",
            spread(&bucketed),
            spread(&plain)
        );
        // The final partial batch (1000 = 62 x 16 + 8) stays last and whole.
        assert_eq!(bucketed.rank_slice(0, 62, 0, 1).unwrap().samples.len(), 8);
    }

    #[test]
    fn packs_hold_every_sample_once_fit_and_give_every_rank_as_many() {
        let lengths: Vec<u32> = (0..203u32).map(|i| (i * 7919) % 3000 + 50).collect();
        let shaping = Shaping {
            pack_max_tokens: Some(4096),
            ..Shaping::default()
        };
        let plain = Plan::new(203, 32, 5);
        let packed = Plan::new(203, 32, 5).with_lengths(lengths.clone(), shaping);
        for g in 0..packed.batches_per_epoch() {
            for world in [1, 3, 4, 32] {
                let slices: Vec<RankSlice> = (0..world)
                    .map(|r| packed.rank_slice(2, g, r, world).unwrap())
                    .collect();
                let packs = |s: &RankSlice| s.packs.clone().expect("packed");
                let counts: Vec<usize> = slices.iter().map(|s| packs(s).len()).collect();
                assert!(
                    counts.iter().all(|&c| c == counts[0] && c > 0),
                    "{counts:?}"
                );
                let mut global: Vec<u64> = Vec::new();
                for s in &slices {
                    assert_eq!(packs(s).iter().sum::<usize>(), s.samples.len());
                    let mut rest = s.samples.as_slice();
                    for n in packs(s) {
                        let (pack, tail) = rest.split_at(n);
                        let tokens: u32 = pack.iter().map(|&i| lengths[i as usize]).sum();
                        assert!(tokens <= 4096, "a pack of {tokens} tokens");
                        rest = tail;
                    }
                    global.extend(&s.samples);
                }
                global.sort_unstable();
                let mut want = plain.rank_slice(2, g, 0, 1).unwrap().samples;
                want.sort_unstable();
                assert_eq!(global, want, "batch {g}, world {world}");
            }
        }
        // A pure function of its inputs: another plan object answers the same.
        let again = Plan::new(203, 32, 5).with_lengths(lengths.clone(), shaping);
        assert_eq!(
            again.rank_slice(0, 3, 1, 4).unwrap(),
            packed.rank_slice(0, 3, 1, 4).unwrap()
        );
    }

    #[test]
    fn a_mix_draws_each_dataset_by_weight_and_walks_its_own_epochs() {
        // A 3:1:1 mix of 60, 25 and 15 samples: the small third dataset is drawn 20 times an
        // epoch, more than it holds; the second 20 times, fewer.
        let plan = Plan::new(100, 10, 9).with_mix(&[60, 25, 15], &[3, 1, 1]);
        assert_eq!(plan.draws_per_epoch(), [60, 20, 20]);
        let source = |id: u32| match id {
            0..60 => 0,
            60..85 => 1,
            _ => 2,
        };
        let mut drawn: [Vec<u32>; 3] = Default::default();
        for epoch in 0..4 {
            let perm = plan.permutation(epoch);
            assert_eq!(perm.len(), 100);
            let mut counts = [0; 3];
            for &id in perm.iter() {
                counts[source(id)] += 1;
                drawn[source(id)].push(id);
            }
            assert_eq!(counts, [60, 20, 20], "epoch {epoch}");
            // Deterministic, and another interleaving per epoch.
            let again = Plan::new(100, 10, 9).with_mix(&[60, 25, 15], &[3, 1, 1]);
            assert_eq!(again.permutation(epoch), perm);
            assert_ne!(plan.permutation(epoch + 1), perm);
        }
        // Each dataset's draws, across the plan's epochs, are its own epochs back to back:
        // every sample once per own epoch, each own epoch another shuffle.
        for (s, (range, n)) in [(0..60u32, 60), (60..85, 25), (85..100, 15)]
            .into_iter()
            .enumerate()
        {
            let own: Vec<&[u32]> = drawn[s].chunks_exact(n).collect();
            for chunk in &own {
                let mut sorted = chunk.to_vec();
                sorted.sort_unstable();
                assert_eq!(sorted, range.clone().collect::<Vec<_>>(), "dataset {s}");
            }
            assert_ne!(own[0], own[1], "dataset {s}");
        }
    }

    #[test]
    fn mix_shares_round_to_the_largest_remainders() {
        assert_eq!(Mix::new(&[10, 10, 10], &[1, 1, 1]).draws, [10, 10, 10]);
        assert_eq!(Mix::new(&[5, 5], &[2, 1]).draws, [7, 3]);
        assert_eq!(Mix::new(&[1, 1, 1, 1], &[1, 1, 1, 3]).draws, [1, 1, 0, 2]);
    }

    /// Every position's sample once: the order is a bijection of `0..n` for any n.
    #[test]
    fn a_feistel_order_is_a_permutation_for_any_size() {
        for n in [1u64, 2, 3, 4, 5, 17, 1000, 4096, 4097, 65_537] {
            let order = Feistel::new(n, stream(FEISTEL, 3, 1, 0));
            let mut seen: Vec<u64> = (0..n).map(|p| order.permute(p)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }

    fn epoch_ids(plan: &Plan, epoch: u64) -> Vec<u64> {
        (0..plan.batches_per_epoch())
            .flat_map(|g| plan.rank_slice(epoch, g, 0, 1).unwrap().samples)
            .collect()
    }

    #[test]
    fn feistel_plans_hold_every_sample_once_and_are_their_own_order() {
        let lengths: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % 5000 + 100).collect();
        let bucketing = Shaping {
            bucket_by_length: true,
            ..Shaping::default()
        };
        let plans = [
            Plan::new(1000, 16, 3),
            Plan::new(1000, 16, 3).with_lengths(lengths.clone(), bucketing),
            Plan::new(1000, 16, 3).with_mix(&[600, 300, 100], &[1, 1, 2]),
        ];
        for plan in plans {
            let plan = plan.with_order(SampleOrder::Feistel);
            let one = epoch_ids(&plan, 0);
            assert_ne!(one, epoch_ids(&plan, 1), "another order per epoch");
            if plan.mix.is_none() {
                let mut sorted = one.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..1000).collect::<Vec<u64>>());
            }
            // The same global batches for any world size.
            for world in [3, 16] {
                let mut global = Vec::new();
                for g in 0..plan.batches_per_epoch() {
                    for r in 0..world {
                        global.extend(plan.rank_slice(0, g, r, world).unwrap().samples);
                    }
                }
                let mut a = global.clone();
                let mut b = one.clone();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "world {world}");
            }
        }
        // A mix keeps its shares and each dataset's own epochs are whole: over 12 epochs
        // the first dataset (250 draws an epoch of 600) came 5 times per sample, the third
        // (500 of 100) 60 times. (Unlike `shuffle`, an epoch's draws of one dataset come in
        // any order: an oversampled dataset's own epochs interleave within the epoch.)
        let plan = Plan::new(1000, 16, 3)
            .with_mix(&[600, 300, 100], &[1, 1, 2])
            .with_order(SampleOrder::Feistel);
        assert_eq!(plan.draws_per_epoch(), [250, 250, 500]);
        let mut times = vec![0u32; 1000];
        for e in 0..12 {
            epoch_ids(&plan, e)
                .iter()
                .for_each(|&id| times[id as usize] += 1);
        }
        assert!(times[..600].iter().all(|&t| t == 5), "{:?}", &times[..600]);
        assert!(times[900..].iter().all(|&t| t == 60), "{:?}", &times[900..]);
        // Not the `shuffle` order; pinned (a change here breaks every stored resume state).
        let feistel = Plan::new(10, 4, 0).with_order(SampleOrder::Feistel);
        assert_ne!(epoch_ids(&feistel, 0), epoch_ids(&Plan::new(10, 4, 0), 0));
        assert_eq!(epoch_ids(&feistel, 0), PINNED_FEISTEL);
    }

    const PINNED_FEISTEL: [u64; 10] = [1, 8, 3, 2, 9, 5, 7, 6, 4, 0];

    /// A server's request near an epoch's end has the next epoch built ahead, off the
    /// calling thread; what it answers is what `rank_slice` answers.
    #[tokio::test]
    async fn serve_slice_builds_the_next_epoch_ahead() {
        let plan = Arc::new(Plan::new(10_000, 100, 1));
        let first = plan.serve_slice(0, 0, 1, 4).await.unwrap();
        assert_eq!(first, plan.rank_slice(0, 0, 1, 4).unwrap());
        assert!(!plan.perms.has(1), "nothing ahead early in the epoch");
        plan.serve_slice(0, 95, 0, 4).await.unwrap();
        for _ in 0..200 {
            if plan.perms.is_built(1) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(plan.perms.is_built(1), "epoch 1 built ahead");
        assert_eq!(
            plan.serve_slice(0, 100, 0, 4).await,
            Err(PlanError::BatchOutOfRange { g: 100, n: 100 })
        );
    }
}
