use super::*;
use crate::crd::{example, DataPipeline, PlacementMode};
use crate::labels::selector_string;
use crate::placement::{max_workers_per_node, room};
use k8s_openapi::api::core::v1::Node;

fn valid(dp: &DataPipeline) -> Valid<'_> {
    crate::validate::validate(dp).unwrap()
}

fn pod(d: &Deployment) -> &PodSpec {
    d.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn anti_affinity(d: &Deployment) -> &k8s_openapi::api::core::v1::PodAntiAffinity {
    let affinity = pod(d).affinity.as_ref().unwrap();
    affinity.pod_anti_affinity.as_ref().unwrap()
}

#[test]
fn deployment_runs_the_worker_with_the_plan_and_preprocessing() {
    let dp = example();
    let d = deployment(&valid(&dp), 3, None);
    assert_eq!(d.metadata.name.as_deref(), Some("qwen-sft-workers"));
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(3));
    let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("DataPipeline", Some(true))
    );
    let c = &pod(&d).containers[0];
    let args = c.args.as_ref().unwrap().join(" ");
    for want in [
        "worker --data s3://datasets/llava-sft",
        "--seed 42",
        "--global-batch-size 256",
        "--preset qwen2-vl",
        "--max-pixels 1003520",
        "--pixel-dtype bf16",
        "--max-length 4096",
        "--cpu-threads 4",
        "--s3-endpoint http://minio.storage:9000",
        "--s3-path-style",
        "--token-file /var/run/stoker/token",
    ] {
        assert!(args.contains(want), "{want:?} not in {args}");
    }
    let env: Vec<&str> = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    assert!(env.contains(&"AWS_ACCESS_KEY_ID") && env.contains(&"AWS_SECRET_ACCESS_KEY"));
    // The selector matches the template's labels.
    let sel = d
        .spec
        .as_ref()
        .unwrap()
        .selector
        .match_labels
        .clone()
        .unwrap();
    let tpl = d.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
    assert!(sel
        .iter()
        .all(|(k, v)| tpl.labels.as_ref().unwrap().get(k) == Some(v)));
    assert_eq!(
        selector_string(&dp),
        "app.kubernetes.io/instance=qwen-sft,app.kubernetes.io/name=stoker-worker"
    );
}

#[test]
fn workers_serve_the_operators_certificate_unless_plaintext_is_asked_for() {
    let mut dp = example();
    let d = deployment(&valid(&dp), 1, Some(1_700_000_000));
    let tpl = d.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
    assert_eq!(
        tpl.annotations.as_ref().unwrap()["stoker.dev/tls-not-after"],
        "1700000000"
    );
    let c = &pod(&d).containers[0];
    let args = c.args.as_ref().unwrap().join(" ");
    assert!(
        args.contains(
            "--tls-cert /var/run/stoker-tls/tls.crt --tls-key /var/run/stoker-tls/tls.key"
        ),
        "{args}"
    );
    assert!(!args.contains("--insecure-plaintext"), "{args}");
    let mounts = c.volume_mounts.as_ref().unwrap();
    let tls = mounts.iter().find(|m| m.name == "tls").unwrap();
    assert_eq!(
        (tls.mount_path.as_str(), tls.read_only),
        ("/var/run/stoker-tls", Some(true))
    );
    let volumes = pod(&d).volumes.as_ref().unwrap();
    let secret = volumes.iter().find(|v| v.name == "tls").unwrap();
    let secret = secret.secret.as_ref().unwrap().secret_name.as_deref();
    assert_eq!(secret, Some("qwen-sft-tls"));

    dp.spec.tls.mode = TlsMode::InsecurePlaintext;
    let d = deployment(&valid(&dp), 1, None);
    let c = &pod(&d).containers[0];
    let args = c.args.as_ref().unwrap().join(" ");
    assert!(args.contains("--insecure-plaintext") && !args.contains("--tls-cert"));
    assert!(!c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .any(|m| m.name == "tls"));
    let tpl = d.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
    assert_eq!(tpl.annotations, None);
}

