//! The scheduler as a state machine: link events go in one at a time, and the requests each
//! worker receives and the deliveries the trainer gets are asserted after every step. No
//! sockets and no timing: links are channels the test holds.

use super::*;
use crate::buffer::AlignedBuf;
use crate::policy::HedgePolicy;
use std::collections::VecDeque;
use stoker_wire::{BatchHead, DType, TensorMeta};

const BATCHES_PER_EPOCH: u64 = 4;

fn plan(plan_id: u64) -> Welcome {
    Welcome {
        plan_id,
        dataset_version: 1,
        num_samples: 32,
        global_batch_size: 8,
        batches_per_epoch: BATCHES_PER_EPOCH,
        description: format!("plan {plan_id}"),
        max_connections: 0,
        links_per_rank: 0,
        media: MEDIA,
    }
}

/// Image pad 9, video pad 10, merged 1x1.
const MEDIA: stoker_wire::MediaTokens = stoker_wire::MediaTokens {
    image_token: 9,
    video_token: 10,
    merge_size: 1,
};

fn config(depth: usize) -> LoaderConfig {
    let mut c = LoaderConfig::new(crate::Discovery::Static(Vec::new()), 1, 2);
    c.token = "t".into();
    c.depth = Depth::Fixed(depth);
    c.hedge = None;
    c.max_attempts = 3;
    c.no_worker_timeout = Duration::from_secs(3600);
    c
}

/// A loaded state: resume plan `plan_id` at (epoch, batch).
fn resume_at(plan_id: u64, epoch: u64, next_batch: u64) -> Option<crate::LoaderState> {
    Some(crate::LoaderState {
        plan_id,
        epoch,
        next_batch,
    })
}

struct Machine {
    s: Scheduler,
    /// Virtual time: tests advance it instead of sleeping.
    now: Instant,
    workers: WorkerSet,
    links_by_addr: HashMap<String, LinkId>,
    /// Each link's requests, as the worker would receive them (drained by `asked`).
    sent: HashMap<LinkId, Vec<BatchRequest>>,
    cancelled: Vec<(LinkId, u64)>,
    closed: Vec<LinkId>,
    /// The trainer's channel: at most `capacity` deliveries not yet taken.
    outbox: VecDeque<Delivery>,
    capacity: usize,
}

impl Machine {
    fn new(cfg: LoaderConfig) -> Machine {
        let now = Instant::now();
        let s = Scheduler::new(cfg, Shared::new(), ClientMetrics::new("p", 1), now);
        let capacity = s.max_depth() + 1;
        Machine {
            s,
            now,
            workers: WorkerSet::new(),
            links_by_addr: HashMap::new(),
            sent: HashMap::new(),
            cancelled: Vec::new(),
            closed: Vec::new(),
            outbox: VecDeque::new(),
            capacity,
        }
    }

    /// Carries out the scheduler's actions (as the driver would) and fills the trainer's
    /// channel while it has room.
    fn pump(&mut self) {
        for a in self.s.take_actions() {
            match a {
                Action::Connect { link, addr } => {
                    self.links_by_addr.insert(addr, link);
                }
                Action::Send { link, request } => self.sent.entry(link).or_default().push(request),
                Action::Cancel { link, request_id } => self.cancelled.push((link, request_id)),
                Action::Close { link } => self.closed.push(link),
            }
        }
        while self.outbox.len() < self.capacity {
            match self.s.poll_delivery() {
                Some(d) => self.outbox.push_back(d),
                None => break,
            }
        }
    }

    fn step(&mut self) {
        self.s.step(self.now);
        self.pump();
    }

    fn event(&mut self, ev: Event) {
        self.s.on_event(self.now, ev);
        self.pump();
    }

