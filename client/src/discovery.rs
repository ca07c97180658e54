//! Where the workers are: a fixed list, a DNS name re-resolved periodically (a Kubernetes
//! headless Service resolves to every ready worker pod), or a list pushed by the embedding
//! program (the demo's process backend). Every source feeds one `watch` of address sets, so
//! workers that appear or vanish are picked up without a restart.

use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::watch;

pub type WorkerSet = BTreeSet<String>;

pub enum Discovery {
    /// `host:port` addresses, fixed for the loader's life.
    Static(Vec<String>),
    /// `host:port` resolved to every address behind it, again every `every`.
    Dns { name: String, every: Duration },
    /// Sets pushed by the caller.
    Watch(watch::Receiver<WorkerSet>),
}

impl Discovery {
    /// `dns:HOST:PORT` (re-resolved every 5 s) or a comma-separated list of `HOST:PORT`.
    pub fn parse(spec: &str) -> crate::Result<Discovery> {
        let ensure = |ok: bool, why: String| {
            if ok {
                Ok(())
            } else {
                Err(crate::Error::Config(why))
            }
        };
        if let Some(name) = spec.strip_prefix("dns:") {
            ensure(
                name.rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()),
                format!("worker discovery {spec:?}: expected dns:HOST:PORT"),
            )?;
            return Ok(Discovery::Dns {
                name: name.into(),
                every: Duration::from_secs(5),
            });
        }
        let list: Vec<String> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        ensure(
            !list.is_empty(),
            "worker discovery: no worker addresses given".into(),
        )?;
        for a in &list {
            ensure(
                a.rsplit_once(':')
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok()),
                format!("worker address {a:?}: expected HOST:PORT"),
            )?;
        }
        Ok(Discovery::Static(list))
    }

    /// Starts the source on the current runtime; the receiver sees every change.
    pub(crate) fn start(&self) -> watch::Receiver<WorkerSet> {
        match self {
            Discovery::Static(list) => {
                let (tx, rx) = watch::channel(list.iter().cloned().collect());
                // Keep the sender alive: a closed watch would read as "no workers".
                tokio::spawn(async move { tx.closed().await });
                rx
            }
            Discovery::Watch(rx) => rx.clone(),
            Discovery::Dns { name, every } => {
                let (name, every) = (name.clone(), *every);
                let (tx, rx) = watch::channel(WorkerSet::new());
                tokio::spawn(async move {
                    loop {
                        match tokio::net::lookup_host(&name).await {
                            Ok(addrs) => {
                                let set: WorkerSet = addrs.map(|a| a.to_string()).collect();
                                tx.send_if_modified(|cur| {
                                    let changed = *cur != set;
                                    *cur = set;
                                    changed
                                });
                            }
                            // Keep the last answer: a DNS hiccup must not drop live workers.
                            Err(e) => tracing::warn!("resolving workers at {name}: {e}"),
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(every) => {}
                            _ = tx.closed() => return,
                        }
                    }
                });
                rx
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_dns() {
        match Discovery::parse("a:1, b:2").unwrap() {
            Discovery::Static(l) => assert_eq!(l, vec!["a:1", "b:2"]),
            _ => panic!("expected a static list"),
        }
        assert!(matches!(
            Discovery::parse("dns:workers.ns.svc:7700").unwrap(),
            Discovery::Dns { .. }
        ));
        for bad in ["", "a", "dns:host", "a:b", "dns::80"] {
            assert!(Discovery::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[tokio::test]
    async fn dns_resolves_and_follows_changes() {
        let rx = Discovery::Dns {
            name: "localhost:7700".into(),
            every: Duration::from_millis(10),
        }
        .start();
        let mut rx = rx;
        rx.wait_for(|s| !s.is_empty()).await.unwrap();
        assert!(rx.borrow().iter().all(|a| a.ends_with(":7700")));
    }
}
