//! Pure resource builders: a validated pipeline (and a few decided numbers) in, the objects
//! the operator applies out. No I/O here, so every builder is unit-tested on its own.

use crate::crd::{S3Source, TlsMode};
use crate::labels::{labels, meta, names, selector_labels};
use crate::placement::{affinity, spread};
use crate::validate::{DataSource, Valid};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::EmptyDirVolumeSource;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Lifecycle,
    LifecycleHandler, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretKeySelector, SecretVolumeSource,
    SecurityContext, Service, ServicePort, ServiceSpec, SleepAction, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};
use stoker_config::{Concurrency, S3Connection, Serving, WorkerConfig};

pub const BATCH_PORT: i32 = 7700;
pub const METRICS_PORT: i32 = 9090;
const TOKEN_DIR: &str = "/var/run/stoker";
/// The workers' certificate: beside the token's folder, not in it (a Secret volume is
/// read-only, so no mount point can be made inside it).
const TLS_DIR: &str = "/var/run/stoker-tls";
const DATA_DIR: &str = "/data";
/// The worker's --drain-timeout-s; the grace period adds the preStop pause and a margin.
const DRAIN_SECONDS: i64 = 30;
const PRESTOP_SECONDS: i64 = 5;
/// UID of the image's non-root user (distroless "nonroot").
const RUN_AS_USER: i64 = 65532;

/// What each worker is told: the dataset, its preprocessing and sampling exactly as the spec
/// says (the same types), the pod's ports, token and CPU budget.
pub fn worker_config(p: &Valid) -> WorkerConfig {
    let (dp, s) = (p.dp, &p.dp.spec);
    let tls = s.tls.mode == TlsMode::Operator;
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
            tls_cert: tls.then(|| format!("{TLS_DIR}/tls.crt")),
            tls_key: tls.then(|| format!("{TLS_DIR}/tls.key")),
            insecure_plaintext: !tls,
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

/// The token (always), a scratch /tmp (the root filesystem is read-only), the certificate
/// (unless plaintext) and the dataset volume (read-only) when the source is one: (mounts,
/// volumes).
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
    if p.dp.spec.tls.mode == TlsMode::Operator {
        mounts.push(VolumeMount {
            name: "tls".into(),
            mount_path: TLS_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "tls".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(n.tls_secret.clone()),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
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

/// The worker Deployment at `replicas`; `cert_not_after`: when the workers' certificate
/// expires (a renewed one changes the pod template, which rolls the workers onto it).
pub fn deployment(p: &Valid, replicas: i32, cert_not_after: Option<u64>) -> Deployment {
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
                    annotations: cert_not_after.map(|t| {
                        BTreeMap::from([(crate::credentials::NOT_AFTER.into(), t.to_string())])
                    }),
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

/// Ingress to the workers: the batch port from the trainer pods, the metrics port from pods of
/// the pipeline's namespace and of `metrics_from` (where Prometheus runs), nothing else.
pub fn network_policy(p: &Valid, metrics_from: &[String]) -> NetworkPolicy {
    let dp = p.dp;
    let namespaces: BTreeSet<String> = dp
        .namespace()
        .into_iter()
        .chain(metrics_from.iter().cloned())
        .collect();
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
                        namespace_selector: Some(LabelSelector {
                            match_expressions: Some(vec![LabelSelectorRequirement {
                                key: "kubernetes.io/metadata.name".into(),
                                operator: "In".into(),
                                values: Some(namespaces.into_iter().collect()),
                            }]),
                            ..LabelSelector::default()
                        }),
                        ..NetworkPolicyPeer::default()
                    }]),
                    ports: Some(vec![port(METRICS_PORT)]),
                },
            ]),
            ..NetworkPolicySpec::default()
        }),
    }
}

#[cfg(test)]
mod tests;
