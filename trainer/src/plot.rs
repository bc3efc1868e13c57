//! `trainer plot`: a stage's metrics.jsonl drawn as a grid of curves (reward, losses,
//! entropy, KL, clip fraction, explained variance, episode lengths, throughput), whichever
//! the file holds.

use std::path::Path;

use charts::{grid, LineChart, Series};
use serde_json::Value;

use crate::error::TrainError;
use crate::metrics::read_metrics;

/// Metrics drawn, in panel order: (title, key).
const PANELS: [(&str, &str); 14] = [
    ("reward mean", "reward_mean"),
    ("nll", "nll"),
    ("policy loss", "policy_loss"),
    ("value loss", "value_loss"),
    ("entropy", "entropy"),
    ("kl to rollout", "approx_kl"),
    ("kl to reference", "ref_kl"),
    ("clip fraction", "clip_fraction"),
    ("explained variance", "explained_variance"),
    ("turns per episode", "turns_per_episode"),
    ("tokens per episode", "tokens_per_episode"),
    ("valid call share", "valid_call_share"),
    ("episodes per min", "episodes_per_min"),
    ("grad norm", "grad_norm_actor"),
];

/// Draws `metrics` (JSON Lines) to `out` (PNG); fails when no known metric is present.
pub fn plot_metrics(metrics: &Path, out: &Path) -> Result<(), TrainError> {
    let records = read_metrics(metrics)?;
    let panels: Vec<_> = PANELS
        .iter()
        .filter_map(|(title, key)| {
            let points: Vec<(f64, f64)> = records
                .iter()
                .filter_map(|r| Some((r["step"].as_f64()?, r.get(*key).and_then(Value::as_f64)?)))
                .collect();
            (!points.is_empty()).then(|| {
                LineChart {
                    title: (*title).into(),
                    x_label: "step".into(),
                    series: vec![Series {
                        name: (*key).into(),
                        points,
                    }],
                }
                .render(360, 220)
            })
        })
        .collect();
    if panels.is_empty() {
        return Err(TrainError::Data(format!(
            "{} holds no metric to plot",
            metrics.display()
        )));
    }
    Ok(grid(&panels, 3).save_png(out)?)
}
