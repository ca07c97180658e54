//! Where the autoscaler's numbers come from: the trainer clients' /metrics (pods by label, or
//! fixed URLs), or a Prometheus server. Plain HTTP/1.0 over tokio: the endpoints are ours
//! (or Prometheus), all speak it, and the operator needs no HTTP client stack for it.

use crate::cache::TrainerPods;
use crate::crd::{DataPipeline, MetricSource};
use kube::ResourceExt;
use std::net::IpAddr;
use std::time::Duration;
use stoker_control::autoscale::{Observation, RankCounters};
use stoker_control::exposition::rank_counters;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on a response body: a rank's /metrics page is ~5 KiB whatever the workers; a
/// Prometheus answer of one number per rank at 4,096 ranks is ~0.5 MiB.
const MAX_BODY: usize = 4 << 20;
/// Ranks read at once by the direct scrape: 4,096 ranks' pages (~20 MiB) are read 64 at a
/// time, not all at once.
const SCRAPE_CONCURRENCY: usize = 64;
/// A round of the direct scrape ends by then; ranks not read by then count as unreadable
/// (the decision needs 95 % of them), so a few black holes cannot stall it.
const ROUND_DEADLINE: Duration = Duration::from_secs(20);

/// The longest metric URL the operator reads.
pub const MAX_URL_LEN: usize = 2048;

/// Why the operator will not read `url`, if it will not: it speaks plain `http://` (what the
/// trainer client and Prometheus serve), and whitespace or a control character would end the
/// request line and add headers of the URL's author to it.
pub fn url_problem(url: &str) -> Option<&'static str> {
    if !url.starts_with("http://") {
        Some("is not an http:// URL")
    } else if url.len() > MAX_URL_LEN {
        Some("is longer than 2048 bytes")
    } else if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains whitespace or a control character")
    } else {
        None
    }
}

