//! The Stoker operator: reconciles `DataPipeline`s into worker pools and scales them on the
//! trainers' wait ratio. Shaped as validate (`validate`) → build, pure (`build`) → apply
//! (`reconcile`) → status, pure (`status`); the CRD types are apart (`crd`), the scaling
//! policy is `stoker-control`, free of Kubernetes types. The operator reaches the data plane
//! only through the worker's command line and Prometheus text: it does not link it.

pub mod build;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod scrape;
pub mod status;
pub mod validate;

use crd::DataPipeline;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use kube::{Api, CustomResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
}

const LEASE_NAME: &str = "stoker-operator";
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_EVERY: Duration = Duration::from_secs(5);
/// How often deleted pipelines' autoscaler state and series are dropped.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Runs until SIGTERM/SIGINT: metrics endpoint, leader election, then the controller.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let metrics = metrics::OperatorMetrics::new();
    let listener = tokio::net::TcpListener::bind(&cfg.metrics_listen).await?;
    tracing::info!(
        "operator metrics on http://{}/metrics",
        listener.local_addr()?
    );
    tokio::spawn(metrics::serve(listener, metrics.clone()));
    let election = leader::LeaderElection {
        api: Api::namespaced(client.clone(), &cfg.lease_namespace),
        name: LEASE_NAME.into(),
        identity: cfg.identity.clone(),
        duration: LEASE_DURATION,
    };
    lead(election, &cfg.lease_namespace).await;
    metrics.leader.set(1);
    control(client, cfg, metrics).await;
    Ok(())
}

/// Waits until this replica holds the Lease, then keeps renewing it in the background.
async fn lead(election: leader::LeaderElection, namespace: &str) {
    let identity = election.identity.clone();
    tracing::info!("{identity}: waiting for the {LEASE_NAME} Lease in {namespace}");
    loop {
        match election.try_acquire().await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => tracing::warn!("leader election: {e}"),
        }
        tokio::time::sleep(RENEW_EVERY).await;
    }
    tracing::info!("{identity}: leading");
    tokio::spawn(async move {
        // Losing the Lease (or failing to renew it for its whole duration) ends the process:
        // the Deployment restarts it as a candidate, and nothing reconciles twice.
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(RENEW_EVERY).await;
            match election.try_acquire().await {
                Ok(true) => last_ok = Instant::now(),
                Ok(false) => {
                    tracing::error!("another replica holds the leader Lease; exiting");
                    std::process::exit(1);
                }
                Err(e) if last_ok.elapsed() > LEASE_DURATION => {
                    tracing::error!("could not renew the leader Lease ({e}); exiting");
                    std::process::exit(1);
                }
                Err(e) => tracing::warn!("renewing the leader Lease: {e}"),
            }
        }
    });
}

/// The controller: DataPipelines and the Deployments they own, plus a sweep that forgets
/// deleted pipelines (no finalizer: their objects go by garbage collection).
async fn control(client: kube::Client, cfg: Config, metrics: Arc<metrics::OperatorMetrics>) {
    let (dps, deployments): (Api<DataPipeline>, Api<Deployment>) = match &cfg.namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "stoker-operator".into(),
            instance: Some(cfg.identity),
        },
    );
    let ctx = Arc::new(reconcile::Context::new(client, recorder, metrics));
    let controller = Controller::new(dps, watcher::Config::default())
        .owns(deployments, watcher::Config::default());
    let store = controller.store();
    let sweeper = ctx.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            // Only pipelines that were reconciled are tracked, and the controller reconciles
            // only once its cache is filled: the cache is complete whenever anything is
            // tracked. (Not `Store::wait_until_ready`: it wakes one waiter, the controller.)
            let live = store.state().iter().map(|dp| reconcile::key(dp)).collect();
            sweeper.forget_deleted(&live);
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
