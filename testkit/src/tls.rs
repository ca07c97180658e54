//! Certificates for workers run by tests and benchmarks: a fresh CA per call, files beside
//! the test's other data.

use std::path::Path;
use std::time::Duration;
use stoker_config::WorkerConfig;
use stoker_tls::issue::{unique_name, Authority};
use stoker_tls::ClientTls;

const VALID_FOR: Duration = Duration::from_secs(86_400);

/// Writes a new CA's certificate (`ca.crt`) and a worker certificate for `names` (`tls.crt`,
/// `tls.key`) into `dir`, points `cfg` at them, and returns what a rank trusts.
pub fn serve_tls(dir: &Path, names: &[&str], cfg: &mut WorkerConfig) -> anyhow::Result<ClientTls> {
    let ca = Authority::new(&unique_name("stoker test CA"), VALID_FOR)?;
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let worker = ca.issue(&names, VALID_FOR)?;
    let (cert, key) = ca.write_files(dir, &worker)?;
    cfg.serving.tls_cert = Some(cert.display().to_string());
    cfg.serving.tls_key = Some(key.display().to_string());
    cfg.serving.insecure_plaintext = false;
    Ok(ClientTls::from_ca_pem(ca.cert_pem().as_bytes())?)
}