    fn control(&mut self, c: Control) {
        self.s.on_control(self.now, c);
        self.pump();
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// Discovery now lists `addrs` too; the links the scheduler opened for them.
    fn discover(&mut self, addrs: &[&str]) {
        for a in addrs {
            self.workers.insert(a.to_string());
        }
        self.s.set_workers(self.now, self.workers.clone());
        self.pump();
    }

    /// The link the scheduler opened to `addr`.
    fn link(&self, addr: &str) -> LinkId {
        self.links_by_addr[addr]
    }

    /// A worker at `addr` whose handshake offered `welcome`, its window already open (as
    /// after many answers): the tests of ordering and retries are not about the slow start.
    fn worker_up(&mut self, addr: &str, welcome: Welcome) -> LinkId {
        let link = self.cold_worker_up(addr, welcome);
        if let Some(l) = self.s.links.get_mut(&link) {
            l.window = LINK_QUEUE;
        }
        link
    }

    /// A worker at `addr` that just came up.
    fn cold_worker_up(&mut self, addr: &str, welcome: Welcome) -> LinkId {
        if !self.workers.contains(addr) {
            self.discover(&[addr]);
        }
        let link = self.link(addr);
        self.event(Event::Up { link, welcome });
        link
    }

    /// Everything `link` was asked for since the last call: (request id, epoch, batch).
    fn asked(&mut self, link: LinkId) -> Vec<(u64, u64, u64)> {
        let reqs = self.sent.remove(&link).unwrap_or_default();
        reqs.into_iter()
            .map(|r| {
                assert_eq!((r.rank, r.world_size), (1, self.s.cfg.world_size));
                (r.request_id, r.epoch, r.global_batch)
            })
            .collect()
    }

    /// The worker's answer to `request_id`: the batch it was asked for, one sample whose id
    /// is the request id (so a test sees which request won).
    fn answer(&mut self, link: LinkId, request_id: u64) {
        let request = self.request(request_id);
        self.answer_with(link, request);
    }

    /// The request `request_id` as the worker received it.
    fn request(&self, request_id: u64) -> BatchRequest {
        let position = self.s.in_flight.get(&request_id).map_or(0, |f| f.position);
        let plan_id = self.s.identity.as_ref().map_or(0, |p| p.plan_id);
        BatchRequest {
            request_id,
            plan_id,
            epoch: position / BATCHES_PER_EPOCH,
            global_batch: position % BATCHES_PER_EPOCH,
            rank: 1,
            world_size: self.s.cfg.world_size,
        }
    }

    fn answer_with(&mut self, link: LinkId, request: BatchRequest) {
        self.answer_frame(link, request, Vec::new(), AlignedBuf::zeroed(0));
    }

    /// An answer to `request` with these tensors in this payload.
    fn answer_frame(
        &mut self,
        link: LinkId,
        request: BatchRequest,
        tensors: Vec<TensorMeta>,
        payload: AlignedBuf,
    ) {
        let request_id = request.request_id;
        let head = BatchHead {
            request,
            sample_ids: vec![request_id],
            skipped: Vec::new(),
            tensors,
            payload_len: payload.len() as u64,
        };
        self.event(Event::Answer {
            link,
            request_id,
            answer: Ok((head, payload)),
        });
    }

    fn fail(&mut self, link: LinkId, request_id: u64, code: ErrorCode, message: &str) {
        let e = ErrorFrame {
            request_id,
            code,
            message: message.into(),
        };
        self.event(Event::Answer {
            link,
            request_id,
            answer: Err(e),
        });
    }

    fn down(&mut self, link: LinkId) {
        self.event(Event::Down {
            link,
            error: "connection reset".into(),
        });
    }

    /// Deliveries so far: the sample ids (= the request that won) or the error.
    fn delivered(&mut self) -> Vec<Result<u64, Error>> {
        self.pump();
        self.outbox
            .drain(..)
            .map(|d| d.result.map(|b| b.sample_ids[0]))
            .collect()
    }

    fn consume(&mut self, n: u64) {
        self.s.shared.consumed.fetch_add(n, Ordering::AcqRel);
    }
}

#[tokio::test]
async fn the_window_is_requested_in_order_and_delivered_in_order_whatever_the_answer_order() {
    let mut m = Machine::new(config(3));
    let a = m.worker_up("a", plan(7));
    m.step();
    let asked = m.asked(a);
    assert_eq!(
        asked.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 0), (0, 1), (0, 2)]
    );
    // Answers arrive 2, 0, 1: delivery waits for 0, then releases in plan order.
    m.answer(a, asked[2].0);
    m.step();
    assert!(m.delivered().is_empty(), "position 0 is not ready");
    m.answer(a, asked[0].0);
    m.answer(a, asked[1].0);
    m.step();
    let ids: Vec<u64> = asked.iter().map(|r| r.0).collect();
    assert_eq!(m.delivered(), ids.into_iter().map(Ok).collect::<Vec<_>>());
    // The trainer takes two: the window slides, crossing into epoch 1 after batch 3.
    m.consume(3);
    m.step();
    let next: Vec<(u64, u64)> = m.asked(a).iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(next, [(0, 3), (1, 0), (1, 1)]);
}

#[tokio::test]
async fn requests_spread_over_workers_and_a_lost_worker_s_go_to_the_others() {
    let mut m = Machine::new(config(4));
    let a = m.worker_up("a", plan(7));
    let b = m.worker_up("b", plan(7));
    m.step();
    let (on_a, on_b) = (m.asked(a), m.asked(b));
    assert_eq!(
        (on_a.len(), on_b.len()),
        (2, 2),
        "the fewest outstanding first"
    );
    // a dies with its two requests unanswered: they are re-sent to b, nothing is lost.
    m.down(a);
    m.step();
    let resent: Vec<(u64, u64)> = m.asked(b).iter().map(|r| (r.1, r.2)).collect();
    let mut lost: Vec<(u64, u64)> = on_a.iter().map(|r| (r.1, r.2)).collect();
    lost.sort();
    assert_eq!(resent, lost);
    assert!(
        m.s.reconnect_at.contains_key("a"),
        "a reconnect is scheduled"
    );
    // A late answer from the dead link's request is dropped; b's answers deliver everything.
    m.answer(a, on_a[0].0);
    let on_b_now: Vec<u64> = m.s.in_flight.keys().copied().collect();
    assert_eq!(on_b_now.len(), 4, "b holds every position now");
    for id in on_b_now {
        m.answer(b, id);
    }
    m.step();
    let got = m.delivered();
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(got.iter().all(|r| r.is_ok()));
}

#[tokio::test]
async fn a_draining_worker_is_asked_nothing_more_and_its_refusal_is_retried_elsewhere() {
    let mut m = Machine::new(config(1));
    let a = m.worker_up("a", plan(7));
    m.step();
    let first = m.asked(a);
    let b = m.worker_up("b", plan(7));
    m.fail(a, first[0].0, ErrorCode::Unavailable, "draining");
    m.step();
    let retried = m.asked(b);
    assert_eq!(
        (retried[0].1, retried[0].2),
        (0, 0),
        "the same position, elsewhere"
    );
    m.answer(b, retried[0].0);
    m.consume(1);
    m.step();
    assert!(m.asked(a).is_empty(), "a drains: nothing more for it");
    assert_eq!(m.asked(b).len(), 1);
    assert_eq!(m.delivered(), [Ok(retried[0].0)]);
}

#[tokio::test]
async fn a_failed_request_reaches_the_trainer_naming_the_batch_and_the_worker() {
    let mut m = Machine::new(config(2));
    let a = m.worker_up("a", plan(7));
    m.step();
    let asked = m.asked(a);
    m.answer(a, asked[0].0);
    m.fail(a, asked[1].0, ErrorCode::Failed, "object x.jpg: corrupt");
    m.step();
    let got = m.delivered();
    assert_eq!(got[0], Ok(asked[0].0));
    let err = got[1].as_ref().unwrap_err();
    assert_eq!(err.kind(), "batch_failed");
    assert_eq!(
        err.to_string(),
        "epoch 0 batch 1 (rank 1/2): worker a: object x.jpg: corrupt"
    );
}

#[tokio::test]
async fn repeated_draining_refusals_give_up_after_max_attempts() {
    let mut m = Machine::new(config(1));
    let mut links = Vec::new();
    for addr in ["a", "b", "c"] {
        links.push(m.worker_up(addr, plan(7)));
    }
    for _ in 0..3 {
        m.step();
        let (link, id) = links
            .iter()
            .find_map(|l| m.asked(*l).first().map(|r| (*l, r.0)))
            .expect("one worker was asked");
        m.fail(link, id, ErrorCode::Unavailable, "draining");
    }
    m.step();
    let got = m.delivered();
    assert_eq!(got.len(), 1);
    assert!(got[0]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("epoch 0 batch 0"));
}

