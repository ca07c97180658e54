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

#[test]
fn a_runs_order_holds_every_sample_once_for_any_size() {
    for (n, len, batch) in [
        (1u64, 4u32, 3u32),
        (5, 8, 4),
        (64, 8, 8),
        (1000, 8, 16),
        (1003, 8, 16),
        (1003, 32, 7),
        (4099, 5, 64),
    ] {
        let plan = Plan::new(n, batch, 9)
            .with_order(SampleOrder::Runs)
            .with_run_lines(len);
        let mut one = epoch_ids(&plan, 0);
        if n > 8 {
            assert_ne!(one, epoch_ids(&plan, 1), "another order per epoch");
        }
        one.sort_unstable();
        assert_eq!(
            one,
            (0..n).collect::<Vec<_>>(),
            "n {n}, runs of {len}, batch {batch}"
        );
    }
}

/// Under `runs`, a rank's contiguous slice keeps its runs: over a full window every run's
/// samples go to one rank, each global batch draws from as many runs as it holds samples, and
/// the runs are not in file order.
#[test]
fn a_runs_order_gives_each_rank_whole_runs() {
    let (len, batch, world) = (8u64, 16u32, 4u32);
    let n = len * u64::from(batch) * 3 + 5;
    let plan = Plan::new(n, batch, 2)
        .with_order(SampleOrder::Runs)
        .with_run_lines(len as u32);
    let mut rank_of_run = std::collections::HashMap::new();
    for g in 0..3 * len {
        let mut runs_in_batch = std::collections::HashSet::new();
        for r in 0..world {
            for id in plan.rank_slice(0, g, r, world).unwrap().samples {
                let run = plan.run_of(id).unwrap();
                assert_eq!(run, id / len * len..id / len * len + len);
                assert_eq!(*rank_of_run.entry(run.start).or_insert(r), r, "run {run:?}");
                runs_in_batch.insert(run.start);
            }
        }
        assert_eq!(runs_in_batch.len(), batch as usize, "batch {g}");
    }
    let first: Vec<u64> = plan.rank_slice(0, 0, 0, 1).unwrap().samples;
    let starts: Vec<u64> = first.iter().map(|id| id / len).collect();
    assert!(starts.windows(2).any(|w| w[0] > w[1]), "{starts:?}");
    // Shaped, ranks are given samples by cost: no rank keeps a run.
    let lengths: Vec<u32> = (0..n as u32).map(|i| i % 300 + 10).collect();
    let balanced = Shaping {
        balance_ranks: true,
        ..Shaping::default()
    };
    let shaped = Plan::new(n, batch, 2)
        .with_order(SampleOrder::Runs)
        .with_lengths(lengths, balanced);
    assert_eq!(shaped.run_of(0), None);
    // Pinned (a change here breaks every stored resume state).
    let runs = Plan::new(10, 4, 0)
        .with_order(SampleOrder::Runs)
        .with_run_lines(3);
    assert_eq!(epoch_ids(&runs, 0), PINNED_RUNS);
}

const PINNED_RUNS: [u64; 10] = [0, 7, 4, 9, 2, 6, 3, 1, 8, 5];

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
