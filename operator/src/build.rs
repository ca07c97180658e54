//! Pure resource builders: a validated pipeline (and a few decided numbers) in, the objects
//! the operator applies out. No I/O here, so every builder is unit-tested on its own.

use crate::crd::{DataPipeline, S3Source};
use crate::labels::{labels, names, selector_labels};
use crate::placement::{affinity, spread};
use crate::validate::{DataSource, Valid};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Lifecycle,
    LifecycleHandler, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretKeySelector, SecretVolumeSource,
    SecurityContext, Service, ServicePort, ServiceSpec, SleepAction, Volume, VolumeMount,
};
use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Secret};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;
use stoker_config::{Concurrency, S3Connection, Serving, WorkerConfig};

pub const BATCH_PORT: i32 = 7700;
pub const METRICS_PORT: i32 = 9090;
const TOKEN_DIR: &str = "/var/run/stoker";
const DATA_DIR: &str = "/data";
/// The worker's --drain-timeout-s; the grace period adds the preStop pause and a margin.
const DRAIN_SECONDS: i64 = 30;
const PRESTOP_SECONDS: i64 = 5;
/// UID of the image's non-root user (distroless "nonroot").
const RUN_AS_USER: i64 = 65532;

fn meta(dp: &DataPipeline, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: dp.namespace(),
        labels: Some(labels(dp)),
        owner_references: Some(vec![owner(dp)]),
        ..ObjectMeta::default()
    }
}

fn owner(dp: &DataPipeline) -> OwnerReference {
    dp.controller_owner_ref(&())
        .expect("a DataPipeline from the API server has a name and uid")
}

/// What each worker is told: the dataset, its preprocessing and sampling exactly as the spec
/// says (the same types), the pod's ports, token and CPU budget.
pub fn worker_config(p: &Valid) -> WorkerConfig {
    let (dp, s) = (p.dp, &p.dp.spec);
    let mut sampling = s.plan.sampling.clone();
    let media_root = s.source.media_root.clone();
    let (data, media_root, s3) = match p.source {
        DataSource::S3(s3) => (
            s3.uri.trim_end_matches('/').into(),
            media_root,
            s3.connection.clone(),
        ),
        DataSource::Volume(v) => {
            // Mixed datasets and media roots are folders in the mounted claim, as the source's
            // path is.
            for m in &mut sampling.mix {
                m.data = in_volume(&m.data);
                m.media_root = m.media_root.as_deref().map(in_volume);
            }
            let media_root = media_root.as_deref().map(in_volume);
            (in_volume(&v.path), media_root, S3Connection::default())
        }
    };
    WorkerConfig {
        data,
        media_root,
        s3,
        preprocessing: s.preprocessing.clone(),
        sampling,
        concurrency: Concurrency {
            cpu_threads: p.cpu_threads.map(|n| n as usize),
            ..Concurrency::default()
        },
        serving: Serving {
            listen: format!("0.0.0.0:{BATCH_PORT}"),
            metrics_listen: format!("0.0.0.0:{METRICS_PORT}"),
            token_file: Some(format!("{TOKEN_DIR}/token")),
            // The operator issues no certificates yet: its workers serve plaintext, said so by
            // name (docs/security.md).
            insecure_plaintext: true,
            pipeline: dp.name_any(),
            drain_timeout_s: DRAIN_SECONDS as u64,
            limits: s.serving.clone(),
            ..Serving::default()
        },
    }
}

/// Where a folder of the source's volume is in the worker's container.
fn in_volume(path: &str) -> String {
    format!("{DATA_DIR}/{}", path.trim_start_matches('/'))
        .trim_end_matches('/')
        .into()
}

/// The worker container's arguments.
pub fn worker_args(p: &Valid) -> Vec<String> {
    std::iter::once("worker".to_string())
        .chain(worker_config(p).to_args())
        .collect()
}

fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("metrics".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    }
}

