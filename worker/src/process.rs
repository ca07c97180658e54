//! `stoker worker` as a child process on loopback: the local backend of the demo, the
//! benchmarks and the end-to-end tests (the operator runs the same binary in pods), plus the
//! plain-HTTP scraping they use to read its metrics.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running `stoker worker`; killed when dropped.
pub struct LocalWorker {
    child: Child,
    /// Where it serves batches.
    pub addr: String,
    /// Where it serves /metrics, /healthz and /readyz.
    pub metrics_addr: String,
}

impl LocalWorker {
    /// Starts `EXE worker --data DATA ARGS…` (EXE: the `stoker` binary) on loopback ports and
    /// waits until it listens.
    pub fn spawn(
        exe: &Path,
        data: &str,
        args: &[OsString],
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        Self::start(Command::new(exe), "127.0.0.1", data, args, env)
    }

    /// The same inside network namespace `netns`, listening on `host` (an address of that
    /// namespace): a worker on a "node" of `stoker bench spread`.
    pub fn spawn_in_netns(
        netns: &str,
        exe: &Path,
        host: &str,
        data: &str,
        args: &[OsString],
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        let mut cmd = Command::new("ip");
        // `ip netns exec` execs the program: the child's pid is the worker's.
        cmd.args(["netns", "exec", netns]).arg(exe);
        Self::start(cmd, host, data, args, env)
    }

    fn start(
        mut cmd: Command,
        host: &str,
        data: &str,
        args: &[OsString],
        env: &[(&'static str, String)],
    ) -> anyhow::Result<LocalWorker> {
        let mut child = cmd
            .args(["worker", "--data", data])
            .arg("--listen")
            .arg(format!("{host}:0"))
            .arg("--metrics-listen")
            .arg(format!("{host}:0"))
            .args(args)
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

/// GETs a path over plain HTTP/1.0 (metrics scraping on loopback).
pub fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .ok_or_else(|| anyhow::anyhow!("{addr}{path}: not an HTTP response"))?;
    Ok(body)
}