/// The spec's preprocessing and sampling are the worker's own types; the container args
/// are `to_args()` of them; the worker's CLI parses those args back to the same values.
#[test]
fn the_worker_parses_its_container_args_back_to_the_spec() {
    #[derive(clap::Parser)]
    struct WorkerCli {
        #[command(flatten)]
        config: WorkerConfig,
    }
    let mut dp = example();
    dp.spec.preprocessing = stoker_config::Preprocessing {
        preset: stoker_config::PresetName::Qwen3Vl,
        min_pixels: Some(4096),
        video_min_pixels: None,
        video_max_pixels: Some(1 << 23),
        max_pixels: Some(1 << 21),
        pixel_dtype: Some(stoker_config::PixelDtype::U8),
        max_length: Some(2048),
        tokenizer: Some("s3://models/qwen3/tokenizer.json".into()),
        template: Some("/etc/stoker/chat.jinja".into()),
        max_image_side: 9000,
        max_image_pixels: 1 << 25,
        max_images_per_sample: 8,
        max_sample_pixels: 1 << 27,
        max_object_bytes: 1 << 24,
        max_sample_bytes: 1 << 27,
        max_line_bytes: 1 << 18,
        max_turns: 40,
        max_video_frames: 1800,
        max_sample_work: 1 << 34,
    };
    dp.spec.plan.sampling.on_error = stoker_config::OnError::Fail;
    dp.spec.serving = stoker_config::ServingLimits {
        max_inflight_per_conn: 3,
        max_connections: 4096,
        links_per_rank: 2,
        idle_timeout_s: 120,
        max_worker_bytes: 3 << 30,
        send_timeout_s: 45,
    };
    let d = deployment(&valid(&dp), 1, None);
    let args = pod(&d).containers[0].args.clone().unwrap();
    assert_eq!(args[0], "worker");
    let joined = args.join(" ");
    for want in [
        "--max-inflight-per-conn 3",
        "--max-connections 4096",
        "--links-per-rank 2",
        "--idle-timeout-s 120",
        "--max-worker-bytes 3221225472",
        "--send-timeout-s 45",
    ] {
        assert!(joined.contains(want), "{want:?} not in {joined}");
    }
    let argv = std::iter::once("stoker-worker".to_string()).chain(args[1..].iter().cloned());
    let parsed = <WorkerCli as clap::Parser>::try_parse_from(argv)
        .unwrap()
        .config;
    assert_eq!(parsed.preprocessing, dp.spec.preprocessing);
    assert_eq!(parsed.sampling, dp.spec.plan.sampling);
    assert_eq!(parsed.s3, dp.spec.source.s3.as_ref().unwrap().connection);
    assert_eq!(parsed.serving.limits, dp.spec.serving);
    assert_eq!(parsed, worker_config(&valid(&dp)));
}

#[test]
fn pods_meet_the_restricted_pod_security_standard() {
    let d = deployment(&valid(&example()), 1, None);
    let p = pod(&d);
    let psc = p.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    for c in &p.containers {
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop,
            Some(vec!["ALL".into()])
        );
        assert!(c.readiness_probe.is_some() && c.liveness_probe.is_some());
        let pre_stop = c.lifecycle.as_ref().unwrap().pre_stop.as_ref().unwrap();
        assert!(pre_stop.sleep.is_some(), "preStop without a shell");
    }
    // No host namespaces, no host paths, no privileged anything.
    assert!(p.host_network.is_none() && p.host_pid.is_none() && p.host_ipc.is_none());
    assert!(p
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .all(|v| v.host_path.is_none()));
}

