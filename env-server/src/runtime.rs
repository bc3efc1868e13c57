//! What the server finds on its machine at start: the Python that runs the harness (with
//! torch), the evaluation device, and the pristine harness files it lays out.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The harness files, compiled into the server so that its copy cannot be tampered with.
pub const HARNESS_FILES: &[(&str, &str)] = &[
    ("SKILL.md", include_str!("../../skills/SKILL.md")),
    (
        "SKILL_REFERENCE.md",
        include_str!("../../skills/SKILL_REFERENCE.md"),
    ),
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
    "SKILL_REFERENCE.md",
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

/// Where a device's section of `SKILL.md` or `SKILL_REFERENCE.md` starts:
/// `<!-- device: cpu -->` or `<!-- device: cuda -->`, its first line a `## ` heading.
const SECTION_START: &str = "<!-- device: ";
/// Where a device's section ends.
const SECTION_END: &str = "<!-- end device -->";

/// What a laid-out page does with the sections of the devices other than the server's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OtherDevices {
    /// Moved to the end, marked as not this server's (the reference file).
    AtTheEnd,
    /// Left out (`SKILL.md`: its reader is the agent, whose every token counts; the
    /// reference file keeps them).
    LeftOut,
}

/// `SKILL.md` as the workspace of a `device` server holds it: that device's section where
/// the source keeps the device sections (before the loop), its heading marked as this
/// server's; the other device's section is left out (it is in `SKILL_REFERENCE.md`). An
/// agent reads the page from the top: on a CPU server GPU advice first cost episodes, and
/// the whole page read every episode was most of what its observations held.
pub fn render_skill(device: Device) -> String {
    render_from(
        include_str!("../../skills/SKILL.md"),
        device,
        OtherDevices::LeftOut,
    )
}

/// `SKILL_REFERENCE.md` as the workspace of a `device` server holds it: that device's
/// section where the source keeps the device sections, the other device's at the end,
/// marked as not this server's.
pub fn render_skill_reference(device: Device) -> String {
    render_from(
        include_str!("../../skills/SKILL_REFERENCE.md"),
        device,
        OtherDevices::AtTheEnd,
    )
}

/// A harness file's text as the workspace of a `device` server holds it: the two pages laid
/// out for the device, every other file as it is.
pub fn workspace_text(name: &str, text: &str, device: Device) -> String {
    match name {
        "SKILL.md" => render_skill(device),
        "SKILL_REFERENCE.md" => render_skill_reference(device),
        _ => text.to_string(),
    }
}