/// Whether a metric source may be at `ip`: never a link-local address (the cloud's metadata
/// service at 169.254.169.254 answers there with the node's credentials), the unspecified
/// address or a multicast group, whatever name resolved to it.
fn may_connect_to(ip: IpAddr) -> bool {
    let link_local = match ip.to_canonical() {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !(link_local || ip.is_unspecified() || ip.is_multicast())
}

/// GET an `http://host:port/path?query` URL; the body on 200, an error naming the URL
/// otherwise. The host is resolved here and the connection made to an address that passed
/// [`may_connect_to`], so a name cannot resolve to another address between check and use.
pub async fn http_get(url: &str) -> anyhow::Result<String> {
    if let Some(problem) = url_problem(url) {
        anyhow::bail!("{url:?} {problem}");
    }
    let rest = &url["http://".len()..];
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let has_port = authority.rsplit_once(':').is_some_and(|(host, port)| {
        !port.is_empty()
            && port.bytes().all(|b| b.is_ascii_digit())
            && (!host.starts_with('[') || host.ends_with(']'))
    });
    let target = if has_port {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let fetch = async {
        let mut resolved = tokio::net::lookup_host(&target).await?;
        let addr = resolved.find(|a| may_connect_to(a.ip())).ok_or_else(|| {
            anyhow::anyhow!(
                "{authority} is only at link-local, unspecified or multicast addresses: refused"
            )
        })?;
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").as_bytes())
            .await?;
        let mut out = Vec::new();
        s.take(MAX_BODY as u64).read_to_end(&mut out).await?;
        anyhow::Ok(out)
    };
    let raw = tokio::time::timeout(TIMEOUT, fetch)
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer within {TIMEOUT:?}"))??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("{url}: not an HTTP response"))?;
    let status = head.split_whitespace().nth(1).unwrap_or("");
    anyhow::ensure!(status == "200", "{url}: HTTP {status}");
    Ok(body.to_string())
}

/// One reading of every rank: keyed by where it came from, so consecutive readings pair up
/// even when trainer pods come and go.
pub type RankReading = Vec<(String, Option<RankCounters>)>;

/// What a metric source gives: every rank's counters (the direct scrape; two readings make
/// an observation), or the observation itself, aggregated by Prometheus.
#[derive(Debug, Clone, PartialEq)]
pub enum Reading {
    Ranks(RankReading),
    /// Over the last interval: (worst wait ratio, mean, samples/s consumed, ranks reporting,
    /// ranks), or `None` when Prometheus has no trainer series for the pipeline.
    Aggregated(Option<Aggregate>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Aggregate {
    pub worst_wait_ratio: f64,
    pub mean_wait_ratio: f64,
    pub consumed_per_s: f64,
    pub ranks_reporting: u32,
    pub ranks: u32,
}

impl Reading {
    /// The observation from this reading and the one before (if the source needs two).
    pub fn observation(&self, before: Option<&Reading>, ready: u32) -> Option<Observation> {
        match (self, before) {
            (Reading::Aggregated(a), _) => {
                let a = (*a)?;
                Observation::of_ranks(
                    a.worst_wait_ratio,
                    a.mean_wait_ratio,
                    a.consumed_per_s,
                    (a.ranks_reporting, a.ranks),
                    ready,
                )
            }
            (Reading::Ranks(after), Some(Reading::Ranks(before))) => {
                let (b, a) = paired(before, after);
                Observation::between(&b, &a, ready)
            }
            _ => None,
        }
    }
}

/// Reads the ranks' counters from the pipeline's metric source.
pub async fn read(
    trainers: &TrainerPods,
    dp: &DataPipeline,
    source: &MetricSource,
) -> anyhow::Result<Reading> {
    let urls: Vec<String> = if let Some(urls) = &source.urls {
        urls.clone()
    } else if let (Some(pods), Some((ns, selector))) = (&source.trainer_pods, trainer_pods_of(dp)) {
        let port = pods.port;
        let running = (trainers.running(&ns, &selector).await).ok_or_else(|| {
            anyhow::anyhow!("the watch of trainer pods {selector} in {ns} has not listed yet")
        })?;
        running
            .iter()
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .map(|ip| format!("http://{ip}:{port}/metrics"))
            .collect()
    } else if let Some(prom) = &source.prometheus {
        let ns = dp.namespace().unwrap_or_default();
        let window = dp
            .spec
            .autoscaling
            .as_ref()
            .map_or(60, |a| a.interval_seconds.max(30));
        let agg = read_prometheus(&prom.url, &ns, &dp.name_any(), window).await?;
        return Ok(Reading::Aggregated(agg));
    } else {
        anyhow::bail!("no metric source (rejected at admission)")
    };
    Ok(Reading::Ranks(scrape_all(urls, ROUND_DEADLINE).await))
}

/// The (namespace, label selector) of the trainer pods `dp` scrapes, if it scrapes pods.
pub fn trainer_pods_of(dp: &DataPipeline) -> Option<(String, String)> {
    let pods = dp
        .spec
        .autoscaling
        .as_ref()?
        .metrics
        .trainer_pods
        .as_ref()?;
    let ns = dp.namespace().unwrap_or_else(|| "default".into());
    Some((ns, crate::labels::label_selector_string(&pods.selector)))
}

/// Every URL's counters, [`SCRAPE_CONCURRENCY`] at a time, within `round` (unread by then:
/// unreadable); in the order of `urls`.
async fn scrape_all(urls: Vec<String>, round: Duration) -> RankReading {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + round;
    // Unordered: a rank that never answers holds one of the slots, not the ones behind it.
    let mut reading: Vec<(usize, (String, Option<RankCounters>))> = futures::stream::iter(urls)
        .enumerate()
        .map(|(i, u)| async move {
            let read = tokio::time::timeout_at(deadline, http_get(&u));
            let counters = match read.await {
                Ok(Ok(text)) => rank_counters(&text),
                Ok(Err(e)) => {
                    tracing::debug!("scrape {u}: {e:#}");
                    None
                }
                Err(_) => {
                    tracing::debug!("scrape {u}: the round's {round:?} ran out");
                    None
                }
            };
            (i, (u, counters))
        })
        .buffer_unordered(SCRAPE_CONCURRENCY)
        .collect()
        .await;
    reading.sort_unstable_by_key(|(i, _)| *i);
    reading.into_iter().map(|(_, r)| r).collect()
}

/// The observation, aggregated by Prometheus over the last `window_s` seconds: five
/// instant queries of one number each, whatever the ranks (rates per rank summed over their
/// other labels, ranks that neither stepped nor waited left out). The pipeline label is
/// unique only within a namespace, so both select.
async fn read_prometheus(
    base: &str,
    namespace: &str,
    pipeline: &str,
    window_s: i32,
) -> anyhow::Result<Option<Aggregate>> {
    let sel = format!("{{namespace=\"{namespace}\",pipeline=\"{pipeline}\"}}");
    let rate = |name: &str| format!("sum by (rank) (rate({name}{sel}[{window_s}s]))");
    let (wait, step) = (
        rate("stoker_trainer_wait_seconds_total"),
        rate("stoker_trainer_step_seconds_total"),
    );
    let ratio = format!("(({wait}) / ((({wait}) + ({step})) > 0))");
    let queries = [
        format!("max({ratio})"),
        format!("avg({ratio})"),
        format!("sum({})", rate("stoker_trainer_samples_total")),
        format!("count({ratio})"),
        format!("count(count by (rank) (stoker_trainer_wait_seconds_total{sel}))"),
    ];
    let mut values = [0.0f64; 5];
    for (v, query) in values.iter_mut().zip(&queries) {
        let url = format!(
            "{}/api/v1/query?query={}",
            base.trim_end_matches('/'),
            percent_encode(query)
        );
        let body: serde_json::Value = serde_json::from_str(&http_get(&url).await?)?;
        let result = body["data"]["result"].as_array();
        // An empty vector: no such series (no trainer has reported yet).
        let Some(first) = result.and_then(|r| r.first()) else {
            return Ok(None);
        };
        *v = first["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| anyhow::anyhow!("{url}: no number in {first}"))?;
    }
    let [worst, mean, consumed, seen, ranks] = values;
    Ok(Some(Aggregate {
        worst_wait_ratio: worst,
        mean_wait_ratio: mean,
        consumed_per_s: consumed,
        ranks_reporting: seen as u32,
        ranks: ranks as u32,
    }))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Pairs two readings by source; sources present in only one are unreadable for this
/// interval (a new or vanished rank).
fn paired(
    before: &RankReading,
    after: &RankReading,
) -> (Vec<Option<RankCounters>>, Vec<Option<RankCounters>>) {
    after
        .iter()
        .map(|(k, a)| {
            let b = before.iter().find(|(kb, _)| kb == k).and_then(|(_, c)| *c);
            (b, *a)
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// 4,096 ranks are read a bounded number at a time, and a rank that accepts but never
    /// answers costs the round its deadline, not the decision: it is unreadable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_is_bounded_in_concurrency_and_time() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (o, m) = (open.clone(), most.clone());
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let (o, m) = (o.clone(), m.clone());
                tokio::spawn(async move {
                    m.fetch_max(o.fetch_add(1, SeqCst) + 1, SeqCst);
                    let mut buf = [0u8; 1024];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if String::from_utf8_lossy(&buf[..n]).starts_with("GET /hole ") {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let body = "stoker_trainer_wait_seconds_total 1\nstoker_trainer_step_seconds_total 9\nstoker_trainer_samples_total 64\n";
                    let _ = s
                        .write_all(format!("HTTP/1.0 200 OK\r\n\r\n{body}").as_bytes())
                        .await;
                    o.fetch_sub(1, SeqCst);
                });
            }
        });
        let mut urls: Vec<String> = (0..300)
            .map(|i| format!("http://{addr}/metrics?r={i}"))
            .collect();
        urls[7] = format!("http://{addr}/hole");
        let reading = scrape_all(urls.clone(), Duration::from_secs(2)).await;
        assert_eq!(
            reading.iter().map(|(u, _)| u.clone()).collect::<Vec<_>>(),
            urls
        );
        let unread: Vec<usize> = (0..300).filter(|&i| reading[i].1.is_none()).collect();
        assert_eq!(unread, [7], "only the black hole is unreadable");
        let most = most.load(SeqCst);
        assert!(most <= SCRAPE_CONCURRENCY + 1, "{most} connections at once");
    }

    #[tokio::test]
    async fn reads_counters_over_http_and_names_failures() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let body = "stoker_trainer_wait_seconds_total{rank=\"0\"} 1.5\nstoker_trainer_step_seconds_total{rank=\"0\"} 8.5\nstoker_trainer_samples_total{rank=\"0\"} 640\n";
                let resp = if req.starts_with("GET /metrics ") {
                    format!("HTTP/1.0 200 OK\r\n\r\n{body}")
                } else {
                    "HTTP/1.0 404 Not Found\r\n\r\n".to_string()
                };
                s.write_all(resp.as_bytes()).await.unwrap();
            }
        });
        let text = http_get(&format!("http://{addr}/metrics")).await.unwrap();
        assert_eq!(
            rank_counters(&text),
            Some(RankCounters {
                wait_s: 1.5,
                step_s: 8.5,
                samples: 640.0
            })
        );
        let e = http_get(&format!("http://{addr}/nope")).await.unwrap_err();
        assert!(e.to_string().contains("HTTP 404"), "{e}");
        let e = http_get("https://x").await.unwrap_err();
        assert!(e.to_string().contains("is not an http:// URL"), "{e}");
    }

    /// A URL's author cannot add headers to the request, nor point the operator at the
    /// metadata service, by address or by a name that resolves to it.
    #[tokio::test]
    async fn no_headers_from_the_url_and_no_link_local_target() {
        let injected = "http://127.0.0.1:9/metrics HTTP/1.0\r\nX-Injected: 1\r\n";
        let e = http_get(injected).await.unwrap_err().to_string();
        assert!(
            e.contains("contains whitespace or a control character"),
            "{e}"
        );
        let long = format!("http://127.0.0.1:9/{}", "a".repeat(MAX_URL_LEN));
        let e = http_get(&long).await.unwrap_err().to_string();
        assert!(e.contains("is longer than 2048 bytes"), "{e}");
        for target in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fe80::1]:80/metrics",
            "http://[::ffff:169.254.169.254]/",
            "http://0.0.0.0:9090/metrics",
        ] {
            let e = http_get(target).await.unwrap_err().to_string();
            assert!(e.contains("refused"), "{target}: {e}");
        }
        assert!(may_connect_to("10.1.2.3".parse().unwrap()));
        assert!(may_connect_to("127.0.0.1".parse().unwrap()));
    }

    /// A stand-in for the Prometheus HTTP API: answers the five instant queries with one
    /// number each; the observation follows (97 of 100 ranks reporting is enough).
    #[tokio::test]
    async fn reads_an_aggregated_observation_from_prometheus() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap();
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                assert!(
                    req.contains("namespace%3D%22ml%22%2Cpipeline%3D%22sft%22"),
                    "{req}"
                );
                assert!(
                    req.contains("%5B60s%5D") || req.contains("count%28count"),
                    "{req}"
                );
                let v = if req.contains("query=max") {
                    "0.25"
                } else if req.contains("query=avg") {
                    "0.1"
                } else if req.contains("query=sum") {
                    "970"
                } else if req.contains("query=count%28count") {
                    "100"
                } else {
                    "97"
                };
                let body = format!(
                    r#"{{"status":"success","data":{{"resultType":"vector","result":[{{"metric":{{}},"value":[1,"{v}"]}}]}}}}"#
                );
                s.write_all(format!("HTTP/1.0 200 OK\r\n\r\n{body}").as_bytes())
                    .await
                    .unwrap();
            }
        });
        let got = read_prometheus(&format!("http://{addr}/"), "ml", "sft", 60)
            .await
            .unwrap();
        let reading = Reading::Aggregated(got);
        let o = reading.observation(None, 4).unwrap();
        assert_eq!((o.ranks_reporting, o.ranks, o.ready_workers), (97, 100, 4));
        assert_eq!((o.worst_wait_ratio, o.mean_wait_ratio), (0.25, 0.1));
        assert!((o.consumed_per_s - 1000.0).abs() < 1e-9);
        // 94 of 100: hold.
        let few = Reading::Aggregated(got.map(|a| Aggregate {
            ranks_reporting: 94,
            ..a
        }));
        assert_eq!(few.observation(None, 4), None);
    }

    #[test]
    fn readings_pair_by_source() {
        let c = |w| {
            Some(RankCounters {
                wait_s: w,
                step_s: 1.0,
                samples: 1.0,
            })
        };
        let before = vec![("a".to_string(), c(1.0)), ("b".to_string(), c(2.0))];
        let after = vec![("b".to_string(), c(3.0)), ("c".to_string(), c(4.0))];
        let (b, a) = paired(&before, &after);
        assert_eq!(b, vec![c(2.0), None]);
        assert_eq!(a, vec![c(3.0), c(4.0)]);
        assert_eq!(percent_encode("a b{}"), "a%20b%7B%7D");
    }
}
