//! Token-aware batch shaping: what a sample costs a rank's step, how to split a global batch
//! over ranks so the heaviest rank is as light as possible, and how to pack samples into
//! sequences of at most `max_tokens`. Pure functions of their inputs (integers only, ties
//! broken by position), so every worker computes the same assignment for the same batch.

#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What one sample costs a training step: its tokens (the linear layers' work, per token) plus
/// attention's quadratic term, `tokens² / attention_tokens`. `attention_tokens` is the length
/// at which attention's pairwise work equals the linear work: about 2·params / (4·d·layers),
/// e.g. ~38,000 for Qwen2-VL-7B's language model (7.6 B parameters, d = 3,584, 28 layers).
/// Packed samples attend only within themselves (varlen attention), so a pack costs the sum
/// of its samples' costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostModel {
    pub attention_tokens: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            attention_tokens: 32_768,
        }
    }
}

impl CostModel {
    pub fn cost(&self, tokens: u64) -> u64 {
        tokens + tokens * tokens / self.attention_tokens.max(1)
    }
}

/// Splits items (by cost) over `ranks` to minimise the heaviest rank's total: longest
/// processing time first — the costliest item goes to the rank with the least so far (the
/// lowest rank among equals). `counts`: rank r takes exactly `counts[r]` items (trainers with
/// a fixed micro-batch size; they must add up to `costs.len()`); `None`: any number. Returns
/// each rank's item positions in ascending order.
pub fn balance(costs: &[u64], ranks: usize, counts: Option<&[usize]>) -> Vec<Vec<usize>> {
    assert!(ranks > 0, "at least one rank");
    if let Some(c) = counts {
        assert_eq!(c.len(), ranks, "a count per rank");
        assert_eq!(
            c.iter().sum::<usize>(),
            costs.len(),
            "counts add up to the items"
        );
    }
    let has_room = |r: usize, taken: usize| counts.is_none_or(|c| taken < c[r]);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by_key(|&i| (Reverse(costs[i]), i));
    // Min-heap of (load, rank): the next item goes to the lightest rank with room.
    let mut open: BinaryHeap<Reverse<(u64, usize)>> = (0..ranks)
        .filter(|&r| has_room(r, 0))
        .map(|r| Reverse((0, r)))
        .collect();
    let mut out = vec![Vec::new(); ranks];
    for i in order {
        let Reverse((load, r)) = open.pop().expect("a rank with room");
        out[r].push(i);
        if has_room(r, out[r].len()) {
            open.push(Reverse((load + costs[i], r)));
        }
    }
    for items in &mut out {
        items.sort_unstable();
    }
    out
}

/// Contiguous, near-equal slices: what a plan that ignores cost gives rank by rank.
pub fn slice_evenly(items: usize, ranks: usize) -> Vec<Vec<usize>> {
    (0..ranks)
        .map(|r| even_slice(items, ranks, r).collect())
        .collect()
}

/// Rank `rank`'s part of [`slice_evenly`] alone: what one request needs, in O(1) rather than
/// a slice per rank of the world (4,096 allocations per request at full scale).
pub fn even_slice(items: usize, ranks: usize, rank: usize) -> std::ops::Range<usize> {
    items * rank / ranks..items * (rank + 1) / ranks
}

/// The sizes of [`slice_evenly`]'s slices: the counts a balanced split keeps.
pub fn even_counts(items: usize, ranks: usize) -> Vec<usize> {
    (0..ranks)
        .map(|r| items * (r + 1) / ranks - items * r / ranks)
        .collect()
}

/// Packed micro-batches: every rank gets the same number `m` of sequences (a synchronous
/// step runs the same number of micro-batches on every rank), each at most `max_tokens`
/// long, as even in cost as possible. The global batch's items are balanced over `ranks · m`
/// sequences (longest processing time first, as [`balance`]), starting from the fewest `m`
/// that holds the tokens and adding one while a sequence would run over; rank `r` takes
/// sequences `r·m .. (r+1)·m`. An item longer than `max_tokens` alone is an error of the
/// caller (truncate or skip it first). Returns, per rank, its sequences' item positions.
pub fn pack_ranks(
    lengths: &[u64],
    costs: &[u64],
    ranks: usize,
    max_tokens: u64,
) -> Vec<Vec<Vec<usize>>> {
    assert_eq!(lengths.len(), costs.len());
    assert!(
        lengths.iter().all(|&l| l <= max_tokens),
        "an item is longer than max_tokens {max_tokens}"
    );
    let total: u64 = lengths.iter().sum();
    let mut m = (total.div_ceil(max_tokens.max(1)) as usize)
        .div_ceil(ranks)
        .max(1);
    loop {
        let seqs = balance(costs, ranks * m, None);
        let fits = loads(lengths, &seqs).iter().all(|&l| l <= max_tokens);
        if fits {
            let mut seqs = seqs.into_iter();
            return (0..ranks)
                .map(|_| seqs.by_ref().take(m).collect())
                .collect();
        }
        m += 1;
    }
}

/// Each group's total of `values` (costs or lengths) over its item positions.
pub fn loads(values: &[u64], groups: &[Vec<usize>]) -> Vec<u64> {
    groups
        .iter()
        .map(|g| g.iter().map(|&i| values[i]).sum())
        .collect()
}

/// The heaviest group's cost over the mean group's: 1.0 is a perfect split.
pub fn max_over_mean(costs: &[u64], groups: &[Vec<usize>]) -> f64 {
    let loads = loads(costs, groups);
    let max = loads.iter().copied().max().unwrap_or(0) as f64;
    let mean = loads.iter().sum::<u64>() as f64 / loads.len().max(1) as f64;
    if mean == 0.0 {
        1.0
    } else {
        max / mean
    }
}

