//! `stoker bench …`: benchmarks printing ours-vs-baseline tables.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {}
}
