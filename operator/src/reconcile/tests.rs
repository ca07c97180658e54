use super::*;
use crate::apply::Changes;
use http::{Method, Request, Response};
use kube::client::Body;
use kube::runtime::reflector::store::Writer;
use serde_json::{json, Value};
use stoker_tls::issue::Authority;

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
    let ctx = Context::new(
        client,
        recorder,
        metrics,
        cluster,
        Credentials::new("cluster.local"),
        vec!["monitoring".into()],
    );
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

/// The Service, PDB and NetworkPolicy, none in the caches: each read (none there), then
/// applied, owned by the pipeline, answered as stored; what the API server answered.
async fn serve_owned_patches(h: &mut Handle) -> Vec<Value> {
    let mut answers = vec![];
    for path in OWNED_PATHS {
        serve_absent(h, path).await;
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

fn not_found() -> Response<Body> {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "not found"});
    Response::builder()
        .status(404)
        .body(Body::from(serde_json::to_vec(&status).unwrap()))
        .unwrap()
}

/// A read of an object missing from the caches, which does not exist either.
async fn serve_absent(h: &mut Handle, path: &str) {
    let (_, send) = expect(h, Method::GET, path).await;
    send.send_response(not_found());
}

const SECRETS: &str = "/api/v1/namespaces/ml/secrets";
const CONFIG_MAP_PATH: &str = "/api/v1/namespaces/ml/configmaps/qwen-sft-ca";

/// A first TLS check: no CA (made and created), no workers' certificate (issued and
/// applied), no ConfigMap (applied). The workers' Secret as applied.
async fn serve_first_tls(h: &mut Handle) -> Value {
    let (_, send) = expect(h, Method::GET, &format!("{SECRETS}/qwen-sft-tls-ca")).await;
    send.send_response(not_found());
    let (ca, send) = expect(h, Method::POST, SECRETS).await;
    assert_eq!(ca["metadata"]["name"], "qwen-sft-tls-ca");
    assert_eq!(ca["metadata"]["ownerReferences"][0]["uid"], "uid-1");
    send.send_response(ok(&ca));
    let (_, send) = expect(h, Method::GET, &format!("{SECRETS}/qwen-sft-tls")).await;
    send.send_response(not_found());
    let (tls, send) = expect(h, Method::PATCH, &format!("{SECRETS}/qwen-sft-tls")).await;
    assert_eq!(tls["type"], "kubernetes.io/tls");
    assert_eq!(tls["data"]["ca.crt"], ca["data"]["ca.crt"]);
    send.send_response(ok(&tls));
    let (_, send) = expect(h, Method::GET, CONFIG_MAP_PATH).await;
    send.send_response(not_found());
    let (cm, send) = expect(h, Method::PATCH, CONFIG_MAP_PATH).await;
    let ca_pem = String::from_utf8(
        serde_json::from_value::<k8s_openapi::ByteString>(ca["data"]["ca.crt"].clone())
            .unwrap()
            .0,
    )
    .unwrap();
    assert_eq!(cm["data"]["ca.crt"], ca_pem);
    send.send_response(ok(&cm));
    tls
}

/// The first reconcile's requests: token, TLS, Deployment (answered with `ready` of 2
/// ready), the other owned objects, status. What the API server answered, and the status
/// sent.
async fn serve_first_reconcile(h: &mut Handle, ready: i32) -> (Vec<Value>, Value) {
    // The token Secret: its metadata read (none there; its value is never read), created.
    let (req, send) = h.next_request().await.expect("a request");
    assert_eq!(req.uri().path(), format!("{SECRETS}/qwen-sft-token"));
    let accept = req.headers().get(http::header::ACCEPT).unwrap();
    assert!(
        accept
            .to_str()
            .unwrap()
            .contains("as=PartialObjectMetadata"),
        "{accept:?}"
    );
    send.send_response(not_found());
    let (secret, send) = expect(h, Method::POST, SECRETS).await;
    assert_eq!(secret["metadata"]["name"], "qwen-sft-token");
    assert_eq!(secret["stringData"]["token"].as_str().unwrap().len(), 64);
    send.send_response(ok(&secret));
    let tls = serve_first_tls(h).await;
    // No Deployment in the cache: one read (none there either), spec.replicas (2) holds; no
    // read for the nodes (the bandwidth budget allows 5 per node; 1 node fits 2 workers).
    serve_absent(h, DEPLOYMENT_PATH).await;
    let (d, send) = expect(h, Method::PATCH, DEPLOYMENT_PATH).await;
    assert_eq!(d["spec"]["replicas"], 2);
    assert_eq!(d["metadata"]["ownerReferences"][0]["uid"], "uid-1");
    // The workers serve the certificate just issued.
    assert_eq!(
        d["spec"]["template"]["metadata"]["annotations"]["stoker.dev/tls-not-after"],
        tls["metadata"]["annotations"]["stoker.dev/tls-not-after"]
    );
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
        serve_absent(&mut h, OWNED_PATHS[2]).await;
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
        "kind": "Deployment", "metadata": {"name": "qwen-sft-workers", "namespace": "ml",
            "ownerReferences": [{"apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
                "name": "qwen-sft", "uid": "uid-1", "controller": true}]},
        "spec": {"replicas": 2, "selector": {}, "template": {}},
        "status": {"replicas": 2, "readyReplicas": 2}}))
    .unwrap();
    // Three eligible nodes at one worker each: 4 wanted, capped at 3.
    let (ctx, mut h, _watches) = context(vec![existing], &["a", "b", "c"]);
    let mut dp = example();
    dp.spec.replicas = 4; // kubectl scale dp/qwen-sft --replicas=4
    dp.spec.token_secret = Some("given".into());
    dp.spec.tls.mode = crate::crd::TlsMode::InsecurePlaintext;
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

