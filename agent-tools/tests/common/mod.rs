//! A real sandboxed workspace for the tests: a temp tree with the workspace, its temp dir, a
//! second workspace and a server-only directory the sandbox must not reach.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agent_tools::{
    create_private_dir, Jail, ResourceLimits, Sandbox, SandboxConfig, ToolCall, ToolLimits,
    ToolOutput, Toolbox, Workspace,
};
use env_api::observation::{BashData, EditData, GlobData, GrepData, ReadData, ToolData, WriteData};
use serde_json::Value;

/// The details of a call of the tool the function is named for; panics on any other.
macro_rules! details {
    ($($name:ident: $variant:ident => $ty:ty),* $(,)?) => {$(
        pub fn $name(out: &ToolOutput) -> &$ty {
            match &out.data.details {
                ToolData::$variant(d) => d,
                other => panic!("not {} details: {other:?} ({})", stringify!($variant), out.text),
            }
        }
    )*};
}

details! {
    bash_data: Bash => BashData,
    edit_data: Edit => EditData,
    write_data: Write => WriteData,
    read_data: Read => ReadData,
    glob_data: Glob => GlobData,
    grep_data: Grep => GrepData,
}

/// Python's installation prefixes, which the sandbox must be able to read.
pub fn python_dirs() -> (PathBuf, Vec<PathBuf>) {
    let out = Command::new("python3")
        .args(["-c", "import sys,os;print(os.path.realpath(sys.executable));print(sys.prefix);print(sys.base_prefix)"])
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines().map(PathBuf::from);
    let exe = lines.next().expect("python path");
    (
        exe.parent().expect("bin dir").to_path_buf(),
        lines.collect(),
    )
}

static NEXT_UID: AtomicU32 = AtomicU32::new(0);

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub tmp: PathBuf,
    pub other_workspace: PathBuf,
    pub secret: PathBuf,
    pub toolbox: Toolbox,
}

pub fn fixture() -> Fixture {
    fixture_with(ResourceLimits::default())
}

pub fn fixture_with(limits: ResourceLimits) -> Fixture {
    fixture_of(limits, false)
}

/// A fixture whose jail runs CUDA (`Jail::cuda`: its own `/proc` entries writable).
#[allow(dead_code)]
pub fn cuda_fixture() -> Fixture {
    fixture_of(ResourceLimits::default(), true)
}

fn fixture_of(limits: ResourceLimits, cuda: bool) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let sandbox_probe = agent_tools::sandbox::KernelFeatures::detect();
    // A distinct uid per fixture, so process limits of parallel tests do not add up.
    let owner = sandbox_probe.can_switch_uid.then(|| {
        let uid =
            61_000 + std::process::id() % 1000 * 16 + NEXT_UID.fetch_add(1, Ordering::Relaxed) % 16;
        (uid, uid)
    });
    let root = dir.path().join("ws");
    let tmp = dir.path().join("ws-tmp");
    create_private_dir(&root, owner).expect("workspace");
    create_private_dir(&tmp, owner).expect("tmp");
    let other_workspace = dir.path().join("other-ws");
    std::fs::create_dir(&other_workspace).expect("other");
    std::fs::write(
        other_workspace.join("model_new.py"),
        "other episode's secret kernel",
    )
    .expect("write");
    std::fs::set_permissions(&other_workspace, std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let server = dir.path().join("server-state");
    std::fs::create_dir(&server).expect("server dir");
    std::fs::set_permissions(&server, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let secret = server.join("hidden_seeds.json");
    std::fs::write(&secret, "{\"seeds\": [1, 2, 3]}").expect("write");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");

    let (py_bin, py_prefixes) = python_dirs();
    let mut config = SandboxConfig::with_toolchains(py_prefixes);
    config.limits = limits;
    let sandbox = Sandbox::new(config).expect("sandbox available on this kernel");
    let mut ws = Workspace::open(&root, owner).expect("workspace");
    ws.add_protected("verify.py", b"print('pristine verify')\n")
        .expect("protected");
    ws.add_protected("model.py", b"class Model: pass\n")
        .expect("protected");
    let path = vec![
        py_bin,
        PathBuf::from("/usr/local/bin"),
        PathBuf::from("/usr/bin"),
        PathBuf::from("/bin"),
    ];
    let mut jail = Jail::standard(ws.root(), &tmp, &path, &[], owner);
    jail.cuda = cuda;
    let toolbox = Toolbox::new(sandbox, ws, jail, tmp.clone(), ToolLimits::default());
    let root = toolbox.workspace().root().to_path_buf();
    Fixture {
        dir,
        root,
        tmp,
        other_workspace,
        secret,
        toolbox,
    }
}

impl Fixture {
    pub async fn call(&mut self, tool: &str, args: Value) -> ToolOutput {
        let call = ToolCall::parse(tool, &args).expect("valid call");
        self.toolbox.run(&call, Duration::from_secs(600)).await
    }

    pub async fn bash(&mut self, command: &str) -> ToolOutput {
        self.call("Bash", serde_json::json!({"command": command}))
            .await
    }
}
