//! The reconcile loop, one small step each: validate the spec → observe what exists (from the
//! caches: a reconcile reads nothing from the API server) → decide the worker count
//! (stoker-control's autoscaler) → build the objects (pure, `build`) → apply what changed
//! (`apply`: server-side apply, owner references) → report status (pure, `status`; patched
//! only when it changed), conditions and Events.

use crate::apply::Owned;
use crate::build;
use crate::cache::{Cached, TrainerPods};
use crate::crd::{Autoscaling, DataPipeline, DataPipelineStatus, ScalingRules};
use crate::placement;
use crate::scrape::{self, Reading};
use crate::secrets::Credentials;
use crate::status::{self, Observed, Scale};
use crate::validate::Valid;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stoker_control::autoscale::{self, Autoscaler, Observation};

pub use crate::error::{at, Error};
pub use crate::metrics::{ReconcileErrorKind, Step};

/// What the operator remembers per reconciled pipeline between reconciles (the autoscaler's
/// part stays empty without autoscaling).
#[derive(Default)]
struct ScalerState {
    autoscaler: Autoscaler,
    started: Option<Instant>,
    last_reading: Option<(Instant, Reading)>,
    last_observation: Option<Observation>,
}

/// What a reconcile reads and writes through: the owned kinds (cache + what was applied), the
/// Nodes and worker pods placement reads, the trainer pods a metric source scrapes.
pub struct Cluster {
    pub deployments: Owned<Deployment>,
    pub services: Owned<Service>,
    pub disruption_budgets: Owned<PodDisruptionBudget>,
    pub network_policies: Owned<NetworkPolicy>,
    pub nodes: Cached<Node>,
    /// Every pipeline (the controller's own cache): other pipelines' workers' egress.
    pub pipelines: Store<DataPipeline>,
    /// Worker pods of every pipeline the operator manages.
    pub workers: Cached<Pod>,
    pub trainers: TrainerPods,
}

impl Cluster {
    /// Whether every reflector a reconcile reads has listed once: before that a missing
    /// object may exist, and nothing is decided.
    pub fn synced(&self) -> bool {
        self.deployments.cache.is_synced()
            && self.services.cache.is_synced()
            && self.disruption_budgets.cache.is_synced()
            && self.network_policies.cache.is_synced()
            && self.nodes.is_synced()
            && self.workers.is_synced()
    }
}

pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub metrics: Arc<crate::metrics::OperatorMetrics>,
    pub cluster: Cluster,
    scalers: Mutex<HashMap<String, ScalerState>>,
    pub credentials: Credentials,
    /// Namespaces whose pods may read the workers' /metrics, besides the pipeline's own.
    pub worker_metrics_from: Vec<String>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<crate::metrics::OperatorMetrics>,
        cluster: Cluster,
        credentials: Credentials,
        worker_metrics_from: Vec<String>,
    ) -> Self {
        Context {
            client,
            recorder,
            metrics,
            cluster,
            scalers: Mutex::new(HashMap::new()),
            credentials,
            worker_metrics_from,
        }
    }

    /// Drops the state and metric series of pipelines that no longer exist (`live` holds
    /// the "namespace/name" keys of those that do; `scraped`, the trainer pods they read).
    pub fn forget_deleted(&self, live: &HashSet<String>, scraped: &HashSet<(String, String)>) {
        let mut scalers = self.scalers.lock().expect("scaler state");
        scalers.retain(|k, _| {
            let keep = live.contains(k);
            if !keep {
                let (ns, name) = k.split_once('/').unwrap_or(("", k));
                self.metrics.scaler.forget_pipeline(ns, name);
                tracing::info!("{k}: deleted; autoscaler state dropped");
            }
            keep
        });
        self.credentials.retain(live);
        let c = &self.cluster;
        c.deployments.retain(live);
        c.services.retain(live);
        c.disruption_budgets.retain(live);
        c.network_policies.retain(live);
        c.trainers.retain(scraped);
    }
}