#[tokio::test]
async fn a_worker_of_another_plan_is_never_asked() {
    let mut m = Machine::new(config(2));
    let a = m.worker_up("a", plan(7));
    let stranger = m.worker_up("stranger", plan(8));
    m.step();
    assert_eq!(m.asked(a).len(), 2);
    assert!(m.asked(stranger).is_empty());
    let problem = &m.s.problems["stranger"];
    assert_eq!(problem.kind(), "plan_mismatch");
    assert!(problem.to_string().contains("serves plan 0000000000000008"));
}

#[tokio::test]
async fn a_loaded_state_starts_at_its_epoch_and_batch_and_refuses_other_plans() {
    let mut cfg = config(2);
    cfg.state = resume_at(7, 2, 3);
    let mut m = Machine::new(cfg);
    let other = m.worker_up("other", plan(9));
    m.step();
    assert!(m.asked(other).is_empty());
    let a = m.worker_up("a", plan(7));
    m.step();
    let got: Vec<(u64, u64)> = m.asked(a).iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(got, [(2, 3), (3, 0)]);
}

#[tokio::test]
async fn a_seek_restarts_delivery_and_drops_answers_for_the_old_window() {
    let mut m = Machine::new(config(2));
    let a = m.worker_up("a", plan(7));
    m.step();
    let old = m.asked(a);
    m.control(Control::Seek {
        position: 6,
        generation: 1,
    });
    m.s.shared.consumed.store(6, Ordering::Release);
    m.step();
    let new = m.asked(a);
    assert_eq!(
        new.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(1, 2), (1, 3)]
    );
    for (id, _, _) in old.iter().copied() {
        m.answer(a, id); // stale: no pending position
    }
    m.answer(a, new[0].0);
    m.step();
    m.pump();
    let d = m.outbox.pop_front().unwrap();
    assert_eq!(d.generation, 1);
    assert_eq!(d.result.unwrap().sample_ids, [new[0].0]);
    assert!(m.outbox.is_empty());
    // Under the subset policy the old window's requests were cancelled.
    let mut cancelled: Vec<u64> = m.cancelled.iter().map(|c| c.1).collect();
    cancelled.sort();
    assert_eq!(cancelled, old.iter().map(|r| r.0).collect::<Vec<_>>());
}

/// Depth 1, hedging from the first observation, workers `a` and `b` up and one 1 ms answer
/// recorded: the hedge tests' start (`tweak` adjusts the configuration).
fn hedging_on_two_workers(tweak: impl FnOnce(&mut LoaderConfig)) -> (Machine, LinkId, LinkId) {
    let mut cfg = config(1);
    cfg.hedge = Some(HedgePolicy {
        min_observations: 1,
        ..HedgePolicy::default()
    });
    tweak(&mut cfg);
    let mut m = Machine::new(cfg);
    let a = m.worker_up("a", plan(7));
    let b = m.worker_up("b", plan(7));
    m.s.latencies.record(Duration::from_millis(1));
    (m, a, b)
}

#[tokio::test]
async fn a_straggler_at_the_head_is_hedged_on_another_worker_and_the_first_answer_wins() {
    let (mut m, a, b) = hedging_on_two_workers(|_| {});
    m.step();
    let (slow, other) = if m.asked(a).is_empty() {
        (b, a)
    } else {
        (a, b)
    };
    let first = m.s.in_flight.keys().copied().next().unwrap();
    // Older than 1.5 × p95 of what was seen (1 ms): hedged once, on the other worker.
    m.advance(Duration::from_millis(5));
    m.step();
    m.step();
    let hedge = m.asked(other);
    assert_eq!(hedge.len(), 1, "one hedge");
    assert_eq!((hedge[0].1, hedge[0].2), (0, 0));
    m.answer(other, hedge[0].0);
    m.answer(slow, first); // the loser: dropped
    m.step();
    assert_eq!(m.delivered(), [Ok(hedge[0].0)]);
}

#[tokio::test]
async fn with_only_workers_of_another_plan_the_loader_fails_with_a_plan_mismatch() {
    let mut cfg = config(2);
    cfg.state = resume_at(7, 0, 0);
    cfg.no_worker_timeout = Duration::ZERO;
    let mut m = Machine::new(cfg);
    m.worker_up("other", plan(9));
    m.step();
    let err = m.s.take_identity().unwrap().unwrap_err();
    assert_eq!(err.kind(), "plan_mismatch", "{err}");
    assert!(err
        .to_string()
        .contains("worker other serves plan 0000000000000009"));
}

#[tokio::test]
async fn a_refused_token_fails_the_loader_as_unauthorized_at_once() {
    let mut m = Machine::new(config(2));
    m.discover(&["a"]);
    let link = m.link("a");
    m.event(Event::Refused {
        link,
        error: ErrorFrame {
            request_id: 0,
            code: ErrorCode::Unauthorized,
            message: "wrong pipeline token".into(),
        },
    });
    let err = m.s.take_identity().unwrap().unwrap_err();
    assert_eq!(
        err,
        Error::Unauthorized {
            worker: "a".into(),
            reason: "wrong pipeline token".into()
        }
    );
}

#[tokio::test]
async fn a_transient_failure_is_asked_again_elsewhere_and_never_reaches_the_trainer() {
    let mut m = Machine::new(config(1));
    let a = m.worker_up("a", plan(7));
    m.step();
    let first = m.asked(a);
    let b = m.worker_up("b", plan(7));
    m.fail(
        a,
        first[0].0,
        ErrorCode::Transient,
        "object x.jpg: connection reset",
    );
    m.step();
    let retried = m.asked(b);
    assert_eq!((retried[0].1, retried[0].2), (0, 0), "the same position");
    m.answer(b, retried[0].0);
    m.step();
    assert_eq!(m.delivered(), [Ok(retried[0].0)]);
}

