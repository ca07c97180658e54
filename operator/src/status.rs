//! The DataPipeline status from what reconcile observed and decided: pure, so each condition
//! is unit-tested without an API server.

use crate::crd::{DataPipeline, DataPipelineStatus, WaitRatio};
use crate::labels::selector_string;
use crate::placement::Room;
use k8s_openapi::api::apps::v1::DeploymentStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use stoker_control::autoscale::Observation;

/// A decision about the worker count, with what the status shows of it (made by the
/// reconciler's autoscaling step, shown here).
pub struct Scale {
    pub replicas: i32,
    pub observation: Option<Observation>,
    pub per_worker: Option<f64>,
    pub reason: String,
    pub metrics_available: Option<bool>,
}

/// What reconcile saw of the cluster.
pub struct Observed {
    /// The worker Deployment's status after the apply.
    pub deployment: DeploymentStatus,
    /// What the nodes the workers may use can take, when a per-node limit applies.
    pub room: Option<Room>,
    /// The count the autoscaler (or spec.replicas) asked for, before the per-node cap.
    pub wanted: i32,
    /// The Deployment's replicas before this reconcile (`None`: it did not exist).
    pub previous_replicas: Option<i32>,
}

pub fn compute(dp: &DataPipeline, scale: &Scale, seen: &Observed) -> DataPipelineStatus {
    let prev = dp.status.clone().unwrap_or_default();
    let ready = seen.deployment.ready_replicas.unwrap_or(0);
    let replicas = seen.deployment.replicas.unwrap_or(0);
    let changed = seen.previous_replicas.is_some_and(|p| p != scale.replicas);
    let (last_scale_time, last_scale_reason) = match seen.previous_replicas {
        Some(from) if changed => (
            Some(now()),
            Some(format!("{from} -> {}: {}", scale.replicas, scale.reason)),
        ),
        _ => (prev.last_scale_time.clone(), prev.last_scale_reason.clone()),
    };
    let mut conditions = vec![
        ready_condition(ready, scale.replicas),
        scaling_condition(ready, replicas, scale.replicas),
    ];
    if let Some(available) = scale.metrics_available {
        conditions.push(metrics_condition(available));
    }
    if let Some(room) = &seen.room {
        conditions.push(nic_condition(seen.wanted, scale.replicas, room));
    }
    let generation = dp.metadata.generation;
    DataPipelineStatus {
        replicas,
        desired_replicas: scale.replicas,
        ready_replicas: ready,
        selector: selector_string(dp),
        wait_ratio: scale.observation.map(|o| {
            let shown = prev.wait_ratio;
            WaitRatio {
                worst: Shown::WAIT_RATIO.of(o.worst_wait_ratio, shown.map(|w| w.worst)),
                mean: Shown::WAIT_RATIO.of(o.mean_wait_ratio, shown.map(|w| w.mean)),
            }
        }),
        samples_per_second: (scale.observation)
            .map(|o| Shown::RATE.of(o.consumed_per_s, prev.samples_per_second)),
        per_worker_samples_per_second: match scale.per_worker {
            Some(v) => Some(Shown::RATE.of(v, prev.per_worker_samples_per_second)),
            None => prev.per_worker_samples_per_second,
        },
        last_scale_time,
        last_scale_reason,
        observed_generation: generation,
        conditions: conditions
            .into_iter()
            .map(|c| c.stamp(generation, &prev.conditions))
            .collect(),
    }
}

/// The previous status with Ready=False for `reason`: nothing more was applied for this spec.
pub fn not_ready(dp: &DataPipeline, reason: &'static str, message: String) -> DataPipelineStatus {
    let prev = dp.status.clone().unwrap_or_default();
    let generation = dp.metadata.generation;
    let mut conditions: Vec<Condition> = prev
        .conditions
        .iter()
        .filter(|c| c.type_ != "Ready")
        .cloned()
        .collect();
    conditions.push(
        Cond {
            type_: "Ready",
            ok: false,
            reason,
            message,
        }
        .stamp(generation, &prev.conditions),
    );
    DataPipelineStatus {
        selector: selector_string(dp),
        observed_generation: generation,
        conditions,
        ..prev
    }
}

/// A condition before its transition time is known.
struct Cond {
    type_: &'static str,
    ok: bool,
    reason: &'static str,
    message: String,
}

