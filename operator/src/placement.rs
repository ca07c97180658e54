//! Where workers go and how many the nodes can take: the per-node limit (explicit, or what
//! the NIC budget fits), the scheduler terms that spread or pack them, and the room the
//! eligible nodes have left once every other pipeline's workers on them are counted.

use crate::crd::{DataPipeline, PlacementMode};
use crate::labels::selector_labels;
use k8s_openapi::api::core::v1::{
    Affinity, Node, Pod, PodAffinity, PodAffinityTerm, PodAntiAffinity, TopologySpreadConstraint,
    WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use std::collections::HashMap;

/// Workers per topology domain the placement allows: explicit, else what the per-node
/// bandwidth budget fits, else unlimited.
pub fn max_workers_per_node(dp: &DataPipeline) -> Option<u32> {
    let p = &dp.spec.placement;
    if let Some(n) = p.max_workers_per_node {
        return Some(n.max(1) as u32);
    }
    match (p.node_bandwidth_gbps, p.worker_egress_gbps) {
        (Some(node), Some(worker)) if worker > 0.0 => Some(((node / worker).floor() as u32).max(1)),
        _ => None,
    }
}

pub fn affinity(dp: &DataPipeline) -> Option<Affinity> {
    let p = &dp.spec.placement;
    let term = PodAffinityTerm {
        label_selector: Some(LabelSelector {
            match_labels: Some(selector_labels(dp)),
            ..LabelSelector::default()
        }),
        topology_key: p.topology_key.clone(),
        ..PodAffinityTerm::default()
    };
    match p.mode {
        // One per domain is the only per-node cap the scheduler enforces by itself.
        PlacementMode::Spread if max_workers_per_node(dp) == Some(1) => Some(Affinity {
            pod_anti_affinity: Some(PodAntiAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![term]),
                ..PodAntiAffinity::default()
            }),
            ..Affinity::default()
        }),
        PlacementMode::Spread => None,
        PlacementMode::Pack => Some(Affinity {
            pod_affinity: Some(PodAffinity {
                preferred_during_scheduling_ignored_during_execution: Some(vec![
                    WeightedPodAffinityTerm {
                        weight: 100,
                        pod_affinity_term: term,
                    },
                ]),
                ..PodAffinity::default()
            }),
            ..Affinity::default()
        }),
    }
}

pub fn spread(dp: &DataPipeline) -> Option<Vec<TopologySpreadConstraint>> {
    let p = &dp.spec.placement;
    (p.mode == PlacementMode::Spread).then(|| {
        vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: p.topology_key.clone(),
            // Hard: workers on one node would share (and saturate) its NIC.
            when_unsatisfiable: "DoNotSchedule".into(),
            // Count only nodes a worker may go to: tainted GPU nodes and nodes outside the
            // affinity would otherwise hold the skew at 0 and leave workers Pending.
            node_taints_policy: Some("Honor".into()),
            node_affinity_policy: Some("Honor".into()),
            label_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(dp)),
                ..LabelSelector::default()
            }),
            ..TopologySpreadConstraint::default()
        }]
    })
}

/// Nodes listed by name in a condition's message (the rest are counted).
const LISTED_NODES: usize = 3;

/// What the eligible nodes can still take of one pipeline's workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Room {
    /// Nodes the workers may land on.
    pub nodes: u32,
    /// The pipeline's own per-node limit.
    pub per_node: u32,
    /// Its workers the nodes can host within every node's NIC budget, after the bandwidth other
    /// pipelines' workers use there.
    pub workers: u32,
    /// Nodes where other pipelines' workers use part of the budget: their count, and the
    /// busiest few as (node, Gb/s used by others).
    pub shared: u32,
    pub busiest: Vec<(String, f64)>,
}

/// Whether a node may take this pipeline's workers: its node selector matches and it is
/// schedulable.
pub fn eligible(dp: &DataPipeline, n: &Node) -> bool {
    let labels = n.labels();
    dp.spec
        .worker
        .node_selector
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
        && !n
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false)
}