/// The autoscaler's spec from the resource (defaults: stoker_control's, the HPA's).
pub fn policy_spec(a: &Autoscaling) -> autoscale::Spec {
    let d = autoscale::Spec::default();
    let rules = |r: &Option<ScalingRules>, base: autoscale::Rules| match r {
        None => base,
        Some(r) => autoscale::Rules {
            stabilization: r
                .stabilization_window_seconds
                .map_or(base.stabilization, |s| Duration::from_secs(s.max(0) as u64)),
            max_pods: r.max_pods.map_or(base.max_pods, |v| v.max(1) as u32),
            max_percent: r.max_percent.map_or(base.max_percent, |v| v.max(1) as u32),
            period: r
                .period_seconds
                .map_or(base.period, |s| Duration::from_secs(s.max(1) as u64)),
        },
    };
    autoscale::Spec {
        min_replicas: a.min_replicas.max(1) as u32,
        max_replicas: a.max_replicas.max(1) as u32,
        target_wait_ratio: a.target_wait_ratio,
        scale_up: rules(&a.behavior.scale_up, d.scale_up),
        scale_down: rules(&a.behavior.scale_down, d.scale_down),
        ..d
    }
}

pub fn key(dp: &DataPipeline) -> String {
    format!("{}/{}", dp.namespace().unwrap_or_default(), dp.name_any())
}

async fn decide(dp: &DataPipeline, ctx: &Context, current: i32, ready: i32) -> Scale {
    let Some(a) = &dp.spec.autoscaling else {
        return Scale {
            replicas: dp.spec.replicas,
            observation: None,
            per_worker: None,
            reason: "spec.replicas (autoscaling off)".into(),
            metrics_available: None,
        };
    };
    let interval = Duration::from_secs(a.interval_seconds.max(1) as u64);
    let now = Instant::now();
    let due = |state: &ScalerState| {
        state
            .last_reading
            .as_ref()
            .is_none_or(|(t, _)| now.duration_since(*t) >= interval)
    };
    {
        let scalers = ctx.scalers.lock().expect("scaler state");
        if let Some(state) = scalers.get(&key(dp)).filter(|s| !due(s)) {
            // Reconciles between evaluations (owned objects changing) hold the count.
            return Scale {
                replicas: current,
                observation: state.last_observation,
                per_worker: None,
                reason: String::new(),
                metrics_available: Some(state.last_observation.is_some()),
            };
        }
    }
    // Scrape without holding the lock: other pipelines reconcile meanwhile.
    let reading = scrape::read(&ctx.cluster.trainers, dp, &a.metrics).await;
    if let Err(e) = &reading {
        tracing::warn!("{}: reading trainer metrics: {e:#}", key(dp));
    }
    let mut scalers = ctx.scalers.lock().expect("scaler state");
    let state = scalers.entry(key(dp)).or_default();
    let started = *state.started.get_or_insert(now);
    let before = state.last_reading.as_ref().map(|(_, r)| r);
    let obs = reading
        .as_ref()
        .ok()
        .and_then(|r| r.observation(before, ready.max(0) as u32));
    state.last_reading = reading.ok().map(|r| (now, r));
    state.last_observation = obs;
    let d = state.autoscaler.evaluate(
        &policy_spec(a),
        now.duration_since(started),
        current.max(0) as u32,
        obs,
    );
    Scale {
        replicas: d.replicas as i32,
        observation: obs,
        per_worker: d.per_worker_per_s,
        reason: d.reason,
        metrics_available: Some(obs.is_some()),
    }
}

