//! The build phase and its cache entry: candidates build off the device, bounded, as the
//! worker's uid, into an entry keyed by the sources' hash; the server records which built
//! (`build-ok/`), holds each entry to its cap and the whole cache to its bound.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::time::Instant;

use agent_tools::sandbox::CpuPriority;
use agent_tools::Jail;
use env_api::{BuildDetails, EvaluationPhases};

use super::dirs::EvalDirs;
use super::process::{describe_exit, tail};
use super::volume::{copy_tree, Copied};
use super::{io_err, EvalError, Evaluator};
use crate::runtime::Device;

impl Evaluator {
    /// The build of these sources into their working directory `ext` on the evaluation's
    /// volume: the cached one (`entry`, copied onto the volume) where `mark` records that they
    /// built before, else a build now (its place queued fairly among `requester`s) whose
    /// directory is admitted into the cache, within its cap, afterwards. The build's times go
    /// into `phases`. Also whether it was a cache hit.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn build_once(
        &self,
        requester: &str,
        worker_jail: &Jail,
        layout: &EvalDirs,
        ext: &Path,
        entry: &Path,
        built_mark: &Path,
        worker_owner: Option<(u32, u32)>,
        phases: &mut EvaluationPhases,
    ) -> Result<(BuildDetails, bool), EvalError> {
        if let Some(report) = self.copy_in(entry, built_mark, ext, worker_owner).await? {
            // These exact sources built before: the worker loads the copy (and torch rebuilds
            // it there, on the volume, if anything in it is out of date).
            return Ok((report, true));
        }
        let t = Instant::now();
        let _permit = self.builds.acquire(requester).await;
        phases.build_queue_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut report = self.build(worker_jail, layout).await?;
        phases.build_s = t.elapsed().as_secs_f64();
        if report.built {
            if let Some(reason) = self.admit(ext, entry, built_mark, &report).await? {
                report = build_failed(reason);
            }
        }
        Ok((report, false))
    }

    /// Copies the cached build `entry` onto the volume as the worker's `ext` when `mark` says
    /// these sources built; its report then. None where there is no such build (or it went
    /// while being copied: `ext` is emptied, and the sources are built again).
    async fn copy_in(
        &self,
        entry: &Path,
        mark: &Path,
        ext: &Path,
        owner: Option<(u32, u32)>,
    ) -> Result<Option<BuildDetails>, EvalError> {
        let (entry, mark, ext) = (entry.to_path_buf(), mark.to_path_buf(), ext.to_path_buf());
        let (pruning, cap) = (self.pruning.clone(), self.cfg.build_cache_entry_max_bytes);
        tokio::task::spawn_blocking(move || {
            let Some(report) = read_built_mark(&mark, &entry) else {
                return Ok(None);
            };
            // No entry is removed or admitted meanwhile.
            let _one = pruning.lock().unwrap_or_else(|e| e.into_inner());
            // Least recently used entries are pruned first (retention.rs).
            let _ = crate::retention::touch(&entry);
            let staged = ext.with_file_name("ext.cached");
            let copied = copy_tree(&entry, &staged, owner, cap, MAX_ENTRY_FILES);
            let swapped = match copied {
                Ok(Copied::All(_)) => std::fs::remove_dir(&ext)
                    .and_then(|()| std::fs::rename(&staged, &ext))
                    .map(|()| true),
                Ok(Copied::OverCap) => Ok(false),
                Err(e) => {
                    tracing::warn!(entry = %entry.display(), error = %e, "copying a cached build onto an evaluation's volume");
                    Ok(false)
                }
            };
            let _ = crate::retention::remove_entry(&staged);
            match swapped {
                Ok(true) => Ok(Some(report)),
                Ok(false) => Ok(None),
                Err(e) => Err(io_err(&ext, e)),
            }
        })
        .await?
    }

    /// Admits the finished build in `ext` into the cache as `entry`: copied by the server
    /// (`copy_tree`) into a staging directory, its size checked, and then, with the cache
    /// pruned to make room for it, renamed into place and recorded in `mark`. A build over
    /// the entry cap is not admitted: the reason (`build_size`) is returned.
    async fn admit(
        &self,
        ext: &Path,
        entry: &Path,
        mark: &Path,
        report: &BuildDetails,
    ) -> Result<Option<String>, EvalError> {
        let (ext, entry, mark) = (ext.to_path_buf(), entry.to_path_buf(), mark.to_path_buf());
        let (pruning, cap, max) = (
            self.pruning.clone(),
            self.cfg.build_cache_entry_max_bytes,
            self.cfg.build_cache_max_bytes,
        );
        let report = report.clone();
        tokio::task::spawn_blocking(move || {
            let cache = entry.parent().map(Path::to_path_buf).unwrap_or_default();
            let name = entry.file_name().map(|n| n.to_os_string()).unwrap_or_default();
            // Beside the cache, on the same file system (renamed into it), never in it.
            let staging = cache.with_file_name("build-staging");
            std::fs::create_dir_all(&staging).map_err(|e| io_err(&staging, e))?;
            let staged = staging.join(format!("{}.{:016x}", name.to_string_lossy(), super::random_u64()));
            let over = || Some(format!("build_size: the build directory holds more than {cap} bytes after the build"));
            let outcome = match copy_tree(&ext, &staged, None, cap, MAX_ENTRY_FILES) {
                Ok(Copied::OverCap) => Ok(over()),
                // Allocated blocks, as retention counts them.
                Ok(Copied::All(_)) if crate::retention::tree_bytes(&staged, cap) > cap => Ok(over()),
                Ok(Copied::All(_)) => {
                    let bytes = crate::retention::tree_bytes(&staged, u64::MAX);
                    let _one = pruning.lock().unwrap_or_else(|e| e.into_inner());
                    // This entry's older copy goes, then the least recently used until the new
                    // one fits: every entry is admitted here, so the cache never holds more
                    // than its bound (runs use their own copies: nothing in it is spared).
                    let _ = crate::retention::remove_entry(&entry);
                    crate::retention::prune_build_cache_sparing(
                        &cache,
                        max.saturating_sub(bytes),
                        |_, _| false,
                    );
                    if bytes > max {
                        Ok(Some(format!("build_size: the build directory ({bytes} bytes) does not fit in the build cache ({max} bytes)")))
                    } else {
                        std::fs::rename(&staged, &entry)
                            .map_err(|e| io_err(&entry, e))
                            .map(|()| {
                                write_built_mark(&mark, &report);
                                None
                            })
                    }
                }
                Err(e) => Err(io_err(&ext, e)),
            };
            let _ = crate::retention::remove_entry(&staged);
            outcome
        })
        .await?
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
        // The volume full: the build was ended (whatever it printed), the candidate's fault.
        if let Some(breach) = outcome.breach {
            if let Some(reason) = self.volume_breach_reason(breach, "build") {
                return Ok(build_failed(reason));
            }
        }
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

    /// When the build directory `ext` on the volume holds more than an entry's cap after the
    /// run (the worker may write into it at import, or rebuild there): the reason. Nothing of
    /// the run is ever admitted into the cache; the cap is the same for a build and a run so
    /// that a candidate judged correct could also be cached.
    pub(super) async fn entry_over_cap(&self, ext: &Path, when: &str) -> Option<String> {
        let cap = self.cfg.build_cache_entry_max_bytes;
        let ext = ext.to_path_buf();
        let over =
            tokio::task::spawn_blocking(move || crate::retention::tree_bytes(&ext, cap) > cap)
                .await
                .unwrap_or(false);
        over.then(|| {
            format!("build_size: the build directory holds more than {cap} bytes after the {when}")
        })
    }

    /// Brings the build cache back under its bound, least recently used entries first. Runs
    /// use their own copies of an entry, so none is spared. One pass at a time, and never
    /// beside an admission or a copy out of the cache.
    pub(super) async fn prune_build_cache(&self) {
        let (dir, max, pruning) = (
            self.cfg.data_dir.join("build-cache"),
            self.cfg.build_cache_max_bytes,
            self.pruning.clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            let _one = pruning.lock().unwrap_or_else(|e| e.into_inner());
            let removed = crate::retention::prune_build_cache_sparing(&dir, max, |_, _| false);
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

/// Most files and directories one entry may hold (copied in or out).
const MAX_ENTRY_FILES: u64 = 65_536;

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
