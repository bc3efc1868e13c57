//! Set-up the synthesis tests share: the Python that has torch, and the filters' worker as
//! the CPU tests run it (any runtime accepted, torch.compile only traced).
// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::time::Duration;

use kernelbench::synth::worker::{JudgeWorker, RunLimits, WorkerConfig};

/// The filters' flags on the CPU in these tests: any runtime accepted, torch.compile only traced.
pub const CPU_FILTERS: [&str; 6] = [
    "--device",
    "cpu",
    "--min-ms",
    "0",
    "--compile-backend",
    "eager",
];

/// The interpreter with torch (scripts/test.sh sets `CUDA_AGENT_PYTHON`).
pub fn python() -> String {
    std::env::var("CUDA_AGENT_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The filters' worker on the CPU, its script in a directory of its own (kept alive by the
/// returned guard), each proposal's run bounded by `timeout` and `limits`.
pub async fn cpu_worker(timeout: Duration, limits: RunLimits) -> (tempfile::TempDir, JudgeWorker) {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("synth.py");
    std::fs::write(&script, kernelbench::synth::SYNTH_PY).unwrap();
    let worker = JudgeWorker::start(WorkerConfig {
        python: python().into(),
        script,
        args: CPU_FILTERS.map(String::from).to_vec(),
        timeout,
        start_timeout: Duration::from_secs(300),
        limits,
    })
    .await
    .unwrap();
    (dir, worker)
}