/// What the nodes `dp`'s workers may land on can still take of them, every other pipeline's
/// workers there counted (for the per-node cap and the NIC saturation check).
fn room(dp: &DataPipeline, c: &Cluster) -> Option<placement::Room> {
    let nodes = c.nodes.store.state();
    let nodes: Vec<&Node> = nodes
        .iter()
        .map(|n| n.as_ref())
        .filter(|n| placement::eligible(dp, n))
        .collect();
    let workers = c.workers.store.state();
    let workers: Vec<&Pod> = workers.iter().map(|p| p.as_ref()).collect();
    // Pipelines created earlier come first: a pipeline counts their workers, not those of
    // later ones (two pipelines each yielding to the other would take turns scaling down).
    let first = |p: &DataPipeline| (p.creation_timestamp(), p.namespace(), p.name_any());
    let egress_of = |ns: &str, name: &str| {
        let other = c.pipelines.get(&ObjectRef::new(name).within(ns))?;
        (first(&other) < first(dp)).then_some(other.spec.placement.worker_egress_gbps)?
    };
    placement::room(dp, &nodes, &workers, egress_of)
}

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let t0 = Instant::now();
    let r = match reconcile_inner(&dp, &ctx).await {
        // Someone else's object in the way: said where the user looks, then retried.
        Err(e @ Error::NotOwned { .. }) => report(&dp, &ctx, "NotOwned", e.to_string())
            .await
            .and(Err(e)),
        r => r,
    };
    let result = r
        .as_ref()
        .map(|_| ())
        .map_err(|e| (e.metric_label(), e.step_label()));
    ctx.metrics.observe_reconcile(t0.elapsed(), result);
    r
}

/// How soon a reconcile that found the caches not yet listed runs again.
const UNSYNCED_RETRY: Duration = Duration::from_secs(1);

async fn reconcile_inner(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    let ns = dp.namespace().ok_or(Error::NoNamespace)?;
    if !ctx.cluster.synced() {
        return Ok(Action::requeue(UNSYNCED_RETRY));
    }
    let valid = match crate::validate::validate(dp) {
        Ok(valid) => valid,
        Err(problems) => {
            report(dp, ctx, "InvalidSpec", problems.join("; ")).await?;
            return Err(Error::InvalidSpec(problems));
        }
    };
    let (pipeline, c) = (key(dp), &ctx.cluster);
    let existing = c
        .deployments
        .current(&pipeline, &ns, &crate::labels::names(dp).workers);
    let current = existing.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let ready = existing
        .as_ref()
        .and_then(|d| d.status.as_ref()?.ready_replicas)
        .unwrap_or(0);
    // A deleted Secret keeps new worker pods from starting: unready workers are a reason to
    // read the credentials again.
    let unready = current.is_some_and(|c| ready < c);
    let credentials = &ctx.credentials;
    credentials
        .ensure_token(&valid, &ctx.client, &pipeline, unready)
        .await?;
    let cert_not_after = credentials
        .ensure_tls(dp, &ctx.client, &pipeline, unready)
        .await?;
    let mut scale = decide(dp, ctx, current.unwrap_or(dp.spec.replicas), ready).await;
    let room = room(dp, c);
    let wanted = scale.replicas;
    if let Some(cap) = room.as_ref().and_then(|r| placement::replica_cap(dp, r)) {
        scale.replicas = scale.replicas.min(cap);
    }

    let deployment = build::deployment(&valid, scale.replicas, cert_not_after);
    let deployment = (c.deployments)
        .apply(&ctx.client, &pipeline, &deployment)
        .await?;
    apply_owned(&valid, ctx, &pipeline).await?;
    if let Some(from) = current.filter(|c| *c != scale.replicas) {
        publish_scale(dp, ctx, &ns, from, &scale).await;
    }
    let observed = Observed {
        deployment: deployment.status.clone().unwrap_or_default(),
        room,
        wanted,
        previous_replicas: current,
    };
    let status = status::compute(dp, &scale, &observed);
    record_gauges(dp, ctx, &ns, &scale, status.ready_replicas);
    patch_status(dp, &ctx.client, &ns, &status).await?;
    let requeue = dp
        .spec
        .autoscaling
        .as_ref()
        .map_or(300, |a| a.interval_seconds.max(1) as u64);
    Ok(Action::requeue(Duration::from_secs(requeue)))
}

