//! The orders a plan draws from: the seeded streams, Fisher–Yates (`shuffle`), the keyed
//! Feistel permutation (`feistel`), runs of neighbouring lines (`runs`) and the mix of several
//! datasets by weight. Each is a pure function of (seed, epoch): the values are pinned by the
//! plan's tests, since a stored resume state names them.

use rand::{RngCore, SeedableRng};

/// The streams of the `shuffle` order (tag "stokerv1", its values pinned since the first
/// release), of the `feistel` order (round keys, and bucketing windows' shuffles) and of the
/// `runs` order (the same parts as `feistel`'s, part 0 keying the runs' order and part 1
/// the orders within runs).
pub(super) const SHUFFLE: &[u8; 8] = b"stokerv1";
pub(super) const FEISTEL: &[u8; 8] = b"feistel2";
pub(super) const RUNS: &[u8; 8] = b"runsv001";

/// The ChaCha8 stream of (order, seed, epoch, part). `shuffle`: part 0 orders an epoch, part
/// s + 1 shuffles mixed dataset s's own epoch `epoch`. `feistel`: part 0 keys an epoch's
/// order, part w + 1 shuffles its bucketing window w; mixed dataset s's own epochs are keyed
/// by part `MIXED_PART + s`.
pub(super) fn stream(order: &[u8; 8], seed: u64, epoch: u64, part: u64) -> rand_chacha::ChaCha8Rng {
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
pub(super) struct Feistel {
    n: u64,
    half: u32,
    keys: [u64; FEISTEL_ROUNDS],
}

const FEISTEL_ROUNDS: usize = 6;

impl Feistel {
    pub(super) fn new(n: u64, mut rng: rand_chacha::ChaCha8Rng) -> Self {
        let mut keys = [0; FEISTEL_ROUNDS];
        keys.iter_mut().for_each(|k| *k = rng.next_u64());
        Self::with_keys(n, keys)
    }

    /// The permutation of `0..n` under round keys `keys`.
    fn with_keys(n: u64, keys: [u64; FEISTEL_ROUNDS]) -> Self {
        let bits = (64 - n.saturating_sub(1).leading_zeros())
            .max(2)
            .next_multiple_of(2);
        Feistel {
            n,
            half: bits / 2,
            keys,
        }
    }

    pub(super) fn permute(&self, mut x: u64) -> u64 {
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

/// The `runs` order of one epoch: sample ids cut into runs of `len` neighbouring ids (the
/// last one shorter when `len` does not divide n), the full runs in a keyed Feistel order,
/// the short one last. Windows of `width` runs (the global batch size) are read out step by
/// step: step t of a window takes the t-th sample (in the run's own keyed order) of each of
/// its runs, slot after slot. So global batch g of a full window holds one sample of each of
/// `width` runs, and position i of the global batch keeps run i of the window for `len`
/// steps: a rank's contiguous slice keeps its runs, and its worker reads each run's lines
/// once. The last window (fewer runs, the short one last) reads out the same way, the short
/// run's slot dropping out once it is spent.
pub(super) struct Runs {
    n: u64,
    len: u64,
    width: u64,
    /// The full runs' order.
    order: Feistel,
    /// The keys each run's own order is derived from.
    within: [u64; FEISTEL_ROUNDS],
}

impl Runs {
    pub(super) fn new(n: u64, len: u64, width: u64, seed: u64, epoch: u64) -> Self {
        let mut keys = stream(RUNS, seed, epoch, 1);
        let mut within = [0; FEISTEL_ROUNDS];
        within.iter_mut().for_each(|k| *k = keys.next_u64());
        Runs {
            n,
            len,
            width,
            order: Feistel::new(n / len, stream(RUNS, seed, epoch, 0)),
            within,
        }
    }

    /// The sample at position `p` (< n) of the epoch.
    pub(super) fn sample(&self, p: u64) -> u64 {
        debug_assert!(p < self.n);
        let (len, full) = (self.len, self.n / self.len);
        let short = self.n % len;
        let runs = self.n.div_ceil(len);
        let (w, q) = (p / (self.width * len), p % (self.width * len));
        let first = w * self.width;
        let k = self.width.min(runs - first);
        let (step, slot) = match short > 0 && first + k == runs && q >= short * k {
            // Past the short run's last step: its slot (the window's last) is spent.
            true => {
                let q = q - short * k;
                (short + q / (k - 1), q % (k - 1))
            }
            false => (q / k, q % k),
        };
        let slot = first + slot;
        let (run, run_len) = match slot < full {
            true => (self.order.permute(slot), len),
            false => (slot, short),
        };
        let keys = self.within.map(|k| mix64(k ^ run));
        run * len + Feistel::with_keys(run_len, keys).permute(step)
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
pub(super) fn shuffled(n: u64, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    fisher_yates(&mut v, rng);
    v
}

pub(super) fn fisher_yates<T>(v: &mut [T], rng: &mut rand_chacha::ChaCha8Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, below(rng, i as u32 + 1) as usize);
    }
}

/// Datasets mixed by weight. An epoch draws as many samples as the datasets hold; dataset s
/// gets `draws[s]` of them (its weight's share, largest remainders rounded up, ties to the
/// earlier dataset). Its k-th draw over the whole run (`epoch · draws[s] + j`) is position
/// `k mod n` of its own shuffle number `k div n`: every dataset walks its own epochs, each a
/// fresh shuffle, across the plan's epochs — no sample of it repeats before all of it came.
pub(super) struct Mix {
    pub(super) sizes: Vec<u64>,
    pub(super) draws: Vec<u64>,
}

impl Mix {
    pub(super) fn new(sizes: &[u64], weights: &[u32]) -> Mix {
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
    pub(super) fn order(
        &self,
        seed: u64,
        epoch: u64,
        rng: &mut rand_chacha::ChaCha8Rng,
    ) -> Vec<u32> {
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
    pub(super) fn draw(
        &self,
        seed: u64,
        epoch: u64,
        q: u64,
        own: &mut [Option<(u64, Feistel)>],
    ) -> u32 {
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
