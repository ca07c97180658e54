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