#[test]
fn placement_spreads_packs_and_caps_per_node() {
    // Spread with a 20 Gb/s budget and 4 Gb/s workers: 5 per node, which no affinity rule
    // expresses; the hard spread constraint keeps them even across nodes.
    let mut dp = example();
    assert_eq!(max_workers_per_node(&dp), Some(5));
    let p = deployment(&valid(&dp), 4, None);
    let tsc = &pod(&p).topology_spread_constraints.as_ref().unwrap()[0];
    assert_eq!(
        (
            tsc.max_skew,
            tsc.topology_key.as_str(),
            tsc.when_unsatisfiable.as_str()
        ),
        (1, "kubernetes.io/hostname", "DoNotSchedule")
    );
    assert_eq!(
        (
            tsc.node_taints_policy.as_deref(),
            tsc.node_affinity_policy.as_deref()
        ),
        (Some("Honor"), Some("Honor"))
    );
    let rolling = p.spec.as_ref().unwrap().strategy.as_ref().unwrap();
    let rolling = rolling.rolling_update.as_ref().unwrap();
    assert_eq!(
        (rolling.max_surge.clone(), rolling.max_unavailable.clone()),
        (
            Some(IntOrString::Int(0)),
            Some(IntOrString::String("10%".into()))
        )
    );
    assert!(pod(&p).affinity.is_none());
    // A budget for one worker per node: required anti-affinity.
    dp.spec.placement.worker_egress_gbps = Some(15.0);
    assert_eq!(max_workers_per_node(&dp), Some(1));
    let p = deployment(&valid(&dp), 4, None);
    let anti = anti_affinity(&p);
    assert!(anti
        .required_during_scheduling_ignored_during_execution
        .is_some());
    // Pack: preferred co-location, no spread constraint.
    dp.spec.placement.mode = PlacementMode::Pack;
    let p = deployment(&valid(&dp), 4, None);
    assert!(pod(&p).topology_spread_constraints.is_none());
    let aff = pod(&p)
        .affinity
        .as_ref()
        .unwrap()
        .pod_affinity
        .as_ref()
        .unwrap();
    assert_eq!(
        aff.preferred_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()[0]
            .weight,
        100
    );
}

#[test]
fn the_measured_egress_makes_the_operator_spread_as_the_experiment_found_best() {
    // docs/spread.json: `stoker-lab bench spread` on this machine (network namespaces, tbf).
    let report: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/spread.json")).unwrap();
    let rate = |placement: &str| {
        report["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| {
                r["placement"] == placement
                    && r["scale"] == "network-bound"
                    && r["path"] == "direct"
            })
            .unwrap()["samples_per_s"]
            .as_f64()
            .unwrap()
    };
    assert!(
        rate("spread") >= 1.5 * rate("pack"),
        "the experiment found spread best"
    );
    let number = |k: &str| report[k].as_f64().unwrap();
    // The same numbers as the DataPipeline's bandwidth budget.
    let mut dp = example();
    dp.spec.placement.node_bandwidth_gbps = Some(number("link_mbit") / 1000.0);
    dp.spec.placement.worker_egress_gbps = Some(number("worker_egress_gbps"));
    let per_node = max_workers_per_node(&dp).unwrap();
    assert_eq!(per_node, 1, "one busy worker fills a node's link");
    // One worker per node: required anti-affinity plus the spread constraint, which is
    // the experiment's spread placement (worker i on node i).
    let d = deployment(&valid(&dp), number("workers") as i32, None);
    let anti = anti_affinity(&d);
    let term = &anti
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()[0];
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    // Enough nodes: room for every worker. The packed layout (all on one node): room for
    // one, which the condition reports.
    let w = number("workers") as u32;
    let nodes: Vec<Node> = (0..number("nodes") as usize)
        .map(|i| {
            serde_json::from_value(serde_json::json!({"metadata": {"name": format!("n{i}")}}))
                .unwrap()
        })
        .collect();
    let room_on = |n: usize| {
        let nodes: Vec<&Node> = nodes.iter().take(n).collect();
        room(&dp, &nodes, &[], |_, _| None).unwrap().workers
    };
    assert!(room_on(nodes.len()) >= w);
    assert!(room_on(1) < w);
}

