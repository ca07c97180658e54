//! What the operator checks before it builds anything: rules the API server's CEL cannot
//! express (they need parsing, or knowledge of what the operator and worker support). A spec
//! that fails gets a `Ready=False/InvalidSpec` condition and a Warning Event naming every
//! problem; nothing is applied for it until it changes.

use crate::crd::{DataPipeline, DataPipelineSpec, MetricSource, S3Source, VolumeSource};
use crate::labels::MAX_NAME_LEN;
use crate::scrape::url_problem;
use kube::ResourceExt;

/// A pipeline the operator can honour, with what validation parsed kept: what the builders
/// take (they never re-read what this decided, nor default what it rejected).
pub struct Valid<'a> {
    pub dp: &'a DataPipeline,
    pub source: DataSource<'a>,
    /// CPU threads from the CPU limit (else request), rounded up; `None`: the worker's default.
    pub cpu_threads: Option<u32>,
}

/// Where the dataset is: exactly one (admission's CEL says so; validation makes sure).
#[derive(Debug, Clone, Copy)]
pub enum DataSource<'a> {
    S3(&'a S3Source),
    Volume(&'a VolumeSource),
}

/// `dp` as a [`Valid`] pipeline, or every problem it has (see [`problems`]).
pub fn validate(dp: &DataPipeline) -> Result<Valid<'_>, Vec<String>> {
    let mut problems = problems(&dp.spec);
    problems.extend(name_problem(&dp.name_any()));
    let source = match (&dp.spec.source.s3, &dp.spec.source.volume) {
        (Some(s3), None) => DataSource::S3(s3),
        (None, Some(v)) => DataSource::Volume(v),
        _ => return Err(problems),
    };
    if !problems.is_empty() {
        return Err(problems);
    }
    Ok(Valid {
        dp,
        source,
        cpu_threads: crate::quantity::cpu_threads(&dp.spec),
    })
}

/// Every problem of `spec`, each naming its field; empty when the operator can honour it.
pub fn problems(spec: &DataPipelineSpec) -> Vec<String> {
    let mut out = Vec::new();
    if spec.source.s3.is_some() == spec.source.volume.is_some() {
        out.push("source: set exactly one of source.s3 and source.volume".into());
    }
    if spec.worker.image.trim().is_empty() {
        out.push("worker.image is empty".into());
    }
    if let Some(a) = &spec.autoscaling {
        metric_source(&a.metrics, &mut out);
    }
    if let Some(t) = &spec.preprocessing.tokenizer {
        tokenizer(t, spec.source.s3.is_some(), &mut out);
    }
    mix(spec, &mut out);
    media_roots(spec, &mut out);
    // The schema's bounds, by name: a spec that skipped them (an older CRD) would otherwise
    // reach workers that refuse to start.
    out.extend(spec.serving.problems());
    if let Some(r) = &spec.worker.resources {
        for (kind, list) in [("limits", &r.limits), ("requests", &r.requests)] {
            if let Some(cpu) = list.as_ref().and_then(|l| l.get("cpu")) {
                if crate::quantity::cpu_cores(&cpu.0).is_none() {
                    out.push(format!(
                        "worker.resources.{kind}.cpu {:?} is not a CPU quantity",
                        cpu.0
                    ));
                }
            }
        }
    }
    out
}

/// Mixed datasets are read as the source is: from its bucket with its connection and
/// credentials (S3 prefixes), or from its claim (folders inside the volume, given as
/// `source.volume.path` is).
fn mix(spec: &DataPipelineSpec, out: &mut Vec<String>) {
    let mix = &spec.plan.sampling.mix;
    let Some(s3) = &spec.source.s3 else {
        for m in mix.iter().filter(|m| !is_volume_folder(&m.data)) {
            out.push(format!(
                "plan.mix: {:?} is not a folder inside source.volume (give its path in the \
                 claim, as source.volume.path is)",
                m.data
            ));
        }
        return;
    };
    let bucket = |uri: &str| {
        uri.strip_prefix("s3://")
            .map(|r| r.split('/').next().unwrap_or("").to_string())
    };
    for m in mix {
        if bucket(&m.data).is_none() || bucket(&m.data) != bucket(&s3.uri) {
            out.push(format!(
                "plan.mix: {:?} is not in source.s3's bucket ({})",
                m.data, s3.uri
            ));
        }
    }
}

/// Media roots are read as the source is: any S3 prefix its connection and credentials reach
/// (another bucket too), or a folder inside its volume.
fn media_roots(spec: &DataPipelineSpec, out: &mut Vec<String>) {
    let source = spec
        .source
        .media_root
        .iter()
        .map(|m| ("source.mediaRoot", m));
    let mixed = spec.plan.sampling.mix.iter();
    let mixed = mixed.filter_map(|m| m.media_root.as_ref().map(|r| ("plan.mix[].mediaRoot", r)));
    for (field, root) in source.chain(mixed) {
        if spec.source.s3.is_some() {
            let bucket = root.strip_prefix("s3://").map(|r| r.split('/').next());
            if !matches!(bucket, Some(Some(b)) if !b.is_empty()) {
                out.push(format!(
                    "{field}: {root:?} is not an s3://bucket/prefix (the source is on S3)"
                ));
            }
        } else if !is_volume_folder(root) {
            out.push(format!(
                "{field}: {root:?} is not a folder inside source.volume (give its path in the \
                 claim, as source.volume.path is)"
            ));
        }
    }
}

