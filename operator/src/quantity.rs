//! Quantities the operator reads from a spec.

use crate::crd::DataPipelineSpec;

/// CPU threads from the CPU limit (else request), rounded up; `None` = the worker's default.
pub fn cpu_threads(spec: &DataPipelineSpec) -> Option<u32> {
    let r = spec.worker.resources.as_ref()?;
    let q = r
        .limits
        .as_ref()
        .and_then(|l| l.get("cpu"))
        .or_else(|| r.requests.as_ref().and_then(|l| l.get("cpu")))?;
    Some((cpu_cores(&q.0)?.ceil() as u32).max(1))
}

/// Cores in a Kubernetes CPU quantity ("4", "500m", "1.5").
pub fn cpu_cores(quantity: &str) -> Option<f64> {
    let s = quantity.trim();
    match s.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().ok().map(|m| m / 1000.0),
        None => s.parse::<f64>().ok(),
    }
    .filter(|c| c.is_finite() && *c > 0.0)
}