/// The worker's environment: log filter, node name, store credentials, the user's extras.
fn worker_env(p: &Valid) -> Vec<EnvVar> {
    let s = &p.dp.spec;
    let mut env = vec![
        EnvVar {
            name: "RUST_LOG".into(),
            value: Some("info,aws_config=warn,aws_smithy_runtime=warn".into()),
            ..EnvVar::default()
        },
        // The node label of stoker_worker_info (bytes out per node: NIC headroom).
        EnvVar {
            name: "NODE_NAME".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "spec.nodeName".into(),
                    ..ObjectFieldSelector::default()
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        },
    ];
    if let DataSource::S3(S3Source {
        credentials_secret: Some(secret),
        ..
    }) = p.source
    {
        env.push(secret_env("AWS_ACCESS_KEY_ID", secret, "AWS_ACCESS_KEY_ID"));
        env.push(secret_env(
            "AWS_SECRET_ACCESS_KEY",
            secret,
            "AWS_SECRET_ACCESS_KEY",
        ));
    }
    env.extend(s.worker.env.iter().cloned());
    env
}

/// The token (always), a scratch /tmp (the root filesystem is read-only) and the dataset
/// volume (read-only) when the source is one: (mounts, volumes).
fn worker_volumes(p: &Valid) -> (Vec<VolumeMount>, Vec<Volume>) {
    let n = names(p.dp);
    let mut mounts = vec![
        VolumeMount {
            name: "token".into(),
            mount_path: TOKEN_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..VolumeMount::default()
        },
    ];
    let mut volumes = vec![
        Volume {
            name: "token".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(n.token_secret.clone()),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        },
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
    ];
    if let DataSource::Volume(v) = p.source {
        mounts.push(VolumeMount {
            name: "data".into(),
            mount_path: DATA_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "data".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: v.claim_name.clone(),
                read_only: Some(true),
            }),
            ..Volume::default()
        });
    }
    (mounts, volumes)
}

/// The worker container: args from the spec, ports, probes, a drain on stop, least privilege.
fn worker_container(p: &Valid, mounts: Vec<VolumeMount>) -> Container {
    let s = &p.dp.spec;
    Container {
        name: "worker".into(),
        image: Some(s.worker.image.clone()),
        args: Some(worker_args(p)),
        ports: Some(vec![
            ContainerPort {
                name: Some("batches".into()),
                container_port: BATCH_PORT,
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("metrics".into()),
                container_port: METRICS_PORT,
                ..ContainerPort::default()
            },
        ]),
        env: Some(worker_env(p)),
        resources: s.worker.resources.clone(),
        readiness_probe: Some(http_probe("/readyz", 2, 1)),
        liveness_probe: Some(http_probe("/healthz", 10, 3)),
        // Endpoints drop a terminating pod asynchronously: keep serving a moment, then the
        // worker's own SIGTERM drain finishes what is in flight.
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: PRESTOP_SECONDS,
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(mounts),
        ..Container::default()
    }
}

/// The worker pod: restricted security context, a grace period covering the drain, and
/// placement (node selector, tolerations, affinity, spread).
fn worker_pod(p: &Valid) -> PodSpec {
    let (dp, s) = (p.dp, &p.dp.spec);
    let (mounts, volumes) = worker_volumes(p);
    PodSpec {
        containers: vec![worker_container(p, mounts)],
        volumes: Some(volumes),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(RUN_AS_USER),
            run_as_group: Some(RUN_AS_USER),
            fs_group: Some(RUN_AS_USER),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        automount_service_account_token: Some(false),
        termination_grace_period_seconds: Some(DRAIN_SECONDS + PRESTOP_SECONDS + 10),
        node_selector: (!s.worker.node_selector.is_empty()).then(|| s.worker.node_selector.clone()),
        tolerations: (!s.worker.tolerations.is_empty()).then(|| s.worker.tolerations.clone()),
        affinity: affinity(dp),
        topology_spread_constraints: spread(dp),
        ..PodSpec::default()
    }
}

