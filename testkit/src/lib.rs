//! What Stoker's demo, benchmarks and tests run against, kept out of the data-plane library:
//! an S3-compatible server in-process, a synthetic VLM dataset, `stoker worker` as a child
//! process, certificates for it, and the one plain-HTTP GET they scrape metrics with.

#![forbid(unsafe_code)]

pub mod docs;
pub mod embedded_s3;
pub mod http;
pub mod local_worker;
pub mod netns;
pub mod synth;
pub mod tls;