#[tokio::test]
async fn a_request_that_crashes_every_worker_it_reaches_fails_after_max_attempts() {
    let mut m = Machine::new(config(1));
    let mut failed = None;
    for attempt in 0..3 {
        let link = m.worker_up(&format!("w{attempt}"), plan(7));
        m.step();
        let asked = m.asked(link);
        assert_eq!((asked[0].1, asked[0].2), (0, 0), "batch 0, again");
        m.down(link);
        m.step();
        failed = m.delivered().pop();
    }
    let err = failed.expect("delivered after the third loss").unwrap_err();
    assert_eq!(err.kind(), "batch_failed");
    let msg = err.to_string();
    assert!(
        msg.starts_with("epoch 0 batch 0 (rank 1/2): worker w2:"),
        "{msg}"
    );
    assert!(msg.contains("lost 3 times"), "{msg}");
}

#[tokio::test]
async fn an_error_is_never_dropped_for_a_full_channel_and_takes_no_batch_s_place() {
    let mut m = Machine::new(config(3));
    let a = m.worker_up("a", plan(7));
    m.step();
    for (id, _, _) in m.asked(a) {
        m.answer(a, id);
    }
    m.step(); // three batches fill the channel (capacity depth + 1 = 4)
    m.s.fail_trainer(Error::Internal("first".into()));
    m.s.fail_trainer(Error::Internal("second".into()));
    let got = m.delivered();
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(got[3], Err(Error::Internal("first".into())));
    m.step();
    let got = m.delivered();
    assert_eq!(
        got,
        [Err(Error::Internal("second".into()))],
        "queued, not dropped"
    );
    // The batches kept their positions: the next one asked is batch 3.
    m.consume(3);
    m.step();
    assert_eq!(
        m.asked(a).iter().map(|r| r.2).collect::<Vec<_>>(),
        [3, 0, 1]
    );
}

#[tokio::test]
async fn an_answer_for_another_batch_is_never_delivered_and_is_asked_for_elsewhere() {
    a_bad_answer_is_never_delivered_and_is_asked_for_elsewhere(
        ("wrong_batch", "wrong_batch"),
        |m, a, request| {
            // Batch 2 for batch 0.
            m.answer_with(
                a,
                BatchRequest {
                    global_batch: 2,
                    ..request
                },
            );
        },
    );
}

/// A packed batch whose layout does not fit its tensors (here: pack boundaries without the
/// images per pack) would make the trainer index past a tensor or lose samples.
#[tokio::test]
async fn a_packed_answer_whose_layout_does_not_fit_is_never_delivered() {
    a_bad_answer_is_never_delivered_and_is_asked_for_elsewhere(
        ("malformed_batch", "malformed_layout"),
        |m, a, request| {
            let bounds = TensorMeta {
                name: "cu_seqlens".into(),
                dtype: DType::I32,
                shape: vec![1, 2],
                offset: 0,
                nbytes: 8,
            };
            m.answer_frame(a, request, vec![bounds], AlignedBuf::zeroed(8));
        },
    );
}

