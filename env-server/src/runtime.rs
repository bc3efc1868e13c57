//! What the server finds on its machine at start: the Python that runs the harness (with
//! torch), the evaluation device, and the pristine harness files it lays out.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The harness files, compiled into the server so that its copy cannot be tampered with.
pub const HARNESS_FILES: &[(&str, &str)] = &[
    ("SKILL.md", include_str!("../../skills/SKILL.md")),
    ("verify.py", include_str!("../../skills/verify.py")),
    ("profile.py", include_str!("../../skills/profile.py")),
    (
        "cuda_agent_harness.py",
        include_str!("../../skills/cuda_agent_harness.py"),
    ),
    (
        "cuda_agent_judge.py",
        include_str!("../../skills/cuda_agent_judge.py"),
    ),
    (
        "cuda_agent_worker.py",
        include_str!("../../skills/cuda_agent_worker.py"),
    ),
    ("evaluate.py", include_str!("../../skills/evaluate.py")),
    (
        "kernels_ext.py",
        include_str!("../../skills/kernels_ext.py"),
    ),
];

/// The files laid read-only into every workspace (evaluate.py is the server's alone).
pub const WORKSPACE_FILES: &[&str] = &[
    "SKILL.md",
    "verify.py",
    "profile.py",
    "cuda_agent_harness.py",
    "cuda_agent_judge.py",
    "cuda_agent_worker.py",
    "kernels_ext.py",
];

/// Errors found at start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Python could not be run or lacks torch.
    #[error("python {python}: {message}")]
    Python {
        /// The interpreter.
        python: String,
        /// What failed.
        message: String,
    },
    /// Python could not be run.
    #[error("python {python}")]
    Spawn {
        /// The interpreter.
        python: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Python's probe printed something other than its JSON.
    #[error("python {python}: bad probe output")]
    ProbeOutput {
        /// The interpreter.
        python: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// CUDA was asked for and is not there.
    #[error("--device cuda: torch sees no CUDA device on this machine")]
    NoCuda,
    /// A file could not be written.
    #[error("{0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// One process cannot map another's GPU memory: the judge shares inputs and outputs
    /// with its workers that way, so no CUDA evaluation could run.
    #[error("--device cuda: a second process cannot map GPU memory by CUDA IPC handle on this machine ({0}); the judge needs it to share inputs and outputs with its workers")]
    NoCudaIpc(String),
}

/// The Python environment, as it reported itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PythonInfo {
    /// The interpreter as invoked (inside its venv).
    pub executable: PathBuf,
    /// The interpreter with symlinks resolved.
    pub real_executable: PathBuf,
    /// sys.prefix.
    pub prefix: PathBuf,
    /// sys.base_prefix.
    pub base_prefix: PathBuf,
    /// torch.__version__.
    pub torch: String,
    /// torch.version.cuda.
    pub torch_cuda: Option<String>,
    /// Number of CUDA devices torch sees.
    pub gpus: usize,
    /// Their names.
    pub gpu_names: Vec<String>,
    /// Their compute capabilities (`9.0`), clamped to what this torch was built for, as
    /// `TORCH_CUDA_ARCH_LIST` spells them.
    #[serde(default)]
    pub gpu_archs: Vec<String>,
}

