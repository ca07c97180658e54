//! Paths written inside samples and dataset URIs, turned into keys: never above the root
//! they are relative to (the shard's folder, a media root, the dataset root).

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("path {path:?} in {base} is not allowed: {why}")]
pub struct PathError {
    pub path: String,
    pub base: String,
    pub why: String,
}

/// The folder holding several datasets, and each one's folder relative to it (empty or
/// ending in '/'): one store rooted there reads every dataset's shards and images. They must
/// share a bucket (or all be local folders), and none may lie inside another.
pub fn common_root(uris: &[&str]) -> anyhow::Result<(String, Vec<String>)> {
    let mut bucket = None;
    let mut folders = Vec::with_capacity(uris.len());
    for uri in uris {
        let (b, path) = match uri.strip_prefix("s3://") {
            Some(rest) => {
                let (b, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                (Some(b.to_string()), prefix.to_string())
            }
            None => {
                let path = uri.strip_prefix("file://").unwrap_or(uri);
                let path = std::path::Path::new(path)
                    .canonicalize()
                    .map_err(|e| anyhow::anyhow!("{uri}: {e}"))?;
                (None, path.display().to_string())
            }
        };
        anyhow::ensure!(
            folders.is_empty() || b == bucket,
            "mixed datasets must all be in one bucket or all be local folders: {uri} is not \
             where {} is",
            uris[0]
        );
        bucket = b;
        folders.push(
            path.split('/')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>(),
        );
    }
    let common = (0..)
        .take_while(|&i| {
            folders
                .iter()
                .all(|f| f.get(i).is_some() && f[i] == folders[0][i])
        })
        .count();
    let relative: Vec<String> = folders
        .iter()
        .map(|f| f[common..].iter().map(|p| format!("{p}/")).collect())
        .collect();
    for (a, ra) in relative.iter().enumerate() {
        for (b, rb) in relative.iter().enumerate() {
            anyhow::ensure!(
                a == b || !rb.starts_with(ra.as_str()),
                "mixed datasets may not lie inside each other: {} holds {}",
                uris[a],
                uris[b]
            );
        }
    }
    let root = folders[0][..common].join("/");
    let root = match bucket {
        Some(b) => format!("s3://{b}/{root}"),
        None => format!("/{root}"),
    };
    Ok((root, relative))
}

/// Resolves `rel` against the folder of `base_key` (a shard), within the dataset root.
pub fn resolve_relative(base_key: &str, rel: &str) -> Result<String, PathError> {
    let mut folder: Vec<&str> = base_key.split('/').collect();
    folder.pop(); // the shard's file name
    resolve_in(folder, rel, base_key, "the dataset root", "the shard")
}

/// The key of a media path written in shard `shard_key`: beside the shard when `media_root`
/// is empty, else under that root (a [`MediaRoot::uri`](super::MediaRoot::uri)), as the root's URI and the path in
/// it; a path that leaves the root is refused either way.
pub fn media_key(shard_key: &str, media_root: &str, path: &str) -> Result<String, PathError> {
    if media_root.is_empty() {
        return resolve_relative(shard_key, path);
    }
    let key = resolve_in(
        Vec::new(),
        path,
        shard_key,
        "the media root",
        "the media root",
    )?;
    Ok(format!("{media_root}{key}"))
}

/// `rel`'s segments applied to `folder`, never above it: `base` (where the path was written)
/// and the names of the root and of what paths are relative to are for messages.
fn resolve_in<'a>(
    mut folder: Vec<&'a str>,
    rel: &'a str,
    base: &str,
    root: &str,
    relative_to: &str,
) -> Result<String, PathError> {
    let err = |why: String| PathError {
        path: rel.to_string(),
        base: base.to_string(),
        why,
    };
    if rel.is_empty() {
        return Err(err("empty path".into()));
    }
    if rel.starts_with('/') || rel.starts_with('\\') || rel.contains("://") || rel.contains(':') {
        return Err(err(format!(
            "absolute paths and URLs are refused; use a path relative to {relative_to}"
        )));
    }
    if rel.contains('\\') || rel.contains('\0') {
        return Err(err("backslashes and NUL are refused".into()));
    }
    for seg in rel.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if folder.pop().is_none() {
                    return Err(err(format!("it escapes {root}")));
                }
            }
            s => folder.push(s),
        }
    }
    if folder.is_empty() {
        return Err(err(format!("it names {root}")));
    }
    Ok(folder.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_resolve_against_the_shard_folder() {
        assert_eq!(
            resolve_relative("a/b/s.jsonl", "img/x.jpg").unwrap(),
            "a/b/img/x.jpg"
        );
        assert_eq!(
            resolve_relative("a/b/s.jsonl", "../c.png").unwrap(),
            "a/c.png"
        );
        assert_eq!(resolve_relative("s.jsonl", "./x.jpg").unwrap(), "x.jpg");
    }

    #[test]
    fn traversal_and_absolute_paths_are_refused() {
        for bad in [
            "../x.jpg",
            "a/../../x",
            "/etc/passwd",
            "s3://other/x",
            "C:\\x",
            "..\\x",
            "",
        ] {
            let e = resolve_relative("s.jsonl", bad).unwrap_err();
            assert_eq!(e.path, bad);
        }
        let e = resolve_relative("d/s.jsonl", "../../etc/passwd").unwrap_err();
        assert!(e.to_string().contains("escapes the dataset root"), "{e}");
    }

    #[test]
    fn media_paths_resolve_under_the_media_root_never_above_it() {
        let root = "s3://images/coco/";
        assert_eq!(
            media_key("a/b/s.jsonl", root, "train/x.jpg").unwrap(),
            "s3://images/coco/train/x.jpg"
        );
        assert_eq!(
            media_key("a/b/s.jsonl", root, "t/../x.jpg").unwrap(),
            "s3://images/coco/x.jpg"
        );
        assert_eq!(media_key("a/b/s.jsonl", "", "x.jpg").unwrap(), "a/b/x.jpg");
        for bad in ["../x.jpg", "t/../../x.jpg", "/x.jpg", "s3://other/x", "."] {
            let e = media_key("a/b/s.jsonl", root, bad).unwrap_err();
            assert_eq!((e.path.as_str(), e.base.as_str()), (bad, "a/b/s.jsonl"));
            assert!(e.why.contains("media root"), "{e}");
        }
    }

    #[test]
    fn mixed_datasets_share_a_root_and_keep_their_folders() {
        let (root, rel) =
            common_root(&["s3://b/sft/chat", "s3://b/sft/vqa/v2", "s3://b/sft/mt"]).unwrap();
        assert_eq!(
            (root.as_str(), rel),
            (
                "s3://b/sft",
                vec!["chat/".into(), "vqa/v2/".into(), "mt/".into()]
            )
        );
        let (root, rel) = common_root(&["s3://b/x", "s3://b/y/"]).unwrap();
        assert_eq!(
            (root.as_str(), rel),
            ("s3://b/", vec!["x/".into(), "y/".into()])
        );
        let e = common_root(&["s3://b/x", "s3://c/y"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("one bucket"), "{e}");
        let e = common_root(&["s3://b/x", "s3://b/x/y"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("inside each other"), "{e}");
        let e = common_root(&["s3://b/x", "s3://b/x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("inside each other"), "{e}");
    }

    /// Local folders (a volume source's datasets under its mount): rooted at their common
    /// folder; a local folder does not mix with a bucket.
    #[test]
    fn mixed_local_folders_share_their_common_folder() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        for d in ["llava", "sft/vqa"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        let (llava, vqa) = (base.join("llava"), base.join("sft/vqa/"));
        let uris = [llava.to_str().unwrap(), vqa.to_str().unwrap()];
        let (root, rel) = common_root(&uris).unwrap();
        assert_eq!(
            (root, rel),
            (
                base.display().to_string(),
                vec!["llava/".into(), "sft/vqa/".into()]
            )
        );
        let e = common_root(&[uris[0], "s3://b/x"]).unwrap_err().to_string();
        assert!(e.contains("one bucket or all be local folders"), "{e}");
    }
}
