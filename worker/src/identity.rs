//! What identifies a plan: the data version, the order and every preprocessing knob. Two
//! workers of one identity serve the same bytes for the same request.

use crate::pipeline::{Pipeline, PipelineConfig};

/// What fixes a sample's tensors besides its data: preset, limits, tokenizer and template.
pub fn preprocessing_parts(config: &PipelineConfig, text_fingerprint: u64) -> [Vec<u8>; 3] {
    [
        serde_json::to_vec(&config.preset).expect("preset serializes"),
        serde_json::to_vec(&config.limits).expect("limits serialize"),
        text_fingerprint.to_le_bytes().to_vec(),
    ]
}

/// [`preprocessing_parts`] as one number: the lengths `--balance-ranks` reads must have been
/// measured with the same.
pub fn preprocessing_id(config: &PipelineConfig, text_fingerprint: u64) -> u64 {
    let parts = preprocessing_parts(config, text_fingerprint);
    crate::dataset::index::fingerprint(&parts)
}

/// The identity of what a worker serves: data version, order and every preprocessing knob.
pub fn plan_id(p: &Pipeline) -> u64 {
    let mut parts: Vec<Vec<u8>> = vec![
        p.index.version.to_le_bytes().to_vec(),
        p.plan.seed.to_le_bytes().to_vec(),
        p.plan.global_batch_size.to_le_bytes().to_vec(),
    ];
    parts.extend(preprocessing_parts(&p.config, p.text.fingerprint));
    // Shaped plans are other plans (unshaped ones keep their ids).
    let shaping = p.plan.shaping();
    if shaping.balance_ranks {
        parts.push(b"balance-ranks".to_vec());
    }
    if shaping.bucket_by_length {
        parts.push(b"bucket-by-length".to_vec());
    }
    if let Some(max) = shaping.pack_max_tokens {
        parts.push(format!("pack-max-tokens={max}").into_bytes());
    }
    // `shuffle` plans keep the ids they had before there was a choice.
    match p.plan.order() {
        crate::plan::SampleOrder::Shuffle => {}
        crate::plan::SampleOrder::Runs => {
            let order = format!("order=runs,run-lines={}", p.plan.run_lines());
            parts.push(order.into_bytes());
        }
        other => parts.push(format!("order={}", other.as_str()).into_bytes()),
    }
    // A mix's datasets are in the index version; their shares are here.
    let draws = p.plan.draws_per_epoch();
    if draws.len() > 1 {
        parts.push(format!("mix={draws:?}").into_bytes());
    }
    crate::dataset::index::fingerprint(&parts)
}
