//! A rank slice → its batch: the slice's samples loaded side by side, failures skipped by name
//! (a pack shortened by its skipped samples) or failing the request, then collated, packed
//! when the plan packs.

use crate::batch::{collate, Batch, PreparedSample};
use crate::metrics::Stage;
use crate::pack::{collate_packed, RopeLayout};
use crate::pipeline::{OnError, Pipeline, SampleFailure};
use crate::plan::RankSlice;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Instant;
use stoker_wire::Skipped;

impl Pipeline {
    /// Loads a rank slice's samples (concurrently, in order) and collates them, packed if the
    /// slice is. Under `OnError::Skip` failed samples are listed in `skipped` (a pack gets
    /// shorter); under `Fail`, and for a transient store failure always, the first failure is
    /// returned.
    pub async fn build_batch(self: &Arc<Self>, slice: &RankSlice) -> Result<Batch, SampleFailure> {
        let ids = &slice.samples;
        let mut pack_sizes = slice.packs.clone();
        // Each sample's pack, so a skipped sample shortens its own.
        let pack_of: Vec<usize> = slice
            .packs
            .iter()
            .flatten()
            .enumerate()
            .flat_map(|(p, &n)| std::iter::repeat_n(p, n))
            .collect();
        let mut pack_of = pack_of.into_iter();
        let spans = self.request_spans(ids);
        let results: Vec<Result<PreparedSample, SampleFailure>> =
            futures::stream::iter(ids.iter().copied().zip(spans))
                .map(|(id, span)| {
                    let this = self.clone();
                    async move { this.load_sample_of_request(id, span).await }
                })
                .buffered(self.config.sample_parallelism.clamp(1, ids.len().max(1)))
                .collect()
                .await;
        let mut samples = Vec::with_capacity(results.len());
        let mut skipped = Vec::new();
        for r in results {
            let pack = pack_of.next();
            match r {
                Ok(s) => samples.push(s),
                Err(f) if self.config.on_error == OnError::Skip && !f.transient => {
                    if let (Some(sizes), Some(p)) = (&mut pack_sizes, pack) {
                        sizes[p] -= 1;
                    }
                    tracing::warn!("skipping {f}");
                    skipped.push(Skipped {
                        sample_id: f.sample_id,
                        reason: f.to_string(),
                    })
                }
                Err(f) => return Err(f),
            }
        }
        let t = Instant::now();
        let pad = self.text.pad_id;
        let batch = match pack_sizes {
            Some(sizes) => {
                let dated = self.config.preset.video.timestamps;
                collate_packed(samples, &sizes, skipped, pad, self.rope_layout(), dated)
            }
            None => collate(samples, skipped, pad),
        };
        self.metrics.observe_stage(Stage::Collate, t.elapsed());
        Ok(batch)
    }

    fn rope_layout(&self) -> RopeLayout {
        let preset = &self.config.preset;
        RopeLayout {
            image_token: self.text.image_token(),
            video_token: self.text.video_token(),
            merge_size: preset.merge_size.into(),
            // The released Qwen2.5-VL checkpoints' vision_config.tokens_per_second.
            tokens_per_second: preset.video.second_per_grid.then_some(2),
        }
    }
}
