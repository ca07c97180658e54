//! A plain HTTP/1.0 GET over loopback: how the demo, benchmarks and tests read a worker's or a
//! client's /metrics, /healthz and /readyz. Blocking and dependency-free on purpose: callers
//! are test threads and supervisors, not the data path.

use std::io::{Read, Write};
use std::time::Duration;

/// An HTTP response: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// GETs `path` from `addr` (host:port), waiting at most 5 s for the answer.
pub fn get(addr: &str, path: &str) -> anyhow::Result<Response> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let not_http = || anyhow::anyhow!("{addr}{path}: not an HTTP response");
    let (head, body) = out.split_once("\r\n\r\n").ok_or_else(not_http)?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(not_http)?;
    Ok(Response {
        status,
        body: body.to_string(),
    })
}

/// The body of a 200 answer to GET `path`; any other status is an error naming it.
pub fn get_ok(addr: &str, path: &str) -> anyhow::Result<String> {
    let r = get(addr, path)?;
    anyhow::ensure!(r.status == 200, "{addr}{path}: HTTP {}", r.status);
    Ok(r.body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_status_and_body() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            for answer in [
                "HTTP/1.0 200 OK\r\n\r\nup 1\n",
                "HTTP/1.0 503 Busy\r\n\r\nno",
            ] {
                let (mut c, _) = listener.accept().unwrap();
                // Read the whole request: closing on unread bytes would reset the connection.
                let mut req = Vec::new();
                let mut byte = [0u8; 1];
                while !req.ends_with(b"\r\n\r\n") && c.read(&mut byte).unwrap() == 1 {
                    req.push(byte[0]);
                }
                c.write_all(answer.as_bytes()).unwrap();
            }
        });
        assert_eq!(get_ok(&addr, "/metrics").unwrap(), "up 1\n");
        let err = get_ok(&addr, "/readyz").unwrap_err().to_string();
        assert!(err.ends_with("/readyz: HTTP 503"), "{err}");
        server.join().unwrap();
    }
}
