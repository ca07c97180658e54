//! The reconcile loop: validate → decide the worker count → build (pure) → apply (server-side
//! apply, owner references, idempotent) → report status, conditions and Events.

use super::build::{self, FIELD_MANAGER};
use super::crd::{Autoscaling, DataPipeline, DataPipelineStatus, ScalingRules, WaitRatio};
use super::scrape::{self, Reading};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
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
    #[error("{0}")]
    Other(String),
}

/// What the autoscaler remembers per pipeline between reconciles.
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
    pub metrics: Arc<super::metrics::OperatorMetrics>,
    scalers: Mutex<HashMap<String, ScalerState>>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<super::metrics::OperatorMetrics>,
    ) -> Self {
        Context {
            client,
            recorder,
            metrics,
            scalers: Mutex::new(HashMap::new()),
        }
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

fn key(dp: &DataPipeline) -> String {
    format!("{}/{}", dp.namespace().unwrap_or_default(), dp.name_any())
}

/// A decision about the worker count, with what the status shows of it.
struct Scale {
    replicas: i32,
    observation: Option<Observation>,
    per_worker: Option<f64>,
    reason: String,
    metrics_available: Option<bool>,
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
    let spec = policy_spec(a);
    let interval = Duration::from_secs(a.interval_seconds.max(1) as u64);
    let reading = scrape::read(&ctx.client, dp, &a.metrics).await;
    let mut scalers = ctx.scalers.lock().expect("scaler state");
    let state = scalers.entry(key(dp)).or_default();
    let started = *state.started.get_or_insert_with(Instant::now);
    let now = Instant::now();
    let due = state
        .last_reading
        .as_ref()
        .is_none_or(|(t, _)| now.duration_since(*t) >= interval);
    if !due {
        // Reconciles between evaluations (owned objects changing) hold the count.
        return Scale {
            replicas: current,
            observation: state.last_observation,
            per_worker: None,
            reason: String::new(),
            metrics_available: Some(state.last_observation.is_some()),
        };
    }
    let obs = match (&reading, &state.last_reading) {
        (Ok(after), Some((_, before))) => {
            let (b, a) = scrape::paired(before, after);
            Observation::between(&b, &a, ready.max(0) as u32)
        }
        _ => None,
    };
    if let Err(e) = &reading {
        tracing::warn!("{}: reading trainer metrics: {e:#}", key(dp));
    }
    state.last_reading = reading.ok().map(|r| (now, r));
    state.last_observation = obs;
    let d = state.autoscaler.evaluate(
        &spec,
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
    let name = obj
        .meta()
        .name
        .clone()
        .ok_or_else(|| Error::Other("object without a name".into()))?;
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    Ok(api.patch(&name, &pp, &Patch::Apply(obj)).await?)
}

/// Creates the token Secret unless it exists: a token is never rotated under running
/// trainers by accident.
async fn ensure_token(dp: &DataPipeline, secrets: &Api<Secret>) -> Result<(), Error> {
    let name = build::names(dp).token_secret;
    if secrets.get_opt(&name).await?.is_some() || dp.spec.token_secret.is_some() {
        return Ok(());
    }
    let token = random_token();
    match secrets
        .create(&PostParams::default(), &build::token_secret(dp, &token))
        .await
    {
        Ok(_) => Ok(()),
        // Another replica (or a retry) created it first: fine.
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

fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    prev: &[Condition],
) -> Condition {
    let status = if ok { "True" } else { "False" };
    // The transition time moves only when the status does (API conventions).
    let last = prev
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: last,
    }
}

/// Nodes the workers may land on (for the NIC saturation check).
async fn eligible_nodes(dp: &DataPipeline, client: &kube::Client) -> Result<usize, Error> {
    let selector = dp
        .spec
        .worker
        .node_selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&selector))
        .await?;
    Ok(nodes
        .items
        .iter()
        .filter(|n| {
            !n.spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false)
        })
        .count())
}

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let t0 = Instant::now();
    let r = reconcile_inner(&dp, &ctx).await;
    ctx.metrics.observe_reconcile(t0.elapsed(), r.is_ok());
    r
}

