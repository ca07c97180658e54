//! The reconcile loop, one small step each: validate the spec → observe what exists (from the
//! caches: a reconcile reads nothing from the API server) → decide the worker count
//! (stoker-control's autoscaler) → build the objects (pure, `build`) → apply what changed
//! (`apply`: server-side apply, owner references) → report status (pure, `status`; patched
//! only when it changed), conditions and Events.

use crate::apply::{Owned, RESYNC};
use crate::build;
use crate::cache::{Cached, TrainerPods};
use crate::crd::{Autoscaling, DataPipeline, DataPipelineStatus, ScalingRules};
use crate::placement;
use crate::scrape::{self, Reading};
use crate::status::{self, Observed, Scale};
use crate::validate::Valid;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stoker_control::autoscale::{self, Autoscaler, Observation};

pub use crate::metrics::{ReconcileErrorKind, Step};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `object` is "Kind namespace/name".
    #[error("{} {object}: {source}", .step.as_str())]
    Kube {
        step: Step,
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The operator cannot honour the spec; the status and an Event say why.
    #[error("invalid spec: {}", .0.join("; "))]
    InvalidSpec(Vec<String>),
    #[error("DataPipeline without a namespace")]
    NoNamespace,
}

impl Error {
    /// The `kind` label of stoker_operator_reconcile_errors_total.
    pub fn metric_label(&self) -> ReconcileErrorKind {
        match self {
            Error::Kube {
                source: kube::Error::Api(_),
                ..
            } => ReconcileErrorKind::KubeApi,
            Error::Kube { .. } => ReconcileErrorKind::KubeClient,
            Error::InvalidSpec(_) => ReconcileErrorKind::InvalidSpec,
            Error::NoNamespace => ReconcileErrorKind::NoNamespace,
        }
    }

    /// The `step` label: where it failed.
    pub fn step_label(&self) -> Step {
        match self {
            Error::Kube { step, .. } => *step,
            Error::InvalidSpec(_) | Error::NoNamespace => Step::Validate,
        }
    }
}

