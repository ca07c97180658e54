//! Local runs (demo, benchmarks): where generated datasets are cached, and `stoker worker`
//! processes of the product binary.

use std::path::{Path, PathBuf};
use stoker_config::{PixelDtype, Preprocessing, WorkerConfig};
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};

/// Starts a `stoker worker` of the product binary.
pub fn spawn_worker(
    config: &WorkerConfig,
    env: &[(&'static str, String)],
) -> anyhow::Result<LocalWorker> {
    LocalWorker::spawn(&product_binary()?, config, env)
}

/// The product binary (`stoker`) the lab runs workers and dataset tools of: `$STOKER_BIN`,
/// else `stoker` beside this executable (cargo builds both into one folder).
pub fn product_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("STOKER_BIN") {
        return Ok(PathBuf::from(path));
    }
    let lab = std::env::current_exe()?;
    let path = lab.with_file_name("stoker");
    anyhow::ensure!(
        path.exists(),
        "no product binary at {} (build it: cargo build --release --bin stoker, or set STOKER_BIN)",
        path.display()
    );
    Ok(path)
}

/// The demo's synthetic dataset (LLaVA format, 100 samples per shard, long sides up to
/// `max_side`), generated once under `root`; its bucket name.
pub fn ensure_demo_dataset(root: &Path, samples: usize, max_side: u32) -> anyhow::Result<String> {
    let bucket = format!("demo-{samples}-{max_side}px");
    let synth = SynthOptions {
        samples,
        format: SynthFormat::Llava,
        samples_per_shard: 100,
        max_side,
        ..SynthOptions::default()
    };
    ensure_dataset(&root.join(&bucket), &synth)?;
    Ok(bucket)
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
    generate(dir, o, &|| pb.inc(1))?;
    pb.finish_and_clear();
    std::fs::write(done, b"")?;
    Ok(())
}

/// The demo's preprocessing unless told otherwise: up to 256 vision tokens per image
/// (max_pixels 200,704) and bf16 pixels, to keep a run on a laptop short.
pub fn demo_preprocessing(pre: &mut Preprocessing) {
    pre.max_pixels.get_or_insert(200_704);
    pre.pixel_dtype.get_or_insert(PixelDtype::Bf16);
}
