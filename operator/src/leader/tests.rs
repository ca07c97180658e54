use super::*;
use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{json, Value};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn election() -> (LeaderElection, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "ops");
    let api = Api::namespaced(client, "ops");
    let e = LeaderElection::new(api, "stoker-operator", "me", Duration::from_secs(15));
    (e, handle)
}

/// The Lease at `resource_version`, held by `holder`, whose `renewTime` (the holder's wall
/// clock) says `renewed_secs_ago`.
fn lease(holder: &str, renewed_secs_ago: i64, resource_version: &str) -> Value {
    let renew = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_secs_ago);
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "stoker-operator", "namespace": "ops",
                     "resourceVersion": resource_version},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                 "renewTime": MicroTime(renew), "leaseTransitions": 2}})
}

const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/stoker-operator";

/// One try against a Lease answered as `answer`: whether it was taken (the PUT echoed).
async fn try_once(e: &LeaderElection, h: &mut Handle, answer: Value) -> bool {
    let serve = async {
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!((req.method(), req.uri().path()), (&Method::GET, PATH));
        send.send_response(respond(&answer));
        // A PUT follows only when the Lease is taken.
        if let Ok(Some((req, send))) =
            tokio::time::timeout(Duration::from_millis(100), h.next_request()).await
        {
            assert_eq!(req.method(), Method::PUT);
            let body = req.into_body().collect_bytes().await.unwrap();
            let mut put: Value = serde_json::from_slice(&body).unwrap();
            put["metadata"]["resourceVersion"] = json!("8");
            send.send_response(respond(&put));
        }
    };
    let (taken, ()) = tokio::join!(e.try_acquire(), serve);
    taken.unwrap()
}

/// Elections on the candidate's own clock: a Lease is taken only after this process saw
/// it unchanged for its whole duration, whatever the holder's timestamps say — a holder
/// whose clock is 30 s behind (its renewTime "60 s ago") keeps the Lease while it renews,
/// and one whose clock is 30 s ahead loses it once it stops.
#[tokio::test(start_paused = true)]
async fn a_lease_is_taken_only_after_this_candidate_saw_it_unchanged_for_its_duration() {
    let (e, mut h) = election();
    // Renewed "60 s ago" by the holder's clock, first seen now: not taken.
    assert!(!try_once(&e, &mut h, lease("other", 60, "7")).await);
    // The holder renews (a new resourceVersion) every 5 s: never taken, for a minute.
    for rv in 8..20 {
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(!try_once(&e, &mut h, lease("other", 60, &rv.to_string())).await);
    }
    // It stops renewing (its renewTime says "in 30 s", a clock ahead): taken only once
    // this candidate saw the same version for more than 15 s.
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(!try_once(&e, &mut h, lease("other", -30, "19")).await);
    tokio::time::advance(Duration::from_secs(6)).await;
    assert!(try_once(&e, &mut h, lease("other", -30, "19")).await);
}

fn respond(v: &Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(v).unwrap()))
        .unwrap()
}

