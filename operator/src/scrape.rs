//! Where the autoscaler's numbers come from: the trainer clients' /metrics (pods by label, or
//! fixed URLs), or a Prometheus server, read over HTTP/1.1 with hyper's client.

use crate::cache::TrainerPods;
use crate::crd::{DataPipeline, MetricSource};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use kube::ResourceExt;
use std::net::IpAddr;
use std::time::Duration;
use stoker_control::autoscale::{Observation, RankCounters};
use stoker_control::exposition::rank_counters;
use tokio::sync::{Semaphore, SemaphorePermit};

const TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on a response body: a rank's /metrics page is ~5 KiB whatever the workers; a
/// Prometheus answer of one number per rank at 4,096 ranks is ~0.5 MiB.
const MAX_BODY: usize = 4 << 20;
/// Bound on the bodies held at once by every scrape of every pipeline: a round of 64 rank pages
/// is ~0.4 MiB, so 16 MiB is spent only by pages far larger than ours (or by a hostile
/// endpoint), and then the scrapes that find it spent fail instead of waiting.
const MEMORY_BUDGET: usize = 16 << 20;
/// Bound on the bytes of a response's head (status line and headers), per connection.
const MAX_HEAD: usize = 16 << 10;
/// Ranks read at once by the direct scrape: 4,096 ranks' pages (~20 MiB) are read 64 at a
/// time, not all at once.
const SCRAPE_CONCURRENCY: usize = 64;
/// A round of the direct scrape ends by then; ranks not read by then count as unreadable
/// (the decision needs 95 % of them), so a few black holes cannot stall it.
const ROUND_DEADLINE: Duration = Duration::from_secs(20);

/// The longest metric URL the operator reads.
pub const MAX_URL_LEN: usize = 2048;

/// Why the operator will not read `url`, if it will not: its form ([`parse`]), or an IP
/// literal (or `localhost`) that [`may_connect_to`] refuses; names are checked when the
/// scrape resolves them.
pub fn url_problem(url: &str) -> Option<&'static str> {
    let uri = match parse(url) {
        Ok(uri) => uri,
        Err(problem) => return Some(problem),
    };
    let host = bare_host(&uri);
    let refused =
        host.eq_ignore_ascii_case("localhost") || host.parse().is_ok_and(|ip| !may_connect_to(ip));
    refused.then_some("names a loopback, link-local, unspecified or multicast address")
}

/// `url` as one the scrape can send, or why not: it speaks plain `http://` (what the trainer
/// client and Prometheus serve) to a host; whitespace or a control character would end the
/// request line and add headers of the URL's author to it.
fn parse(url: &str) -> Result<http::Uri, &'static str> {
    if !url.starts_with("http://") {
        return Err("is not an http:// URL");
    } else if url.len() > MAX_URL_LEN {
        return Err("is longer than 2048 bytes");
    } else if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace or a control character");
    }
    let not_a_host = "is not an http://host[:port]/path URL without user info";
    let uri: http::Uri = url.parse().map_err(|_| not_a_host)?;
    let without_user = uri.authority().is_some_and(|a| !a.as_str().contains('@'));
    let host = uri.host().is_some_and(|h| !h.is_empty());
    if without_user && host {
        Ok(uri)
    } else {
        Err(not_a_host)
    }
}