/// A source without the markers is returned as it is.
fn render_from(source: &str, device: Device, others_go: OtherDevices) -> String {
    let mut rest = String::new();
    let mut own = None;
    let mut others = Vec::new();
    let mut at = source;
    let mut place = None;
    while let Some(start) = at.find(SECTION_START) {
        let Some(len) = at[start..].find(SECTION_END) else {
            break;
        };
        let before = &at[..start];
        // A left-out section takes its blank line with it.
        if place.is_some() && before.trim().is_empty() {
            rest.push_str(before.trim_start_matches('\n'));
        } else {
            rest.push_str(before);
        }
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
    let Some(place) = place else {
        return source.to_string();
    };
    // The text after the sections starts on a line of its own.
    let tail = at.trim_start_matches('\n');
    rest.push_str(tail);
    let mut out = String::with_capacity(source.len() + 128);
    out.push_str(&rest[..place]);
    if let Some(own) = own {
        out.push_str(&own);
        out.push_str("\n\n");
    }
    out.push_str(&rest[place..]);
    if others_go == OtherDevices::AtTheEnd {
        for other in others {
            if !out.ends_with("\n\n") {
                out.push('\n');
            }
            out.push_str(&other);
            out.push('\n');
        }
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
/// `SKILL.md` and `SKILL_REFERENCE.md` as [`workspace_text`] lays them out for `device`.
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
        std::fs::write(&p, workspace_text(name, text, device)).map_err(|e| io(&p, e))?;
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
    fn the_reference_puts_the_devices_own_section_first_and_the_other_last() {
        let cpu = render_from(SOURCE, Device::Cpu, OtherDevices::AtTheEnd);
        let own = cpu.find("## On a CPU (this server's device)").expect(&cpu);
        let other = cpu
            .find("## On a GPU (not this server's device: for reference)")
            .expect(&cpu);
        let lp = cpu.find("## Loop").unwrap();
        assert!(own < lp && lp < other, "{cpu}");
        assert!(!cpu.contains("<!--"), "{cpu}");
        let gpu = render_from(SOURCE, Device::Cuda, OtherDevices::AtTheEnd);
        let own = gpu.find("## On a GPU (this server's device)").expect(&gpu);
        let other = gpu
            .find("## On a CPU (not this server's device")
            .expect(&gpu);
        assert!(own < gpu.find("## Loop").unwrap() && gpu.find("## Loop").unwrap() < other);
    }

    #[test]
    fn skill_md_holds_the_devices_own_section_alone() {
        let cpu = render_from(SOURCE, Device::Cpu, OtherDevices::LeftOut);
        assert_eq!(
            cpu,
            "# Title\nintro\n\n## On a CPU (this server's device)\ncpu text\n\n## Loop\nloop text\n"
        );
        let gpu = render_from(SOURCE, Device::Cuda, OtherDevices::LeftOut);
        assert_eq!(
            gpu,
            "# Title\nintro\n\n## On a GPU (this server's device)\ngpu text\n\n## Loop\nloop text\n"
        );
    }

    #[test]
    fn the_bundled_pages_lay_out_each_device() {
        for device in [Device::Cpu, Device::Cuda] {
            let page = render_skill(device);
            assert!(page.contains("(this server's device)"), "{device:?}");
            assert!(!page.contains("(not this server's device"), "{device:?}");
            assert!(!page.contains(SECTION_START), "{device:?}");
            let reference = render_skill_reference(device);
            let own = reference
                .find("(this server's device)")
                .expect("own section");
            let other = reference
                .find("(not this server's device")
                .expect("other section");
            assert!(own < other, "{device:?}");
            assert!(!reference.contains(SECTION_START), "{device:?}");
        }
    }

    /// What the agent reads whole in every episode: the first page stays short (it was
    /// 22,890 characters, most of an episode's observations); the detail is in the reference.
    #[test]
    fn skill_md_stays_a_short_first_page() {
        for device in [Device::Cpu, Device::Cuda] {
            let n = render_skill(device).chars().count();
            assert!(
                n <= 9_500,
                "{device:?}: SKILL.md is {n} characters; move detail to SKILL_REFERENCE.md"
            );
        }
    }

    /// Each `SKILL_REFERENCE.md, "Section"` that SKILL.md points to is a heading there.
    #[test]
    fn skill_md_points_to_sections_the_reference_has() {
        let skill = include_str!("../../skills/SKILL.md");
        let reference = include_str!("../../skills/SKILL_REFERENCE.md");
        let mut pointers = 0;
        for (at, _) in skill.match_indices("SKILL_REFERENCE.md, \"") {
            let rest = &skill[at + "SKILL_REFERENCE.md, \"".len()..];
            let name = rest.split('"').next().unwrap_or_default();
            assert!(
                reference.contains(&format!("\n## {name}\n")),
                "SKILL.md points to {name:?}, which SKILL_REFERENCE.md lacks"
            );
            pointers += 1;
        }
        assert!(pointers > 0);
    }

    #[test]
    fn the_workspace_gets_both_pages_laid_out() {
        for name in ["SKILL.md", "SKILL_REFERENCE.md"] {
            assert!(WORKSPACE_FILES.contains(&name), "{name}");
            assert!(HARNESS_FILES.iter().any(|(n, _)| *n == name), "{name}");
            let text = workspace_text(name, "", Device::Cpu);
            assert!(text.contains("(this server's device)"), "{name}");
        }
        assert_eq!(workspace_text("verify.py", "x", Device::Cpu), "x");
    }

    #[test]
    fn the_installed_pages_are_read_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let harness = dir.path().join("harness");
        install_harness(&harness, Device::Cuda).unwrap();
        for name in ["SKILL.md", "SKILL_REFERENCE.md"] {
            let meta = std::fs::metadata(harness.join(name)).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o444, "{name}");
            let text = std::fs::read_to_string(harness.join(name)).unwrap();
            assert!(
                text.contains("## On a GPU (this server's device)"),
                "{name}"
            );
        }
    }

    #[test]
    fn a_page_without_markers_is_left_as_it_is() {
        for others in [OtherDevices::AtTheEnd, OtherDevices::LeftOut] {
            assert_eq!(
                render_from("# x\ntext\n", Device::Cpu, others),
                "# x\ntext\n"
            );
        }
    }
}