/// What the probe prints: where Python lives and what torch sees. The capability is clamped
/// to the newest architecture this torch was built for, as torch's extension builder does.
const PROBE: &str = r#"import json, os, sys
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
built = [int(a.split('_')[1].rstrip('a')) for a in (torch.cuda.get_arch_list() if n else []) if a.startswith('sm_')]
archs = []
for i in range(n):
    cap = torch.cuda.get_device_capability(i)
    if built:
        cap = min(cap, max((b // 10, b % 10) for b in built))
    a = '%d.%d' % cap
    if a not in archs:
        archs.append(a)
print(json.dumps({'executable': sys.executable, 'real_executable': os.path.realpath(sys.executable),
    'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'torch': torch.__version__,
    'torch_cuda': torch.version.cuda, 'gpus': n,
    'gpu_names': [torch.cuda.get_device_name(i) for i in range(n)], 'gpu_archs': sorted(archs)}))
"#;

impl PythonInfo {
    /// Runs `python` once to learn where it lives and what torch sees. The answer is kept
    /// for the life of the process, per interpreter path: importing torch costs seconds of
    /// CPU, and a process that builds several servers (the tests) would pay it for each.
    pub fn probe(python: &Path) -> Result<Self, RuntimeError> {
        static PROBED: std::sync::OnceLock<
            std::sync::Mutex<std::collections::HashMap<PathBuf, PythonInfo>>,
        > = std::sync::OnceLock::new();
        let probed = PROBED.get_or_init(Default::default);
        if let Some(info) = probed.lock().ok().and_then(|m| m.get(python).cloned()) {
            return Ok(info);
        }
        let info = Self::probe_now(python)?;
        if let Ok(mut m) = probed.lock() {
            m.insert(python.to_path_buf(), info.clone());
        }
        Ok(info)
    }

    fn probe_now(python: &Path) -> Result<Self, RuntimeError> {
        let script = PROBE;
        let err = |message: String| RuntimeError::Python {
            python: python.display().to_string(),
            message,
        };
        let out = std::process::Command::new(python)
            .args(["-c", script])
            .output()
            .map_err(|source| RuntimeError::Spawn {
                python: python.display().to_string(),
                source,
            })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(err(format!(
                "cannot import torch: {}",
                stderr.lines().last().unwrap_or("")
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.lines().last().unwrap_or("")).map_err(|source| {
            RuntimeError::ProbeOutput {
                python: python.display().to_string(),
                source,
            }
        })
    }

    /// Directories the sandbox must let tool processes read: Python's and CUDA's.
    pub fn toolchain_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.prefix.clone(), self.base_prefix.clone()];
        if let Some(root) = self.real_executable.parent().and_then(Path::parent) {
            dirs.push(root.to_path_buf());
        }
        for cuda in ["/usr/local/cuda", "/usr/local/nvidia"] {
            if let Ok(real) = Path::new(cuda).canonicalize() {
                dirs.push(real);
                dirs.push(PathBuf::from(cuda));
            }
        }
        dirs.sort();
        dirs.dedup();
        dirs
    }

    /// The PATH tool processes get: the venv's bin first, then CUDA's, then the system's.
    pub fn path_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.prefix.join("bin")];
        if let Some(bin) = self.real_executable.parent() {
            dirs.push(bin.to_path_buf());
        }
        if Path::new("/usr/local/cuda/bin").exists() {
            dirs.push(PathBuf::from("/usr/local/cuda/bin"));
        }
        dirs.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
        dirs.dedup();
        dirs
    }
}

/// The evaluation device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// C++ candidates on the CPU.
    Cpu,
    /// CUDA candidates on the GPUs.
    Cuda,
}

impl Device {
    /// Its name as the harness takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// Resolves the device `asked` for against what torch sees.
    pub fn choose(asked: DeviceChoice, python: &PythonInfo) -> Result<Self, RuntimeError> {
        match asked {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda if python.gpus > 0 => Ok(Device::Cuda),
            DeviceChoice::Cuda => Err(RuntimeError::NoCuda),
            DeviceChoice::Auto if python.gpus > 0 => Ok(Device::Cuda),
            DeviceChoice::Auto => Ok(Device::Cpu),
        }
    }
}

/// The device a server is asked to evaluate on (`--device`), resolved by [`Device::choose`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA where torch sees a GPU, else the CPU.
    #[default]
    Auto,
    /// The CPU, even where there is a GPU.
    Cpu,
    /// CUDA; the server does not start without a GPU.
    Cuda,
}