/// The Service, PDB and NetworkPolicy (the Deployment is applied first, with the count).
async fn apply_owned(dp: &Valid<'_>, ctx: &Context, pipeline: &str) -> Result<(), Error> {
    let (c, client) = (&ctx.cluster, &ctx.client);
    let service = build::service(dp);
    c.services.apply(client, pipeline, &service).await?;
    let pdb = build::pod_disruption_budget(dp);
    c.disruption_budgets.apply(client, pipeline, &pdb).await?;
    let policy = build::network_policy(dp, &ctx.worker_metrics_from);
    c.network_policies.apply(client, pipeline, &policy).await?;
    Ok(())
}

async fn publish_scale(dp: &DataPipeline, ctx: &Context, ns: &str, from: i32, scale: &Scale) {
    let up = scale.replicas > from;
    ctx.metrics.scaler.count_scale(ns, &dp.name_any(), up);
    let event = Event {
        type_: EventType::Normal,
        reason: if up { "ScaledUp" } else { "ScaledDown" }.into(),
        note: Some(format!(
            "{from} -> {} workers: {}",
            scale.replicas, scale.reason
        )),
        action: "Scale".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &dp.object_ref(&())).await {
        tracing::warn!("publishing a scale event: {e}");
    }
}

fn record_gauges(dp: &DataPipeline, ctx: &Context, ns: &str, scale: &Scale, ready: i32) {
    // Tracked, so that its series go when it does.
    ctx.scalers
        .lock()
        .expect("scaler state")
        .entry(key(dp))
        .or_default();
    let a = dp.spec.autoscaling.as_ref();
    ctx.metrics
        .scaler
        .record_pipeline(stoker_control::metrics::PipelineGauges {
            namespace: ns,
            pipeline: &dp.name_any(),
            desired: scale.replicas,
            ready,
            max: a.map_or(dp.spec.replicas, |a| a.max_replicas),
            target: a.map(|a| a.target_wait_ratio),
            metrics_available: scale.metrics_available,
        });
}

/// A JSON merge patch of the status, unless it is the status the object has: a field the
/// status leaves out keeps its value, so the last scale decision survives a reconcile that
/// read a stale copy of the object (an apply would remove it); observations that are gone are
/// cleared with an explicit null.
async fn patch_status(
    dp: &DataPipeline,
    client: &kube::Client,
    ns: &str,
    status: &DataPipelineStatus,
) -> Result<(), Error> {
    if dp.status.as_ref() == Some(status) {
        return Ok(());
    }
    let mut status = serde_json::to_value(status).expect("a status serializes");
    if let Some(fields) = status.as_object_mut() {
        for observation in ["waitRatio", "samplesPerSecond"] {
            fields.entry(observation).or_insert(serde_json::Value::Null);
        }
    }
    let patch = serde_json::json!({ "status": status });
    Api::<DataPipeline>::namespaced(client.clone(), ns)
        .patch_status(
            &dp.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(at(Step::Status, dp))?;
    Ok(())
}

/// What keeps the pipeline from running (`reason`: InvalidSpec, a spec the operator cannot
/// honour; NotOwned, an object in the way): a Warning Event and a Ready=False condition
/// saying so; nothing else changes.
async fn report(
    dp: &DataPipeline,
    ctx: &Context,
    reason: &'static str,
    message: String,
) -> Result<(), Error> {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(message.clone()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &dp.object_ref(&())).await {
        tracing::warn!("publishing a {reason} event: {e}");
    }
    let ns = dp.namespace().unwrap_or_default();
    patch_status(
        dp,
        &ctx.client,
        &ns,
        &status::not_ready(dp, reason, message),
    )
    .await
}

pub fn error_policy(dp: Arc<DataPipeline>, e: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!("reconciling {}: {e}", key(&dp));
    match e {
        // Nothing changes until the spec does (a new generation triggers a reconcile).
        Error::InvalidSpec(_) => Action::requeue(Duration::from_secs(300)),
        // A person removes the object in the way; nothing of ours tells us when.
        Error::NotOwned { .. } => Action::requeue(Duration::from_secs(60)),
        _ => Action::requeue(Duration::from_secs(5)),
    }
}

/// The reconcile loop against a mocked API server: every request it makes, in order, with
/// what it sends (tests/k8s runs the same against a real API server).
#[cfg(test)]
mod tests;