/// The room `nodes` have for `dp`'s workers when `workers` (every managed pipeline's worker
/// pods) run on them; `egress_of(namespace, pipeline)` is a pipeline's Gb/s per worker (none:
/// it declared no figure, or does not take precedence over `dp`, and counts as using no
/// bandwidth). `None`: no per-node limit.
pub fn room(
    dp: &DataPipeline,
    nodes: &[&Node],
    workers: &[&Pod],
    egress_of: impl Fn(&str, &str) -> Option<f64>,
) -> Option<Room> {
    let per_node = max_workers_per_node(dp)?;
    let p = &dp.spec.placement;
    let (ns, name) = (dp.namespace().unwrap_or_default(), dp.name_any());
    let mut others: HashMap<&str, f64> = HashMap::new();
    for pod in workers {
        let (Some(node), Some(pipeline)) = (
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            pod.labels().get(crate::labels::INSTANCE),
        ) else {
            continue;
        };
        let pod_ns = pod.namespace().unwrap_or_default();
        if pod_ns == ns && *pipeline == name {
            continue;
        }
        *others.entry(node).or_default() += egress_of(&pod_ns, pipeline).unwrap_or(0.0);
    }
    let fits = |used: f64| match (p.node_bandwidth_gbps, p.worker_egress_gbps) {
        (Some(budget), Some(worker)) if worker > 0.0 => {
            per_node.min(((budget - used) / worker + 1e-9).floor().max(0.0) as u32)
        }
        _ => per_node,
    };
    let mut busiest: Vec<(String, f64)> = nodes
        .iter()
        .filter_map(|n| Some((n.name_any(), *others.get(n.name_any().as_str())?)))
        .filter(|(_, used)| *used > 0.0)
        .collect();
    let workers = nodes
        .iter()
        .map(|n| fits(others.get(n.name_any().as_str()).copied().unwrap_or(0.0)))
        .sum();
    busiest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let shared = busiest.len() as u32;
    busiest.truncate(LISTED_NODES);
    Some(Room {
        nodes: nodes.len() as u32,
        per_node,
        workers,
        shared,
        busiest,
    })
}

/// The most workers the placement can host within every node's limit: with Spread's hard
/// constraint (max skew 1) no node gets more than ceil(workers / nodes) of one pipeline, and
/// capping its workers at the room the nodes have left keeps the sum of every pipeline's
/// workers within the nodes' budgets. `None`: no limit. Pack places by preference only, so
/// it has no cap (the NICSaturationRisk condition says when its workers exceed the budget).
pub fn replica_cap(dp: &DataPipeline, room: &Room) -> Option<i32> {
    (dp.spec.placement.mode == PlacementMode::Spread)
        .then(|| room.workers.min(i32::MAX as u32) as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::example;
    use serde_json::json;

    fn node(name: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
    }

    fn worker(ns: &str, pipeline: &str, node: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": format!("{pipeline}-{node}"),
            "namespace": ns, "labels": {crate::labels::INSTANCE: pipeline}},
            "spec": {"containers": [], "nodeName": node}}))
        .unwrap()
    }

    #[test]
    fn every_pipelines_workers_on_a_node_count_against_its_budget() {
        // The example: 20 Gb/s per node, 4 per worker: 5 of its workers per node.
        let dp = example();
        let nodes = [node("a"), node("b"), node("c")];
        let nodes: Vec<&Node> = nodes.iter().collect();
        let alone = room(&dp, &nodes, &[], |_, _| None).unwrap();
        assert_eq!((alone.workers, alone.shared), (15, 0));
        // Another pipeline's workers at 8 Gb/s: two on a (16 of 20 Gb/s left: room for one of
        // ours), one on b (room for three); its own workers and a pipeline without a
        // figure use none of the budget it computes.
        let pods = [
            worker("ml", "video", "a"),
            worker("ml", "video", "a"),
            worker("other", "video", "b"),
            worker("ml", "qwen-sft", "c"),
            worker("ml", "unsized", "c"),
        ];
        let pods: Vec<&Pod> = pods.iter().collect();
        let egress = |ns: &str, name: &str| match (ns, name) {
            (_, "video") => Some(8.0),
            ("ml", "qwen-sft") => Some(4.0),
            _ => None,
        };
        let shared = room(&dp, &nodes, &pods, egress).unwrap();
        assert_eq!(shared.workers, 1 + 3 + 5);
        assert_eq!(shared.shared, 2);
        assert_eq!(shared.busiest, [("a".into(), 16.0), ("b".into(), 8.0)]);
        assert_eq!(replica_cap(&dp, &shared), Some(9));
        // A node full of others' workers takes none of ours (never a negative count).
        let full: Vec<Pod> = (0..3).map(|_| worker("ml", "video", "a")).collect();
        let full: Vec<&Pod> = full.iter().collect();
        assert_eq!(room(&dp, &nodes[..1], &full, egress).unwrap().workers, 0);
    }
}