/// An answer to `request` whose image pad tokens are one short of its grid's: one sample of 4
/// ids holding 2 pad tokens, a grid of 1x1x3 (3 patches, 3 tokens at merge 1).
fn answer_with_a_pad_token_missing(m: &mut Machine, link: LinkId, request: BatchRequest) {
    let meta = |name: &str, dtype, shape: Vec<u64>, offset, nbytes| TensorMeta {
        name: name.into(),
        dtype,
        shape,
        offset,
        nbytes,
    };
    let ids: Vec<u8> = [9i64, 9, 1, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let grid: Vec<u8> = [1i64, 1, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut buf = AlignedBuf::zeroed(128);
    buf.as_mut_slice()[..32].copy_from_slice(&ids);
    buf.as_mut_slice()[64..88].copy_from_slice(&grid);
    let tensors = vec![
        meta("input_ids", DType::I64, vec![1, 4], 0, 32),
        meta("pixel_values", DType::U8, vec![3, 1], 32, 3),
        meta("image_grid_thw", DType::I64, vec![1, 3], 64, 24),
    ];
    m.answer_frame(link, request, tensors, buf);
}

/// A batch whose media disagree with its tokens (a forged batch, or a worker of another
/// build) would misalign pixels and text in the model: never delivered, asked elsewhere.
#[tokio::test]
async fn an_answer_whose_media_disagree_with_its_tokens_is_never_delivered() {
    a_bad_answer_is_never_delivered_and_is_asked_for_elsewhere(
        ("malformed_batch", "media_mismatch"),
        answer_with_a_pad_token_missing,
    );
}

/// When every worker asked answers the batch with media that disagree, the trainer gets the
/// error, naming the batch and the disagreement.
#[tokio::test]
async fn a_batch_every_worker_answers_inconsistently_fails_by_name() {
    let mut cfg = config(1);
    cfg.max_attempts = 2;
    let mut m = Machine::new(cfg);
    let a = m.worker_up("a", plan(7));
    m.step();
    let asked = m.asked(a)[0].0;
    let first = m.request(asked);
    let b = m.worker_up("b", plan(7));
    answer_with_a_pad_token_missing(&mut m, a, first);
    m.step();
    let asked = m.asked(b)[0].0;
    let second = m.request(asked);
    answer_with_a_pad_token_missing(&mut m, b, second);
    m.step();
    let got = m.delivered();
    let Some(Err(Error::BatchFailed {
        epoch,
        batch,
        reason,
        ..
    })) = got.first()
    else {
        panic!("expected BatchFailed, got {got:?}");
    };
    assert_eq!((*epoch, *batch), (0, 0));
    assert!(
        reason.contains("media and tokens disagree: row 0 holds 2 image pad tokens, its images 3"),
        "{reason}"
    );
    let rejected =
        m.s.metrics
            .rejected
            .with_label_values(&["media_mismatch"])
            .get();
    assert_eq!(rejected, 2);
}

/// Worker a answers batch 0 badly: nothing is delivered, the error is counted as `kind` (and
/// the rejection by its reason), b is asked for batch 0 and its answer delivered, a is not
/// asked again.
fn a_bad_answer_is_never_delivered_and_is_asked_for_elsewhere(
    (kind, reason): (&str, &str),
    answer_badly: impl FnOnce(&mut Machine, LinkId, BatchRequest),
) {
    let mut m = Machine::new(config(1));
    let a = m.worker_up("a", plan(7));
    m.step();
    let asked = m.asked(a);
    let b = m.worker_up("b", plan(7));
    let request = m.request(asked[0].0);
    assert_eq!((request.epoch, request.global_batch), (0, 0));
    answer_badly(&mut m, a, request);
    m.step();
    assert!(m.delivered().is_empty(), "the bad answer was delivered");
    assert_eq!(m.s.metrics.errors.with_label_values(&[kind]).get(), 1);
    let rejected = |r: &str| m.s.metrics.rejected.with_label_values(&[r]).get();
    assert_eq!(rejected(reason), 1);
    let all: u64 = RejectReason::ALL.iter().map(|r| rejected(r.as_str())).sum();
    assert_eq!(all, 1);
    let retried = m.asked(b);
    assert_eq!((retried[0].1, retried[0].2), (0, 0), "batch 0, from b");
    m.answer(b, retried[0].0);
    m.step();
    assert_eq!(m.delivered(), [Ok(retried[0].0)]);
    assert!(m.asked(a).is_empty(), "a is not asked again");
}

/// A worker that stalls (connected, never answering) does not hold a batch forever: past
/// `request_timeout` the request is asked again elsewhere and the stalled answer, if it ever
/// comes, is dropped; with only stalling workers the trainer gets `BatchFailed` after
/// `max_attempts` deadlines.
#[tokio::test]
async fn a_request_unanswered_past_its_deadline_is_asked_again_elsewhere() {
    let mut cfg = config(1);
    cfg.request_timeout = Duration::from_millis(5);
    let mut m = Machine::new(cfg);
    let a = m.worker_up("a", plan(7));
    m.step();
    let first = m.asked(a);
    assert_eq!(first.len(), 1);
    let b = m.worker_up("b", plan(7));
    m.advance(Duration::from_millis(10));
    m.step();
    let again = m.asked(b);
    assert_eq!(again.len(), 1, "asked again on the other worker");
    assert_eq!((again[0].1, again[0].2), (0, 0));
    m.answer(a, first[0].0); // the stalled answer, late: dropped
    m.step();
    assert!(m.delivered().is_empty());
    m.answer(b, again[0].0);
    m.step();
    assert_eq!(m.delivered(), [Ok(again[0].0)]);
    let retries = m.s.metrics.retries.with_label_values(&["deadline"]).get();
    assert_eq!(retries, 1);

    // One worker, stalled on everything: three deadlines, then the trainer's error.
    let mut cfg = config(1);
    cfg.request_timeout = Duration::from_millis(5);
    let mut m = Machine::new(cfg);
    let only = m.worker_up("only", plan(7));
    let mut delivered = Vec::new();
    for _ in 0..3 {
        m.step();
        assert_eq!(m.asked(only).len(), 1, "asked again after each deadline");
        m.advance(Duration::from_millis(10));
        m.step();
        delivered = m.delivered();
    }
    let err = delivered.pop().expect("an error").unwrap_err();
    assert_eq!(err.kind(), "batch_failed");
    assert!(err.to_string().contains("no answer within 5ms"), "{err}");
}

/// Rank 1 of 64 over 16 workers with 4 links: one home, three spares.
fn subset_machine() -> (Machine, Vec<String>) {
    let mut cfg = config(2);
    cfg.world_size = 64;
    cfg.links_per_rank = 4;
    let mut m = Machine::new(cfg);
    let addrs: Vec<String> = (0..16).map(|i| format!("w{i:02}")).collect();
    let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    m.discover(&refs);
    (m, addrs)
}

/// The same rank with its home up (members as the plan sets them).
fn subset_home_up() -> (Machine, LinkId, crate::topology::Members) {
    let (mut m, _) = subset_machine();
    let home_addr = m.s.members().homes[0].clone();
    let home = m.worker_up(&home_addr, plan(7));
    let members = m.s.members().clone();
    (m, home, members)
}

#[tokio::test]
async fn a_rank_links_only_its_home_and_spills_to_one_spare_when_the_home_fails() {
    let (mut m, _) = subset_machine();
    // Before the plan is known: one home, no spare (the connection limit is not known yet).
    let probe = m.s.members().clone();
    assert_eq!((probe.homes.len(), probe.spares.len()), (1, 0));
    assert_eq!(m.links_by_addr.len(), 1, "only the home is dialled");
    let home = m.worker_up(&probe.homes[0], plan(7));
    let members = m.s.members().clone();
    assert_eq!(
        members.homes, probe.homes,
        "the same home once the plan is known"
    );
    assert_eq!((members.homes.len(), members.spares.len()), (1, 3));
    m.step();
    let asked = m.asked(home);
    assert_eq!(asked.len(), 2);
    // The home dies: its two positions wait for one spare, which is dialled, then get them.
    m.down(home);
    m.step();
    assert_eq!(m.links_by_addr.len(), 2, "one spare dialled");
    let spare = m.worker_up(&members.spares[0], plan(7));
    m.step();
    let resent: Vec<(u64, u64)> = m.asked(spare).iter().map(|r| (r.1, r.2)).collect();
    assert_eq!(resent, [(0, 0), (0, 1)]);
    for id in m.s.in_flight.keys().copied().collect::<Vec<_>>() {
        m.answer(spare, id);
    }
    assert_eq!(m.delivered().len(), 2);
    // The home comes back (after its backoff): requests go home again, and the idle spare is
    // released once idle long enough.
    m.advance(Duration::from_secs(1));
    m.links_by_addr.remove(&members.homes[0]);
    m.step();
    let home = m.worker_up(&members.homes[0], plan(7));
    m.consume(2);
    m.step();
    assert_eq!(m.asked(home).len(), 2, "the home again");
    assert!(m.asked(spare).is_empty());
    m.advance(LINK_IDLE);
    m.step();
    assert_eq!(m.closed, [spare], "the idle spare is released");
    assert_eq!(m.s.link_count(), 1);
}

#[tokio::test]
async fn a_home_at_its_connection_limit_is_not_a_dead_end() {
    let (mut m, _) = subset_machine();
    let members = m.s.members().clone();
    let home = m.link(&members.homes[0]);
    let full = ErrorFrame {
        request_id: 0,
        code: ErrorCode::Unavailable,
        message: "worker at its limit of 8 connections; retry on another worker".into(),
    };
    m.event(Event::Refused {
        link: home,
        error: full,
    });
    m.down(home);
    m.step();
    // Before any plan is known too: another worker is dialled (one), and serves.
    let dialled: Vec<String> = m
        .links_by_addr
        .keys()
        .filter(|a| **a != members.homes[0])
        .cloned()
        .collect();
    assert_eq!(dialled.len(), 1, "{dialled:?}");
    let spare = m.worker_up(&dialled[0], plan(7));
    m.step();
    assert_eq!(m.asked(spare).len(), 2, "the spare serves meanwhile");
    let problem = m.s.problems[&members.homes[0]].to_string();
    assert!(
        problem.contains("at its limit of 8 connections"),
        "{problem}"
    );
    // Still refused after every backoff: the rank keeps being served by the spare.
    m.advance(Duration::from_secs(1));
    m.step();
    assert_ne!(m.link(&members.homes[0]), home, "the home is dialled again");
}

#[tokio::test]
async fn a_new_link_starts_with_a_small_window_that_grows_with_its_answers() {
    let mut m = Machine::new(config(8));
    let a = m.cold_worker_up("a", plan(7));
    m.step();
    let first = m.asked(a);
    assert_eq!(first.len(), INITIAL_WINDOW, "slow start");
    m.answer(a, first[0].0);
    m.step();
    // One answered: one more room than the answer freed.
    assert_eq!(m.asked(a).len(), 2);
    // A transient failure halves it.
    let open: Vec<u64> = m.s.in_flight.keys().copied().collect();
    let before = m.s.links[&a].window;
    m.fail(a, open[0], ErrorCode::Transient, "store hiccup");
    assert_eq!(m.s.links[&a].window, (before / 2).max(1));
}

#[tokio::test]
async fn the_auto_depth_stays_at_two_until_the_trainer_s_pace_is_known() {
    let mut cfg = config(1);
    cfg.depth = Depth::Auto { max: 16 };
    let mut m = Machine::new(cfg);
    let a = m.worker_up("a", plan(7));
    m.step();
    let first = m.asked(a);
    assert_eq!(first.len(), 2);
    m.advance(Duration::from_millis(100));
    m.answer(a, first[0].0);
    m.step();
    assert!(
        m.asked(a).is_empty(),
        "a latency alone does not deepen the window"
    );
    // The pace is known: 100 ms latency, a batch every 20 ms: 5 in flight + 2.
    m.s.shared.took(1, Some(Duration::from_millis(20)));
    m.step();
    assert_eq!(m.s.depth(), 7);
}

#[tokio::test]
async fn the_loser_of_a_hedge_and_an_expired_request_are_cancelled() {
    let (mut m, a, b) = hedging_on_two_workers(|c| c.request_timeout = Duration::from_secs(10));
    m.step();
    let (slow, other) = if m.asked(a).is_empty() {
        (b, a)
    } else {
        (a, b)
    };
    let first = m.s.in_flight.keys().copied().next().unwrap();
    m.advance(Duration::from_millis(5));
    m.step();
    let hedge = m.asked(other);
    m.answer(other, hedge[0].0);
    assert_eq!(m.cancelled, [(slow, first)], "the loser is cancelled");
    // A request past its deadline is cancelled too, then asked again.
    m.consume(1);
    m.step();
    let next =
        m.s.in_flight
            .iter()
            .map(|(id, f)| (*id, f.link))
            .next()
            .unwrap();
    m.advance(Duration::from_secs(11));
    m.step();
    assert_eq!(m.cancelled.last(), Some(&(next.1, next.0)));
}

#[tokio::test]
async fn hedges_stop_at_their_budget() {
    let mut cfg = config(4);
    cfg.hedge = Some(HedgePolicy {
        min_observations: 1,
        head_positions: 4,
        burst: 2.0,
        ..HedgePolicy::default()
    });
    let mut m = Machine::new(cfg);
    let _a = m.worker_up("a", plan(7));
    let _b = m.worker_up("b", plan(7));
    let _c = m.worker_up("c", plan(7));
    m.s.latencies.record(Duration::from_millis(1));
    m.step();
    m.advance(Duration::from_millis(5));
    m.step();
    // Four stragglers, a burst of two hedges, nothing answered to earn more.
    assert_eq!(m.s.metrics.hedges.with_label_values(&["sent"]).get(), 2);
    assert!(m.s.metrics.hedges.with_label_values(&["over_budget"]).get() >= 1);
}

#[tokio::test]
async fn a_straggler_with_time_to_spare_is_hedged_only_once_the_trainer_would_wait_for_it() {
    let (mut m, a, b) = hedging_on_two_workers(|_| {});
    // The trainer takes a batch every 100 ms: position 0 is needed 100 ms from now.
    m.s.shared.took(0, Some(Duration::from_millis(100)));
    m.step();
    let (slow, other) = if m.asked(a).is_empty() {
        (b, a)
    } else {
        (a, b)
    };
    // A straggler by the latency rule (1.5 × 1 ms), but a fresh request (1 ms) would still
    // arrive in time: no duplicate yet.
    m.advance(Duration::from_millis(5));
    m.step();
    assert!(m.asked(other).is_empty(), "not hedged with 95 ms to spare");
    // 1 ms before it is needed: hedged.
    m.advance(Duration::from_millis(94));
    m.step();
    assert_eq!(m.asked(other).len(), 1, "hedged once it would be late");
    assert!(m.asked(slow).is_empty());
}

/// A home that lags keeps what it holds, the next position goes to a spare, and the home
/// answers late (a suspect now), the spare in time: the rank, its home and the spare.
fn a_suspect_home_beside_a_spare() -> (Machine, LinkId, LinkId) {
    let (mut m, home, members) = subset_home_up();
    for _ in 1..LAG_OBSERVATIONS {
        m.s.latencies.record(Duration::from_millis(10));
    }
    m.s.latencies.record(Duration::from_millis(30));
    m.step();
    let first = m.asked(home);
    assert_eq!(first.len(), 2);
    m.advance(Duration::from_millis(10));
    m.answer(home, first[0].0);
    // Position 1 has waited 50 ms at home, past 4 × the median (10 ms): the home lags, so
    // position 2 goes to a spare, dialled for it. It answered 40 ms ago, less than 1.5 ×
    // the longest recent latency (30 ms): lagging, not silent, so it keeps position 1.
    m.advance(Duration::from_millis(40));
    m.consume(1);
    m.step();
    assert!(m.asked(home).is_empty(), "a lagging home gets nothing more");
    assert_eq!(m.links_by_addr.len(), 2, "a spare dialled");
    let spare = m.worker_up(&members.spares[0], plan(7));
    m.step();
    let on_spare = m.asked(spare);
    assert_eq!(
        on_spare.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 2)]
    );
    // The home answers late (a suspect now), the spare in time.
    m.answer(home, first[1].0);
    m.advance(Duration::from_millis(10));
    m.answer(spare, on_spare[0].0);
    assert_eq!(m.delivered().len(), 3);
    (m, home, spare)
}

