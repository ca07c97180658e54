//! `stoker operator` and `stoker crd`: the command line of the stoker-operator crate.

use stoker_operator::Config;

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
    /// The cluster's DNS domain: workers' certificates name their Service up to
    /// `<service>.<namespace>.svc.<domain>`.
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
    /// Namespaces whose pods may read the workers' /metrics (Prometheus's), comma-separated;
    /// the pipeline's own namespace always may, every other may not.
    #[arg(long, value_delimiter = ',')]
    worker_metrics_from: Vec<String>,
}

pub async fn run(a: OperatorArgs) -> anyhow::Result<()> {
    let identity = a.identity.unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| format!("stoker-operator-{}", std::process::id()))
    });
    stoker_operator::run(Config {
        metrics_listen: a.metrics_listen,
        lease_namespace: a.lease_namespace,
        identity,
        namespace: a.namespace,
        cluster_domain: a.cluster_domain,
        worker_metrics_from: a.worker_metrics_from,
    })
    .await
}

pub fn print_crd() -> anyhow::Result<()> {
    print!("{}", stoker_operator::crd_yaml()?);
    Ok(())
}
