//! `stoker worker`: serve batches of one plan over TCP, with /metrics, /healthz and /readyz.

use std::sync::Arc;
use std::time::Duration;
use stoker_config::WorkerConfig;
use stoker_tls::{Serve, ServerTls};
use stoker_worker::dataset::index::{NeedsIndex, INDEX_KEY};
use stoker_worker::metrics::{serve_http, Metrics};
use stoker_worker::open::open_pipeline;
use stoker_worker::pipeline::Pipeline;
use stoker_worker::server::{Server, ServerConfig};
use stoker_worker::source::{FetchError, Store};

/// The token from --token-file, else $STOKER_TOKEN; none only with --no-auth.
fn load_token(a: &stoker_config::Serving) -> anyhow::Result<Option<String>> {
    if a.no_auth {
        return Ok(None);
    }
    let token = match &a.token_file {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("reading token file {p}: {e}"))?
            .trim()
            .to_string(),
        None => std::env::var("STOKER_TOKEN").map_err(|_| {
            anyhow::anyhow!("no pipeline token: pass --token-file, set STOKER_TOKEN, or --no-auth")
        })?,
    };
    anyhow::ensure!(!token.is_empty(), "the pipeline token is empty");
    Ok(Some(token))
}

/// TLS with --tls-cert/--tls-key, plaintext only with --insecure-plaintext (which wins over
/// certificates from the environment: the flag is the explicit word).
fn load_transport(a: &stoker_config::Serving) -> anyhow::Result<Serve> {
    if a.insecure_plaintext {
        tracing::warn!(
            "serving without TLS (--insecure-plaintext{}): tokens travel in the clear and ranks \
             cannot tell this worker from an impostor",
            if a.tls_cert.is_some() {
                ", the TLS certificate unused"
            } else {
                ""
            }
        );
        return Ok(Serve::InsecurePlaintext);
    }
    match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            let tls = ServerTls::from_files(cert, key)?;
            tracing::info!("serving TLS with the certificate {cert}");
            Ok(Serve::Tls(tls))
        }
        _ => anyhow::bail!(
            "no TLS certificate: pass --tls-cert and --tls-key (or STOKER_TLS_CERT and \
             STOKER_TLS_KEY; `stoker certs` makes them), or --insecure-plaintext on a trusted \
             network (docs/security.md)"
        ),
    }
}

/// The first wait for a dataset's index to appear, doubled up to the longest: one HEAD per
/// worker each time, so a fleet waiting for `stoker dataset index` asks little of the store.
const INDEX_WAIT_FIRST: Duration = Duration::from_secs(5);
const INDEX_WAIT_LONGEST: Duration = Duration::from_secs(60);

/// Opens the pipeline; a dataset too large to index here keeps the worker unready (/readyz
/// names the command to run) until its index appears.
async fn open_waiting_for_an_index(
    cfg: &WorkerConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Arc<Pipeline>> {
    let mut wait = INDEX_WAIT_FIRST;
    loop {
        let needs = match open_pipeline(cfg, metrics.clone()).await {
            Ok(p) => {
                metrics.set_waiting_for(None);
                return Ok(p);
            }
            Err(e) => match e.downcast::<NeedsIndex>() {
                Ok(needs) => needs,
                Err(other) => return Err(other),
            },
        };
        tracing::error!("not ready: {needs}");
        metrics.set_waiting_for(Some(needs.to_string()));
        let store = Store::open(&needs.dataset, &cfg.s3).await?;
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(INDEX_WAIT_LONGEST);
            match store.head(INDEX_KEY).await {
                Ok(_) => break,
                Err(FetchError::NotFound(_)) => {}
                Err(e) => tracing::warn!("looking for {}: {e}", store.describe(INDEX_KEY)),
            }
        }
        tracing::info!(
            "{} appeared: opening the pipeline",
            store.describe(INDEX_KEY)
        );
    }
}

pub async fn run(cfg: WorkerConfig) -> anyhow::Result<()> {
    let a = &cfg.serving;
    let token = load_token(a)?;
    let transport = load_transport(a)?;
    let metrics = Metrics::for_pipeline(&a.pipeline);
    // Health first: liveness holds while the index loads; readiness waits for the server.
    let http = tokio::net::TcpListener::bind(&a.metrics_listen).await?;
    tracing::info!("metrics on http://{}/metrics", http.local_addr()?);
    // Machine-readable lines for process supervisors (the demo, tests) that bind port 0.
    println!("metrics {}", http.local_addr()?);
    tokio::spawn(serve_http(http, metrics.clone()));

    let pipeline = open_waiting_for_an_index(&cfg, metrics).await?;
    let cpu_threads = pipeline.config.cpu_threads;
    let server = Server::new(
        pipeline,
        ServerConfig {
            transport,
            token,
            max_inflight_per_conn: a.limits.max_inflight_per_conn as usize,
            max_connections: a.limits.max_connections as usize,
            idle_timeout: Duration::from_secs(a.limits.idle_timeout_s),
            max_inflight_samples: a.inflight_samples(cpu_threads),
            max_worker_bytes: a.limits.max_worker_bytes,
            send_timeout: Duration::from_secs(a.limits.send_timeout_s),
            drain_timeout: Duration::from_secs(a.drain_timeout_s),
            links_per_rank: a.limits.links_per_rank,
        },
    );
    let (budget, samples) = (a.limits.max_worker_bytes, server.max_inflight_samples());
    let per_sample = server.pipeline.peak_sample_bytes();
    tracing::info!(
        "memory: at most {budget} bytes of samples and batches (--max-worker-bytes), past it \
         at most {samples} samples in preparation of {per_sample} bytes each: {} bytes of \
         data in all (docs/reliability.md)",
        budget.saturating_add((samples as u64).saturating_mul(per_sample))
    );
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
    tracing::info!(
        "serving plan {:016x} ({} samples, {} batches/epoch) on {}",
        server.welcome.plan_id,
        server.welcome.num_samples,
        server.welcome.batches_per_epoch,
        listener.local_addr()?
    );
    println!("listening {}", listener.local_addr()?);
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("draining: not ready, finishing in-flight requests");
    };
    server.serve(listener, shutdown).await;
    tracing::info!("drained; exiting");
    Ok(())
}
