//! The deterministic plan: which samples form global batch `g` of epoch `e`, and which slice
//! of it rank `r` of `W` gets. A pure function of (dataset index, seed, epoch), so any worker
//! answers any request with no coordinator, and a trainer resumes from `(epoch, next g)`.
//! Several datasets can be mixed by weight (`--mix`). With sample costs, three optional
//! shapings: `--balance-ranks` keeps the global batch but hands its samples to ranks by cost
//! (stoker-balance), so no rank draws a heavier slice; `--bucket-by-length` makes each global batch's samples similar in length (less padding for
//! trainers that cannot take packed input); `--pack-max-tokens` hands each rank the same
//! number of packs, each at most that many tokens, balanced by cost.

use rand::{RngCore, SeedableRng};
use std::sync::{Arc, Mutex};

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
    /// Each sample's length and cost (by id), and what the plan does with them.
    costs: Option<(SampleCosts, Shaping)>,
    /// Several datasets mixed by weight (their ids follow each other).
    mix: Option<Mix>,
    /// Cache of recent epochs' permutations: consecutive requests share an epoch.
    perms: Mutex<Vec<(u64, Arc<Vec<u32>>)>>,
    /// Cache of recently shaped global batches, by (epoch, batch, world size): all ranks'.
    shaped: Mutex<Vec<ShapedBatch>>,
}

type ShapedBatch = ((u64, u64, usize), Arc<Vec<RankSlice>>);

const CACHED_EPOCHS: usize = 2;
/// Shaped global batches kept: a worker serves a few batches ahead of the slowest rank.
const CACHED_SHAPES: usize = 16;
/// Length bucketing sorts windows of this many global batches of the shuffled order.
pub const BUCKET_WINDOW: usize = 32;

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

/// Per sample id: tokens, and the cost model's cost of them.
struct SampleCosts {
    lengths: Vec<u64>,
    costs: Vec<u64>,
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
            costs: None,
            mix: None,
            perms: Mutex::new(Vec::new()),
            shaped: Mutex::new(Vec::new()),
        }
    }

    /// The same plan shaped by the samples' token lengths (one per sample id); costs are the
    /// default cost model's. Packing needs every length to fit a pack.
    pub fn with_lengths(mut self, lengths: &[u32], shaping: Shaping) -> Self {
        assert_eq!(
            lengths.len() as u64,
            self.num_samples,
            "a length per sample"
        );
        let lengths: Vec<u64> = lengths.iter().map(|&t| t.into()).collect();
        if let Some(max) = shaping.pack_max_tokens {
            assert!(
                lengths.iter().all(|&t| t <= max.into()),
                "a sample over {max}"
            );
        }
        let model = stoker_balance::CostModel::default();
        let costs = lengths.iter().map(|&t| model.cost(t)).collect();
        self.costs = Some((SampleCosts { lengths, costs }, shaping));
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

    /// Batches per epoch; the last one is smaller when the sizes do not divide (nothing is
    /// dropped).
    pub fn batches_per_epoch(&self) -> u64 {
        self.num_samples.div_ceil(self.global_batch_size as u64)
    }

    /// The epoch's sample order: a Fisher–Yates shuffle over ChaCha8's u32 stream seeded from
    /// (seed, epoch). rand_chacha keeps that stream's values stable; the shuffle and its
    /// bounded sampling are written out here (the values rand 0.8's `shuffle` gave, pinned by
    /// a test), since rand may change `shuffle`'s values in any release: a dependency
    /// upgrade never changes a plan under a stored resume state.
    pub fn permutation(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.perms.lock().expect("plan cache");
        if let Some((_, p)) = cache.iter().find(|(e, _)| *e == epoch) {
            return p.clone();
        }
        let mut rng = stream(self.seed, epoch, 0);
        let mut perm = match &self.mix {
            None => shuffled(self.num_samples, &mut rng),
            Some(mix) => mix.order(self.seed, epoch, &mut rng),
        };
        if let Some((
            sample,
            Shaping {
                bucket_by_length: true,
                ..
            },
        )) = &self.costs
        {
            let batch = self.global_batch_size as usize;
            perm = bucketed(&perm, &sample.costs, batch, &mut rng);
        }
        let perm = Arc::new(perm);
        if cache.len() >= CACHED_EPOCHS {
            cache.remove(0);
        }
        cache.push((epoch, perm.clone()));
        perm
    }

    /// Rank `rank`'s share of global batch `g`: contiguous, near-equal slices; with costs the
    /// same counts chosen by cost (`balance_ranks`), or the rank's packs. Either way the
    /// global batch is the same for any world size.
    pub fn rank_slice(
        &self,
        epoch: u64,
        g: u64,
        rank: u32,
        world: u32,
    ) -> Result<RankSlice, PlanError> {
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
        let perm = self.permutation(epoch);
        let start = g * self.global_batch_size as u64;
        let end = (start + self.global_batch_size as u64).min(self.num_samples);
        let batch = &perm[start as usize..end as usize];
        let (rank, world) = (rank as usize, world as usize);
        let Some((sample, shaping)) = &self.costs else {
            let contiguous = stoker_balance::even_slice(batch.len(), world, rank);
            return Ok(RankSlice {
                samples: batch[contiguous].iter().map(|&id| id as u64).collect(),
                packs: None,
            });
        };
        // Every rank of the batch asks: shape it once for all of them.
        let key = (epoch, g, world);
        if let Some((_, all)) = self
            .shaped
            .lock()
            .expect("plan cache")
            .iter()
            .find(|(k, _)| *k == key)
        {
            return Ok(all[rank].clone());
        }
        let all = Arc::new(shape(batch, sample, *shaping, world));
        let mut cache = self.shaped.lock().expect("plan cache");
        if cache.len() >= CACHED_SHAPES {
            cache.remove(0);
        }
        cache.push((key, all.clone()));
        Ok(all[rank].clone())
    }
}

