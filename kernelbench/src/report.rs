//! The table kernel papers print, from evaluation results: per level and overall, pass rate,
//! share faster than eager and than torch.compile, geometric-mean speedups, and fast_p.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One evaluated task, as replay writes it (one JSON object per line).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResultRecord {
    /// Task id (`L1/19_ReLU`).
    pub task: String,
    /// Task level.
    pub level: u8,
    /// Milestone reward.
    pub reward: f64,
    /// Correct and no rule broken.
    pub correct: bool,
    /// Speedup over eager (baseline time / candidate time), when correct and timed.
    #[serde(default)]
    pub speedup_eager: Option<f64>,
    /// Speedup over torch.compile.
    #[serde(default)]
    pub speedup_compile: Option<f64>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The thresholds of fast_p.
pub const FAST_P: [f64; 3] = [1.0, 1.5, 2.0];

/// Metrics of one group of results.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Metrics {
    /// Results in the group.
    pub tasks: usize,
    /// Share correct.
    pub pass_rate: f64,
    /// Share correct and faster than eager (speedup > 1).
    pub faster_than_eager: f64,
    /// Share correct and faster than torch.compile.
    pub faster_than_compile: f64,
    /// Geometric mean of the speedup over eager, over correct results (NaN if none).
    pub geomean_speedup_eager: f64,
    /// Geometric mean of the speedup over torch.compile, over correct results with one.
    pub geomean_speedup_compile: f64,
    /// fast_p for p in [`FAST_P`]: share of all tasks correct and more than p times faster than eager.
    pub fast_p: Vec<(f64, f64)>,
    /// Mean reward.
    pub mean_reward: f64,
}

fn geomean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs
        .filter(|x| *x > 0.0 && x.is_finite())
        .fold((0.0, 0usize), |(s, n), x| (s + x.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}

/// Metrics of a group.
pub fn metrics(results: &[&ResultRecord]) -> Metrics {
    let n = results.len();
    let share = |f: &dyn Fn(&ResultRecord) -> bool| {
        if n == 0 {
            0.0
        } else {
            results.iter().filter(|r| f(r)).count() as f64 / n as f64
        }
    };
    let correct: Vec<&&ResultRecord> = results.iter().filter(|r| r.correct).collect();
    Metrics {
        tasks: n,
        pass_rate: share(&|r| r.correct),
        faster_than_eager: share(&|r| r.correct && r.speedup_eager.is_some_and(|s| s > 1.0)),
        faster_than_compile: share(&|r| r.correct && r.speedup_compile.is_some_and(|s| s > 1.0)),
        geomean_speedup_eager: geomean(correct.iter().filter_map(|r| r.speedup_eager)),
        geomean_speedup_compile: geomean(correct.iter().filter_map(|r| r.speedup_compile)),
        fast_p: FAST_P
            .iter()
            .map(|&p| {
                (
                    p,
                    share(&|r| r.correct && r.speedup_eager.is_some_and(|s| s > p)),
                )
            })
            .collect(),
        mean_reward: if n == 0 {
            0.0
        } else {
            results.iter().map(|r| r.reward).sum::<f64>() / n as f64
        },
    }
}

/// Metrics per level (`level1`, ...) and `overall`.
pub fn by_level(results: &[ResultRecord]) -> BTreeMap<String, Metrics> {
    let mut groups: BTreeMap<String, Vec<&ResultRecord>> = BTreeMap::new();
    for r in results {
        groups
            .entry(format!("level{}", r.level))
            .or_default()
            .push(r);
    }
    let mut out: BTreeMap<String, Metrics> = groups
        .iter()
        .map(|(k, v)| (k.clone(), metrics(v)))
        .collect();
    out.insert(
        "overall".into(),
        metrics(&results.iter().collect::<Vec<_>>()),
    );
    out
}

/// The table as Markdown.
pub fn markdown(table: &BTreeMap<String, Metrics>) -> String {
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let num = |x: f64| {
        if x.is_nan() {
            "-".to_string()
        } else {
            format!("{x:.3}x")
        }
    };
    let mut s = String::from("| group | tasks | pass | faster than eager | faster than compile | geomean vs eager | geomean vs compile | fast_1.0 | fast_1.5 | fast_2.0 | mean reward |\n");
    s.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    let order = table
        .keys()
        .filter(|k| *k != "overall")
        .chain(std::iter::once(&"overall".to_string()))
        .cloned()
        .collect::<Vec<_>>();
    for k in order {
        let Some(m) = table.get(&k) else { continue };
        let fp: Vec<String> = m.fast_p.iter().map(|(_, v)| pct(*v)).collect();
        s.push_str(&format!(
            "| {k} | {} | {} | {} | {} | {} | {} | {} | {:.2} |\n",
            m.tasks,
            pct(m.pass_rate),
            pct(m.faster_than_eager),
            pct(m.faster_than_compile),
            num(m.geomean_speedup_eager),
            num(m.geomean_speedup_compile),
            fp.join(" | "),
            m.mean_reward
        ));
    }
    s
}

/// Edges of the speedup buckets of [`speedup_distribution`]: `< 0.5`, `0.5-1`, `1-1.5`, `1.5-2`, `>= 2`.
pub const SPEEDUP_EDGES: [f64; 4] = [0.5, 1.0, 1.5, 2.0];

/// Names of the buckets of [`speedup_distribution`], failures first.
pub const SPEEDUP_BUCKETS: [&str; 6] = ["failed", "<0.5x", "0.5-1x", "1-1.5x", "1.5-2x", ">=2x"];

/// The distribution of the speedup over eager per level: for each level (`level1`, ...), the
/// share of its tasks in each of [`SPEEDUP_BUCKETS`]. A task counts as failed when it is not
/// correct or has no speedup; a speedup on an edge goes to the bucket above it.
pub fn speedup_distribution(results: &[ResultRecord]) -> BTreeMap<String, [f64; 6]> {
    let mut counts: BTreeMap<String, ([usize; 6], usize)> = BTreeMap::new();
    for r in results {
        let bucket = match r.speedup_eager.filter(|s| r.correct && s.is_finite()) {
            None => 0,
            Some(s) => 1 + SPEEDUP_EDGES.iter().filter(|&&e| s >= e).count(),
        };
        let entry = counts.entry(format!("level{}", r.level)).or_default();
        entry.0[bucket] += 1;
        entry.1 += 1;
    }
    counts
        .into_iter()
        .map(|(k, (c, n))| (k, c.map(|x| x as f64 / n as f64)))
        .collect()
}
