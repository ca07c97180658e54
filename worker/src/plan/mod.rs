//! The deterministic plan: which samples form global batch `g` of epoch `e`, and which slice
//! of it rank `r` of `W` gets. A pure function of (dataset index, seed, epoch), so any worker
//! answers any request with no coordinator, and a trainer resumes from `(epoch, next g)`.
//! Several datasets can be mixed by weight (`--mix`). With sample costs, three optional
//! shapings: `--balance-ranks` keeps the global batch but hands its samples to ranks by cost
//! (stoker-balance), so no rank draws a heavier slice; `--bucket-by-length` makes each global batch's samples similar in length (less padding for
//! trainers that cannot take packed input); `--pack-max-tokens` hands each rank the same
//! number of packs, each at most that many tokens, balanced by cost.
//!
//! Three orders (`--order`): `shuffle` holds each epoch's permutation (4 bytes per sample,
//! seconds to build at 10^8), `feistel` computes each position's sample on its own (nothing
//! held, nothing built at an epoch boundary), and `runs` does the same for runs of
//! neighbouring lines, which a rank's slot keeps for a run's length of steps (its worker reads
//! a run's text at once). A server asks through [`Plan::serve_slice`],
//! which builds what a request needs on the blocking pool and the next epoch's order ahead of
//! the boundary: the serving threads (and the health probes) never wait on a build.

use crate::dataset::le_u32s::LeU32s;
mod order;

use order::{fisher_yates, shuffled, stream, Feistel, Mix, Runs, FEISTEL, RUNS, SHUFFLE};
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
    /// `runs`: lines per run.
    run_lines: u32,
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
            run_lines: stoker_config::DEFAULT_RUN_LINES,
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

    /// The same plan with `n` lines per run under `runs` (another plan).
    pub fn with_run_lines(mut self, n: u32) -> Self {
        self.run_lines = n.max(1);
        self
    }

    pub fn run_lines(&self) -> u32 {
        self.run_lines
    }

    /// Under `runs` and unshaped, the ids of the run that holds `id` (which a rank's slot
    /// takes over consecutive steps, so a worker reads them together); `None` otherwise
    /// (shaping hands a global batch's samples to ranks by cost, so no rank keeps a run).
    pub fn run_of(&self, id: u64) -> Option<std::ops::Range<u64>> {
        if self.order != SampleOrder::Runs || self.costs.is_some() {
            return None;
        }
        let len = u64::from(self.run_lines);
        let first = id / len * len;
        Some(first..(first + len).min(self.num_samples))
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

    /// The stream tag of a computed order (`feistel`, `runs`).
    fn computed_tag(&self) -> &'static [u8; 8] {
        match self.order {
            SampleOrder::Runs => RUNS,
            _ => FEISTEL,
        }
    }

    /// The samples at positions `range` of epoch `epoch` under `feistel` or `runs`, before
    /// bucketing.
    fn computed_ids(&self, epoch: u64, range: std::ops::Range<u64>) -> Vec<u32> {
        if self.order == SampleOrder::Runs {
            assert!(self.mix.is_none(), "runs of one dataset only");
            let len = u64::from(self.run_lines);
            let batch = u64::from(self.global_batch_size);
            let runs = Runs::new(self.num_samples, len, batch, self.seed, epoch);
            return range.map(|p| runs.sample(p) as u32).collect();
        }
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

    /// `feistel` or `runs` with bucketing: window `w` of epoch `epoch` (its positions'
    /// samples sorted by cost, cut into global batches, and those shuffled, as `shuffle` does).
    fn computed_window(&self, epoch: u64, w: u64, sample: &SampleCosts) -> Arc<Vec<u32>> {
        self.windows.get_or_build((epoch, w), || {
            let batch = self.global_batch_size as u64;
            let start = w * batch * BUCKET_WINDOW as u64;
            let end = (start + batch * BUCKET_WINDOW as u64).min(self.num_samples);
            let mut ids = self.computed_ids(epoch, start..end);
            let mut rng = stream(self.computed_tag(), self.seed, epoch, w + 1);
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
            (SampleOrder::Feistel | SampleOrder::Runs, None) => {
                self.computed_ids(epoch, start..end)
            }
            (SampleOrder::Feistel | SampleOrder::Runs, Some(sample)) => {
                let w = g / BUCKET_WINDOW as u64;
                let at = (start - w * batch * BUCKET_WINDOW as u64) as usize;
                self.computed_window(epoch, w, sample)[at..at + (end - start) as usize].to_vec()
            }
        }
    }

    /// What cutting global batch `g` of `epoch` needs built first.
    fn needs(&self, epoch: u64, g: u64) -> Needs {
        match (self.order, self.bucketing()) {
            (SampleOrder::Shuffle, _) => Needs::Epoch(epoch),
            (SampleOrder::Feistel | SampleOrder::Runs, None) => Needs::Nothing,
            (SampleOrder::Feistel | SampleOrder::Runs, Some(_)) => {
                Needs::Window(epoch, g / BUCKET_WINDOW as u64)
            }
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
                self.computed_window(e, w, sample);
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

#[cfg(test)]
mod tests;