/// A relative folder that stays inside the volume.
fn is_volume_folder(path: &str) -> bool {
    let path = path.trim_end_matches('/');
    !path.is_empty()
        && !path.starts_with('/')
        && !path.contains("://")
        && path
            .split('/')
            .all(|part| part != ".." && part != "." && !part.is_empty())
}

fn metric_source(m: &MetricSource, out: &mut Vec<String>) {
    let urls = m.urls.iter().flatten().map(|u| ("urls", u));
    let prometheus = m.prometheus.iter().map(|p| ("prometheus.url", &p.url));
    for (field, url) in urls.chain(prometheus) {
        if let Some(problem) = url_problem(url) {
            out.push(format!("autoscaling.metrics.{field}: {url:?} {problem}"));
        }
    }
}

/// Why `name` cannot name a pipeline (a CRD installed before its CEL rule admits it): a name
/// with a dot or over [`MAX_NAME_LEN`] would run workers whose Service cannot be applied.
fn name_problem(name: &str) -> Option<String> {
    let dns_1035 = name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    (!dns_1035 || name.len() > MAX_NAME_LEN).then(|| {
        format!(
            "metadata.name {name:?} must be a DNS-1035 label of at most {MAX_NAME_LEN} characters \
             (lowercase letters, digits and '-', starting with a letter): the workers' Service \
             is named <name>-workers"
        )
    })
}