#[test]
fn volume_sources_mount_read_only_with_their_mixed_folders() {
    let mut dp = example();
    dp.spec.source.s3 = None;
    dp.spec.source.volume = Some(crate::crd::VolumeSource {
        claim_name: "sft-data".into(),
        path: "/llava".into(),
    });
    dp.spec.source.media_root = Some("images/".into());
    dp.spec.plan.sampling.mix = vec!["vqa/=2,media-root=coco".parse().unwrap()];
    dp.spec.preprocessing.tokenizer = None; // the fixture's is on S3
    let d = deployment(&valid(&dp), 1, None);
    let args = pod(&d).containers[0].args.as_ref().unwrap().join(" ");
    assert!(args.contains("--data /data/llava"), "{args}");
    assert!(args.contains("--media-root /data/images"), "{args}");
    assert!(
        args.contains("--mix /data/vqa=2,media-root=/data/coco"),
        "{args}"
    );
    for s3_only in ["--s3-endpoint", "--s3-region", "--s3-path-style"] {
        assert!(!args.contains(s3_only), "{args}");
    }
    let vol = pod(&d)
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "data")
        .unwrap();
    let pvc = vol.persistent_volume_claim.as_ref().unwrap();
    assert_eq!(
        (pvc.claim_name.as_str(), pvc.read_only),
        ("sft-data", Some(true))
    );
}

#[test]
fn service_pdb_policy_and_secret() {
    let dp = example();
    let s = service(&valid(&dp));
    let spec = s.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    assert_eq!(spec.selector.as_ref(), Some(&selector_labels(&dp)));
    let pdb = pod_disruption_budget(&valid(&dp));
    assert_eq!(
        pdb.spec.as_ref().unwrap().max_unavailable,
        Some(IntOrString::String("10%".into()))
    );
    let np = network_policy(&valid(&dp), &["monitoring".into(), "ml".into()]);
    let rules = np.spec.as_ref().unwrap().ingress.as_ref().unwrap();
    // The metrics port: the pipeline's namespace and the ones named, each once; no other.
    let metrics = &rules[1];
    assert_eq!(
        metrics.ports.as_ref().unwrap()[0].port,
        Some(IntOrString::Int(METRICS_PORT))
    );
    let namespaces = metrics.from.as_ref().unwrap()[0]
        .namespace_selector
        .as_ref()
        .unwrap();
    assert_eq!(namespaces.match_labels, None);
    let only = &namespaces.match_expressions.as_ref().unwrap()[0];
    assert_eq!(
        (only.key.as_str(), only.operator.as_str()),
        ("kubernetes.io/metadata.name", "In")
    );
    assert_eq!(
        only.values.as_deref(),
        Some(&["ml".into(), "monitoring".into()][..])
    );
    let batches = &rules[0];
    assert_eq!(
        batches.from.as_ref().unwrap()[0]
            .pod_selector
            .as_ref()
            .unwrap()
            .match_labels
            .as_ref()
            .unwrap()
            .get("app")
            .map(String::as_str),
        Some("qwen-sft-trainer")
    );
    assert_eq!(
        batches.ports.as_ref().unwrap()[0].port,
        Some(IntOrString::Int(BATCH_PORT))
    );
    let secret = crate::credentials::token_secret(&valid(&dp), "abc");
    assert_eq!(secret.metadata.name.as_deref(), Some("qwen-sft-token"));
    assert_eq!(secret.string_data.unwrap()["token"], "abc");
    for owner in [
        s.metadata.owner_references,
        pdb.metadata.owner_references,
        np.metadata.owner_references,
    ] {
        assert_eq!(owner.unwrap()[0].name, "qwen-sft");
    }
}
