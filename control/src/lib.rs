//! Stoker's control policies as pure functions, shared by the operator (Kubernetes backend)
//! and `stoker-lab demo` (local process backend), and unit-tested against a simulated plant; with
//! them, what both backends read and export: the Prometheus text parser and the autoscaler's
//! series.

#![forbid(unsafe_code)]

pub mod autoscale;
pub mod exposition;
pub mod metrics;
pub mod sim;
