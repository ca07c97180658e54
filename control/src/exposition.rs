//! Reading Prometheus text exposition: the one parser that the operator (trainer /metrics),
//! the demo, benchmarks and tests use to pick a sample out of a /metrics page.

use crate::autoscale::RankCounters;

/// The value of the first sample of `name` (any labels) in a Prometheus text exposition.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    metric_value_with(text, name, &[])
}

/// The value of the first sample of `name` carrying every `labels` pair (others may be
/// present, in any order).
pub fn metric_value_with(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            let Some(rest) = l.strip_prefix(name) else {
                return false;
            };
            let label_part = match rest.strip_prefix('{') {
                Some(r) => r.split('}').next().unwrap_or(""),
                None if rest.starts_with(' ') => "",
                None => return false,
            };
            labels
                .iter()
                .all(|(k, v)| label_part.split(',').any(|p| p == format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A trainer client's counters from its /metrics text.
pub fn rank_counters(text: &str) -> Option<RankCounters> {
    Some(RankCounters {
        wait_s: metric_value(text, "stoker_trainer_wait_seconds_total")?,
        step_s: metric_value(text, "stoker_trainer_step_seconds_total")?,
        samples: metric_value(text, "stoker_trainer_samples_total")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_samples_by_name_and_labels_in_any_order() {
        let text = "# HELP x y\nstoker_a_total{pipeline=\"p\",rank=\"1\"} 4\nstoker_a_total{rank=\"0\",pipeline=\"p\"} 2.5\nstoker_ab 9\n";
        assert_eq!(metric_value(text, "stoker_a_total"), Some(4.0));
        assert_eq!(
            metric_value_with(text, "stoker_a_total", &[("rank", "0"), ("pipeline", "p")]),
            Some(2.5)
        );
        assert_eq!(
            metric_value(text, "stoker_a"),
            None,
            "a prefix is not a name"
        );
        assert_eq!(metric_value(text, "stoker_ab"), Some(9.0));
        assert_eq!(rank_counters(text), None);
    }
}
