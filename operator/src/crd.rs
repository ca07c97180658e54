//! The `DataPipeline` custom resource (stoker.dev/v1alpha1): the types, their schema with CEL
//! validation rules, and the status. Reconcile logic lives elsewhere; these are plain data.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::core::{Message, Rule};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
pub use stoker_config::{
    PixelDtype, Preprocessing, PresetName, S3Connection, Sampling, ServingLimits,
};

/// A pool of Stoker workers that preprocesses one dataset for one training job and streams
/// batches to its data-parallel ranks, scaled on the trainers' wait ratio.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "stoker.dev",
    version = "v1alpha1",
    kind = "DataPipeline",
    plural = "datapipelines",
    shortname = "dp",
    namespaced,
    doc = "A pool of Stoker workers feeding one training job: see spec for the dataset, preprocessing, plan, placement and autoscaling.",
    status = "DataPipelineStatus",
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 55").message("metadata.name must be a DNS-1035 label of at most 55 characters (lowercase letters, digits and '-', starting with a letter): the workers' Service is named <name>-workers"),
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".status.desiredReplicas"}"#,
    printcolumn = r#"{"name":"Wait","type":"number","jsonPath":".status.waitRatio.worst","description":"worst trainer rank's wait ratio"}"#,
    printcolumn = r#"{"name":"Rate","type":"number","jsonPath":".status.samplesPerSecond","description":"samples/s the trainers consume"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.autoscaling) || (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas) || self.replicas == 0").message("spec.replicas must lie within [autoscaling.minReplicas, autoscaling.maxReplicas]"))]
