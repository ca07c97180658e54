//! TLS between ranks and a real `stoker worker` process (docs/security.md): impostors given
//! to a rank beside a real worker — a plain listener and a TLS server with another CA's
//! certificate for the right name — never receive the pipeline token, and the rank gets the
//! whole epoch from the real worker; a worker whose certificate names another host is refused
//! by name; a worker refuses to start with neither certificates nor --insecure-plaintext,
//! and counts a plaintext client as a `tls` refusal.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stoker_client::{Dial, Discovery, Error, Loader, LoaderConfig};
use stoker_config::WorkerConfig;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::http;
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};
use stoker_testkit::tls::serve_tls;
use stoker_tls::issue::Authority;
use stoker_tls::{ClientTls, ServerTls};
use stoker_worker::connection::Connection;
use tokio::io::AsyncReadExt;

mod common;
use common::STOKER;

const TOKEN: &str = "s3cret-token";
const SAMPLES: usize = 24;

/// A local synthetic dataset and a worker configuration serving it with `TOKEN`.
fn dataset(root: &std::path::Path) -> WorkerConfig {
    let o = SynthOptions {
        samples: SAMPLES,
        format: SynthFormat::Messages,
        samples_per_shard: 12,
        min_side: 64,
        max_side: 200,
        ..SynthOptions::default()
    };
    generate(&root.join("data"), &o, &|| {}).unwrap();
    std::fs::write(root.join("token"), TOKEN).unwrap();
    let mut cfg = WorkerConfig {
        data: root.join("data").display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.sampling.global_batch_size = 4;
    cfg.concurrency.cpu_threads = Some(1);
    cfg.serving.token_file = Some(root.join("token").display().to_string());
    cfg
}

/// Listens on loopback and keeps every byte any peer sends (TLS-decrypted when `tls` is
/// given, for a server that completes the handshake); its address.
async fn impostor(tls: Option<ServerTls>, heard: Arc<Mutex<Vec<u8>>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (tls, heard) = (tls.clone(), heard.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let keep = |n: &[u8]| heard.lock().unwrap().extend_from_slice(n);
                match tls {
                    None => {
                        let mut tcp = tcp;
                        while let Ok(n @ 1..) = tcp.read(&mut buf).await {
                            keep(&buf[..n]);
                        }
                    }
                    Some(tls) => {
                        if let Ok(mut s) = tls.accept(tcp).await {
                            while let Ok(n @ 1..) = s.read(&mut buf).await {
                                keep(&buf[..n]);
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A worker of `dataset` serving TLS with a certificate for `name`, and what a rank trusts.
fn tls_worker(root: &std::path::Path, name: &str) -> (LocalWorker, ClientTls) {
    let mut cfg = dataset(root);
    let trust = serve_tls(&root.join("tls"), &[name], &mut cfg).unwrap();
    (
        LocalWorker::spawn(STOKER.as_ref(), &cfg, &[]).unwrap(),
        trust,
    )
}

#[test]
fn impostors_beside_a_real_worker_never_receive_the_token() {
    let root = tempfile::tempdir().unwrap();
    let (w, trust) = tls_worker(root.path(), "127.0.0.1");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let (plain_heard, tls_heard) = (Arc::default(), Arc::default());
    // The impostor with TLS holds a certificate for the very name the rank dials, from a CA
    // of its own (anyone may make one).
    let rogue = Authority::new("rogue", Duration::from_secs(3600)).unwrap();
    let rogue = rogue
        .issue(&["127.0.0.1".into()], Duration::from_secs(3600))
        .unwrap();
    let rogue = ServerTls::from_pem(rogue.cert_pem.as_bytes(), rogue.key_pem.as_bytes()).unwrap();
    let plain = rt.block_on(impostor(None, Arc::clone(&plain_heard)));
    let tls = rt.block_on(impostor(Some(rogue), Arc::clone(&tls_heard)));

    let workers = vec![plain, w.addr.clone(), tls];
    let mut c = LoaderConfig::new(Discovery::Static(workers), 0, 1);
    c.dial = Some(Dial::Tls(trust));
    c.token = TOKEN.into();
    c.no_worker_timeout = Duration::from_secs(30);
    let mut loader = Loader::new(c).unwrap();
    let mut ids = Vec::new();
    while let Some(b) = loader.next_batch().unwrap() {
        assert_eq!(b.worker, w.addr, "a batch from an impostor");
        ids.extend(b.sample_ids.iter().copied());
    }
    let once: BTreeSet<u64> = ids.iter().copied().collect();
    assert_eq!((ids.len(), once.len()), (SAMPLES, SAMPLES), "{ids:?}");
    drop(loader);

    let plain_heard = plain_heard.lock().unwrap();
    // The rank did dial it (a TLS ClientHello: record type 22), and sent nothing else.
    assert_eq!(plain_heard.first(), Some(&22), "{plain_heard:?}");
    assert!(!contains(&plain_heard, TOKEN.as_bytes()));
    // The TLS impostor never completed a handshake, so it read nothing at all.
    assert!(tls_heard.lock().unwrap().is_empty());
}

#[test]
fn a_worker_certificate_for_another_name_is_refused_by_name() {
    let root = tempfile::tempdir().unwrap();
    let (w, trust) = tls_worker(root.path(), "other.example");
    let mut c = LoaderConfig::new(Discovery::Static(vec![w.addr.clone()]), 0, 1);
    c.dial = Some(Dial::Tls(trust.clone()));
    c.token = TOKEN.into();
    c.no_worker_timeout = Duration::from_secs(3);
    let e = Loader::new(c).err().expect("refused");
    assert!(matches!(e, Error::NoWorker { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains(&w.addr)
            && e.contains("TLS with the worker as 127.0.0.1")
            && e.contains("not valid for name \"127.0.0.1\"")
            && e.contains("other.example"),
        "{e}"
    );

    // The same worker, dialled under the name its certificate holds, serves.
    let mut c = LoaderConfig::new(Discovery::Static(vec![w.addr.clone()]), 0, 1);
    c.dial = Some(Dial::Tls(trust.with_server_name("other.example").unwrap()));
    c.token = TOKEN.into();
    assert!(Loader::new(c).unwrap().next_batch().unwrap().is_some());
}

#[test]
fn plaintext_is_only_ever_asked_for() {
    let root = tempfile::tempdir().unwrap();
    let cfg = dataset(root.path());
    // Neither certificates nor --insecure-plaintext: the worker does not start.
    let out = std::process::Command::new(&*STOKER)
        .arg("worker")
        .args(cfg.to_args())
        .env_remove("STOKER_TLS_CERT")
        .env_remove("STOKER_TLS_KEY")
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && why.contains("no TLS certificate")
            && why.contains("--insecure-plaintext"),
        "{why}"
    );

    // A loader given no CA bundle and no plaintext does not start either.
    let mut c = LoaderConfig::new(Discovery::Static(vec!["127.0.0.1:9".into()]), 0, 1);
    c.dial = None;
    if std::env::var_os(stoker_client::CA_ENV).is_none() {
        let e = Loader::new(c).err().expect("refused").to_string();
        assert!(
            e.contains("no CA bundle") && e.contains("STOKER_TLS_CA"),
            "{e}"
        );
    }

    // A plaintext client at a TLS worker is refused and counted.
    let mut cfg = cfg;
    serve_tls(&root.path().join("tls"), &["127.0.0.1"], &mut cfg).unwrap();
    let w = LocalWorker::spawn(STOKER.as_ref(), &cfg, &[]).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), Connection::open(&w.addr, TOKEN)).await
    });
    assert!(
        !matches!(r, Ok(Ok(Ok(_)))),
        "a plaintext Hello was answered"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let m = http::get_ok(&w.metrics_addr, "/metrics").unwrap();
        let refused = metric_value_with(
            &m,
            "stoker_worker_requests_refused_total",
            &[("reason", "tls")],
        );
        if refused == Some(1.0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