/// Every rank's share of a global batch (`batch`: its sample ids) under `shaping`.
fn shape(batch: &[u32], sample: &SampleCosts, shaping: Shaping, world: usize) -> Vec<RankSlice> {
    let ids = |positions: &[usize]| positions.iter().map(|&p| batch[p] as u64).collect();
    let of_batch = |v: &[u64]| batch.iter().map(|&i| v[i as usize]).collect::<Vec<_>>();
    let costs = of_batch(&sample.costs);
    if let Some(max) = shaping.pack_max_tokens {
        let lengths = of_batch(&sample.lengths);
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
/// stays last, so every global batch keeps its place in the epoch.
fn bucketed(
    perm: &[u32],
    costs: &[u64],
    batch: usize,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(perm.len());
    for window in perm.chunks(batch * BUCKET_WINDOW) {
        let mut sorted = window.to_vec();
        sorted.sort_unstable_by_key(|&i| (costs[i as usize], i));
        let full = sorted.len() / batch;
        let mut batches: Vec<&[u32]> = sorted.chunks(batch).collect();
        fisher_yates(&mut batches[..full], rng);
        out.extend(batches.concat());
    }
    out
}

/// The ChaCha8 stream of (seed, epoch, part): part 0 orders an epoch, part s + 1 shuffles
/// mixed dataset s's own epoch `epoch`.
fn stream(seed: u64, epoch: u64, part: u64) -> rand_chacha::ChaCha8Rng {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&epoch.to_le_bytes());
    bytes[16..24].copy_from_slice(b"stokerv1");
    bytes[24..].copy_from_slice(&part.to_le_bytes());
    rand_chacha::ChaCha8Rng::from_seed(bytes)
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
                    let mut rng = stream(seed, own_epoch, s as u64 + 1);
                    own[s] = (own_epoch, shuffled(self.sizes[s], &mut rng));
                }
                (offsets[s] + u64::from(own[s].1[at as usize])) as u32
            })
            .collect()
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
        let balanced = Plan::new(203, 32, 5).with_lengths(&lengths, shaping);
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
        let bucketed = Plan::new(1000, 16, 3).with_lengths(&lengths, shaping);
        let mut all = bucketed.permutation(0).to_vec();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<u32>>());
        // Deterministic in (seed, epoch), and another order per epoch.
        assert_eq!(
            bucketed.permutation(0),
            Plan::new(1000, 16, 3)
                .with_lengths(&lengths, shaping)
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
        let packed = Plan::new(203, 32, 5).with_lengths(&lengths, shaping);
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
        let again = Plan::new(203, 32, 5).with_lengths(&lengths, shaping);
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
}
