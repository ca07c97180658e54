//! Runs the scheduler's state machine over tokio and TCP: one task feeds it link events,
//! worker-set changes, seeks and the trainer's wake-ups with the time they happened, executes
//! its actions (one task per connection, `link.rs`) and passes its deliveries to the trainer.

use crate::buffer::BufferPool;
use crate::config::LoaderConfig;
use crate::discovery::WorkerSet;
use crate::error::Error;
use crate::link::{self, Outbound};
use crate::metrics::ClientMetrics;
use crate::scheduler::{Action, Control, Delivery, Event, LinkId, PlanIdentity, Scheduler, Shared};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_tls::Dial;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// Events from all links at once.
const EVENT_QUEUE: usize = 1024;
/// The longest the driver sleeps without an event (a safety net under the scheduler's own
/// timers).
const MAX_SLEEP: Duration = Duration::from_millis(100);

pub struct Handles {
    pub identity: oneshot::Receiver<Result<PlanIdentity, Error>>,
    pub deliveries: mpsc::Receiver<Delivery>,
    pub control: mpsc::Sender<Control>,
}

struct Driver {
    core: Scheduler,
    shared: Arc<Shared>,
    dial: Dial,
    token: String,
    pool: BufferPool,
    events_tx: mpsc::Sender<Event>,
    links: HashMap<LinkId, (mpsc::Sender<Outbound>, JoinHandle<()>)>,
    identity_tx: Option<oneshot::Sender<Result<PlanIdentity, Error>>>,
    out: mpsc::Sender<Delivery>,
}

/// Spawns the scheduler and its driver on the current runtime.
pub fn spawn(
    cfg: LoaderConfig,
    dial: Dial,
    workers: watch::Receiver<WorkerSet>,
    shared: Arc<Shared>,
    metrics: Arc<ClientMetrics>,
) -> Handles {
    let token = cfg.token.clone();
    let core = Scheduler::new(cfg, shared.clone(), metrics, Instant::now());
    // Deliveries never exceed the window, so this capacity is never the binding limit.
    let (out, deliveries) = mpsc::channel(core.max_depth() + 1);
    let (control_tx, control_rx) = mpsc::channel(4);
    let (identity_tx, identity) = oneshot::channel();
    let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
    let driver = Driver {
        core,
        shared,
        dial,
        token,
        // Enough to recycle what the trainer releases while the window refills.
        pool: BufferPool::new(4),
        events_tx,
        links: HashMap::new(),
        identity_tx: Some(identity_tx),
        out,
    };
    tokio::spawn(driver.run(workers, events_rx, control_rx));
    Handles {
        identity,
        deliveries,
        control: control_tx,
    }
}

impl Driver {
    async fn run(
        mut self,
        mut workers: watch::Receiver<WorkerSet>,
        mut events: mpsc::Receiver<Event>,
        mut control: mpsc::Receiver<Control>,
    ) {
        let shared = self.shared.clone();
        let first = workers.borrow_and_update().clone();
        self.core.set_workers(Instant::now(), first);
        loop {
            self.core.step(Instant::now());
            self.execute();
            if self.out.is_closed() {
                break; // the loader is gone
            }
            let now = Instant::now();
            let wake = self
                .core
                .next_timer()
                .map_or(now + MAX_SLEEP, |t| t.clamp(now, now + MAX_SLEEP));
            tokio::select! {
                Some(ev) = events.recv() => self.core.on_event(Instant::now(), ev),
                changed = workers.changed() => {
                    let set = match changed {
                        Ok(()) => workers.borrow_and_update().clone(),
                        Err(_) => WorkerSet::new(),
                    };
                    self.core.set_workers(Instant::now(), set);
                }
                Some(c) = control.recv() => self.core.on_control(Instant::now(), c),
                _ = shared.wake.notified() => {}
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
        }
        for (_, task) in self.links.values() {
            task.abort();
        }
    }

    /// Carries out the scheduler's actions, hands over the plan once, and moves ready
    /// deliveries into the trainer's channel while it has room.
    fn execute(&mut self) {
        for action in self.core.take_actions() {
            match action {
                Action::Connect { link, addr } => {
                    let (tx, rx) = mpsc::channel(link::QUEUE);
                    let task = tokio::spawn(link::run(
                        link,
                        addr,
                        self.dial.clone(),
                        self.token.clone(),
                        rx,
                        self.events_tx.clone(),
                        self.pool.clone(),
                    ));
                    self.links.insert(link, (tx, task));
                }
                // The scheduler keeps a link's requests within its queue; a closed queue
                // means the connection is gone, and its Down event is on the way.
                Action::Send { link, request } => self.push(link, Outbound::Request(request)),
                Action::Cancel { link, request_id } => {
                    self.push(link, Outbound::Cancel(request_id))
                }
                Action::Close { link } => {
                    if let Some((_, task)) = self.links.remove(&link) {
                        task.abort();
                    }
                }
            }
        }
        if let Some(identity) = self.core.take_identity() {
            if let Some(tx) = self.identity_tx.take() {
                let _ = tx.send(identity);
            }
        }
        while self.out.capacity() > 0 {
            let Some(d) = self.core.poll_delivery() else {
                break;
            };
            // Only this task sends, and there is room: this cannot fail but by a closed loader.
            let _ = self.out.try_send(d);
        }
    }

    fn push(&mut self, link: LinkId, frame: Outbound) {
        if let Some((tx, _)) = self.links.get(&link) {
            let _ = tx.try_send(frame);
        }
    }
}