/// What failed, at which step, on which object.
fn at<K: Resource<DynamicType = ()>>(step: Step, obj: &K) -> impl FnOnce(kube::Error) -> Error {
    let object = format!(
        "{} {}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default()
    );
    move |source| Error::Kube {
        step,
        object,
        source,
    }
}

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
    /// When each pipeline's token Secret was last ensured (re-created at most every RESYNC).
    tokens: Mutex<HashMap<String, Instant>>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<crate::metrics::OperatorMetrics>,
        cluster: Cluster,
    ) -> Self {
        Context {
            client,
            recorder,
            metrics,
            cluster,
            scalers: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
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
        self.tokens
            .lock()
            .expect("tokens")
            .retain(|k, _| live.contains(k));
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

/// Creates the token Secret unless it exists: once per pipeline, then every RESYNC (someone
/// may have deleted it). Create only: the operator may not read Secrets (least privilege),
/// and a token is never rotated under running trainers.
async fn ensure_token(valid: &Valid<'_>, ctx: &Context, ns: &str) -> Result<(), Error> {
    let dp = valid.dp;
    if dp.spec.token_secret.is_some() {
        return Ok(());
    }
    let fresh = |t: &Instant| t.elapsed() < RESYNC;
    if ctx
        .tokens
        .lock()
        .expect("tokens")
        .get(&key(dp))
        .is_some_and(fresh)
    {
        return Ok(());
    }
    let secret = build::token_secret(valid, &random_token());
    match Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
    {
        // 409: it exists (created by an earlier reconcile, or another replica): keep it.
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(at(Step::Token, &secret)(e)),
    }
    ctx.tokens
        .lock()
        .expect("tokens")
        .insert(key(dp), Instant::now());
    Ok(())
}

/// 256 random bits, hex.
fn random_token() -> String {
    // ThreadRng is a CSPRNG seeded from the OS.
    let b: [u8; 32] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
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
    let r = reconcile_inner(&dp, &ctx).await;
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
            report_invalid(dp, ctx, &ns, &problems).await?;
            return Err(Error::InvalidSpec(problems));
        }
    };
    ensure_token(&valid, ctx, &ns).await?;

    let (pipeline, c) = (key(dp), &ctx.cluster);
    let existing = c
        .deployments
        .current(&pipeline, &ns, &crate::labels::names(dp).workers);
    let current = existing.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let ready = existing
        .as_ref()
        .and_then(|d| d.status.as_ref()?.ready_replicas)
        .unwrap_or(0);
    let mut scale = decide(dp, ctx, current.unwrap_or(dp.spec.replicas), ready).await;
    let room = room(dp, c);
    let wanted = scale.replicas;
    if let Some(cap) = room.as_ref().and_then(|r| placement::replica_cap(dp, r)) {
        scale.replicas = scale.replicas.min(cap);
    }

    let deployment = build::deployment(&valid, scale.replicas);
    let deployment = (c
        .deployments
        .apply(&ctx.client, &pipeline, &deployment)
        .await)
        .map_err(at(Step::Apply, &deployment))?;
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
    (c.services.apply(client, pipeline, &service).await).map_err(at(Step::Apply, &service))?;
    let pdb = build::pod_disruption_budget(dp);
    (c.disruption_budgets.apply(client, pipeline, &pdb).await).map_err(at(Step::Apply, &pdb))?;
    let policy = build::network_policy(dp);
    (c.network_policies.apply(client, pipeline, &policy).await)
        .map_err(at(Step::Apply, &policy))?;
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

/// A spec the operator cannot honour: a Warning Event and a Ready=False condition naming
/// every problem; nothing else changes.
async fn report_invalid(
    dp: &DataPipeline,
    ctx: &Context,
    ns: &str,
    problems: &[String],
) -> Result<(), Error> {
    let message = problems.join("; ");
    let event = Event {
        type_: EventType::Warning,
        reason: "InvalidSpec".into(),
        note: Some(message.clone()),
        action: "Validate".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &dp.object_ref(&())).await {
        tracing::warn!("publishing an InvalidSpec event: {e}");
    }
    let status = status::invalid(dp, message);
    patch_status(dp, &ctx.client, ns, &status).await
}

pub fn error_policy(dp: Arc<DataPipeline>, e: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!("reconciling {}: {e}", key(&dp));
    match e {
        // Nothing changes until the spec does (a new generation triggers a reconcile).
        Error::InvalidSpec(_) => Action::requeue(Duration::from_secs(300)),
        _ => Action::requeue(Duration::from_secs(5)),
    }
}

/// The reconcile loop against a mocked API server: every request it makes, in order, with
/// what it sends (tests/k8s runs the same against a real API server).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::Changes;
    use http::{Method, Request, Response};
    use kube::client::Body;
    use kube::runtime::reflector::store::Writer;
    use serde_json::{json, Value};

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn example() -> DataPipeline {
        let mut dp = crate::crd::example();
        dp.metadata.generation = Some(3);
        dp.spec.autoscaling = None;
        dp
    }

    /// The watches as the tests play them: one writer per cache.
    struct Watches {
        deployments: Writer<Deployment>,
        services: Writer<Service>,
        disruption_budgets: Writer<PodDisruptionBudget>,
        network_policies: Writer<NetworkPolicy>,
    }

    fn node(name: &str) -> Node {
        Node {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Node::default()
        }
    }

    /// A context over a mocked API server whose caches hold `deployments` and `nodes`.
    fn context(deployments: Vec<Deployment>, nodes: &[&str]) -> (Arc<Context>, Handle, Watches) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let recorder = Recorder::new(client.clone(), "stoker-operator-test".to_string().into());
        let (deployments, deployments_w) = Cached::holding(deployments);
        let (services, services_w) = Cached::holding(vec![]);
        let (pdbs, pdbs_w) = Cached::holding(vec![]);
        let (policies, policies_w) = Cached::holding(vec![]);
        let cluster = Cluster {
            deployments: Owned::new(deployments, Changes::Generation),
            services: Owned::new(services, Changes::ResourceVersion),
            disruption_budgets: Owned::new(pdbs, Changes::Generation),
            network_policies: Owned::new(policies, Changes::Generation),
            nodes: Cached::holding(nodes.iter().map(|n| node(n)).collect()).0,
            pipelines: kube::runtime::reflector::store().0,
            workers: Cached::holding(vec![]).0,
            trainers: TrainerPods::new(client.clone()),
        };
        let metrics = crate::metrics::OperatorMetrics::new();
        let ctx = Context::new(client, recorder, metrics, cluster);
        let watches = Watches {
            deployments: deployments_w,
            services: services_w,
            disruption_budgets: pdbs_w,
            network_policies: policies_w,
        };
        (Arc::new(ctx), handle, watches)
    }

    fn ok(v: &Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(v).unwrap()))
            .unwrap()
    }

    /// Takes the next request, checks method and path, returns its JSON body.
    async fn expect(
        h: &mut Handle,
        method: Method,
        path: &str,
    ) -> (Value, tower_test::mock::SendResponse<Response<Body>>) {
        let (req, send) = h.next_request().await.expect("a request");
        assert_eq!(
            (req.method(), req.uri().path()),
            (&method, path),
            "unexpected request"
        );
        let bytes = req.into_body().collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (body, send)
    }

    /// An apply as the API server answers it: the object with a uid, generation and
    /// resourceVersion.
    fn stored(mut obj: Value) -> Value {
        obj["metadata"]["uid"] = json!("uid-of-owned");
        obj["metadata"]["generation"] = json!(1);
        obj["metadata"]["resourceVersion"] = json!("7");
        obj
    }

    const OWNED_PATHS: [&str; 3] = [
        "/api/v1/namespaces/ml/services/qwen-sft-workers",
        "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/qwen-sft-workers",
        "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/qwen-sft-workers",
    ];

    /// The Service, PDB and NetworkPolicy applies, each owned by the pipeline, answered as
    /// stored; what the API server answered.
    async fn serve_owned_patches(h: &mut Handle) -> Vec<Value> {
        let mut answers = vec![];
        for path in OWNED_PATHS {
            let (obj, send) = expect(h, Method::PATCH, path).await;
            assert_eq!(
                obj["metadata"]["ownerReferences"][0]["kind"],
                "DataPipeline"
            );
            let answer = stored(obj);
            send.send_response(ok(&answer));
            answers.push(answer);
        }
        answers
    }

    /// The status apply; returns what the operator sent.
    async fn serve_status_patch(h: &mut Handle) -> Value {
        let path = "/apis/stoker.dev/v1alpha1/namespaces/ml/datapipelines/qwen-sft/status";
        let (status, send) = expect(h, Method::PATCH, path).await;
        send.send_response(ok(
            &json!({"apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
            "metadata": {"name": "qwen-sft", "namespace": "ml"},
            "spec": serde_json::to_value(&example().spec).unwrap()}),
        ));
        status
    }

    const DEPLOYMENT_PATH: &str = "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers";

    /// The first reconcile's requests: token, Deployment (answered with `ready` of 2 ready),
    /// the other owned objects, status. What the API server answered, and the status sent.
    async fn serve_first_reconcile(h: &mut Handle, ready: i32) -> (Vec<Value>, Value) {
        // The token Secret: created (create only, the operator cannot read Secrets).
        let (secret, send) = expect(h, Method::POST, "/api/v1/namespaces/ml/secrets").await;
        assert_eq!(secret["metadata"]["name"], "qwen-sft-token");
        assert_eq!(secret["stringData"]["token"].as_str().unwrap().len(), 64);
        send.send_response(ok(&secret));
        // No Deployment in the cache: spec.replicas (2) holds; no read request for it or for
        // the nodes (the bandwidth budget allows 5 per node; 1 node fits 2 workers).
        let (d, send) = expect(h, Method::PATCH, DEPLOYMENT_PATH).await;
        assert_eq!(d["spec"]["replicas"], 2);
        assert_eq!(d["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        let mut applied = stored(d);
        applied["status"] = json!({"replicas": 2, "readyReplicas": ready});
        send.send_response(ok(&applied));
        let mut answers = vec![applied];
        answers.extend(serve_owned_patches(h).await);
        let status = serve_status_patch(h).await;
        (answers, status)
    }

    #[tokio::test]
    async fn first_reconcile_creates_everything_owned_and_reports_status() {
        let (ctx, mut h, _watches) = context(vec![], &["n1"]);
        let dp = Arc::new(example());
        let server = tokio::spawn(async move { serve_first_reconcile(&mut h, 1).await.1 });
        let action = reconcile(dp, ctx).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        let status = server.await.unwrap()["status"].clone();
        assert_eq!(status["desiredReplicas"], 2);
        assert_eq!(status["readyReplicas"], 1);
        assert_eq!(status["observedGeneration"], 3);
        assert_eq!(
            status["selector"],
            "app.kubernetes.io/instance=qwen-sft,app.kubernetes.io/name=stoker-worker"
        );
        let cond = |t: &str| {
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == t)
                .cloned()
                .unwrap_or(Value::Null)
        };
        assert_eq!(cond("Ready")["status"], "True");
        assert_eq!(cond("Scaling")["status"], "True"); // 1 of 2 ready
        assert_eq!(cond("NICSaturationRisk")["status"], "False");
        // Autoscaling off: no metrics condition at all.
        assert_eq!(cond("MetricsAvailable"), Value::Null);
    }

    /// Asserts the next reconcile sends nothing: the mock sees no request before it ends.
    async fn reconcile_sends_nothing(dp: &Arc<DataPipeline>, ctx: &Arc<Context>, h: &mut Handle) {
        let quiet = async {
            let r = h.next_request().await;
            panic!("unexpected request: {:?}", r.map(|(r, _)| r.uri().clone()));
        };
        tokio::select! {
            r = reconcile(dp.clone(), ctx.clone()) => { r.unwrap(); }
            _ = quiet => {}
        }
    }

    #[tokio::test]
    async fn a_reconcile_that_finds_nothing_changed_sends_nothing() {
        let (ctx, mut h, mut watches) = context(vec![], &["n1"]);
        let dp = Arc::new(example());
        let first = tokio::spawn(async move {
            let served = serve_first_reconcile(&mut h, 2).await;
            (h, served)
        });
        reconcile(dp.clone(), ctx.clone()).await.unwrap();
        let (mut h, (answers, status)) = first.await.unwrap();
        // The watches bring what was applied into the caches, and the status onto the object.
        fn obj<K: serde::de::DeserializeOwned>(answer: &Value) -> K {
            serde_json::from_value(answer.clone()).unwrap()
        }
        use kube::runtime::watcher::Event::Apply;
        watches
            .deployments
            .apply_watcher_event(&Apply(obj(&answers[0])));
        watches
            .services
            .apply_watcher_event(&Apply(obj(&answers[1])));
        (watches.disruption_budgets).apply_watcher_event(&Apply(obj(&answers[2])));
        (watches.network_policies).apply_watcher_event(&Apply(obj(&answers[3])));
        let mut with_status = example();
        with_status.status = Some(serde_json::from_value(status["status"].clone()).unwrap());
        let dp = Arc::new(with_status);
        // Requeued, or triggered by a change that is not ours to undo: no request at all.
        reconcile_sends_nothing(&dp, &ctx, &mut h).await;
        // Someone edits the Service (its resourceVersion moves): that one is applied again.
        let mut edited: Service = obj(&answers[1]);
        edited.metadata.resource_version = Some("8".into());
        watches.services.apply_watcher_event(&Apply(edited));
        let again = tokio::spawn(async move {
            let (svc, send) = expect(&mut h, Method::PATCH, OWNED_PATHS[0]).await;
            let answer = stored(svc);
            send.send_response(ok(&answer));
            (h, answer)
        });
        reconcile(dp.clone(), ctx.clone()).await.unwrap();
        let (mut h, answer) = again.await.unwrap();
        watches.services.apply_watcher_event(&Apply(obj(&answer)));
        // Someone deletes the NetworkPolicy: it is applied again.
        let policy: NetworkPolicy = obj(&answers[3]);
        watches
            .network_policies
            .apply_watcher_event(&kube::runtime::watcher::Event::Delete(policy));
        let again = tokio::spawn(async move {
            let (np, send) = expect(&mut h, Method::PATCH, OWNED_PATHS[2]).await;
            send.send_response(ok(&stored(np)));
            h
        });
        reconcile(dp.clone(), ctx.clone()).await.unwrap();
        again.await.unwrap();
    }

    #[tokio::test]
    async fn a_scale_change_is_applied_with_an_event_and_the_reason() {
        let existing: Deployment = serde_json::from_value(json!({"apiVersion": "apps/v1",
            "kind": "Deployment", "metadata": {"name": "qwen-sft-workers", "namespace": "ml"},
            "spec": {"replicas": 2, "selector": {}, "template": {}},
            "status": {"replicas": 2, "readyReplicas": 2}}))
        .unwrap();
        // Three eligible nodes at one worker each: 4 wanted, capped at 3.
        let (ctx, mut h, _watches) = context(vec![existing], &["a", "b", "c"]);
        let mut dp = example();
        dp.spec.replicas = 4; // kubectl scale dp/qwen-sft --replicas=4
        dp.spec.token_secret = Some("given".into());
        dp.spec.placement.max_workers_per_node = Some(1);
        let dp = Arc::new(dp);
        let server = tokio::spawn(async move {
            let (d, send) = expect(&mut h, Method::PATCH, DEPLOYMENT_PATH).await;
            assert_eq!(d["spec"]["replicas"], 3);
            send.send_response(ok(&d));
            serve_owned_patches(&mut h).await;
            let (event, send) = expect(
                &mut h,
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ml/events",
            )
            .await;
            send.send_response(ok(&event));
            let status = serve_status_patch(&mut h).await;
            (event, status)
        });
        reconcile(dp, ctx.clone()).await.unwrap();
        let (event, status) = server.await.unwrap();
        assert_eq!(event["reason"], "ScaledUp");
        assert!(
            event["note"].as_str().unwrap().contains("2 -> 3 workers"),
            "{event}"
        );
        let status = &status["status"];
        assert!(status["lastScaleReason"]
            .as_str()
            .unwrap()
            .starts_with("2 -> 3"));
        // 4 workers exceed 3 nodes x 1: the condition says so, with the cap.
        let risk = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "NICSaturationRisk")
            .unwrap();
        assert_eq!(risk["status"], "True");
        assert!(
            risk["message"].as_str().unwrap().contains("capped at 3"),
            "{risk}"
        );
        assert!(ctx
            .metrics
            .render()
            .contains("stoker_operator_scale_decisions_total{direction=\"up\",namespace=\"ml\",pipeline=\"qwen-sft\"} 1"));
    }
}