async fn reconcile_inner(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    let ns = dp
        .namespace()
        .ok_or_else(|| Error::Other("DataPipeline without a namespace".into()))?;
    let client = ctx.client.clone();
    let names = build::names(dp);
    ensure_token(dp, &Api::namespaced(client.clone(), &ns)).await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let existing = deployments.get_opt(&names.workers).await?;
    let current = existing
        .as_ref()
        .and_then(|d| d.spec.as_ref()?.replicas)
        .unwrap_or(dp.spec.replicas);
    let ready = existing
        .as_ref()
        .and_then(|d| d.status.as_ref()?.ready_replicas)
        .unwrap_or(0);
    let scale = decide(dp, ctx, current, ready).await;

    let deployment = apply(&deployments, &build::deployment(dp, scale.replicas)).await?;
    apply(
        &Api::<Service>::namespaced(client.clone(), &ns),
        &build::service(dp),
    )
    .await?;
    apply(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns),
        &build::pod_disruption_budget(dp),
    )
    .await?;
    apply(
        &Api::<NetworkPolicy>::namespaced(client.clone(), &ns),
        &build::network_policy(dp),
    )
    .await?;

    let prev = dp.status.clone().unwrap_or_default();
    let mut status = DataPipelineStatus {
        replicas: deployment
            .status
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(0),
        desired_replicas: scale.replicas,
        ready_replicas: deployment
            .status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0),
        selector: build::selector_string(dp),
        wait_ratio: scale.observation.map(|o| WaitRatio {
            worst: round3(o.worst_wait_ratio),
            mean: round3(o.mean_wait_ratio),
        }),
        samples_per_second: scale.observation.map(|o| round3(o.consumed_per_s)),
        per_worker_samples_per_second: scale
            .per_worker
            .map(round3)
            .or(prev.per_worker_samples_per_second),
        last_scale_time: prev.last_scale_time.clone(),
        last_scale_reason: prev.last_scale_reason.clone(),
        observed_generation: dp.metadata.generation,
        conditions: Vec::new(),
    };
    if scale.replicas != current && existing.is_some() {
        let direction = if scale.replicas > current {
            "up"
        } else {
            "down"
        };
        ctx.metrics
            .count_scale(&ns, &dp.name_any(), scale.replicas > current);
        status.last_scale_time = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        status.last_scale_reason =
            Some(format!("{current} -> {}: {}", scale.replicas, scale.reason));
        let event = Event {
            type_: EventType::Normal,
            reason: if direction == "up" {
                "ScaledUp"
            } else {
                "ScaledDown"
            }
            .into(),
            note: Some(format!(
                "{current} -> {} workers: {}",
                scale.replicas, scale.reason
            )),
            action: "Scale".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &dp.object_ref(&())).await {
            tracing::warn!("publishing a scale event: {e}");
        }
    }
    let g = dp.metadata.generation;
    let c = &prev.conditions;
    let ready_ok = status.ready_replicas >= scale.replicas.min(1) && status.ready_replicas > 0;
    status.conditions.push(condition(
        "Ready",
        ready_ok,
        if ready_ok {
            "WorkersReady"
        } else {
            "WorkersNotReady"
        },
        format!(
            "{} of {} workers ready",
            status.ready_replicas, scale.replicas
        ),
        g,
        c,
    ));
    let scaling = status.ready_replicas != scale.replicas || status.replicas != scale.replicas;
    status.conditions.push(condition(
        "Scaling",
        scaling,
        if scaling {
            "ReplicasChanging"
        } else {
            "Stable"
        },
        format!("{} ready, {} wanted", status.ready_replicas, scale.replicas),
        g,
        c,
    ));
    if let Some(available) = scale.metrics_available {
        status.conditions.push(condition(
            "MetricsAvailable",
            available,
            if available {
                "TrainerMetricsRead"
            } else {
                "TrainerMetricsMissing"
            },
            if available {
                "every trainer rank's wait counters were read".into()
            } else {
                "trainer metrics missing, stale or incomplete: holding the worker count".into()
            },
            g,
            c,
        ));
    }
    if let Some(per_node) = build::max_workers_per_node(dp) {
        let nodes = eligible_nodes(dp, &client).await?;
        let risk = build::nic_saturation_risk(scale.replicas.max(0) as u32, nodes as u32, per_node);
        status.conditions.push(condition(
            "NICSaturationRisk",
            risk,
            if risk { "TooFewNodes" } else { "WithinBudget" },
            format!(
                "{} workers, {nodes} eligible nodes x {per_node} workers per node by the bandwidth budget",
                scale.replicas
            ),
            g,
            c,
        ));
    }
    ctx.metrics.record_pipeline(super::metrics::PipelineGauges {
        namespace: &ns,
        pipeline: &dp.name_any(),
        desired: scale.replicas,
        ready: status.ready_replicas,
        max: dp
            .spec
            .autoscaling
            .as_ref()
            .map_or(dp.spec.replicas, |a| a.max_replicas),
        target: dp.spec.autoscaling.as_ref().map(|a| a.target_wait_ratio),
        metrics_available: scale.metrics_available,
    });
    let dps: Api<DataPipeline> = Api::namespaced(client, &ns);
    let patch = serde_json::json!({
        "apiVersion": "stoker.dev/v1alpha1",
        "kind": "DataPipeline",
        "status": status,
    });
    dps.patch_status(
        &dp.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    let requeue = dp
        .spec
        .autoscaling
        .as_ref()
        .map_or(Duration::from_secs(300), |a| {
            Duration::from_secs(a.interval_seconds.max(1) as u64)
        });
    Ok(Action::requeue(requeue))
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

pub fn error_policy(dp: Arc<DataPipeline>, e: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!("reconciling {}: {e}", key(&dp));
    Action::requeue(Duration::from_secs(5))
}

/// The reconcile loop against a mocked API server: every request it makes, in order, with
/// what it sends (the real API server tests come with the cluster harness).
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
        let ctx = Context::new(
            client,
            recorder,
            super::super::metrics::OperatorMetrics::new(),
        );
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
            // The token Secret: absent, so created once.
            let (_, send) = expect(
                &mut h,
                Method::GET,
                "/api/v1/namespaces/ml/secrets/qwen-sft-token",
            )
            .await;
            send.send_response(not_found());
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
            // The bandwidth budget allows 5 per node; 1 node fits 2 workers.
            let (_, send) = expect(&mut h, Method::GET, "/api/v1/nodes").await;
            send.send_response(ok(
                &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                "items": [{"metadata": {"name": "n1"}}]}),
            ));
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
        let dp = Arc::new(dp);
        let server = tokio::spawn(async move {
            let (_, send) =
                expect(&mut h, Method::GET, "/api/v1/namespaces/ml/secrets/given").await;
            send.send_response(ok(
                &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "given"}}),
            ));
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
            let (d, send) = expect(
                &mut h,
                Method::PATCH,
                "/apis/apps/v1/namespaces/ml/deployments/qwen-sft-workers",
            )
            .await;
            assert_eq!(d["spec"]["replicas"], 4);
            send.send_response(ok(&d));
            serve_owned_patches(&mut h).await;
            let (event, send) = expect(
                &mut h,
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ml/events",
            )
            .await;
            send.send_response(ok(&event));
            let (_, send) = expect(&mut h, Method::GET, "/api/v1/nodes").await;
            send.send_response(ok(
                &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": []}),
            ));
            let status = serve_status_patch(&mut h).await;
            (event, status)
        });
        reconcile(dp, ctx.clone()).await.unwrap();
        let (event, status) = server.await.unwrap();
        assert_eq!(event["reason"], "ScaledUp");
        assert!(
            event["note"].as_str().unwrap().contains("2 -> 4 workers"),
            "{event}"
        );
        let status = &status["status"];
        assert!(status["lastScaleReason"]
            .as_str()
            .unwrap()
            .starts_with("2 -> 4"));
        // No eligible node: 4 workers exceed the bandwidth budget.
        let risk = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "NICSaturationRisk")
            .unwrap();
        assert_eq!(risk["status"], "True");
        assert!(ctx
            .metrics
            .render()
            .contains("stoker_operator_scale_decisions_total{direction=\"up\",namespace=\"ml\",pipeline=\"qwen-sft\"} 1"));
    }
}
