//! The reconcile loop, one small step each: validate the spec → observe what exists → decide
//! the worker count (stoker-control's autoscaler) → build the objects (pure, `build`) → apply
//! them (server-side apply, owner references, idempotent) → report status (pure, `status`),
//! conditions and Events.

use crate::build::{self, FIELD_MANAGER};
use crate::crd::{Autoscaling, DataPipeline, ScalingRules};
use crate::scrape::{self, Reading};
use crate::status::{self, Observed};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stoker_control::autoscale::{self, Autoscaler, Observation};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The operator cannot honour the spec; the status and an Event say why.
    #[error("invalid spec: {}", .0.join("; "))]
    InvalidSpec(Vec<String>),
    #[error("DataPipeline without a namespace")]
    NoNamespace,
}

impl Error {
    /// The `kind` label of stoker_operator_reconcile_errors_total.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(_)) => "kube_api",
            Error::Kube(_) => "kube_client",
            Error::InvalidSpec(_) => "invalid_spec",
            Error::NoNamespace => "no_namespace",
        }
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

pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub metrics: Arc<crate::metrics::OperatorMetrics>,
    scalers: Mutex<HashMap<String, ScalerState>>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<crate::metrics::OperatorMetrics>,
    ) -> Self {
        Context {
            client,
            recorder,
            metrics,
            scalers: Mutex::new(HashMap::new()),
        }
    }

    /// Drops the state and metric series of pipelines that no longer exist (`live` holds
    /// the "namespace/name" keys of those that do).
    pub fn forget_deleted(&self, live: &std::collections::HashSet<String>) {
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

/// A decision about the worker count, with what the status shows of it.
pub struct Scale {
    pub replicas: i32,
    pub observation: Option<Observation>,
    pub per_worker: Option<f64>,
    pub reason: String,
    pub metrics_available: Option<bool>,
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
    let reading = scrape::read(&ctx.client, dp, &a.metrics).await;
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

async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K, Error>
where
    K: Resource + Clone + Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    Ok(api.patch(&name, &pp, &Patch::Apply(obj)).await?)
}

/// Creates the token Secret unless it exists. Create only: the operator may not read
/// Secrets (least privilege), and a token is never rotated under running trainers.
async fn ensure_token(dp: &DataPipeline, secrets: &Api<Secret>) -> Result<(), Error> {
    if dp.spec.token_secret.is_some() {
        return Ok(());
    }
    match secrets
        .create(
            &PostParams::default(),
            &build::token_secret(dp, &random_token()),
        )
        .await
    {
        Ok(_) => Ok(()),
        // It exists (created by an earlier reconcile, or another replica): keep it.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// 256 random bits, hex.
fn random_token() -> String {
    // ThreadRng is a CSPRNG seeded from the OS.
    let b: [u8; 32] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Nodes the workers may land on (for the per-node cap and the NIC saturation check).
async fn eligible_nodes(dp: &DataPipeline, client: &kube::Client) -> Result<u32, Error> {
    let selector = build::label_selector_string(&dp.spec.worker.node_selector);
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&selector))
        .await?;
    let schedulable = |n: &&Node| {
        !n.spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false)
    };
    Ok(nodes.items.iter().filter(schedulable).count() as u32)
}

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let t0 = Instant::now();
    let r = reconcile_inner(&dp, &ctx).await;
    let result = r.as_ref().map(|_| ()).map_err(Error::metric_label);
    ctx.metrics.observe_reconcile(t0.elapsed(), result);
    r
}

async fn reconcile_inner(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    let ns = dp.namespace().ok_or(Error::NoNamespace)?;
    let problems = crate::validate::problems(&dp.spec);
    if !problems.is_empty() {
        report_invalid(dp, ctx, &ns, &problems).await?;
        return Err(Error::InvalidSpec(problems));
    }
    let client = ctx.client.clone();
    ensure_token(dp, &Api::namespaced(client.clone(), &ns)).await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let existing = deployments.get_opt(&build::names(dp).workers).await?;
    let current = existing.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let ready = existing
        .as_ref()
        .and_then(|d| d.status.as_ref()?.ready_replicas)
        .unwrap_or(0);
    let mut scale = decide(dp, ctx, current.unwrap_or(dp.spec.replicas), ready).await;
    let nodes = match build::max_workers_per_node(dp) {
        Some(_) => Some(eligible_nodes(dp, &client).await?),
        None => None,
    };
    let wanted = scale.replicas;
    if let Some(cap) = nodes.and_then(|n| build::replica_cap(dp, n)) {
        scale.replicas = scale.replicas.min(cap);
    }

    let deployment = apply(&deployments, &build::deployment(dp, scale.replicas)).await?;
    apply_owned(dp, &client, &ns).await?;
    if let Some(from) = current.filter(|c| *c != scale.replicas) {
        publish_scale(dp, ctx, &ns, from, &scale).await;
    }
    let observed = Observed {
        deployment: deployment.status.unwrap_or_default(),
        eligible_nodes: nodes,
        wanted,
        previous_replicas: current,
    };
    let status = status::compute(dp, &scale, &observed);
    record_gauges(dp, ctx, &ns, &scale, status.ready_replicas);
    patch_status(dp, &client, &ns, &status).await?;
    let requeue = dp
        .spec
        .autoscaling
        .as_ref()
        .map_or(300, |a| a.interval_seconds.max(1) as u64);
    Ok(Action::requeue(Duration::from_secs(requeue)))
}