/// Checks, through the installed harness, that a second process can map this one's GPU
/// memory by IPC handle (some virtualised GPUs cannot).
pub fn check_cuda_ipc(python: &Path, harness_dir: &Path) -> Result<(), RuntimeError> {
    let script = format!(
        "import sys; sys.path.append({dir:?}); import cuda_agent_harness as h; print(h.cuda_ipc_selftest() or 'ok')",
        dir = harness_dir.display().to_string()
    );
    let out = std::process::Command::new(python)
        .args(["-c", &script])
        .output()
        .map_err(|source| RuntimeError::Spawn {
            python: python.display().to_string(),
            source,
        })?;
    let said = String::from_utf8_lossy(&out.stdout);
    let last = said.lines().last().unwrap_or("").trim();
    if out.status.success() && last == "ok" {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let why = if last.is_empty() {
        err.lines().last().unwrap_or("the check printed nothing")
    } else {
        last
    };
    Err(RuntimeError::NoCudaIpc(why.to_string()))
}

/// Where a device's section of `SKILL.md` starts: `<!-- device: cpu -->` or
/// `<!-- device: cuda -->`, its first line a `## ` heading.
const SECTION_START: &str = "<!-- device: ";
/// Where a device's section ends.
const SECTION_END: &str = "<!-- end device -->";

/// `SKILL.md` as the workspace of a `device` server holds it: that device's section where
/// the source keeps the device sections (before the loop), its heading marked as this
/// server's, and the other device's section moved to the end, marked as not this server's.
/// An agent reads the page from the top: on a CPU server GPU advice first cost episodes.
/// A source without the markers is returned as it is.
pub fn render_skill(device: Device) -> String {
    render_skill_from(include_str!("../../skills/SKILL.md"), device)
}

fn render_skill_from(source: &str, device: Device) -> String {
    let mut rest = String::new();
    let mut own = None;
    let mut others = Vec::new();
    let mut at = source;
    let mut place = None;
    while let Some(start) = at.find(SECTION_START) {
        let Some(len) = at[start..].find(SECTION_END) else {
            break;
        };
        rest.push_str(&at[..start]);
        place.get_or_insert(rest.len());
        let block = &at[start..start + len];
        let (marker, body) = block.split_once('\n').unwrap_or((block, ""));
        let name = marker
            .trim_start_matches(SECTION_START)
            .trim_end_matches("-->")
            .trim();
        let body = body.trim_end().to_string();
        if name == device.as_str() {
            own = Some(mark_heading(&body, "(this server's device)"));
        } else {
            others.push(mark_heading(
                &body,
                "(not this server's device: for reference)",
            ));
        }
        at = &at[start + len + SECTION_END.len()..];
        at = at.strip_prefix('\n').unwrap_or(at);
    }
    rest.push_str(at);
    let Some(place) = place else {
        return source.to_string();
    };
    let mut out = String::with_capacity(source.len() + 128);
    out.push_str(&rest[..place]);
    if let Some(own) = own {
        out.push_str(&own);
        out.push_str("\n\n");
    }
    out.push_str(&rest[place..]);
    for other in others {
        if !out.ends_with("\n\n") {
            out.push('\n');
        }
        out.push_str(&other);
        out.push('\n');
    }
    out
}

/// `body` with `note` after its first line (its heading).
fn mark_heading(body: &str, note: &str) -> String {
    match body.split_once('\n') {
        Some((heading, rest)) => format!("{heading} {note}\n{rest}"),
        None => format!("{body} {note}"),
    }
}

/// Writes the pristine harness into `dir` (read-only), replacing whatever was there;
/// `SKILL.md` as [`render_skill`] lays it out for `device`.
pub fn install_harness(dir: &Path, device: Device) -> Result<(), RuntimeError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |p: &Path, e| RuntimeError::Io(p.to_path_buf(), e);
    if dir.exists() {
        for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
            let _ = std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o644));
        }
        std::fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    for (name, text) in HARNESS_FILES {
        let p = dir.join(name);
        let rendered;
        let text = if *name == "SKILL.md" {
            rendered = render_skill(device);
            rendered.as_str()
        } else {
            text
        };
        std::fs::write(&p, text).map_err(|e| io(&p, e))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444))
            .map_err(|e| io(&p, e))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| io(dir, e))?;
    Ok(())
}

#[cfg(test)]
mod skill_tests {
    use super::*;

    const SOURCE: &str = "# Title\nintro\n\n<!-- device: cpu -->\n## On a CPU\ncpu text\n<!-- end device -->\n\n<!-- device: cuda -->\n## On a GPU\ngpu text\n<!-- end device -->\n\n## Loop\nloop text\n";

    #[test]
    fn each_device_reads_its_own_section_first_and_the_other_last() {
        let cpu = render_skill_from(SOURCE, Device::Cpu);
        let own = cpu.find("## On a CPU (this server's device)").expect(&cpu);
        let other = cpu
            .find("## On a GPU (not this server's device: for reference)")
            .expect(&cpu);
        let lp = cpu.find("## Loop").unwrap();
        assert!(own < lp && lp < other, "{cpu}");
        assert!(!cpu.contains("<!--"), "{cpu}");
        let gpu = render_skill_from(SOURCE, Device::Cuda);
        let own = gpu.find("## On a GPU (this server's device)").expect(&gpu);
        let other = gpu
            .find("## On a CPU (not this server's device")
            .expect(&gpu);
        assert!(own < gpu.find("## Loop").unwrap() && gpu.find("## Loop").unwrap() < other);
    }

    #[test]
    fn the_bundled_page_has_both_sections() {
        for device in [Device::Cpu, Device::Cuda] {
            let page = render_skill(device);
            assert!(page.contains("(this server's device)"), "{device:?}");
            assert!(page.contains("(not this server's device"), "{device:?}");
            assert!(!page.contains(SECTION_START), "{device:?}");
        }
    }

    #[test]
    fn a_page_without_markers_is_left_as_it_is() {
        assert_eq!(render_skill_from("# x\ntext\n", Device::Cpu), "# x\ntext\n");
    }
}
