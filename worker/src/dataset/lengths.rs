//! Every sample's sequence length for one set of preprocessing settings, stored beside the
//! index (`stoker dataset stats --write-lengths`), so a worker knows each sample's cost without
//! decoding a pixel: the token-aware plan assigns ranks and buckets lengths by it.

use crate::source::Store;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;

/// Where `stoker dataset stats --write-lengths` writes the lengths, at the dataset root.
pub const LENGTHS_KEY: &str = "stoker-lengths.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleLengths {
    /// The index they were measured on ([`DatasetIndex::version`](super::index::DatasetIndex)).
    pub index_version: u64,
    /// The preprocessing they were measured with (preset, limits, tokenizer and template).
    pub preprocessing: u64,
    /// Tokens per sample id (0 for a sample that could not be loaded).
    pub tokens: Vec<u32>,
}

impl SampleLengths {
    /// The stored lengths, if they describe this index and these preprocessing settings.
    pub async fn load(
        store: &Store,
        index_version: u64,
        preprocessing: u64,
        num_samples: u64,
    ) -> anyhow::Result<SampleLengths> {
        let fix =
            "run `stoker dataset stats DATA --write-lengths` with the worker's preprocessing flags";
        let data = store.get(LENGTHS_KEY).await.map_err(|e| {
            anyhow::anyhow!(
                "--balance-ranks, --bucket-by-length and --pack-max-tokens need {}: {e}; {fix}",
                store.describe(LENGTHS_KEY)
            )
        })?;
        let lengths: SampleLengths = serde_json::from_slice(&data)
            .map_err(|e| anyhow::anyhow!("{}: {e}", store.describe(LENGTHS_KEY)))?;
        anyhow::ensure!(
            lengths.index_version == index_version && lengths.tokens.len() as u64 == num_samples,
            "{} was measured on another index (the shards changed); {fix}",
            store.describe(LENGTHS_KEY)
        );
        anyhow::ensure!(
            lengths.preprocessing == preprocessing,
            "{} was measured with other preprocessing settings (preset, limits, tokenizer or template); {fix}",
            store.describe(LENGTHS_KEY)
        );
        Ok(lengths)
    }

    /// Every sample fits a pack of `max_tokens`, or an error naming the longest.
    pub fn check_fit(&self, max_tokens: u32) -> anyhow::Result<()> {
        let longest = self
            .tokens
            .iter()
            .enumerate()
            .max_by_key(|&(i, &t)| (t, Reverse(i)));
        match longest {
            Some((id, &tokens)) if tokens > max_tokens => anyhow::bail!(
                "sample {id} is {tokens} tokens, longer than --pack-max-tokens {max_tokens}: \
                 raise it to at least {tokens}, or truncate samples with --max-length"
            ),
            _ => Ok(()),
        }
    }
}