impl Cond {
    fn stamp(self, generation: Option<i64>, prev: &[Condition]) -> Condition {
        let status = if self.ok { "True" } else { "False" };
        // The transition time moves only when the status does (API conventions).
        let last = prev
            .iter()
            .find(|c| c.type_ == self.type_ && c.status == status)
            .map_or_else(now, |c| c.last_transition_time.clone());
        Condition {
            type_: self.type_.into(),
            status: status.into(),
            reason: self.reason.into(),
            message: self.message,
            observed_generation: generation,
            last_transition_time: last,
        }
    }
}

fn ready_condition(ready: i32, desired: i32) -> Cond {
    let ok = ready > 0 && ready >= desired.min(1);
    Cond {
        type_: "Ready",
        ok,
        reason: if ok {
            "WorkersReady"
        } else {
            "WorkersNotReady"
        },
        message: format!("{ready} of {desired} workers ready"),
    }
}

fn scaling_condition(ready: i32, replicas: i32, desired: i32) -> Cond {
    let scaling = ready != desired || replicas != desired;
    Cond {
        type_: "Scaling",
        ok: scaling,
        reason: if scaling {
            "ReplicasChanging"
        } else {
            "Stable"
        },
        message: format!("{ready} ready, {desired} wanted"),
    }
}

fn metrics_condition(available: bool) -> Cond {
    Cond {
        type_: "MetricsAvailable",
        ok: available,
        reason: if available {
            "TrainerMetricsRead"
        } else {
            "TrainerMetricsMissing"
        },
        message: if available {
            "every trainer rank's wait counters were read".into()
        } else {
            "trainer metrics missing, stale or incomplete: holding the worker count".into()
        },
    }
}