#[tokio::test]
async fn a_lagging_home_keeps_what_it_holds_and_is_probed_one_request_at_a_time() {
    let (mut m, home, spare) = a_suspect_home_beside_a_spare();
    // Once its estimate has decayed below the limit the home is probed with one request,
    // whose position goes to the spare too; the next goes to the spare while the probe is out.
    m.advance(Duration::from_secs(20));
    m.consume(2);
    m.step();
    let probe = m.asked(home);
    assert_eq!(
        probe.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 3)]
    );
    let beside = m.asked(spare);
    assert_eq!(
        beside.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 3), (1, 0)]
    );
    // The probe answers in time: its duplicate is cancelled, the home is trusted again and
    // takes the next positions.
    m.advance(Duration::from_millis(10));
    m.answer(home, probe[0].0);
    assert_eq!(m.cancelled, [(spare, beside[0].0)]);
    m.answer(spare, beside[1].0);
    assert_eq!(m.delivered().len(), 2);
    m.consume(2);
    m.step();
    assert_eq!(m.asked(home).len(), 2, "home again");
    assert!(m.asked(spare).is_empty());
}

/// A probe's duplicate is paid from the hedge budget: with the budget spent, the suspect home
/// is not probed; the positions go to the spare alone, duplicated nowhere.
#[tokio::test]
async fn a_suspect_is_not_probed_over_the_hedge_budget() {
    let (mut m, home, spare) = a_suspect_home_beside_a_spare();
    m.s.hedges = no_hedges_left();
    m.advance(Duration::from_secs(20));
    m.consume(2);
    m.step();
    assert!(m.asked(home).is_empty(), "no probe without a duplicate");
    let on_spare = m.asked(spare);
    assert_eq!(
        on_spare.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 3), (1, 0)]
    );
    assert_eq!(m.s.metrics.hedges.with_label_values(&["sent"]).get(), 0);
}