/// The host of `uri` as the resolver takes it: an IPv6 literal without its brackets.
fn bare_host(uri: &http::Uri) -> &str {
    let host = uri.host().unwrap_or_default();
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Whether a metric source may be at `ip`: never loopback (the operator's own pod, or the
/// node when it runs in the host's network), a link-local address (the cloud's metadata
/// service at 169.254.169.254 answers there with the node's credentials), the unspecified
/// address or a multicast group, whatever name resolved to it.
fn may_connect_to(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !(link_local || ip.is_loopback() || ip.is_unspecified() || ip.is_multicast())
}

/// How the operator reads metric URLs: where it may connect, and the memory every response
/// body held at once may take, whichever pipeline's scrape holds it.
pub struct Scraper {
    may_connect: fn(IpAddr) -> bool,
    memory: Semaphore,
    memory_budget: usize,
}

/// The operator's one scraper.
static SCRAPER: Scraper = Scraper {
    may_connect: may_connect_to,
    memory: Semaphore::const_new(MEMORY_BUDGET),
    memory_budget: MEMORY_BUDGET,
};

/// A response body, holding its share of the scrapes' memory budget while it lives.
#[derive(Debug)]
pub struct Page<'a> {
    text: String,
    _held: SemaphorePermit<'a>,
}

impl std::ops::Deref for Page<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

impl Scraper {
    /// GET an `http://host[:port]/path?query` URL; the body on 200, an error naming the URL
    /// otherwise. The host is resolved here and the connection made to an address that
    /// passed `may_connect`, so a name cannot resolve to another address between check and
    /// use; the body is taken from the memory budget as it arrives.
    pub async fn get(&self, url: &str) -> anyhow::Result<Page<'_>> {
        let uri = parse(url).map_err(|problem| anyhow::anyhow!("{url:?} {problem}"))?;
        tokio::time::timeout(TIMEOUT, self.exchange(&uri))
            .await
            .map_err(|_| anyhow::anyhow!("{url}: no answer within {TIMEOUT:?}"))?
            .map_err(|e| anyhow::anyhow!("{url}: {e:#}"))
    }

    async fn exchange(&self, uri: &http::Uri) -> anyhow::Result<Page<'_>> {
        let host = uri.host().unwrap_or_default();
        let port = uri.port_u16().unwrap_or(80);
        let mut resolved = tokio::net::lookup_host((bare_host(uri), port)).await?;
        let addr = resolved.find(|a| (self.may_connect)(a.ip())).ok_or_else(|| {
            anyhow::anyhow!(
                "{host} is only at loopback, link-local, unspecified or multicast addresses: refused"
            )
        })?;
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await?;
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or(host);
        let request = http::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(http::header::HOST, authority)
            .header(http::header::CONNECTION, "close")
            .body(Empty::<Bytes>::new())?;
        let read = async move {
            let response = sender.send_request(request).await?;
            let status = response.status();
            anyhow::ensure!(status == http::StatusCode::OK, "HTTP {}", status.as_u16());
            self.body(response.into_body()).await
        };
        // The connection is driven beside the exchange and dropped (closed) once the page
        // is read; if it ends first, what it delivered is still read.
        tokio::pin!(read);
        tokio::select! {
            biased;
            page = &mut read => page,
            ended = connection => {
                ended?;
                read.await
            }
        }
    }

    /// The body, within [`MAX_BODY`] and the memory budget: what the buffer will hold is
    /// paid for before it grows (to the announced length, else doubling as frames come).
    async fn body(&self, mut body: hyper::body::Incoming) -> anyhow::Result<Page<'_>> {
        let too_long = || anyhow::anyhow!("the body is longer than {MAX_BODY} bytes");
        let announced = hyper::body::Body::size_hint(&body).lower();
        let announced = usize::try_from(announced)
            .ok()
            .filter(|&n| n <= MAX_BODY)
            .ok_or_else(too_long)?;
        let mut held = self.memory.try_acquire_many(0)?;
        let mut bytes = Vec::new();
        let mut grow = |bytes: &mut Vec<u8>, to: usize| {
            let more = u32::try_from(to - bytes.capacity()).expect("within MAX_BODY");
            let paid = self.memory.try_acquire_many(more).map_err(|_| {
                anyhow::anyhow!(
                    "the scrapes' memory budget ({} bytes at once) is spent: not read",
                    self.memory_budget
                )
            })?;
            held.merge(paid);
            bytes.reserve_exact(to - bytes.len());
            anyhow::Ok(())
        };
        grow(&mut bytes, announced)?;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else {
                continue; // trailers
            };
            let needed = bytes.len() + data.len();
            if needed > MAX_BODY {
                return Err(too_long());
            }
            if needed > bytes.capacity() {
                let to = needed.max(2 * bytes.capacity()).min(MAX_BODY);
                grow(&mut bytes, to)?;
            }
            bytes.extend_from_slice(&data);
        }
        let text =
            String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("the body is not UTF-8"))?;
        Ok(Page { text, _held: held })
    }
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
        let agg = read_prometheus(&SCRAPER, &prom.url, &ns, &dp.name_any(), window).await?;
        return Ok(Reading::Aggregated(agg));
    } else {
        anyhow::bail!("no metric source (rejected at admission)")
    };
    Ok(Reading::Ranks(
        scrape_all(&SCRAPER, urls, ROUND_DEADLINE).await,
    ))
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
async fn scrape_all(scraper: &Scraper, urls: Vec<String>, round: Duration) -> RankReading {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + round;
    // Unordered: a rank that never answers holds one of the slots, not the ones behind it.
    let mut reading: Vec<(usize, (String, Option<RankCounters>))> = futures::stream::iter(urls)
        .enumerate()
        .map(|(i, u)| async move {
            let read = tokio::time::timeout_at(deadline, scraper.get(&u));
            let counters = match read.await {
                Ok(Ok(page)) => rank_counters(&page),
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
    scraper: &Scraper,
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
        let body: serde_json::Value = serde_json::from_str(&scraper.get(&url).await?)?;
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
/// interval (a new or vanished rank). One pass over each (a search of `before` per rank was
/// O(R²): 316 ms at 16,384 ranks, under the scaler's lock).
fn paired(
    before: &RankReading,
    after: &RankReading,
) -> (Vec<Option<RankCounters>>, Vec<Option<RankCounters>>) {
    let mut first = std::collections::HashMap::with_capacity(before.len());
    for (k, c) in before {
        first.entry(k.as_str()).or_insert(*c); // a source listed twice: its first reading
    }
    after
        .iter()
        .map(|(k, a)| (first.get(k.as_str()).copied().flatten(), *a))
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A scraper like the operator's, that reads the tests' stand-ins on loopback only, with
    /// `budget` bytes of memory for bodies.
    fn loopback_scraper(budget: usize) -> Scraper {
        Scraper {
            may_connect: |ip| ip.is_loopback(),
            memory: Semaphore::new(budget),
            memory_budget: budget,
        }
    }

    /// A stand-in HTTP server on loopback: each connection's request (its first read) is
    /// answered with `answer(request)`, then closed.
    async fn stand_in(answer: fn(&str) -> Vec<u8>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let _ = s
                        .write_all(&answer(&String::from_utf8_lossy(&buf[..n])))
                        .await;
                });
            }
        });
        addr
    }

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
        let scraper = loopback_scraper(MEMORY_BUDGET);
        let reading = scrape_all(&scraper, urls.clone(), Duration::from_secs(2)).await;
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
        let addr = stand_in(|req| {
            let body = "stoker_trainer_wait_seconds_total{rank=\"0\"} 1.5\nstoker_trainer_step_seconds_total{rank=\"0\"} 8.5\nstoker_trainer_samples_total{rank=\"0\"} 640\n";
            if req.starts_with("GET /metrics ") {
                format!("HTTP/1.0 200 OK\r\n\r\n{body}").into_bytes()
            } else {
                b"HTTP/1.0 404 Not Found\r\n\r\n".to_vec()
            }
        })
        .await;
        let scraper = loopback_scraper(MEMORY_BUDGET);
        let page = scraper
            .get(&format!("http://{addr}/metrics"))
            .await
            .unwrap();
        assert_eq!(
            rank_counters(&page),
            Some(RankCounters {
                wait_s: 1.5,
                step_s: 8.5,
                samples: 640.0
            })
        );
        let e = scraper
            .get(&format!("http://{addr}/nope"))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("HTTP 404"), "{e}");
        let e = scraper.get("https://x").await.unwrap_err();
        assert!(e.to_string().contains("is not an http:// URL"), "{e}");
    }

    /// A URL's author cannot add headers to the request, nor point the operator at itself
    /// or the metadata service, by address (refused at admission and by the scrape) or by a
    /// name that resolves to one (refused by the scrape).
    #[tokio::test]
    async fn no_headers_from_the_url_and_no_loopback_or_link_local_target() {
        let injected = "http://10.0.0.1:9/metrics HTTP/1.0\r\nX-Injected: 1\r\n";
        assert_eq!(
            url_problem(injected),
            Some("contains whitespace or a control character")
        );
        let e = SCRAPER.get(injected).await.unwrap_err().to_string();
        assert!(
            e.contains("contains whitespace or a control character"),
            "{e}"
        );
        let long = format!("http://10.0.0.1:9/{}", "a".repeat(MAX_URL_LEN));
        let e = SCRAPER.get(&long).await.unwrap_err().to_string();
        assert!(e.contains("is longer than 2048 bytes"), "{e}");
        for target in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fe80::1]:80/metrics",
            "http://[::ffff:169.254.169.254]/",
            "http://0.0.0.0:9090/metrics",
            "http://127.0.0.1:9400/metrics",
            "http://127.3.2.1:9400/metrics",
            "http://[::1]:9400/metrics",
            "http://LocalHost:9400/metrics",
        ] {
            assert_eq!(
                url_problem(target),
                Some("names a loopback, link-local, unspecified or multicast address"),
                "{target}"
            );
            let e = SCRAPER.get(target).await.unwrap_err().to_string();
            assert!(e.contains("refused"), "{target}: {e}");
        }
        // A spelling of 127.0.0.1 that is no IP literal to the URL's parser, but is to the
        // resolver: refused when the scrape connects.
        assert_eq!(url_problem("http://2130706433:9/metrics"), None);
        let e = SCRAPER
            .get("http://2130706433:9/metrics")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("refused"), "{e}");
        for fine in [
            "http://10.1.2.3:9400/metrics",
            "http://rank-0.trainers.ml.svc:9400/metrics?x=1",
            "http://[2001:db8::1]:9400/metrics",
            "http://prometheus.monitoring:9090",
        ] {
            assert_eq!(url_problem(fine), None, "{fine}");
        }
        assert_eq!(
            url_problem("http:///metrics"),
            Some("is not an http://host[:port]/path URL without user info")
        );
        assert!(url_problem("http://user@10.0.0.1:9400/metrics").is_some());
        assert!(may_connect_to("10.1.2.3".parse().unwrap()));
        assert!(!may_connect_to("::ffff:127.0.0.1".parse().unwrap()));
    }

    /// A page longer than [`MAX_BODY`] is refused, and the pages held at once never take
    /// more than the budget: a scrape that finds it spent fails at once, and succeeds once a
    /// page is let go.
    #[tokio::test]
    async fn bodies_are_bounded_each_and_together() {
        let addr = stand_in(|req| {
            let size = if req.starts_with("GET /huge ") {
                MAX_BODY + 1
            } else {
                600 << 10
            };
            let mut answer =
                format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n").into_bytes();
            answer.resize(answer.len() + size, b'#');
            answer
        })
        .await;
        let scraper = loopback_scraper(1 << 20);
        let e = scraper
            .get(&format!("http://{addr}/huge"))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("longer than 4194304 bytes"), "{e}");
        let first = scraper.get(&format!("http://{addr}/page")).await.unwrap();
        assert_eq!(first.len(), 600 << 10);
        // Paid for: the buffer it holds (its announced length), no more, no less.
        assert_eq!(scraper.memory.available_permits(), (1 << 20) - (600 << 10));
        let e = scraper
            .get(&format!("http://{addr}/page"))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("memory budget (1048576 bytes at once) is spent"),
            "{e}"
        );
        drop(first);
        assert_eq!(scraper.memory.available_permits(), 1 << 20);
        let second = scraper.get(&format!("http://{addr}/page")).await.unwrap();
        assert_eq!(second.len(), 600 << 10);
    }

    /// A stand-in for the Prometheus HTTP API: answers the five instant queries with one
    /// number each; the observation follows (97 of 100 ranks reporting is enough).
    #[tokio::test]
    async fn reads_an_aggregated_observation_from_prometheus() {
        let addr = stand_in(|req| {
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
            format!("HTTP/1.0 200 OK\r\n\r\n{body}").into_bytes()
        })
        .await;
        let scraper = loopback_scraper(MEMORY_BUDGET);
        let got = read_prometheus(&scraper, &format!("http://{addr}/"), "ml", "sft", 60)
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

    fn counters(wait_s: f64) -> Option<RankCounters> {
        Some(RankCounters {
            wait_s,
            step_s: 1.0,
            samples: 1.0,
        })
    }

    #[test]
    fn readings_pair_by_source() {
        let c = counters;
        let before = vec![("a".to_string(), c(1.0)), ("b".to_string(), c(2.0))];
        let after = vec![("b".to_string(), c(3.0)), ("c".to_string(), c(4.0))];
        let (b, a) = paired(&before, &after);
        assert_eq!(b, vec![c(2.0), None]);
        assert_eq!(a, vec![c(3.0), c(4.0)]);
        assert_eq!(percent_encode("a b{}"), "a%20b%7B%7D");
    }

    /// 16,384 ranks, each reading in the other's order reversed, pair in one pass (the
    /// pairing runs under the scaler's lock each interval). Timed with `--nocapture`.
    #[test]
    fn sixteen_thousand_ranks_pair_by_source() {
        let url = |i: usize| format!("http://10.1.{}.{}:9400/metrics", i / 256, i % 256);
        let before: RankReading = (0..16_384).map(|i| (url(i), counters(1.0))).collect();
        let after: RankReading = (0..16_384).rev().map(|i| (url(i), counters(2.0))).collect();
        let t = std::time::Instant::now();
        let (b, a) = paired(&before, &after);
        println!("16,384 ranks paired in {:?}", t.elapsed());
        assert_eq!(b, vec![counters(1.0); 16_384]);
        assert_eq!(a, vec![counters(2.0); 16_384]);
    }
}