/// The worker Deployment at `replicas`.
pub fn deployment(p: &Valid, replicas: i32) -> Deployment {
    let (dp, n) = (p.dp, names(p.dp));
    Deployment {
        metadata: meta(dp, &n.workers),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector_labels(dp)),
                ..LabelSelector::default()
            },
            // Workers are stateless and clients retry: replace a tenth at a time (one at a
            // time would take days at 1,024 workers; Kubernetes makes it at least one), no
            // surge of extra pods competing for the same NICs.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::String(DISRUPTION_SHARE.into())),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(dp)),
                    ..ObjectMeta::default()
                }),
                spec: Some(worker_pod(p)),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// The headless Service clients resolve (`dns:<name>-workers.<ns>.svc:7700`): one A record per
/// ready worker pod.
pub fn service(p: &Valid) -> Service {
    let dp = p.dp;
    let port = |name: &str, port: i32| ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::String(name.into())),
        ..ServicePort::default()
    };
    Service {
        metadata: meta(dp, &names(dp).service),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(selector_labels(dp)),
            ports: Some(vec![
                port("batches", BATCH_PORT),
                port("metrics", METRICS_PORT),
            ]),
            publish_not_ready_addresses: Some(false),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The share of workers a rollout replaces at once, and voluntary disruptions (drains,
/// upgrades) may take down at once: clients reroute around that many.
const DISRUPTION_SHARE: &str = "10%";

/// At most a tenth of the workers (rounded up: at least one) down by voluntary disruption at
/// a time.
pub fn pod_disruption_budget(p: &Valid) -> PodDisruptionBudget {
    let dp = p.dp;
    PodDisruptionBudget {
        metadata: meta(dp, &names(dp).workers),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::String(DISRUPTION_SHARE.into())),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(dp)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

/// Batches only to the trainer pods; metrics to anyone in the cluster (Prometheus).
pub fn network_policy(p: &Valid) -> NetworkPolicy {
    let dp = p.dp;
    let port = |p: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(p)),
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    };
    NetworkPolicy {
        metadata: meta(dp, &names(dp).workers),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(dp)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(LabelSelector {
                            match_labels: Some(dp.spec.trainer_selector.clone()),
                            ..LabelSelector::default()
                        }),
                        ..NetworkPolicyPeer::default()
                    }]),
                    ports: Some(vec![port(BATCH_PORT)]),
                },
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        namespace_selector: Some(LabelSelector::default()),
                        ..NetworkPolicyPeer::default()
                    }]),
                    ports: Some(vec![port(METRICS_PORT)]),
                },
            ]),
            ..NetworkPolicySpec::default()
        }),
    }
}

/// The generated pipeline token (created once; the operator never overwrites it).
pub fn token_secret(p: &Valid, token: &str) -> Secret {
    let dp = p.dp;
    Secret {
        metadata: meta(dp, &names(dp).token_secret),
        string_data: Some(BTreeMap::from([("token".into(), token.into())])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    }
}

#[cfg(test)]
mod tests {
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
        let d = deployment(&valid(&dp), 3);
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
        let d = deployment(&valid(&dp), 1);
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
        let d = deployment(&valid(&example()), 1);
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
        let p = deployment(&valid(&dp), 4);
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
        let p = deployment(&valid(&dp), 4);
        let anti = anti_affinity(&p);
        assert!(anti
            .required_during_scheduling_ignored_during_execution
            .is_some());
        // Pack: preferred co-location, no spread constraint.
        dp.spec.placement.mode = PlacementMode::Pack;
        let p = deployment(&valid(&dp), 4);
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
            serde_json::from_str(include_str!("../../docs/spread.json")).unwrap();
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
        let d = deployment(&valid(&dp), number("workers") as i32);
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
        let d = deployment(&valid(&dp), 1);
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
        let np = network_policy(&valid(&dp));
        let rules = np.spec.as_ref().unwrap().ingress.as_ref().unwrap();
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
        let secret = token_secret(&valid(&dp), "abc");
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
}