/// A budget with `n` duplicates left, earning none.
fn hedges_left(n: f64) -> HedgeBudget {
    HedgeBudget::new(HedgePolicy {
        burst: n,
        budget: 0.0,
        ..HedgePolicy::default()
    })
}

fn no_hedges_left() -> HedgeBudget {
    hedges_left(0.0)
}

/// A worker gone without a word (no answer, no close: a partition, a lost node) holds two
/// positions. Once its link has answered nothing for longer than 1.5 × any recent answer took
/// and than the lag limit, both are asked of another worker at once: with hedging off, long
/// before the socket's keepalive (30 s) or the request timeout (120 s) would say so.
#[tokio::test]
async fn positions_held_by_a_silent_worker_are_asked_elsewhere_within_a_few_latencies() {
    let (mut m, home, members) = subset_home_up();
    // Median 10 ms (lag limit 40 ms), longest 20 ms (× 1.5 = 30 ms): silent after 40 ms.
    for ms in [10, 10, 10, 10, 10, 10, 10, 20] {
        m.s.latencies.record(Duration::from_millis(ms));
    }
    m.step();
    let held = m.asked(home);
    assert_eq!(held.len(), 2);
    let wake = m.s.next_timer().expect("a timer for the silence");
    assert_eq!(wake.duration_since(m.now), Duration::from_millis(40));
    m.advance(Duration::from_millis(39));
    m.step();
    assert_eq!(m.links_by_addr.len(), 1, "not silent yet: no spare dialled");
    m.advance(Duration::from_millis(1));
    m.step();
    assert_eq!(
        m.links_by_addr.len(),
        2,
        "a spare dialled for the stranded positions"
    );
    let spare = m.worker_up(&members.spares[0], plan(7));
    m.step();
    let again = m.asked(spare);
    assert_eq!(
        again.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 0), (0, 1)]
    );
    assert!(m.asked(home).is_empty(), "a silent home gets nothing new");
    assert_eq!(m.s.metrics.retries.with_label_values(&["silent"]).get(), 2);
    assert_eq!(m.s.metrics.hedges.with_label_values(&["sent"]).get(), 0);
    // Asked once each: the next steps send nothing more while the spare prepares them.
    m.advance(Duration::from_millis(100));
    m.step();
    assert!(m.asked(spare).is_empty() && m.asked(home).is_empty());
    m.answer(spare, again[0].0);
    m.answer(spare, again[1].0);
    let delivered = m.delivered();
    assert_eq!(delivered.len(), 2, "{delivered:?}");
    // The silent worker's answers, should they come after all, are not delivered again.
    m.answer(home, held[0].0);
    m.answer(home, held[1].0);
    assert!(m.delivered().is_empty());
}

/// A silent link's positions are asked elsewhere as duplicates (their requests stay out),
/// so the hedge budget pays for them: with one duplicate left, one of the two positions a
/// silent home holds moves; the other stays until the budget allows or the socket fails.
#[tokio::test]
async fn a_silent_link_s_positions_are_asked_elsewhere_only_within_the_hedge_budget() {
    let (mut m, home, members) = subset_home_up();
    m.s.hedges = hedges_left(1.0);
    for ms in [10, 10, 10, 10, 10, 10, 10, 20] {
        m.s.latencies.record(Duration::from_millis(ms));
    }
    m.step();
    assert_eq!(m.asked(home).len(), 2);
    m.advance(Duration::from_millis(40));
    m.step();
    let spare = m.worker_up(&members.spares[0], plan(7));
    m.step();
    let again = m.asked(spare);
    assert_eq!(
        again.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        [(0, 0)]
    );
    assert_eq!(m.s.metrics.retries.with_label_values(&["silent"]).get(), 1);
    assert!(m.s.metrics.hedges.with_label_values(&["over_budget"]).get() >= 1);
}