fn nic_condition(wanted: i32, replicas: i32, room: &Room) -> Cond {
    let risk = wanted.max(0) as u32 > room.workers;
    let capped = if replicas < wanted {
        format!(" (capped at {replicas})")
    } else {
        String::new()
    };
    let (nodes, per_node) = (room.nodes, room.per_node);
    let mut message = format!(
        "{wanted} workers wanted{capped}, {nodes} eligible nodes x {per_node} workers per node by the placement"
    );
    if room.shared > 0 {
        let busiest: Vec<String> = (room.busiest.iter())
            .map(|(node, gbps)| format!("{node} {gbps:.1} Gb/s"))
            .collect();
        let more = if room.shared as usize > busiest.len() {
            ", ..."
        } else {
            ""
        };
        message += &format!(
            "; other pipelines' workers use bandwidth on {} of them ({}{more}), leaving room for {}",
            room.shared,
            busiest.join(", "),
            room.workers
        );
    }
    Cond {
        type_: "NICSaturationRisk",
        ok: risk,
        reason: if risk { "TooFewNodes" } else { "WithinBudget" },
        message,
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// How a trainer measurement is shown in the status: rounded to what a person reads, and the
/// value already shown kept until the new one is a whole step away from it. Each autoscaled
/// pipeline reads its trainers every interval; shown to 0.001 its status changed at every
/// reading (4 writes a minute per pipeline at 15 s), noise that nobody reads. Kept within a
/// step, a reading that wobbles around a rounding edge writes nothing; a real change of a step
/// is shown at the next reading.
enum Shown {
    /// To 0.01, changed by 0.01: the wait ratio, a fraction whose targets are a few hundredths.
    Hundredths,
    /// To 3 significant digits, changed by 5 % of the value shown: rates.
    Relative,
}

impl Shown {
    const WAIT_RATIO: Shown = Shown::Hundredths;
    const RATE: Shown = Shown::Relative;

    fn of(&self, value: f64, shown: Option<f64>) -> f64 {
        let step = |s: f64| match self {
            Shown::Hundredths => 0.01,
            Shown::Relative => 0.05 * s.abs(),
        };
        match shown {
            Some(s) if (value - s).abs() < step(s) => s,
            _ => match self {
                Shown::Hundredths => (value * 100.0).round() / 100.0,
                Shown::Relative => significant(value, 3),
            },
        }
    }
}

/// `v` to `digits` significant digits (a multiple or fraction of a power of ten computed from
/// integers, so 1230 is 1230.0, not 1230.0000000000002).
fn significant(v: f64, digits: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let shift = digits - 1 - v.abs().log10().floor() as i32;
    if shift >= 0 {
        let m = 10f64.powi(shift);
        (v * m).round() / m
    } else {
        let m = 10f64.powi(-shift);
        (v / m).round() * m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        let mut dp = crate::crd::example();
        dp.metadata.generation = Some(7);
        dp
    }

    fn scale(replicas: i32) -> Scale {
        Scale {
            replicas,
            observation: None,
            per_worker: None,
            reason: "because".into(),
            metrics_available: Some(false),
        }
    }

    fn cond<'a>(s: &'a DataPipelineStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn a_capped_count_reports_the_nic_risk_with_both_numbers() {
        let seen = Observed {
            deployment: DeploymentStatus {
                replicas: Some(2),
                ready_replicas: Some(2),
                ..Default::default()
            },
            room: Some(Room {
                nodes: 2,
                per_node: 5,
                workers: 10,
                shared: 0,
                busiest: vec![],
            }),
            wanted: 12,
            previous_replicas: Some(2),
        };
        // The example's budget: 20 Gb/s per node / 4 per worker = 5 per node.
        let s = compute(&dp(), &scale(10), &seen);
        let nic = cond(&s, "NICSaturationRisk");
        assert_eq!(nic.status, "True");
        assert!(
            nic.message.contains("12 workers wanted (capped at 10)"),
            "{}",
            nic.message
        );
        assert_eq!(s.last_scale_reason.as_deref(), Some("2 -> 10: because"));
        assert_eq!(cond(&s, "Scaling").status, "True");
        assert_eq!(cond(&s, "MetricsAvailable").reason, "TrainerMetricsMissing");
        assert!(s
            .conditions
            .iter()
            .all(|c| c.observed_generation == Some(7)));
    }

    #[test]
    fn measurements_are_shown_as_read_and_kept_within_a_step() {
        let w = Shown::WAIT_RATIO;
        assert_eq!(w.of(0.04712, None), 0.05);
        // Noise about a rounding edge keeps what is shown; a step away, the new value.
        assert_eq!(w.of(0.0449, Some(0.05)), 0.05);
        assert_eq!(w.of(0.0551, Some(0.05)), 0.05);
        assert_eq!(w.of(0.0390, Some(0.05)), 0.04);
        assert_eq!(w.of(0.8, Some(0.05)), 0.8);
        let r = Shown::RATE;
        assert_eq!(r.of(1234.5, None), 1230.0);
        assert_eq!(r.of(0.012345, None), 0.0123);
        assert_eq!(r.of(1290.0, Some(1230.0)), 1230.0);
        assert_eq!(r.of(1300.0, Some(1230.0)), 1300.0);
        assert_eq!(r.of(0.0, Some(0.0)), 0.0);
        assert_eq!(r.of(3.0, Some(0.0)), 3.0);
    }

    #[test]
    fn a_status_is_unchanged_by_readings_within_a_step() {
        let seen = Observed {
            deployment: DeploymentStatus {
                replicas: Some(2),
                ready_replicas: Some(2),
                ..Default::default()
            },
            room: None,
            wanted: 2,
            previous_replicas: Some(2),
        };
        let reading = |wait: f64, rate: f64| Scale {
            observation: Some(Observation {
                worst_wait_ratio: wait,
                mean_wait_ratio: wait / 2.0,
                consumed_per_s: rate,
                ready_workers: 2,
                ranks_reporting: 8,
                ranks: 8,
            }),
            per_worker: Some(rate / 2.0),
            metrics_available: Some(true),
            ..scale(2)
        };
        let mut d = dp();
        d.status = Some(compute(&d, &reading(0.031, 812.4), &seen));
        let first = d.status.clone().unwrap();
        assert_eq!(first.samples_per_second, Some(812.0));
        for (wait, rate) in [(0.034, 790.0), (0.027, 840.0), (0.0251, 780.0)] {
            assert_eq!(compute(&d, &reading(wait, rate), &seen), first);
        }
        let moved = compute(&d, &reading(0.047, 812.0), &seen);
        assert_eq!(moved.wait_ratio.map(|w| w.worst), Some(0.05));
    }

    #[test]
    fn invalid_keeps_the_last_status_and_says_why() {
        let mut d = dp();
        d.status = Some(DataPipelineStatus {
            ready_replicas: 3,
            ..Default::default()
        });
        let s = not_ready(&d, "InvalidSpec", "worker.image is empty".into());
        assert_eq!(s.ready_replicas, 3);
        let ready = cond(&s, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidSpec")
        );
        assert_eq!(ready.message, "worker.image is empty");
    }
}
