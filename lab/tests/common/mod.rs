//! What the lab's end-to-end tests share.

/// The lab binary (synth, bench, demo) and the product binary beside it (dataset tools, the
/// worker), which `scripts/build.sh` builds into the same folder.
pub const LAB: &str = env!("CARGO_BIN_EXE_stoker-lab");
pub static STOKER: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let product = std::path::Path::new(LAB).with_file_name("stoker");
    assert!(
        product.exists(),
        "no {} (cargo build --release --bin stoker)",
        product.display()
    );
    product
});

/// Runs a lab command that prints one JSON object per line; its objects (it must succeed).
#[allow(dead_code)] // not every test file runs one
pub fn json_lines(cmd: &mut std::process::Command) -> Vec<serde_json::Value> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
