//! `stoker`: the product's command line — dataset tools, the worker and the operator (what
//! the image ships). The demo, the benchmarks and synthetic data are `stoker-lab` (`lab/`).
//! Each subcommand's flags and wiring live in `cmd/`; the work is in the crates.

use clap::{Parser, Subcommand};

mod cmd {
    pub mod certs;
    pub mod dataset;
    pub mod operator;
    pub mod worker;
}

#[derive(Parser)]
#[command(
    name = "stoker",
    version,
    about = "Keeps the GPUs of multimodal training jobs fed"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per process: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Index, inspect and measure JSONL + image datasets.
    #[command(subcommand)]
    Dataset(cmd::dataset::DatasetCommand),
    /// Serve preprocessed batches to trainer ranks over TCP.
    Worker(stoker_config::WorkerConfig),
    /// Make a CA and a worker certificate for TLS between ranks and workers run without the
    /// operator.
    Certs(cmd::certs::CertsArgs),
    /// Print the DataPipeline CustomResourceDefinition (YAML), as `crds/` holds it.
    Crd,
    /// Run the operator: reconcile DataPipelines into worker pools and scale them on the
    /// trainers' wait ratio (in-cluster config or $KUBECONFIG).
    Operator(cmd::operator::OperatorArgs),
}

fn main() {
    if let Err(e) = run() {
        // The chain of causes names the thing (shard:line, object key, flag); a backtrace
        // would only bury it.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    stoker_worker::alloc::keep_freed_buffers();
    // Two rustls providers are linked (kube's ring, the AWS SDK's aws-lc-rs); without a
    // process default, rustls panics at the first TLS connection (API server, S3 over HTTPS).
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,aws_config=warn,aws_smithy_runtime=warn".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: `kubectl logs` of a pod shows plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        match cli.command {
            Command::Dataset(c) => cmd::dataset::run(c).await,
            Command::Worker(a) => cmd::worker::run(a).await,
            Command::Operator(a) => cmd::operator::run(a).await,
            Command::Certs(a) => cmd::certs::run(a),
            Command::Crd => cmd::operator::print_crd(),
        }
    })
}