/// The Service, PDB and NetworkPolicy (the Deployment is applied first, with the count).
async fn apply_owned(dp: &DataPipeline, client: &kube::Client, ns: &str) -> Result<(), Error> {
    apply(
        &Api::<Service>::namespaced(client.clone(), ns),
        &build::service(dp),
    )
    .await?;
    apply(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
        &build::pod_disruption_budget(dp),
    )
    .await?;
    apply(
        &Api::<NetworkPolicy>::namespaced(client.clone(), ns),
        &build::network_policy(dp),
    )
    .await?;
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

/// A JSON merge patch of the status: a field the status leaves out keeps its value, so the
/// last scale decision survives a reconcile that read a stale copy of the object (an apply
/// would remove it); observations that are gone are cleared with an explicit null.
async fn patch_status<S: Serialize>(
    dp: &DataPipeline,
    client: &kube::Client,
    ns: &str,
    status: &S,
) -> Result<(), Error> {
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
        .await?;
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
    use http::{Method, Request, Response};
    use kube::client::Body;
    use serde_json::{json, Value};

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn example() -> DataPipeline {
        let mut dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../examples/datapipeline.yaml")).unwrap();
        dp.metadata.namespace = Some("ml".into());
        dp.metadata.uid = Some("uid-1".into());
        dp.metadata.generation = Some(3);
        dp.spec.autoscaling = None;
        dp
    }

    fn context() -> (Arc<Context>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let recorder = Recorder::new(client.clone(), "stoker-operator-test".to_string().into());
        let ctx = Context::new(client, recorder, crate::metrics::OperatorMetrics::new());
        (Arc::new(ctx), handle)
    }

    fn not_found() -> Response<Body> {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not found"});
        Response::builder()
            .status(404)
            .body(Body::from(serde_json::to_vec(&status).unwrap()))
            .unwrap()
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

    /// The Service, PDB and NetworkPolicy applies, each owned by the pipeline, echoed back.
    async fn serve_owned_patches(h: &mut Handle) {
        for path in [
            "/api/v1/namespaces/ml/services/qwen-sft-workers",
            "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/qwen-sft-workers",
            "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/qwen-sft-workers",
        ] {
            let (obj, send) = expect(h, Method::PATCH, path).await;
            assert_eq!(
                obj["metadata"]["ownerReferences"][0]["kind"],
                "DataPipeline"
            );
            send.send_response(ok(&obj));
        }
    }

    /// The node list (for the per-node cap): nodes of these names.
    async fn serve_nodes(h: &mut Handle, names: &[&str]) {
        let (_, send) = expect(h, Method::GET, "/api/v1/nodes").await;
        let items: Vec<Value> = names
            .iter()
            .map(|n| json!({"metadata": {"name": n}}))
            .collect();
        send.send_response(ok(
            &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": items}),
        ));
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

    #[tokio::test]
    async fn first_reconcile_creates_everything_owned_and_reports_status() {
        let (ctx, mut h) = context();
        let dp = Arc::new(example());
        let server = tokio::spawn(async move {
            // The token Secret: created (create only, the operator cannot read Secrets).
            let (secret, send) =
                expect(&mut h, Method::POST, "/api/v1/namespaces/ml/secrets").await;
            assert_eq!(secret["metadata"]["name"], "qwen-sft-token");
            assert_eq!(secret["stringData"]["token"].as_str().unwrap().len(), 64);
            send.send_response(ok(&secret));
            // No Deployment yet: spec.replicas (2) holds.
            let (_, send) = expect(
                &mut h,
                Method::GET,
                "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers",
            )
            .await;
            send.send_response(not_found());
            // The bandwidth budget allows 5 per node; 1 node fits 2 workers.
            serve_nodes(&mut h, &["n1"]).await;
            let (d, send) = expect(
                &mut h,
                Method::PATCH,
                "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers",
            )
            .await;
            assert_eq!(d["spec"]["replicas"], 2);
            assert_eq!(d["metadata"]["ownerReferences"][0]["uid"], "uid-1");
            let mut applied = d.clone();
            applied["status"] = json!({"replicas": 2, "readyReplicas": 1});
            send.send_response(ok(&applied));
            serve_owned_patches(&mut h).await;
            let status = serve_status_patch(&mut h).await;
            status
        });
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

    #[tokio::test]
    async fn a_scale_change_is_applied_with_an_event_and_the_reason() {
        let (ctx, mut h) = context();
        let mut dp = example();
        dp.spec.replicas = 4; // kubectl scale dp/qwen-sft --replicas=4
        dp.spec.token_secret = Some("given".into());
        dp.spec.placement.max_workers_per_node = Some(1);
        let dp = Arc::new(dp);
        let server = tokio::spawn(async move {
            let (_, send) = expect(
                &mut h,
                Method::GET,
                "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers",
            )
            .await;
            send.send_response(ok(&json!({"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "qwen-sft-workers"},
                "spec": {"replicas": 2, "selector": {}, "template": {}},
                "status": {"replicas": 2, "readyReplicas": 2}})));
            // Three eligible nodes at one worker each: 4 wanted, capped at 3.
            serve_nodes(&mut h, &["a", "b", "c"]).await;
            let (d, send) = expect(
                &mut h,
                Method::PATCH,
                "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers",
            )
            .await;
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
