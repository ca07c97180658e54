//! Stoker's control policies as pure functions, shared by the operator (Kubernetes backend)
//! and `stoker demo` (local process backend), and unit-tested against a simulated plant.

pub mod autoscale;
pub mod sim;
