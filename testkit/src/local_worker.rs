//! `stoker worker` as a child process on loopback: the local backend of the demo, the
//! benchmarks and the end-to-end tests (the operator runs the same binary in pods).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use stoker_config::WorkerConfig;

/// A running `stoker worker`; killed when dropped.
pub struct LocalWorker {
    child: Child,
    /// Where it serves batches.
    pub addr: String,
    /// Where it serves /metrics, /healthz and /readyz.
    pub metrics_addr: String,
}

impl LocalWorker {
    /// Starts `EXE worker` (EXE: the `stoker` binary) with `config` on free loopback ports
    /// and waits until it listens.
    pub fn spawn(
        exe: &Path,
        config: &WorkerConfig,
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        Self::start(Command::new(exe), "127.0.0.1", config, env)
    }

    /// The same pinned to `cpus` (a `taskset -c` list, e.g. "1"): a benchmark's worker kept
    /// off the cores its store and client use.
    pub fn spawn_pinned(
        cpus: &str,
        exe: &Path,
        config: &WorkerConfig,
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        let mut cmd = Command::new("taskset");
        // `taskset` execs the program: the child's pid is the worker's.
        cmd.args(["-c", cpus]).arg(exe);
        Self::start(cmd, "127.0.0.1", config, env)
    }

    /// The same inside network namespace `netns`, listening on `host` (an address of that
    /// namespace): a worker on a "node" of `stoker-lab bench spread`.
    pub fn spawn_in_netns(
        netns: &str,
        exe: &Path,
        host: &str,
        config: &WorkerConfig,
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        let mut cmd = Command::new("ip");
        // `ip netns exec` execs the program: the child's pid is the worker's.
        cmd.args(["netns", "exec", netns]).arg(exe);
        Self::start(cmd, host, config, env)
    }

    fn start(
        mut cmd: Command,
        host: &str,
        config: &WorkerConfig,
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        let mut config = config.clone();
        config.serving.listen = format!("{host}:0");
        config.serving.metrics_listen = format!("{host}:0");
        let mut child = cmd
            .arg("worker")
            .args(config.to_args())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                std::env::var("STOKER_WORKER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let (mut metrics_addr, mut addr) = (String::new(), String::new());
        while addr.is_empty() {
            let line = match lines.next() {
                Some(l) => l?,
                None => {
                    let status = child.wait()?;
                    anyhow::bail!("stoker worker exited before listening ({status})");
                }
            };
            if let Some(a) = line.strip_prefix("metrics ") {
                metrics_addr = a.to_string();
            } else if let Some(a) = line.strip_prefix("listening ") {
                addr = a.to_string();
            }
        }
        Ok(LocalWorker {
            child,
            addr,
            metrics_addr,
        })
    }

    /// Waits until /readyz answers 200 (the index is loaded and the server accepts), at most
    /// `timeout`: readiness follows the listen line by a moment, longer on a loaded machine.
    pub fn wait_ready(&self, timeout: std::time::Duration) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match crate::http::get(&self.metrics_addr, "/readyz") {
                Ok(r) if r.status == 200 => return Ok(()),
                _ if std::time::Instant::now() >= deadline => {
                    anyhow::bail!("worker {} not ready after {timeout:?}", self.addr)
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, as Kubernetes sends before removing a pod: the worker drains and exits.
    pub fn terminate(&self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -TERM {}: {status}", self.child.id());
        Ok(())
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait()
    }

    /// SIGKILL, as a node failure would: no drain, connections reset.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LocalWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `EXE dataset index DATA --write-lengths` (with `env`, e.g. the embedded S3's) and
/// returns what it stored in `dir`/stoker-lengths.bin (`dir`: the dataset's folder on disk;
/// `SampleLengths::from_bytes` reads it): what workers with `--balance-ranks`,
/// `--bucket-by-length` or `--pack-max-tokens` read.
pub fn write_sample_lengths(
    exe: &Path,
    data: &str,
    env: &[(&'static str, String)],
    dir: &Path,
) -> anyhow::Result<Vec<u8>> {
    let out = Command::new(exe)
        .args([
            "dataset",
            "index",
            data,
            "--s3-path-style",
            "--write-lengths",
        ])
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "dataset index: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(std::fs::read(dir.join("stoker-lengths.bin"))?)
}