/// A reconcile of a given token and TLS whose CA Secret exists with `ca`.
fn with_given_token() -> Arc<DataPipeline> {
    let mut dp = example();
    dp.spec.token_secret = Some("given".into());
    Arc::new(dp)
}

#[tokio::test]
async fn a_secret_of_the_cas_name_that_the_pipeline_does_not_own_is_refused() {
    let (ctx, mut h, _watches) = context(vec![], &["n1"]);
    let dp = with_given_token();
    let server = tokio::spawn(async move {
        let (_, send) = expect(&mut h, Method::GET, &format!("{SECRETS}/qwen-sft-tls-ca")).await;
        let foreign = json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "qwen-sft-tls-ca", "namespace": "ml"},
            "data": {"ca.crt": "Q0VSVA==", "ca.key": "S0VZ", "name": "eA=="}});
        send.send_response(ok(&foreign));
        serve_not_owned_report(h).await
    });
    let e = reconcile(dp, ctx.clone()).await.unwrap_err();
    let why = "Secret ml/qwen-sft-tls-ca: exists and is not owned by DataPipeline qwen-sft";
    // Nothing written, nothing applied: the reconcile stopped there, and said why.
    assert_not_owned_reported(&e, "tls", why, server.await.unwrap()).await;
}

/// A token Secret of the pipeline's name that someone else made is not taken as the
/// pipeline's (its token would be theirs): its metadata is read, nothing more.
#[tokio::test]
async fn a_token_secret_that_the_pipeline_does_not_own_is_refused() {
    let (ctx, mut h, _watches) = context(vec![], &["n1"]);
    let dp = Arc::new(example());
    let server = tokio::spawn(async move {
        let (_, send) = expect(&mut h, Method::GET, &format!("{SECRETS}/qwen-sft-token")).await;
        let foreign = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "qwen-sft-token", "namespace": "ml"}});
        send.send_response(ok(&foreign));
        serve_not_owned_report(h).await
    });
    let e = reconcile(dp, ctx.clone()).await.unwrap_err();
    let why = "Secret ml/qwen-sft-token: exists and is not owned by DataPipeline qwen-sft";
    assert_not_owned_reported(&e, "token", why, server.await.unwrap()).await;
}

/// After a NotOwned error: the Warning Event and the status, answered; the Event and the
/// Ready condition sent.
async fn serve_not_owned_report(mut h: Handle) -> (Handle, Value, Value) {
    let path = "/apis/events.k8s.io/v1/namespaces/ml/events";
    let (event, send) = expect(&mut h, Method::POST, path).await;
    send.send_response(ok(&event));
    let status = serve_status_patch(&mut h).await;
    let ready = status["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap();
    (h, event, ready)
}

/// The error (kind not_owned, at `step`), the Event and the Ready condition name the object
/// in the way; nothing else is sent.
async fn assert_not_owned_reported(
    e: &Error,
    step: &str,
    why: &str,
    (mut h, event, ready): (Handle, Value, Value),
) {
    assert!(e.to_string().contains(why), "{e}");
    assert_eq!(
        (e.metric_label().as_str(), e.step_label().as_str()),
        ("not_owned", step)
    );
    assert_eq!(event["reason"], "NotOwned");
    assert!(event["note"].as_str().unwrap().contains(why), "{event}");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("NotOwned"))
    );
    assert!(ready["message"].as_str().unwrap().contains(why), "{ready}");
    tokio::select! {
        r = h.next_request() => panic!("unexpected request: {:?}", r.map(|(r, _)| r.uri().clone())),
        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
    }
}

