//! `stoker operator` and `stoker crd`: the Kubernetes side. CRD types (`crd`) are apart from
//! the pure resource builders (`build`), the metric sources (`scrape`) and the reconcile loop
//! (`reconcile`); the scaling policy itself is `stoker-control`, free of Kubernetes types.

pub mod build;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod scrape;

use crd::DataPipeline;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use kube::{Api, CustomResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The DataPipeline CustomResourceDefinition as YAML (what `crds/` holds).
pub fn crd_yaml() -> anyhow::Result<String> {
    Ok(serde_yaml::to_string(&DataPipeline::crd())?)
}

#[derive(clap::Args)]
pub struct OperatorArgs {
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_listen: String,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's name in the Lease and in Events [default: the hostname].
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Watch DataPipelines of this namespace only [default: all namespaces].
    #[arg(long)]
    namespace: Option<String>,
}

const LEASE_NAME: &str = "stoker-operator";
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_EVERY: Duration = Duration::from_secs(5);

pub async fn run(a: OperatorArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let metrics = metrics::OperatorMetrics::new();
    let listener = tokio::net::TcpListener::bind(&a.metrics_listen).await?;
    tracing::info!(
        "operator metrics on http://{}/metrics",
        listener.local_addr()?
    );
    tokio::spawn(metrics::serve(listener, metrics.clone()));

    let identity = a.identity.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| format!("stoker-operator-{}", std::process::id()))
    });
    let election = leader::LeaderElection {
        api: Api::namespaced(client.clone(), &a.lease_namespace),
        name: LEASE_NAME.into(),
        identity: identity.clone(),
        duration: LEASE_DURATION,
    };
    tracing::info!(
        "{identity}: waiting for the {LEASE_NAME} Lease in {}",
        a.lease_namespace
    );
    loop {
        match election.try_acquire().await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => tracing::warn!("leader election: {e}"),
        }
        tokio::time::sleep(RENEW_EVERY).await;
    }
    tracing::info!("{identity}: leading");
    metrics.leader.set(1);
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

    let (dps, deployments): (Api<DataPipeline>, Api<Deployment>) = match &a.namespace {
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
            instance: Some(identity),
        },
    );
    let ctx = Arc::new(reconcile::Context::new(client, recorder, metrics));
    Controller::new(dps, watcher::Config::default())
        .owns(deployments, watcher::Config::default())
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!("controller: {e}");
            }
        })
        .await;
    Ok(())
}