pub struct DataPipelineSpec {
    /// Where the dataset is: an S3 (or S3-compatible) prefix, or a volume.
    pub source: Source,
    /// How samples are preprocessed (the model family's processor, with overrides): the
    /// worker's own configuration type, so the schema and the worker's flags agree.
    #[serde(default)]
    pub preprocessing: Preprocessing,
    /// The deterministic sample order and batch geometry.
    pub plan: PlanSpec,
    /// How much each worker takes from the trainers: connections, requests in flight per
    /// connection, idle timeout, and the workers-per-rank hint it gives clients: the worker's
    /// own serving limits, so the schema and its flags agree.
    #[serde(default)]
    pub serving: ServingLimits,
    /// Worker pods: image, resources, scheduling.
    #[serde(default)]
    pub worker: WorkerTemplate,
    /// Where worker pods go: spread across nodes (default) or packed.
    #[serde(default)]
    pub placement: Placement,
    /// Worker count when autoscaling is absent, and the starting count when it is present
    /// (the scale subresource: `kubectl scale dp/NAME --replicas=N`).
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 4096))]
    pub replicas: i32,
    /// Scale workers on the trainers' wait ratio. Absent: `replicas` holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// Labels of the trainer pods: the only pods the NetworkPolicy admits to the batch port.
    /// Required and non-empty (an empty selector would admit every pod of the namespace).
    #[x_kube(validation = Rule::new("size(self) > 0").message("trainerSelector must name at least one label of the trainer pods (an empty selector would admit every pod of the namespace to the batch port)"))]
    pub trainer_selector: BTreeMap<String, String>,
    /// Secret with the pipeline token under key `token`. Absent: the operator generates
    /// `<name>-token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<String>,
    /// How ranks and workers talk: TLS with certificates the operator issues (default), or
    /// plaintext when asked for by name.
    #[serde(default, skip_serializing_if = "is_default")]
    pub tls: Tls,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Tls {
    /// Operator (default): TLS with certificates the operator issues; trainers trust the CA
    /// certificate in ConfigMap `<name>-ca`. InsecurePlaintext: no TLS (docs/security.md says
    /// what that gives up).
    #[serde(default)]
    pub mode: TlsMode,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum TlsMode {
    /// The operator keeps a CA for the pipeline (Secret `<name>-tls-ca`), issues the workers a
    /// certificate for the Service's names (Secret `<name>-tls`, renewed before it expires)
    /// and publishes the CA certificate for trainers (ConfigMap `<name>-ca`, key `ca.crt`).
    #[default]
    Operator,
    /// Workers serve plaintext: any network peer reads the token and the batches, and anything
    /// at a dialled address can serve forged batches. Trainers dial with
    /// `insecure_plaintext=True`.
    InsecurePlaintext,
}

fn one() -> i32 {
    1
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.s3) != has(self.volume)").message("set exactly one of source.s3 and source.volume"))]
pub struct Source {
    /// An S3 or S3-compatible prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Source>,
    /// A PersistentVolumeClaim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeSource>,
    /// Where the samples' media paths resolve when the images and videos lie apart from the
    /// shards (LLaVA's `image_folder`): s3://bucket/prefix, any bucket the source's connection
    /// and credentials reach, or with a volume source a folder inside the volume. A path that
    /// leaves it is a bad line. Absent: paths are relative to each shard's folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_root: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// s3://bucket/prefix of the shards (images are found relative to them, unless
    /// `source.mediaRoot` says where).
    #[x_kube(validation = Rule::new("self.startsWith('s3://') && size(self) > 5").message("source.s3.uri must look like s3://bucket/prefix"))]
    pub uri: String,
    /// Endpoint, region and addressing: the worker's own S3 settings.
    #[serde(flatten)]
    pub connection: S3Connection,
    /// Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; absent: the pod's identity
    /// (IRSA, instance profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSource {
    /// PersistentVolumeClaim holding the dataset (mounted read-only).
    pub claim_name: String,
    /// Folder inside the volume.
    #[serde(default)]
    pub path: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.globalBatchSize >= self.worldSize").message("plan.globalBatchSize must be at least plan.worldSize (every rank gets a sample)"))]
pub struct PlanSpec {
    /// Seed, global batch size and what to do with a sample that cannot be served: the
    /// worker's own sampling settings.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Data-parallel ranks of the trainer.
    #[schemars(range(min = 1))]
    pub world_size: i32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTemplate {
    /// Container image with the `stoker` binary.
    #[serde(default = "default_image")]
    pub image: String,
    /// CPU and memory of each worker; the CPU limit sets its preprocessing threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Nodes the workers may run on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the workers tolerate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

pub fn default_image() -> String {
    format!("ghcr.io/stoker-dev/stoker:{}", env!("CARGO_PKG_VERSION"))
}

impl Default for WorkerTemplate {
    fn default() -> Self {
        WorkerTemplate {
            image: default_image(),
            resources: None,
            env: Vec::new(),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum PlacementMode {
    /// One worker per topology domain where possible (no NIC carries them all).
    #[default]
    Spread,
    /// As few domains as possible (small jobs: less cross-node traffic).
    Pack,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.nodeBandwidthGbps) || has(self.workerEgressGbps)").message("placement.nodeBandwidthGbps needs placement.workerEgressGbps (what one worker sends)"))]
#[x_kube(validation = Rule::new("self.mode == 'Spread' || !has(self.maxWorkersPerNode)").message("placement.maxWorkersPerNode needs mode Spread (Pack places by preference and cannot cap a node)"))]
pub struct Placement {
    /// Spread (one worker per domain where possible) or Pack (as few domains as possible).
    #[serde(default)]
    pub mode: PlacementMode,
    /// Node label that defines a domain.
    #[serde(default = "hostname_key")]
    pub topology_key: String,
    /// At most this many workers per domain, for any value: the operator caps the worker
    /// count at eligible nodes x this (NICSaturationRisk says when it does), and Spread's
    /// hard constraint (max skew 1) keeps any domain from holding more. Spread only. Absent:
    /// derived from the bandwidth budget, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_workers_per_node: Option<i32>,
    /// NIC bandwidth one node may spend on batches, in Gb/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.001))]
    pub node_bandwidth_gbps: Option<f64>,
    /// Batch egress of one busy worker, in Gb/s (measure it: `stoker_worker_bytes_sent_total`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.001))]
    pub worker_egress_gbps: Option<f64>,
}

fn hostname_key() -> String {
    "kubernetes.io/hostname".into()
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            mode: PlacementMode::Spread,
            topology_key: hostname_key(),
            max_workers_per_node: None,
            node_bandwidth_gbps: None,
            worker_egress_gbps: None,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("autoscaling.minReplicas must not exceed maxReplicas"))]
pub struct Autoscaling {
    /// Fewest workers (never scaled below, also without metrics).
    #[serde(default = "one")]
    #[schemars(range(min = 1))]
    pub min_replicas: i32,
    /// Most workers.
    #[schemars(range(min = 1, max = 4096))]
    pub max_replicas: i32,
    /// Keep the worst trainer rank's wait ratio (blocked time / wall time) under this.
    #[serde(default = "default_target")]
    #[x_kube(validation = Rule::new("self > 0.0 && self < 1.0").message("autoscaling.targetWaitRatio must lie in (0, 1)"))]
    pub target_wait_ratio: f64,
    /// Seconds between evaluations.
    #[serde(default = "default_interval")]
    #[schemars(range(min = 1, max = 3600))]
    pub interval_seconds: i32,
    /// Where the trainers' wait metrics come from.
    pub metrics: MetricSource,
    /// HPA-style limits on how fast the worker count moves.
    #[serde(default)]
    pub behavior: Behavior,
}

fn default_target() -> f64 {
    0.05
}

fn default_interval() -> i32 {
    15
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.trainerPods) ? 1 : 0) + (has(self.urls) ? 1 : 0) + (has(self.prometheus) ? 1 : 0) == 1").message("set exactly one of autoscaling.metrics.trainerPods, urls and prometheus"))]
pub struct MetricSource {
    /// Scrape every trainer pod matching a label selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer_pods: Option<TrainerPods>,
    /// Scrape these /metrics URLs (one per rank, or any subset; trainerPods or prometheus
    /// for more than 256 ranks): http://host[:port]/path, at most 2 KiB, not at a
    /// loopback, link-local, unspecified or multicast address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), inner(length(max = 2048)))]
    #[x_kube(validation = metric_urls_rule("self", "autoscaling.metrics.urls", METRIC_URL_FORM))]
    #[x_kube(validation = metric_urls_rule("self", "autoscaling.metrics.urls", METRIC_URL_ADDRESS))]
    pub urls: Option<Vec<String>>,
    /// Ask a Prometheus server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusSource>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainerPods {
    /// Labels of the trainer pods (every rank runs a client with a metrics port).
    #[schemars(length(min = 1))]
    pub selector: BTreeMap<String, String>,
    /// The port of the client's /metrics (`stoker.Loader(metrics_port=...)`).
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrometheusSource {
    /// Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090. The
    /// operator asks it for each rank's stoker_trainer_wait_seconds_total,
    /// stoker_trainer_step_seconds_total and stoker_trainer_samples_total of this pipeline.
    #[schemars(length(max = 2048))]
    #[x_kube(validation = metric_urls_rule("[self]", "autoscaling.metrics.prometheus.url", METRIC_URL_FORM))]
    #[x_kube(validation = metric_urls_rule("[self]", "autoscaling.metrics.prometheus.url", METRIC_URL_ADDRESS))]
    pub url: String,
}

/// The CEL checks of a metric URL `u`, those of the operator's `scrape::url_problem` (which
/// also refuses every other spelling of these addresses, and names that resolve to them, when
/// it connects). Regular expressions on the URL itself: the API server prices CEL by the
/// longest string it may see, and a host taken apart by `url()` has no bound. Its form
/// (http://, a host, no user info, at most 2 KiB, no whitespace or control character to add
/// headers to the request)...
const METRIC_URL_FORM: (&str, &str) = (
    r"size(u) <= 2048 && u.matches(r'^http://([A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?([/?#]|$)') && !u.matches(r'[\p{Z}\p{Cc}]')",
    "a metric URL must be http://host[:port]/path, without user info, at most 2048 bytes, without whitespace or control characters",
);
/// ... and the address an IP literal names: neither the operator's own pod or node
/// (loopback), the metadata service at 169.254.169.254 (link-local), nor unspecified,
/// multicast or broadcast.
const METRIC_URL_ADDRESS: (&str, &str) = (
    r"!u.matches(r'(?i)^http://(localhost|127\.[0-9.]+|0+(\.0+){0,3}|169\.254\.[0-9.]+|2(2[4-9]|3[0-9])\.[0-9.]+|255\.255\.255\.255|\[([0:]*1?|[0:]*:ffff:[^\]]*|fe[89ab][^\]]*|ff[^\]]*)\])(:[0-9]*)?([/?#]|$)')",
    "a metric URL must not name a loopback, link-local, unspecified or multicast address, nor localhost",
);

/// A rule that every URL `u` of the list `urls` (at `field`) passes `check`.
fn metric_urls_rule(urls: &str, field: &str, (check, message): (&str, &str)) -> Rule {
    Rule::new(format!("{urls}.all(u, {check})"))
        .message(Message::Message(format!("{field}: {message}")))
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Behavior {
    /// Adding workers (default: no stabilization, up to 4 pods or 100 % per 15 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_up: Option<ScalingRules>,
    /// Removing workers (default: 300 s stabilization, 1 pod or 10 % per 60 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down: Option<ScalingRules>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingRules {
    /// Recommendations are stabilized over this many seconds (up: the lowest of the window;
    /// down: the highest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub stabilization_window_seconds: Option<i32>,
    /// One change moves at most this many pods ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_pods: Option<i32>,
    /// ... or this percentage of the current count, whichever allows more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_percent: Option<i32>,
    /// Seconds after any change before a change in this direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub period_seconds: Option<i32>,
}

/// Observed state, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataPipelineStatus {
    /// Worker pods that exist.
    #[serde(default)]
    pub replicas: i32,
    /// Worker pods the operator wants.
    #[serde(default)]
    pub desired_replicas: i32,
    /// Worker pods ready to serve.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the worker pods (for the scale subresource and HPAs).
    #[serde(default)]
    pub selector: String,
    /// The trainers' wait ratio at the last evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ratio: Option<WaitRatio>,
    /// Samples per second the trainers consumed at the last evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_second: Option<f64>,
    /// Samples per second one worker delivered when the workers were the bottleneck.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_worker_samples_per_second: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    /// Why the worker count last changed, with the numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_reason: Option<String>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, Scaling, MetricsAvailable, NICSaturationRisk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaitRatio {
    /// The slowest rank's (it sets the step time).
    pub worst: f64,
    pub mean: f64,
}

/// The example pipeline (examples/datapipeline.yaml) as the API server hands it over: in
/// namespace `ml`, with a uid. The unit tests' fixture.
#[cfg(test)]
pub fn example() -> DataPipeline {
    let mut dp: DataPipeline =
        serde_yaml::from_str(include_str!("../../examples/datapipeline.yaml"))
            .expect("the example parses");
    dp.metadata.namespace = Some("ml".into());
    dp.metadata.uid = Some("uid-1".into());
    dp
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    const EXAMPLE: &str = include_str!("../../examples/datapipeline.yaml");

    /// The CEL rules as the API server would run them at admission (kube's client-side
    /// evaluator); `Err` holds the messages.
    fn admit(dp: &DataPipeline) -> Result<(), String> {
        kube::core::cel::validate_cel(dp).map_err(|e| format!("{e:?}"))
    }

    #[test]
    fn crds_folder_is_up_to_date() {
        let generated = crate::crd_yaml().unwrap();
        for (path, committed) in [
            (
                "crds/datapipeline.yaml",
                include_str!("../../crds/datapipeline.yaml"),
            ),
            (
                "charts/stoker/crds/datapipeline.yaml",
                include_str!("../../charts/stoker/crds/datapipeline.yaml"),
            ),
        ] {
            assert!(
                generated == committed,
                "{path} is stale: run `cargo run --release -- crd > {path}`"
            );
        }
    }

    #[test]
    fn schema_has_descriptions_rules_columns_and_scale() {
        let crd = DataPipeline::crd();
        let v = &crd.spec.versions[0];
        let json = serde_json::to_string(v).unwrap();
        for rule in [
            "has(self.s3) != has(self.volume)",
            "self.minReplicas <= self.maxReplicas",
            "self.globalBatchSize >= self.worldSize",
        ] {
            assert!(json.contains(rule), "missing rule {rule}");
        }
        let columns: Vec<&str> = v
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(columns, ["Ready", "Desired", "Wait", "Rate", "Age"]);
        let scale = v.subresources.as_ref().unwrap().scale.as_ref().unwrap();
        assert_eq!(scale.spec_replicas_path, ".spec.replicas");
        assert_eq!(
            scale.label_selector_path.as_deref(),
            Some(".status.selector")
        );
        // Every spec property says what it is (kubectl explain).
        let schema = serde_json::to_value(v.schema.as_ref().unwrap()).unwrap();
        let mut undocumented = Vec::new();
        walk(
            &schema["openAPIV3Schema"]["properties"]["spec"],
            "spec",
            &mut undocumented,
        );
        assert!(
            undocumented.is_empty(),
            "fields without a description: {undocumented:?}"
        );
    }

    fn walk(s: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
        let Some(props) = s.get("properties").and_then(|p| p.as_object()) else {
            return;
        };
        for (name, p) in props {
            let here = format!("{path}.{name}");
            // k8s-openapi's own types (resources, env, tolerations) carry their upstream docs.
            if p.get("description").is_none() {
                missing.push(here.clone());
            }
            walk(p, &here, missing);
            if let Some(items) = p.get("items") {
                walk(items, &here, missing);
            }
        }
    }

    #[test]
    fn serving_limits_are_bounded_by_the_schema() {
        // The API server enforces these bounds at admission, naming the field; kube's
        // client-side evaluator runs CEL rules only, so the bounds are checked here.
        let crd = DataPipeline::crd();
        let schema = serde_json::to_value(crd.spec.versions[0].schema.as_ref().unwrap()).unwrap();
        let serving = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["serving"];
        let bounds = |f: &str| {
            let p = &serving["properties"][f];
            (p["minimum"].as_f64(), p["maximum"].as_f64())
        };
        assert_eq!(bounds("maxConnections"), (Some(1.0), Some(65_536.0)));
        assert_eq!(bounds("linksPerRank"), (Some(0.0), Some(1024.0)));
        assert_eq!(bounds("maxInflightPerConn"), (Some(1.0), Some(1024.0)));
        assert_eq!(bounds("idleTimeoutS"), (Some(1.0), None));
        let defaults: DataPipeline = serde_yaml::from_str(EXAMPLE).unwrap();
        assert_eq!(defaults.spec.serving, ServingLimits::default());
    }

    #[test]
    fn the_examples_are_admitted_and_valid() {
        admit(&example()).unwrap();
        // The real-node walk-through's (docs/operator.md).
        let real: DataPipeline =
            serde_yaml::from_str(include_str!("../../examples/real-nodes/datapipeline.yaml"))
                .expect("the real-node example parses");
        admit(&real).unwrap();
        assert!(crate::validate::validate(&real).is_ok());
    }

    #[test]
    fn a_name_that_cannot_name_the_workers_service_is_not_admitted() {
        let named = |name: &str| {
            let mut dp = example();
            dp.metadata.name = Some(name.into());
            admit(&dp)
        };
        named(&"a".repeat(55)).unwrap();
        for bad in ["qwen.sft", &"a".repeat(56)] {
            let err = named(bad).expect_err(bad);
            assert!(
                err.contains("must be a DNS-1035 label of at most 55"),
                "{err}"
            );
        }
    }

    /// Admission refuses the metric URLs the operator would refuse to read by their text
    /// (`scrape::url_problem`), in a `urls` list and as Prometheus's URL alike.
    #[test]
    fn metric_urls_are_admitted_as_the_operator_reads_them() {
        let with = |url: &str| {
            let mut listed = example();
            let metrics = &mut listed.spec.autoscaling.as_mut().unwrap().metrics;
            metrics.trainer_pods = None;
            metrics.urls = Some(vec!["http://10.0.0.2:9400/metrics".into(), url.into()]);
            let mut prometheus = example();
            let metrics = &mut prometheus.spec.autoscaling.as_mut().unwrap().metrics;
            metrics.trainer_pods = None;
            metrics.prometheus = Some(PrometheusSource { url: url.into() });
            (admit(&listed), admit(&prometheus))
        };
        for fine in [
            "http://10.1.2.3:9400/metrics",
            "http://rank-0.trainers.ml.svc:9400/metrics?x=1",
            "http://[2001:db8::1]:9400/metrics",
            "http://prometheus.monitoring:9090",
        ] {
            assert_eq!(with(fine), (Ok(()), Ok(())), "{fine}");
            assert_eq!(crate::scrape::url_problem(fine), None, "{fine}");
        }
        let form = "a metric URL must be http://host[:port]/path";
        let address = "a metric URL must not name a loopback, link-local";
        for (bad, message) in [
            ("https://rank-0:9400/metrics", form),
            ("http://10.0.0.1:9/m HTTP/1.0\r\nX-Injected: 1", form),
            ("http://10.0.0.1:9/m\u{a0}", form),
            ("http:///metrics", form),
            ("http://user@10.0.0.1:9400/metrics", form),
            (&format!("http://10.0.0.1/{}", "a".repeat(2048)), form),
            ("http://169.254.169.254/latest/meta-data/", address),
            ("http://[fe80::1]:80/metrics", address),
            ("http://[::ffff:169.254.169.254]/", address),
            ("http://0.0.0.0:9090/metrics", address),
            ("http://127.0.0.1:9400/metrics", address),
            ("http://[::1]:9400/metrics", address),
            ("http://LocalHost:9400/metrics", address),
            ("http://224.0.0.1:9400/metrics", address),
            ("http://127.9.9.9/", address),
            ("http://[0:0:0:0:0:0:0:1]/", address),
        ] {
            let (listed, prometheus) = with(bad);
            for (field, err) in [("urls", listed), ("prometheus.url", prometheus)] {
                let err = err.expect_err(bad);
                assert!(
                    err.contains(&format!("autoscaling.metrics.{field}: {message}")),
                    "{bad}: {err}"
                );
            }
            assert!(crate::scrape::url_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn nonsense_is_rejected_with_a_clear_message() {
        type Case = (fn(&mut DataPipelineSpec), &'static str);
        let cases: Vec<Case> = vec![
            (
                |s| s.autoscaling.as_mut().unwrap().min_replicas = 20,
                "minReplicas must not exceed maxReplicas",
            ),
            (
                |s| s.autoscaling.as_mut().unwrap().target_wait_ratio = 1.5,
                "targetWaitRatio must lie in (0, 1)",
            ),
            (
                |s| {
                    s.source.volume = Some(VolumeSource {
                        claim_name: "data".into(),
                        path: String::new(),
                    })
                },
                "exactly one of source.s3 and source.volume",
            ),
            (
                |s| s.source.s3.as_mut().unwrap().uri = "https://bucket/x".into(),
                "must look like s3://bucket/prefix",
            ),
            (
                |s| s.plan.world_size = 1000,
                "globalBatchSize must be at least plan.worldSize",
            ),
            (
                |s| {
                    s.preprocessing.min_pixels = Some(10_000_000);
                },
                "minPixels must not exceed maxPixels",
            ),
            (
                |s| s.autoscaling.as_mut().unwrap().metrics.urls = Some(vec!["http://x".into()]),
                "exactly one of autoscaling.metrics",
            ),
            (
                |s| s.placement.worker_egress_gbps = None,
                "needs placement.workerEgressGbps",
            ),
            (|s| s.replicas = 40, "spec.replicas must lie within"),
            (
                |s| s.trainer_selector.clear(),
                "trainerSelector must name at least one label",
            ),
            (
                |s| {
                    s.placement.mode = PlacementMode::Pack;
                    s.placement.max_workers_per_node = Some(2);
                },
                "maxWorkersPerNode needs mode Spread",
            ),
        ];
        for (mutate, message) in cases {
            let mut dp = example();
            mutate(&mut dp.spec);
            let err = admit(&dp).expect_err(message);
            assert!(err.contains(message), "expected {message:?} in {err}");
        }
    }
}