/// No adoption: a Service of the workers' name that someone else made (unlabelled, so not in
/// the caches) is read, found not the pipeline's and never patched; the Deployment before it
/// is applied as usual, the pipeline says what is in the way.
#[tokio::test]
async fn an_object_of_an_owned_name_that_the_pipeline_did_not_create_is_never_written() {
    let (ctx, mut h, _watches) = context(vec![], &["n1"]);
    let mut dp = example();
    dp.spec.token_secret = Some("given".into());
    dp.spec.tls.mode = crate::crd::TlsMode::InsecurePlaintext;
    let server = tokio::spawn(async move {
        serve_absent(&mut h, DEPLOYMENT_PATH).await;
        let (d, send) = expect(&mut h, Method::PATCH, DEPLOYMENT_PATH).await;
        send.send_response(ok(&stored(d)));
        let (_, send) = expect(&mut h, Method::GET, OWNED_PATHS[0]).await;
        let theirs = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "qwen-sft-workers", "namespace": "ml", "uid": "theirs"},
            "spec": {"selector": {"app": "their-database"}}});
        send.send_response(ok(&theirs));
        serve_not_owned_report(h).await
    });
    let e = reconcile(Arc::new(dp), ctx.clone()).await.unwrap_err();
    let why = "Service ml/qwen-sft-workers: exists and is not owned by DataPipeline qwen-sft";
    assert_not_owned_reported(&e, "apply", why, server.await.unwrap()).await;
    assert!(ctx
        .metrics
        .render()
        .contains("stoker_operator_reconcile_errors_total{kind=\"not_owned\",step=\"apply\"} 1"));
}

#[tokio::test]
async fn a_certificate_a_month_from_expiry_is_issued_again_and_rolls_the_workers() {
    let (ctx, mut h, _watches) = context(vec![], &["n1"]);
    let dp = with_given_token();
    // The CA as a first reconcile stored it, and a workers' certificate with 10 days left.
    let ca = Authority::new("stoker ml/qwen-sft CA", crate::credentials::CA_VALIDITY).unwrap();
    let names = crate::credentials::worker_names(&dp, "cluster.local");
    let old = ca.issue(&names, Duration::from_secs(86_400)).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expiring = now + 10 * 86_400;
    let ca_secret = serde_json::to_value(crate::credentials::ca_secret(
        &dp,
        "stoker ml/qwen-sft CA",
        ca.cert_pem(),
        &ca.key_pem(),
    ))
    .unwrap();
    let worker_secret = serde_json::to_value(crate::credentials::worker_secret(
        &dp,
        ca.cert_pem(),
        &old.cert_pem,
        &old.key_pem,
        &names,
        expiring,
    ))
    .unwrap();
    let ca_pem = ca.cert_pem().to_string();
    let server = tokio::spawn(async move {
        let (_, send) = expect(&mut h, Method::GET, &format!("{SECRETS}/qwen-sft-tls-ca")).await;
        send.send_response(ok(&ca_secret));
        let (_, send) = expect(&mut h, Method::GET, &format!("{SECRETS}/qwen-sft-tls")).await;
        send.send_response(ok(&worker_secret));
        let (renewed, send) =
            expect(&mut h, Method::PATCH, &format!("{SECRETS}/qwen-sft-tls")).await;
        send.send_response(ok(&renewed));
        // The ConfigMap already holds this CA: left alone.
        let (_, send) = expect(&mut h, Method::GET, CONFIG_MAP_PATH).await;
        let cm = serde_json::to_value(crate::credentials::ca_config_map(
            &with_given_token(),
            &ca_pem,
        ))
        .unwrap();
        send.send_response(ok(&cm));
        serve_absent(&mut h, DEPLOYMENT_PATH).await;
        let (d, send) = expect(&mut h, Method::PATCH, DEPLOYMENT_PATH).await;
        send.send_response(ok(&stored(d.clone())));
        serve_owned_patches(&mut h).await;
        serve_status_patch(&mut h).await;
        (renewed, d)
    });
    reconcile(dp, ctx.clone()).await.unwrap();
    let (renewed, d) = server.await.unwrap();
    let not_after = |v: &Value| -> u64 { v.as_str().unwrap().parse().unwrap() };
    let renewed_until = not_after(&renewed["metadata"]["annotations"]["stoker.dev/tls-not-after"]);
    assert!(renewed_until >= now + 89 * 86_400, "{renewed_until}");
    assert_eq!(
        not_after(&d["spec"]["template"]["metadata"]["annotations"]["stoker.dev/tls-not-after"]),
        renewed_until
    );
    // Signed by the same CA: ranks that trust it need nothing new.
    let cert: k8s_openapi::ByteString =
        serde_json::from_value(renewed["data"]["tls.crt"].clone()).unwrap();
    assert_ne!(cert.0, old.cert_pem.as_bytes());
    let key: k8s_openapi::ByteString =
        serde_json::from_value(renewed["data"]["tls.key"].clone()).unwrap();
    // A rank trusting the CA accepts the renewed certificate for the Service's name.
    let server = stoker_tls::ServerTls::from_pem(&cert.0, &key.0).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let _ = server.accept(tcp).await;
    });
    let rank = stoker_tls::ClientTls::from_ca_pem(ca.cert_pem().as_bytes()).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    rank.connect("qwen-sft-workers.ml.svc", tcp).await.unwrap();
}
