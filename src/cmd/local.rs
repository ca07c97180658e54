//! Local runs (demo, benchmarks): where generated datasets are cached, and `stoker worker`
//! processes started from this very binary.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use stoker_worker::dataset::synth::{generate, SynthOptions};
pub use stoker_worker::process::http_get;
use stoker_worker::process::LocalWorker;

/// Starts a `stoker worker` of this binary.
pub fn spawn_worker(
    data: &str,
    args: &[OsString],
    env: &[(&'static str, String)],
) -> anyhow::Result<LocalWorker> {
    LocalWorker::spawn(&std::env::current_exe()?, data, args, env)
}

/// ~/.cache/stoker: datasets the demo and benchmarks generate once.
pub fn cache_root() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache/stoker")
}

/// Generates a synthetic dataset into `dir` unless a complete one is there.
pub fn ensure_dataset(dir: &Path, o: &SynthOptions) -> anyhow::Result<()> {
    let done = dir.join(".complete");
    if done.exists() {
        return Ok(());
    }
    eprintln!(
        "generating {} samples in {} (once)",
        o.samples,
        dir.display()
    );
    let _ = std::fs::remove_dir_all(dir);
    let pb = indicatif::ProgressBar::new(o.samples as u64);
    generate(dir, o, &pb)?;
    pb.finish_and_clear();
    std::fs::write(done, b"")?;
    Ok(())
}