fn refusal(code: ErrorCode, message: &str) -> ErrorFrame {
    ErrorFrame {
        request_id: 0,
        code,
        message: message.into(),
    }
}

/// The other worker the rank dialled after its home, if there is exactly one.
fn dialled_beside(m: &Machine, home: &str) -> String {
    let others: Vec<&String> = m.links_by_addr.keys().filter(|a| *a != home).collect();
    assert_eq!(others.len(), 1, "{others:?}");
    others[0].clone()
}

/// A worker refusing the token beside a healthy one is that worker's problem: the rank is
/// served by the other; the refusal is counted and named among the workers' problems.
#[tokio::test]
async fn a_refused_token_beside_a_healthy_worker_is_that_worker_s_problem() {
    let (mut m, _) = subset_machine();
    let home = m.s.members().homes[0].clone();
    let link = m.link(&home);
    m.event(Event::Refused {
        link,
        error: refusal(ErrorCode::Unauthorized, "wrong pipeline token"),
    });
    m.down(link);
    m.step();
    assert!(m.s.take_identity().is_none(), "the loader failed");
    let spare = dialled_beside(&m, &home);
    let spare = m.worker_up(&spare, plan(7));
    m.step();
    assert_eq!(m.asked(spare).len(), 2, "the other worker serves");
    assert!(m.s.take_identity().unwrap().is_ok());
    assert!(m.delivered().is_empty(), "no error for the trainer");
    assert_eq!(m.s.metrics.errors.with_label_values(&["refused"]).get(), 1);
    let problem = m.s.problems[&home].to_string();
    assert!(problem.contains("wrong pipeline token"), "{problem}");
}

/// When every worker listed refuses the token, the trainer is told at once, naming them.
#[tokio::test]
async fn a_token_every_worker_refuses_fails_the_loader_naming_each() {
    let mut m = Machine::new(config(1));
    m.discover(&["a", "b"]);
    for _ in 0..2 {
        let (addr, link) = m
            .links_by_addr
            .iter()
            .find(|(a, _)| m.s.token_refusal(a).is_none())
            .map(|(a, l)| (a.clone(), *l))
            .expect("a worker not yet refusing is dialled");
        assert!(
            m.s.take_identity().is_none(),
            "failed before {addr} refused"
        );
        m.event(Event::Refused {
            link,
            error: refusal(ErrorCode::Unauthorized, "wrong pipeline token"),
        });
        m.down(link);
        m.step();
    }
    let err = m.s.take_identity().unwrap().unwrap_err();
    assert_eq!(
        err.to_string(),
        "worker a, b refused the connection: wrong pipeline token"
    );
}

/// One worker refusing or failing a batch beside a healthy one: the batch is asked of the
/// other and delivered, the first is not asked for it again, and the retry is counted by
/// reason.
#[tokio::test]
async fn a_batch_one_worker_refuses_or_fails_is_served_by_another() {
    for (code, reason) in [
        (ErrorCode::BadRequest, "refused"),
        (ErrorCode::Unauthorized, "refused"),
        (ErrorCode::Failed, "failed"),
    ] {
        let mut m = Machine::new(config(1));
        let a = m.worker_up("a", plan(7));
        m.step();
        let first = m.asked(a);
        let b = m.worker_up("b", plan(7));
        m.fail(a, first[0].0, code, "this worker's own trouble");
        m.step();
        assert!(m.delivered().is_empty(), "{code:?} reached the trainer");
        let retried = m.asked(b);
        assert_eq!((retried[0].1, retried[0].2), (0, 0), "batch 0, from b");
        m.answer(b, retried[0].0);
        m.step();
        assert_eq!(m.delivered(), [Ok(retried[0].0)], "{code:?}");
        assert!(m.asked(a).iter().all(|r| (r.1, r.2) != (0, 0)));
        let retries = m.s.metrics.retries.with_label_values(&[reason]).get();
        assert_eq!(retries, 1, "{code:?}");
    }
}

/// A batch two workers fail is the data's fault (`on_error: fail`): the trainer gets it,
/// naming both, without asking the third.
#[tokio::test]
async fn a_batch_two_workers_fail_is_the_data_s_and_ends_naming_both() {
    let mut m = Machine::new(config(1));
    let a = m.worker_up("a", plan(7));
    m.step();
    let first = m.asked(a)[0].0;
    let b = m.worker_up("b", plan(7));
    m.fail(a, first, ErrorCode::Failed, "object x.jpg: corrupt");
    m.step();
    let second = m.asked(b)[0].0;
    let c = m.worker_up("c", plan(7));
    m.fail(b, second, ErrorCode::Failed, "object x.jpg: corrupt");
    m.step();
    let got = m.delivered();
    let err = got[0].as_ref().unwrap_err();
    assert_eq!(
        err.to_string(),
        "epoch 0 batch 0 (rank 1/2): worker a, b: object x.jpg: corrupt"
    );
    assert!(m.asked(c).iter().all(|r| (r.1, r.2) != (0, 0)));
}

/// A batch refused by one worker while the only other is unreachable ends, naming each
/// worker's reason (it would otherwise wait for a worker that may never come back).
#[tokio::test]
async fn a_batch_refused_where_no_other_worker_is_reachable_names_each_reason() {
    let mut m = Machine::new(config(1));
    let a = m.worker_up("a", plan(7));
    let b = m.worker_up("b", plan(7));
    m.step();
    let (link, id) = match (m.asked(a).first(), m.asked(b).first()) {
        (Some(r), _) => (a, r.0),
        (None, Some(r)) => (b, r.0),
        (None, None) => panic!("batch 0 was not asked for"),
    };
    let other = if link == a { b } else { a };
    m.down(other);
    m.fail(link, id, ErrorCode::BadRequest, "bad request");
    m.step();
    let got = m.delivered();
    let msg = got[0].as_ref().unwrap_err().to_string();
    let (refuser, lost) = if link == a { ("a", "b") } else { ("b", "a") };
    assert_eq!(
        msg,
        format!(
            "epoch 0 batch 0 (rank 1/2): worker {refuser}, {lost}: {refuser}: bad request; \
             {lost}: worker {lost}: connection reset"
        )
    );
}
