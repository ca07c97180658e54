//! `stoker-lab`: what the project measures and shows itself with, kept out of the product
//! binary (`stoker`, which the image ships): the demo, the benchmarks, the spread experiment,
//! synthetic datasets and the video sampling sweep. Lab commands that run workers start the
//! product binary beside this one (`$STOKER_BIN`, else `stoker` in this executable's folder).

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use stoker_testkit::synth::{generate, SynthOptions};

mod cmd {
    pub mod balance;
    pub mod bench;
    pub mod dataset_scale;
    pub mod demo;
    pub mod epoch_boundary;
    pub mod hostile;
    pub mod local;
    pub mod scale;
    pub mod spread;
    pub mod store_latency;
    pub mod transport;
    pub mod video_plan;
}

#[derive(Parser)]
#[command(
    name = "stoker-lab",
    version,
    about = "Stoker's demo, benchmarks and synthetic data"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic VLM SFT dataset (JSONL shards + JPEG/PNG images).
    Synth {
        /// Folder to write (created; shards at its root, images under images/).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        options: SynthOptions,
    },
    /// The whole pipeline on this machine: embedded object store, worker processes, simulated
    /// trainer ranks through the real client; prints the ablation table.
    Demo(cmd::demo::DemoArgs),
    /// Benchmarks that print ours-vs-baseline tables (docs/benchmarks.md).
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// The frames each preset samples from clips given by their header (JSON lines on stdin
    /// and stdout): the sampling sweep of the parity tests.
    VideoPlan,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    // As in the product binary: freed buffers kept (the worker's allocation pattern), one
    // rustls provider as the process default, logs to stderr.
    stoker_worker::alloc::keep_freed_buffers();
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,aws_config=warn,aws_smithy_runtime=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        match cli.command {
            Command::Synth { out, options } => synth(out, options).await,
            Command::Bench(c) => cmd::bench::run(c).await,
            Command::Demo(a) => cmd::demo::run(a).await,
            Command::VideoPlan => cmd::video_plan::run(),
        }
    })
}

async fn synth(out: PathBuf, options: SynthOptions) -> anyhow::Result<()> {
    let samples = options.samples;
    let pb = indicatif::ProgressBar::new(samples as u64);
    tokio::task::spawn_blocking(move || {
        generate(&out, &options, &|| pb.inc(1))?;
        pb.finish_and_clear();
        anyhow::Ok(())
    })
    .await??;
    println!("wrote {samples} samples");
    Ok(())
}
