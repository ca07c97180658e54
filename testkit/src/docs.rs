//! What the tests check the documentation against.

use std::collections::BTreeSet;

/// The values `docs` (docs/metrics.md) lists for `metric`'s `label`: the list after
/// "`label` =" in its labels column (up to a `;`), else the backticked snake_case words of the
/// "by kind:" sentence of its meaning.
pub fn documented_labels(docs: &str, metric: &str, label: &str) -> BTreeSet<String> {
    let row = docs
        .lines()
        .find(|l| l.starts_with(&format!("| `{metric}`")))
        .unwrap_or_else(|| panic!("docs/metrics.md has no row for {metric}"));
    let cells: Vec<&str> = row.split('|').collect();
    let (labels, meaning) = (cells[3], cells[4]);
    if let Some((_, list)) = labels.split_once(&format!("`{label}` =")) {
        let list = list.split(';').next().unwrap_or_default();
        return list.split(',').map(|w| w.trim().to_string()).collect();
    }
    // The list runs from "by kind:" to the end of that sentence.
    let after = meaning.split_once("by kind:").map_or(meaning, |(_, a)| a);
    let after = after.split(". ").next().unwrap_or(after);
    after
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_string)
        .collect()
}

/// Panics, naming the metric and label, unless `docs` lists exactly `values` for them.
pub fn assert_documented<'a>(
    docs: &str,
    metric: &str,
    label: &str,
    values: impl IntoIterator<Item = &'a str>,
) {
    let defined: BTreeSet<String> = values.into_iter().map(str::to_string).collect();
    assert_eq!(
        documented_labels(docs, metric, label),
        defined,
        "docs/metrics.md, {metric} `{label}`"
    );
}