/// Padding fraction of plain batches: each group is one batch padded to its longest item.
pub fn padding_plain(lengths: &[u64], groups: &[Vec<usize>]) -> f64 {
    let (mut real, mut slots) = (0u64, 0u64);
    for g in groups {
        let longest = g.iter().map(|&i| lengths[i]).max().unwrap_or(0);
        real += g.iter().map(|&i| lengths[i]).sum::<u64>();
        slots += longest * g.len() as u64;
    }
    padding(real, slots)
}

/// Padding fraction of packed sequences where a step's sequences share one shape: each is
/// padded to the step's longest. (Varlen attention needs no padding at all; this is the cost
/// for kernels that want a static shape.)
pub fn padding_packed(lengths: &[u64], seqs: &[Vec<usize>]) -> f64 {
    let used = loads(lengths, seqs);
    let longest = used.iter().copied().max().unwrap_or(0);
    padding(used.iter().sum(), longest * used.len() as u64)
}

fn padding(real: u64, slots: u64) -> f64 {
    if slots == 0 {
        0.0
    } else {
        1.0 - real as f64 / slots as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_lands_on_exactly_one_rank() {
        let costs: Vec<u64> = (0..97).map(|i| (i * 7919 % 1000) + 1).collect();
        for (ranks, counts) in [(8, None), (10, Some(even_counts(97, 10)))] {
            let groups = balance(&costs, ranks, counts.as_deref());
            if let Some(c) = &counts {
                assert_eq!(&groups.iter().map(Vec::len).collect::<Vec<_>>(), c);
            }
            let mut all: Vec<usize> = groups.concat();
            all.sort_unstable();
            assert_eq!(all, (0..97).collect::<Vec<_>>());
            assert!(groups.iter().all(|g| g.windows(2).all(|w| w[0] < w[1])));
        }
    }

    #[test]
    fn equal_counts_hold_and_the_heaviest_rank_gets_lighter() {
        // One heavy item per 8, as multi-image samples among VQA ones.
        let costs: Vec<u64> = (0..64)
            .map(|i| if i % 8 == 0 { 5000 } else { 300 + i })
            .collect();
        let naive = slice_evenly(64, 8);
        let balanced = balance(&costs, 8, Some(&[8; 8]));
        assert!(balanced.iter().all(|g| g.len() == 8));
        assert!(max_over_mean(&costs, &balanced) <= max_over_mean(&costs, &naive));
        // Heavy items at 0, 8, …, 56: one per naive slice already; shuffle them together.
        let mut clumped = costs.clone();
        clumped.sort_unstable_by(|a, b| b.cmp(a));
        let naive_clumped = max_over_mean(&clumped, &slice_evenly(64, 8));
        let balanced_clumped = max_over_mean(&clumped, &balance(&clumped, 8, Some(&[8; 8])));
        assert!(naive_clumped > 2.0, "{naive_clumped}");
        assert!(balanced_clumped < 1.05, "{balanced_clumped}");
    }

    #[test]
    fn the_assignment_is_a_function_of_the_costs_alone() {
        let costs: Vec<u64> = (0..40).map(|i| [100, 100, 250, 900][i % 4]).collect();
        let a = balance(&costs, 5, Some(&[8; 5]));
        assert_eq!(a, balance(&costs, 5, Some(&[8; 5])));
        // Ties go to the lowest rank: the first four items by cost (900s at 3, 7, 11, 15) go to
        // ranks 0..4 in that order.
        for (r, item) in [3, 7, 11, 15].into_iter().enumerate() {
            assert!(a[r].contains(&item), "rank {r}: {:?}", a[r]);
        }
        let l = loads(&costs, &a);
        assert_eq!(l.iter().sum::<u64>(), costs.iter().sum::<u64>());
    }

    #[test]
    fn packed_ranks_hold_equal_sequence_counts_within_max_tokens_and_fill_well() {
        let lengths: Vec<u64> = (0..512).map(|i| 200 + (i * 7919 % 3800)).collect();
        let model = CostModel::default();
        let costs: Vec<u64> = lengths.iter().map(|&l| model.cost(l)).collect();
        let ranks = pack_ranks(&lengths, &costs, 8, 16_384);
        let m = ranks[0].len();
        assert!(
            ranks.iter().all(|r| r.len() == m),
            "same micro-batch count per rank"
        );
        let seqs: Vec<Vec<usize>> = ranks.concat();
        let mut all: Vec<usize> = seqs.concat();
        all.sort_unstable();
        assert_eq!(all, (0..512).collect::<Vec<_>>());
        for s in &seqs {
            assert!(s.iter().map(|&i| lengths[i]).sum::<u64>() <= 16_384);
        }
        let packed = padding_packed(&lengths, &seqs);
        let plain = padding_plain(&lengths, &slice_evenly(512, 64));
        assert!(
            packed < 0.05 && plain > 0.3,
            "packed {packed}, plain {plain}"
        );
        let per_rank: Vec<Vec<usize>> = ranks.iter().map(|r| r.concat()).collect();
        assert!(max_over_mean(&costs, &per_rank) < 1.05);
    }

    #[test]
    #[should_panic(expected = "longer than max_tokens")]
    fn an_item_longer_than_a_sequence_is_the_callers_to_cut() {
        pack_ranks(&[10_000, 100], &[10_000, 100], 2, 4096);
    }

    #[test]
    fn cost_grows_quadratically_past_the_attention_length() {
        let m = CostModel {
            attention_tokens: 1000,
        };
        assert_eq!(m.cost(100), 110);
        assert_eq!(m.cost(1000), 2000);
        assert_eq!(m.cost(4000), 20_000);
    }
}
