//! The Stoker operator: reconciles `DataPipeline`s into worker pools and scales them on the
//! trainers' wait ratio. Shaped as validate (`validate`) → build, pure (`build`) → apply
//! (`reconcile`) → status, pure (`status`); the CRD types are apart (`crd`), the scaling
//! policy is `stoker-control`, free of Kubernetes types. The operator reaches the data plane
//! only through the worker's command line and Prometheus text: it does not link it.

#![forbid(unsafe_code)]

pub mod apply;
pub mod build;
pub mod cache;
pub mod crd;
pub mod credentials;
pub mod error;
pub mod fence;
pub mod labels;
pub mod leader;
pub mod metrics;
pub mod placement;
pub mod quantity;
pub mod reconcile;
pub mod scrape;
pub mod secrets;
pub mod status;
pub mod validate;

use crd::DataPipeline;
use futures::StreamExt;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use kube::{Api, CustomResourceExt};
use std::sync::Arc;
use std::time::Duration;

/// The DataPipeline CustomResourceDefinition as YAML (what `crds/` holds).
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&DataPipeline::crd())
}

/// How one operator process runs (the CLI's `stoker operator` flags).
pub struct Config {
    /// Address for /metrics, /healthz and /readyz.
    pub metrics_listen: String,
    /// Namespace of the leader-election Lease.
    pub lease_namespace: String,
    /// This replica's name in the Lease and in Events.
    pub identity: String,
    /// Watch DataPipelines of this namespace only (`None`: all namespaces).
    pub namespace: Option<String>,
    /// The cluster's DNS domain (the last name in the workers' certificates).
    pub cluster_domain: String,
    /// Namespaces whose pods may read the workers' /metrics, besides the pipeline's own.
    pub worker_metrics_from: Vec<String>,
}

const LEASE_NAME: &str = "stoker-operator";
/// How often deleted pipelines' autoscaler state and series are dropped.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Runs until SIGTERM/SIGINT: metrics endpoint, leader election, then the controller, whose
/// writes are fenced on the Lease. A replica that steps down exits: the Deployment restarts it
/// as a candidate, and nothing reconciles twice.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    use leader::{LEASE_DURATION, RENEW_DEADLINE};
    let config = kube::Config::infer().await?;
    let metrics = metrics::OperatorMetrics::new();
    let listener = tokio::net::TcpListener::bind(&cfg.metrics_listen).await?;
    tracing::info!(
        "operator metrics on http://{}/metrics",
        listener.local_addr()?
    );
    tokio::spawn(metrics::serve(listener, metrics.clone()));
    // The Lease's own requests go around the fence; everything the controller sends through it.
    let election = leader::LeaderElection::new(
        Api::namespaced(
            kube::Client::try_from(config.clone())?,
            &cfg.lease_namespace,
        ),
        LEASE_NAME,
        &cfg.identity,
        LEASE_DURATION,
    );
    let fence = fence::Fence::new(
        RENEW_DEADLINE,
        LEASE_DURATION,
        metrics.writes_fenced.clone(),
    );
    let client = kube::client::ClientBuilder::try_from(config)?
        .with_layer(&fence::FenceLayer(fence.clone()))
        .build();
    let identity = cfg.identity.clone();
    tracing::info!(
        "{identity}: waiting for the {LEASE_NAME} Lease in {}",
        cfg.lease_namespace
    );
    let won = election.acquire().await;
    tracing::info!("{identity}: leading");
    metrics.leader.set(1);
    tokio::select! {
        why = election.keep(won, &fence) => {
            metrics.leader.set(0);
            tracing::error!("{identity}: stepping down: {why}; exiting");
            std::process::exit(1);
        }
        () = control(client, cfg, metrics.clone()) => Ok(()),
    }
}

/// The controller: DataPipelines (a reconcile on a change of their spec, not of the status it
/// writes itself), the objects they own (watched by our label), the reflectors of Nodes and
/// worker pods placement reads, plus a sweep that forgets deleted pipelines (no finalizer:
/// their objects go by garbage collection).
async fn control(client: kube::Client, cfg: Config, metrics: Arc<metrics::OperatorMetrics>) {
    use apply::{Changes, Owned};
    use kube::runtime::{predicates, reflector, WatchStreamExt};
    fn api<K>(client: &kube::Client, ns: &Option<String>) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let ns = &cfg.namespace;
    let owned = || watcher::Config::default().labels(&labels::managed_selector());
    let (deployments, deployment_events) =
        cache::reflect(api(&client, ns), owned(), cache::keep_all);
    let (services, service_events) = cache::reflect(api(&client, ns), owned(), cache::keep_all);
    let (pdbs, pdb_events) = cache::reflect(api(&client, ns), owned(), cache::keep_all);
    let (policies, policy_events) = cache::reflect(api(&client, ns), owned(), cache::keep_all);
    let (nodes, node_events) = cache::reflect(
        Api::all(client.clone()),
        watcher::Config::default(),
        cache::strip_node,
    );
    let (workers, worker_events) = cache::reflect(api(&client, ns), owned(), cache::strip_pod);
    let (store, writer) = reflector::store();
    let cluster = reconcile::Cluster {
        pipelines: store.clone(),
        deployments: Owned::new(deployments, Changes::Generation),
        services: Owned::new(services, Changes::ResourceVersion),
        disruption_budgets: Owned::new(pdbs, Changes::Generation),
        network_policies: Owned::new(policies, Changes::Generation),
        nodes,
        workers,
        trainers: cache::TrainerPods::new(client.clone()),
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "stoker-operator".into(),
            instance: Some(cfg.identity),
        },
    );
    let pipelines = watcher(api::<DataPipeline>(&client, ns), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default());
    let pipelines = cache::logged(pipelines);
    let credentials = secrets::Credentials::new(&cfg.cluster_domain);
    let ctx = Arc::new(reconcile::Context::new(
        client,
        recorder,
        metrics,
        cluster,
        credentials,
        cfg.worker_metrics_from,
    ));
    // Nodes and pods trigger nothing (a pipeline's cap is re-read at its next reconcile):
    // the controller only drives their reflectors.
    fn nothing<K>(_: K) -> Option<kube::runtime::reflector::ObjectRef<DataPipeline>> {
        None
    }
    let controller = Controller::for_stream(pipelines, store.clone())
        .owns_stream(deployment_events)
        .owns_stream(service_events)
        .owns_stream(pdb_events)
        .owns_stream(policy_events)
        .watches_stream(node_events, nothing)
        .watches_stream(worker_events, nothing);
    let sweeper = ctx.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            // Only pipelines that were reconciled are tracked, and the controller reconciles
            // only once its cache is filled: the cache is complete whenever anything is
            // tracked. (Not `Store::wait_until_ready`: it wakes one waiter, the controller.)
            let pipelines = store.state();
            let live = pipelines.iter().map(|dp| reconcile::key(dp)).collect();
            let scraped = pipelines
                .iter()
                .filter_map(|dp| scrape::trainer_pods_of(dp))
                .collect();
            sweeper.forget_deleted(&live, &scraped);
        }
    });
    controller
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!("controller: {e}");
            }
        })
        .await;
}
