//! The build phase and its cache entry: candidates build off the device, bounded, as the
//! worker's uid, into an entry keyed by the sources' hash; the server records which built
//! (`build-ok/`), holds each entry to its cap and the whole cache to its bound.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use agent_tools::sandbox::CpuPriority;
use agent_tools::Jail;
use env_api::{BuildDetails, EvaluationPhases};

use super::dirs::{prepare_build_dir, EvalDirs};
use super::process::{describe_exit, tail};
use super::{io_err, EvalError, Evaluator};
use crate::runtime::Device;

impl Evaluator {
    /// The build of these sources into their entry `ext`: the one recorded in `mark` where
    /// they built before, else a build now (its place queued fairly among `requester`s), its
    /// entry held to its cap; the build's times go into `phases`. Also whether it was a cache
    /// hit.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn build_once(
        &self,
        requester: &str,
        worker_jail: &Jail,
        layout: &EvalDirs,
        ext: &Path,
        built_mark: &Path,
        worker_owner: Option<(u32, u32)>,
        phases: &mut EvaluationPhases,
    ) -> Result<(BuildDetails, bool), EvalError> {
        prepare_build_dir(ext, worker_owner).map_err(|e| io_err(ext, e))?;
        // Least recently used entries are pruned first (retention.rs).
        let _ = crate::retention::touch(ext);
        Ok(match read_built_mark(built_mark, ext) {
            // These exact sources built before: the worker loads what is there (and
            // torch rebuilds it there, under the lease, if it was changed since).
            Some(report) => (report, true),
            None => {
                let t = Instant::now();
                let _permit = self.builds.acquire(requester).await;
                phases.build_queue_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let mut report = self.build(worker_jail, layout).await?;
                phases.build_s = t.elapsed().as_secs_f64();
                if let Some(reason) = self.entry_over_cap(ext, built_mark, "build").await {
                    report = build_failed(reason);
                }
                if report.built {
                    write_built_mark(built_mark, &report);
                }
                (report, false)
            }
        })
    }

    async fn build(&self, jail: &Jail, d: &EvalDirs) -> Result<BuildDetails, EvalError> {
        let argv: Vec<OsString> = vec![
            self.harness_dir.join("cuda_agent_worker.py").into(),
            "build".into(),
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.candidate.clone().into(),
            "--device".into(),
            self.cfg.device.as_str().into(),
        ];
        let mut jail = jail.clone();
        // A build only has to end in time; the judge holding the device must not wait on it.
        jail.cpu = CpuPriority::Background;
        // nvcc needs no GPU, so a build keeps /proc read-only (and its autogroup with it).
        jail.cuda = false;
        jail.env.push((
            "MAX_JOBS".into(),
            self.cfg.build_jobs.max(1).to_string().into(),
        ));
        if self.cfg.device == Device::Cuda {
            // nvcc needs no GPU; none is visible to a build (TORCH_CUDA_ARCH_LIST, from the
            // server's probe, says what to compile for).
            jail.env.push(("CUDA_VISIBLE_DEVICES".into(), "".into()));
        }
        let (out, err, outcome) = self.run_sandboxed(&jail, &argv, &d.candidate).await?;
        if outcome.timed_out {
            return Ok(build_failed(format!(
                "time_limit: the build ran past {} s",
                self.cfg.phase_timeout.as_secs()
            )));
        }
        // The build's own report can only claim a failure (which counts against it) or a
        // success that the run phase checks again: it decides nothing else.
        let text = String::from_utf8_lossy(&out);
        Ok(text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<BuildDetails>(l).ok())
            .unwrap_or_else(|| {
                build_failed(format!(
                    "compile: the build process died ({}): {}",
                    describe_exit(&outcome),
                    tail(&err, 2000)
                ))
            }))
    }

    /// When the build-cache entry `ext` holds more than its cap: the entry and its record of
    /// a finished build are removed, and the reason is returned.
    pub(super) async fn entry_over_cap(
        &self,
        ext: &Path,
        mark: &Path,
        when: &str,
    ) -> Option<String> {
        let cap = self.cfg.build_cache_entry_max_bytes;
        let (ext, mark) = (ext.to_path_buf(), mark.to_path_buf());
        let over = tokio::task::spawn_blocking(move || {
            let bytes = crate::retention::tree_bytes(&ext, cap);
            if bytes <= cap {
                return false;
            }
            for p in [&ext, &mark] {
                if let Err(e) = crate::retention::remove_entry(p) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %p.display(), error = %e, "removing a build-cache entry over its cap");
                    }
                }
            }
            true
        })
        .await
        .unwrap_or(false);
        over.then(|| {
            format!("build_size: the build directory holds more than {cap} bytes after the {when}")
        })
    }

    /// Brings the build cache back under its bound, least recently used entries first,
    /// sparing those of evaluations in flight (their hash's lock is held). One pass at a time;
    /// a pass waits for the one before, so the bound holds once a burst is over.
    pub(super) async fn prune_build_cache(&self) {
        let in_use: std::collections::HashSet<String> = self
            .build_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, l)| Arc::strong_count(l) > 1)
            .map(|(d, _)| d.clone())
            .collect();
        let (dir, max, pruning) = (
            self.cfg.data_dir.join("build-cache"),
            self.cfg.build_cache_max_bytes,
            self.pruning.clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            let _one = pruning.lock().unwrap_or_else(|e| e.into_inner());
            let removed = crate::retention::prune_build_cache_sparing(&dir, max, |entry, _| {
                entry
                    .file_name()
                    .is_some_and(|n| in_use.contains(&*n.to_string_lossy()))
            });
            if removed.entries > 0 {
                tracing::debug!(
                    entries = removed.entries,
                    bytes = removed.bytes,
                    "build cache pruned to its bound"
                );
            }
        })
        .await;
    }

    pub(super) fn build_lock(&self, digest: &str) -> std::sync::Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.build_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
        locks.entry(digest.to_string()).or_default().clone()
    }

    pub(super) fn build_digest(&self, files: &BTreeMap<String, String>) -> String {
        crate::build::build_key(&self.python.torch, self.cfg.device, files)
    }
}

/// The report of an earlier successful build of the same sources, if its cache entry is
/// still there. The mark is the server's own file, in a directory no sandbox can write.
fn read_built_mark(mark: &Path, ext: &Path) -> Option<BuildDetails> {
    let text = std::fs::read(mark).ok()?;
    if !ext.is_dir() {
        let _ = std::fs::remove_file(mark);
        return None;
    }
    serde_json::from_slice::<BuildDetails>(&text)
        .ok()
        .filter(|r| r.built)
}

fn write_built_mark(mark: &Path, report: &BuildDetails) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = mark.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = mark.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(report).unwrap_or_default())?;
        std::fs::rename(&tmp, mark)
    };
    if let Err(e) = write() {
        tracing::warn!(path = %mark.display(), error = %e, "recording a finished build");
    }
}

/// A build that failed for `reason` (the worker's own report is its last JSON line, a
/// [`BuildDetails`]; it can only claim a failure or a success that the run checks again).
fn build_failed(reason: String) -> BuildDetails {
    BuildDetails {
        built: false,
        reason: Some(reason),
        ..BuildDetails::default()
    }
}