/// An election that saw the Lease of "other" at version 7 unchanged for longer than its
/// duration.
async fn after_an_expired_lease() -> (LeaderElection, Handle) {
    let (e, mut h) = election();
    assert!(!try_once(&e, &mut h, lease("other", 0, "7")).await);
    tokio::time::advance(Duration::from_secs(16)).await;
    (e, h)
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_taken_with_the_version_read_and_a_race_is_lost_on_409() {
    // Seen unchanged for more than its duration: taken over with the resourceVersion read.
    let (e, mut h) = after_an_expired_lease().await;
    let server = tokio::spawn(async move {
        let (_, send) = h.next_request().await.unwrap();
        send.send_response(respond(&lease("other", 0, "7")));
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!((req.method(), req.uri().path()), (&Method::PUT, PATH));
        let body: Value =
            serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
        send.send_response(respond(&body));
        body
    });
    assert!(e.try_acquire().await.unwrap());
    let put = server.await.unwrap();
    assert_eq!(put["spec"]["holderIdentity"], "me");
    assert_eq!(put["spec"]["leaseTransitions"], 3);
    assert_eq!(put["metadata"]["resourceVersion"], "7");

    // A concurrent writer won the race (409): not ours.
    let (e, mut h) = after_an_expired_lease().await;
    let server = tokio::spawn(async move {
        let (_, send) = h.next_request().await.unwrap();
        send.send_response(respond(&lease("other", 0, "7")));
        let (_, send) = h.next_request().await.unwrap();
        let conflict = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Conflict", "code": 409, "message": "the object has been modified"});
        send.send_response(
            Response::builder()
                .status(409)
                .body(Body::from(serde_json::to_vec(&conflict).unwrap()))
                .unwrap(),
        );
    });
    assert!(!e.try_acquire().await.unwrap());
    server.await.unwrap();
}

/// Two operator replicas against one API server, each in its own runtime with its own paused
/// clock (so one can be stopped while the other runs, as SIGSTOP does) and its own wall clock,
/// 30 s ahead and 30 s behind. Each replica is the product's election, renewal and fence; its
/// controller is a writer that applies an object every second through the fenced client.
mod two_replicas {
    use super::*;
    use crate::fence::{Fence, FenceLayer};
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::jiff::SignedDuration;
    use kube::api::{Patch, PatchParams};
    use std::collections::HashSet;
    use std::sync::Arc;
    use tokio::runtime::Runtime;

    /// The API server: the Lease with resourceVersion preconditions, every other write logged
    /// by who made it in the order it landed, and replicas cut off from it.
    #[derive(Default)]
    struct ApiServer {
        state: Mutex<State>,
    }

    #[derive(Default)]
    struct State {
        lease: Option<Value>,
        version: u64,
        writes: Vec<&'static str>,
        cut_off: HashSet<&'static str>,
        lease_reads: usize,
        lease_writes: usize,
    }

    fn status(code: u16) -> Response<Body> {
        let reason = match code {
            404 => "NotFound",
            409 => "Conflict",
            _ => "ServiceUnavailable",
        };
        let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": reason, "code": code, "message": reason});
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap()
    }

    impl ApiServer {
        async fn serve(&self, who: &'static str, req: Request<Body>) -> Response<Body> {
            // Cut off: nothing arrives; the replica sees its request fail once it is back.
            if self.state.lock().unwrap().cut_off.contains(who) {
                while self.state.lock().unwrap().cut_off.contains(who) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                return status(503);
            }
            let (method, path) = (req.method().clone(), req.uri().path().to_string());
            let body = req.into_body().collect_bytes().await.unwrap();
            let mut s = self.state.lock().unwrap();
            let is_lease = path.starts_with("/apis/coordination.k8s.io/");
            match (method, is_lease) {
                (Method::GET, true) => {
                    s.lease_reads += 1;
                    match &s.lease {
                        Some(lease) => respond(lease),
                        None => status(404),
                    }
                }
                (Method::POST | Method::PUT, true) => {
                    s.lease_writes += 1;
                    let mut lease: Value = serde_json::from_slice(&body).unwrap();
                    let current = s.version.to_string();
                    let fresh = match &s.lease {
                        None => true,
                        Some(_) => lease["metadata"]["resourceVersion"] == json!(current),
                    };
                    if !fresh {
                        return status(409);
                    }
                    s.version += 1;
                    lease["metadata"]["resourceVersion"] = json!(s.version.to_string());
                    s.lease = Some(lease.clone());
                    respond(&lease)
                }
                (Method::GET, false) => status(404),
                (_, false) => {
                    s.writes.push(who);
                    respond(&json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "pipeline-workers", "namespace": "ops"}}))
                }
                (m, _) => panic!("unexpected {m} {path}"),
            }
        }
    }

    /// One replica: its runtime (its clock), its fence and the writes that stopped, and why
    /// it stepped down, each time.
    struct Replica {
        rt: Runtime,
        fence: Arc<Fence>,
        writes_fenced: prometheus::IntCounter,
        step_downs: Arc<Mutex<Vec<String>>>,
    }

    /// `who`'s client of the API server; the controller's goes through `fence`.
    fn client(api: &Arc<ApiServer>, who: &'static str, fence: Option<&Arc<Fence>>) -> kube::Client {
        let api = api.clone();
        let service = tower::service_fn(move |req| {
            let api = api.clone();
            async move { Ok::<_, std::convert::Infallible>(api.serve(who, req).await) }
        });
        let builder = kube::client::ClientBuilder::new(service, "ops");
        match fence {
            Some(fence) => builder.with_layer(&FenceLayer(fence.clone())).build(),
            None => builder.build(),
        }
    }

    async fn write(client: &kube::Client) -> Result<ConfigMap, kube::Error> {
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "ops");
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "pipeline-workers"}, "data": {"replicas": "4"}});
        cms.patch(
            "pipeline-workers",
            &PatchParams::apply("stoker-operator"),
            &Patch::Apply(cm),
        )
        .await
    }

    fn ahead() -> Timestamp {
        Timestamp::now() + SignedDuration::from_secs(30)
    }

    fn behind() -> Timestamp {
        Timestamp::now() - SignedDuration::from_secs(30)
    }

    /// Starts a replica that campaigns, leads (writing every second) until it steps down, and
    /// then, as its Deployment would restart it, campaigns again with a fresh state.
    fn replica(api: &Arc<ApiServer>, who: &'static str, wall_clock: fn() -> Timestamp) -> Replica {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let writes_fenced = prometheus::IntCounter::new("fenced", "fenced").unwrap();
        let fence = Fence::new(RENEW_DEADLINE, LEASE_DURATION, writes_fenced.clone());
        let step_downs = Arc::new(Mutex::new(Vec::new()));
        let (api, f, downs) = (api.clone(), fence.clone(), step_downs.clone());
        rt.spawn(async move {
            loop {
                let mut election = LeaderElection::new(
                    Api::namespaced(client(&api, who, None), "ops"),
                    "stoker-operator",
                    who,
                    LEASE_DURATION,
                );
                election.wall_clock = wall_clock;
                let fenced = client(&api, who, Some(&f));
                let won = election.acquire().await;
                let controller = tokio::spawn(async move {
                    loop {
                        let _ = write(&fenced).await;
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                });
                let why = election.keep(won, &f).await;
                controller.abort();
                downs.lock().unwrap().push(why);
            }
        });
        Replica {
            rt,
            fence,
            writes_fenced,
            step_downs,
        }
    }

    impl Replica {
        fn run_for(&self, d: Duration) {
            self.rt.block_on(async { tokio::time::sleep(d).await });
        }

        /// Resumes after `paused` (the clock jumps: every timer due fires at once, in any
        /// order) and finishes, first thing, the write a reconcile had under way: refused.
        fn resume_after(&self, paused: Duration, api: &Arc<ApiServer>, who: &'static str) {
            let written = self.rt.block_on(async {
                let client = client(api, who, Some(&self.fence));
                tokio::time::advance(paused).await;
                write(&client).await
            });
            let e = written.expect_err("a replica resumed past its Lease must not write");
            assert!(e.to_string().contains("not written"), "{e}");
        }
    }

    /// Both replicas advance together in 100 ms steps; `stopped` does not run.
    fn run_both(a: &Replica, b: &Replica, d: Duration, stopped: Option<&Replica>) {
        let step = Duration::from_millis(100);
        for _ in 0..(d.as_millis() / step.as_millis()) {
            for r in [a, b] {
                if !stopped.is_some_and(|s| std::ptr::eq(s, r)) {
                    r.run_for(step);
                }
            }
        }
    }

    /// The writers, each run of writes by one replica as one entry.
    fn leaders_in_write_order(api: &ApiServer) -> Vec<&'static str> {
        let mut runs: Vec<&'static str> = api.state.lock().unwrap().writes.clone();
        runs.dedup();
        runs
    }

    #[test]
    fn a_leader_renews_with_one_request() {
        let api = Arc::new(ApiServer::default());
        let a = replica(&api, "a", Timestamp::now);
        a.run_for(Duration::from_secs(60));
        let s = api.state.lock().unwrap();
        // The first try reads (none there) and creates; each renewal every 5 s writes only.
        assert_eq!(
            (s.lease_reads, s.lease_writes),
            (1, 12),
            "{:?}",
            s.writes.len()
        );
    }

    #[test]
    fn one_leader_writes_at_a_time_through_pauses_and_cut_offs_with_clocks_30s_apart() {
        let api = Arc::new(ApiServer::default());
        let a = replica(&api, "a", ahead);
        let b = replica(&api, "b", behind);
        run_both(&a, &b, Duration::from_secs(30), None);
        assert_eq!(leaders_in_write_order(&api), ["a"]);

        // a is stopped past its Lease (SIGSTOP, a long GC pause): b takes over and writes;
        // a, resumed, writes nothing and steps down.
        run_both(&a, &b, Duration::from_secs(30), Some(&a));
        assert_eq!(leaders_in_write_order(&api), ["a", "b"]);
        a.resume_after(Duration::from_secs(30), &api, "a");
        run_both(&a, &b, Duration::from_secs(30), None);
        assert_eq!(a.step_downs.lock().unwrap().len(), 1);
        assert!(a.writes_fenced.get() >= 1);

        // b is cut off from the API server: it steps down at its renew deadline, a takes over
        // after the Lease's duration on its own clock; b comes back as a candidate.
        api.state.lock().unwrap().cut_off.insert("b");
        run_both(&a, &b, Duration::from_secs(30), None);
        api.state.lock().unwrap().cut_off.clear();
        run_both(&a, &b, Duration::from_secs(30), None);
        assert_eq!(leaders_in_write_order(&api), ["a", "b", "a"]);
        let downs = b.step_downs.lock().unwrap().clone();
        assert_eq!(downs.len(), 1);
        assert!(downs[0].contains("not renewed within"), "{downs:?}");

        // a is stopped again, for just past the Lease: the same hand-over back to b.
        run_both(&a, &b, Duration::from_secs(17), Some(&a));
        a.resume_after(Duration::from_secs(17), &api, "a");
        run_both(&a, &b, Duration::from_secs(30), None);
        assert_eq!(leaders_in_write_order(&api), ["a", "b", "a", "b"]);
        assert_eq!(a.step_downs.lock().unwrap().len(), 2);
        // Every hand-over was a transition of the Lease, each counted once.
        let lease = api.state.lock().unwrap().lease.clone().unwrap();
        assert_eq!(lease["spec"]["holderIdentity"], "b");
        assert_eq!(lease["spec"]["leaseTransitions"], 3);
    }
}
