//! Where the tokenizer comes from: a local path, `$STOKER_TOKENIZER`, the cache
//! `scripts/setup-tokenizer.sh` fills, or the object store.
//!
//! From the object store (`--tokenizer s3://bucket/path/tokenizer.json`, or a prefix holding
//! `tokenizer.json`) a worker image needs no tokenizer baked in. Fetched
//! once at start with the dataset's S3 settings, checked (it must parse and know the Qwen-VL
//! vision tokens), and cached on local disk under a name derived from the URI, so a restart
//! in the same pod reuses it (re-checked before use).

use crate::preprocess::preset::Preset;
use crate::preprocess::text::TextProcessor;
use crate::source::{read_file_at_most, Store, TOKENIZER_CAP};
use std::path::{Path, PathBuf};
use stoker_config::{Preprocessing, S3Connection};

/// Tokens every Qwen-VL chat format needs; a tokenizer without them is the wrong file.
const REQUIRED_TOKENS: [&str; 3] = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"];

/// True when `--tokenizer` names an object-store location rather than a local path.
pub fn is_remote(tokenizer: &str) -> bool {
    tokenizer.starts_with("s3://")
}

/// The local tokenizer `pre` names: `--tokenizer`, else `$STOKER_TOKENIZER`, else the cache
/// `scripts/setup-tokenizer.sh` fills.
pub fn local_path(pre: &Preprocessing) -> anyhow::Result<PathBuf> {
    if let Some(p) = &pre.tokenizer {
        return Ok(p.into());
    }
    if let Ok(p) = std::env::var("STOKER_TOKENIZER") {
        return Ok(p.into());
    }
    let p = stoker_config::cache_root().join("qwen-tokenizer");
    anyhow::ensure!(
        p.join("tokenizer.json").exists(),
        "no tokenizer given and none at {}: pass --tokenizer PATH, set STOKER_TOKENIZER, or run scripts/setup-tokenizer.sh",
        p.display()
    );
    Ok(p)
}

/// The text processor `pre` describes, fetching a remote tokenizer first.
pub async fn text_processor(
    pre: &Preprocessing,
    s3: &S3Connection,
) -> anyhow::Result<TextProcessor> {
    let tokenizer = match &pre.tokenizer {
        Some(uri) if is_remote(uri) => {
            let cache = std::env::temp_dir().join("stoker-tokenizers");
            fetch(uri, s3, &cache).await?
        }
        _ => local_path(pre)?,
    };
    let template = pre.template.as_deref().map(Path::new);
    TextProcessor::load(&tokenizer, template, &Preset::from_config(pre))
}

/// Fetches the tokenizer at `uri` into `cache_dir` (unless a checked copy is there) and
/// returns the folder that holds `tokenizer.json`.
pub async fn fetch(uri: &str, s3: &S3Connection, cache_dir: &Path) -> anyhow::Result<PathBuf> {
    let (folder, file) = match uri.rsplit_once('/') {
        Some((folder, file)) if file.ends_with(".json") => (folder, file),
        _ => (uri.trim_end_matches('/'), "tokenizer.json"),
    };
    let dir = cache_dir.join(format!("{:016x}", fnv1a(uri.as_bytes())));
    let cached = dir.join("tokenizer.json");
    if cached.exists() && check(&read_file_at_most(&cached, TOKENIZER_CAP)?).is_ok() {
        return Ok(dir);
    }
    let store = Store::open(folder, s3).await?;
    let bytes = store
        .get_at_most(file, TOKENIZER_CAP)
        .await
        .map_err(|e| anyhow::anyhow!("tokenizer {uri}: {e}"))?;
    check(&bytes).map_err(|e| anyhow::anyhow!("tokenizer {uri}: {e}"))?;
    std::fs::create_dir_all(&dir)?;
    let tmp = dir.join(format!("tokenizer.json.{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, &cached)?;
    tracing::info!(
        "tokenizer {uri}: {} bytes, cached at {}",
        bytes.len(),
        cached.display()
    );
    Ok(dir)
}

/// The bytes are a tokenizer.json with the Qwen-VL vision tokens.
fn check(bytes: &[u8]) -> anyhow::Result<()> {
    let t = tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| anyhow::anyhow!("not a tokenizer.json: {e}"))?;
    for token in REQUIRED_TOKENS {
        anyhow::ensure!(
            t.token_to_id(token).is_some(),
            "has no {token} token (not a Qwen-VL tokenizer)"
        );
    }
    Ok(())
}

/// A stable name for a URI's cache folder (not a security boundary: the content is checked).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}
