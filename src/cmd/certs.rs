//! `stoker certs`: a CA and one worker certificate, for workers run without the operator (the
//! operator issues its own per pipeline; docs/security.md).

use std::path::PathBuf;
use std::time::Duration;
use stoker_tls::issue::{unique_name, Authority};

#[derive(clap::Args)]
pub struct CertsArgs {
    /// A name ranks dial the workers by (DNS name or IP address), once per name; a headless
    /// Service's name covers every pod behind it.
    #[arg(long = "name", required = true)]
    names: Vec<String>,
    /// Folder for ca.crt (what ranks trust: STOKER_TLS_CA or the loader's tls_ca), tls.crt
    /// and tls.key (every worker's --tls-cert and --tls-key). The CA's key is not kept: run
    /// again for new certificates, and give ranks the new ca.crt.
    #[arg(long)]
    out: PathBuf,
    /// Days the certificates stay valid.
    #[arg(long, default_value_t = 365)]
    days: u64,
}

pub fn run(a: CertsArgs) -> anyhow::Result<()> {
    let valid_for = Duration::from_secs(a.days.max(1) * 86_400);
    let ca = Authority::new(&unique_name("stoker workers CA"), valid_for)?;
    let worker = ca.issue(&a.names, valid_for)?;
    ca.write_files(&a.out, &worker)?;
    println!(
        "{}: ca.crt (ranks trust it), tls.crt and tls.key (workers serve with them) for {}",
        a.out.display(),
        a.names.join(", ")
    );
    Ok(())
}