fn tokenizer(t: &str, has_s3: bool, out: &mut Vec<String>) {
    match t.split_once("://") {
        Some(("s3", _)) if !has_s3 => out.push(format!(
            "preprocessing.tokenizer {t:?} is on S3 but source.s3 is not set (the worker \
             fetches it with the source's endpoint and credentials)"
        )),
        Some(("s3", _)) | None => {}
        Some((scheme, _)) => out.push(format!(
            "preprocessing.tokenizer {t:?}: scheme {scheme}:// is not supported (s3:// or a \
             path in the image or a mounted volume)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DataPipelineSpec {
        crate::crd::example().spec
    }

    #[test]
    fn a_name_is_a_dns_1035_label_short_enough_for_every_derived_name() {
        let longest = "a".repeat(MAX_NAME_LEN);
        for ok in ["qwen-sft", "a", "x1-2", longest.as_str()] {
            assert_eq!(name_problem(ok), None, "{ok}");
            let names = crate::labels::names(&named(ok));
            for derived in [
                names.workers,
                names.ca_secret,
                names.tls_secret,
                names.token_secret,
            ] {
                assert!(derived.len() <= 63, "{derived}");
            }
        }
        let too_long = "a".repeat(MAX_NAME_LEN + 1);
        for bad in [
            "qwen.sft",
            "Qwen",
            "1qwen",
            "qwen-",
            "qwen_sft",
            too_long.as_str(),
        ] {
            let problem = name_problem(bad).unwrap_or_else(|| panic!("{bad} admitted"));
            assert!(
                problem.contains("DNS-1035 label of at most 55"),
                "{problem}"
            );
            assert!(validate(&named(bad)).is_err(), "{bad}");
        }
        // Admission says the same, with the same bound.
        let crd = crate::crd_yaml().unwrap();
        assert!(crd.contains(&format!("size(self.metadata.name) <= {MAX_NAME_LEN}")));
    }

    fn named(name: &str) -> DataPipeline {
        let mut dp = crate::crd::example();
        dp.metadata.name = Some(name.into());
        dp
    }

    #[test]
    fn the_example_is_valid() {
        assert_eq!(problems(&spec()), Vec::<String>::new());
    }

    #[test]
    fn a_valid_pipeline_carries_its_source_and_cpu_budget() {
        let mut dp = crate::crd::example();
        let v = validate(&dp).unwrap();
        assert!(matches!(v.source, DataSource::S3(s3) if s3.uri == "s3://datasets/llava-sft"));
        assert_eq!(v.cpu_threads, Some(4));
        // Neither source, or both (a spec that skipped admission's CEL): named, never built.
        let both = dp.spec.source.s3.clone();
        dp.spec.source.s3 = None;
        let neither = validate(&dp).err().unwrap();
        assert!(
            neither[0].contains("exactly one of source.s3 and source.volume"),
            "{neither:?}"
        );
        dp.spec.source.s3 = both;
        dp.spec.source.volume = Some(VolumeSource {
            claim_name: "c".into(),
            path: String::new(),
        });
        assert!(validate(&dp).is_err());
    }

    #[test]
    fn each_problem_names_its_field() {
        let mut s = spec();
        s.worker.image = " ".into();
        s.preprocessing.tokenizer = Some("https://hub/tokenizer.json".into());
        let a = s.autoscaling.as_mut().unwrap();
        a.metrics.trainer_pods = None;
        a.metrics.urls = Some(vec![
            "https://rank0:9400/metrics".into(),
            "http://rank1:9400/metrics\r\nX-Injected: 1".into(),
        ]);
        let cpu = k8s_openapi::apimachinery::pkg::api::resource::Quantity("two".into());
        s.worker.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
            limits: Some([("cpu".to_string(), cpu)].into()),
            ..Default::default()
        });
        let p = problems(&s).join("\n");
        for needle in [
            "worker.image is empty",
            "scheme https:// is not supported",
            "autoscaling.metrics.urls: \"https://rank0:9400/metrics\" is not an http:// URL",
            "contains whitespace or a control character",
            "worker.resources.limits.cpu \"two\"",
        ] {
            assert!(p.contains(needle), "{needle} missing from:\n{p}");
        }
    }

    #[test]
    fn mixed_datasets_are_s3_prefixes_in_the_sources_bucket() {
        let mut s = spec();
        s.plan.sampling.mix = vec![
            "s3://datasets/vqa=1".parse().unwrap(),
            "s3://other/chat=2".parse().unwrap(),
            "vqa=1".parse().unwrap(),
        ];
        assert_eq!(
            problems(&s),
            [
                "plan.mix: \"s3://other/chat\" is not in source.s3's bucket (s3://datasets/llava-sft)",
                "plan.mix: \"vqa\" is not in source.s3's bucket (s3://datasets/llava-sft)"
            ]
        );
    }

    #[test]
    fn with_a_volume_source_mixed_datasets_are_folders_inside_the_volume() {
        let mut s = spec();
        s.source.s3 = None;
        s.source.volume = Some(crate::crd::VolumeSource {
            claim_name: "pvc".into(),
            path: "sft/chat".into(),
        });
        s.preprocessing.tokenizer = None; // the fixture's is on S3
        let mix = |data: &[&str]| -> Vec<_> {
            data.iter()
                .map(|d| format!("{d}=1").parse().unwrap())
                .collect()
        };
        s.plan.sampling.mix = mix(&["sft/vqa", "multi-turn/"]);
        assert!(problems(&s).is_empty(), "{:?}", problems(&s));
        let outside = ["s3://datasets/vqa", "/etc", "sft/../../x", "", "a//b"];
        s.plan.sampling.mix = mix(&outside);
        let p = problems(&s);
        assert_eq!(p.len(), outside.len(), "{p:?}");
        assert!(p[0].contains("\"s3://datasets/vqa\" is not a folder inside source.volume"));
    }

    #[test]
    fn media_roots_are_read_as_the_source_is() {
        let mut s = spec();
        s.source.media_root = Some("s3://images/coco".into());
        s.plan.sampling.mix = vec!["s3://datasets/vqa=1,media-root=s3://other-bucket"
            .parse()
            .unwrap()];
        assert!(problems(&s).is_empty(), "{:?}", problems(&s));
        s.source.media_root = Some("/images".into());
        s.plan.sampling.mix = vec!["s3://datasets/vqa=1,media-root=s3:///x".parse().unwrap()];
        assert_eq!(
            problems(&s),
            [
                "source.mediaRoot: \"/images\" is not an s3://bucket/prefix (the source is on S3)",
                "plan.mix[].mediaRoot: \"s3:///x\" is not an s3://bucket/prefix (the source is on S3)"
            ]
        );
        s.source.s3 = None;
        s.source.volume = Some(crate::crd::VolumeSource {
            claim_name: "pvc".into(),
            path: "sft/chat".into(),
        });
        s.preprocessing.tokenizer = None; // the fixture's is on S3
        s.source.media_root = Some("images/coco".into());
        s.plan.sampling.mix = vec!["vqa=1,media-root=../../etc".parse().unwrap()];
        let p = problems(&s);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("plan.mix[].mediaRoot: \"../../etc\" is not a folder inside"));
    }

    #[test]
    fn serving_limits_out_of_range_are_named() {
        let mut s = spec();
        s.serving.max_connections = 65_536;
        s.serving.links_per_rank = 1024;
        assert!(problems(&s).is_empty(), "{:?}", problems(&s));
        s.serving.max_connections = 0;
        s.serving.links_per_rank = 1025;
        assert_eq!(
            problems(&s),
            [
                "serving.maxConnections 0 is outside 1..=65536",
                "serving.linksPerRank 1025 is outside 0..=1024"
            ]
        );
    }

    #[test]
    fn an_s3_tokenizer_needs_an_s3_source() {
        let mut s = spec();
        s.preprocessing.tokenizer = Some("s3://models/qwen/tokenizer.json".into());
        assert!(problems(&s).is_empty());
        s.source.s3 = None;
        s.source.volume = Some(crate::crd::VolumeSource {
            claim_name: "data".into(),
            path: String::new(),
        });
        assert!(problems(&s)[0].contains("source.s3 is not set"));
    }
}
