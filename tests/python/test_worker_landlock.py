"""The worker's own landlock layer (signal scoping) inside the sandbox's layer: files may still
move between directories the sandbox lets it write (Triton's cache does so on every put), and
not anywhere the sandbox forbids.

Runs the worker's `scope_signals` in a process under the real `sandbox-exec` (built by cargo
next to the server binary the tests use).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
import cuda_agent_worker as w

rw, ro = sys.argv[2], sys.argv[3]

def move(src_dir, dst_dir, label):
    os.makedirs(src_dir, exist_ok=True)
    src = os.path.join(src_dir, "f.so")
    with open(src, "w") as f:
        f.write("x")
    try:
        os.replace(src, os.path.join(dst_dir, "f.so"))
        print(label, "moved")
    except OSError as e:
        print(label, "refused", e.errno)

print("scoped", w.scope_signals())
# Triton's put: a file written in a fresh subdirectory, then moved up into the cache.
move(os.path.join(rw, "XU5", "tmp.pid_1_abc"), os.path.join(rw, "XU5"), "cache")
move(os.path.join(rw, "XU5", "tmp.pid_2_abc"), ro, "outside")
'''


def sandbox_exec() -> Path | None:
    server = os.environ.get("CUDA_AGENT_SERVER_BIN")
    candidates = [Path(server).parent / "sandbox-exec"] if server else []
    candidates += [ROOT / "target" / "debug" / "sandbox-exec", ROOT / "target" / "release" / "sandbox-exec"]
    return next((c for c in candidates if c.is_file()), None)


def landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    v = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    return max(v, 0)


def test_files_move_between_writable_directories_under_the_worker_layer(tmp_path):
    exe = sandbox_exec()
    if exe is None:
        pytest.skip("sandbox-exec is not built (cargo build -p agent-tools)")
    if landlock_abi() < 6:
        pytest.skip(f"landlock ABI {landlock_abi()}: the worker scopes no signals here")
    rw = tmp_path / "cache"
    ro = tmp_path / "elsewhere"
    rw.mkdir()
    ro.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    for d in (tmp_path, rw, ro):
        d.chmod(0o755)
    probe.chmod(0o644)
    cmd = [str(exe), "--rw", str(rw), "--ro", str(probe), "--ro", str(ro), "--ro", str(ROOT / "skills"),
           "--ro", str(Path(sys.executable).resolve().parents[1]), "--ro", str(Path(sys.prefix)),
           "--", sys.executable, str(probe), str(ROOT / "skills"), str(rw), str(ro)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = r.stdout.split()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "scoped True" in r.stdout, r.stdout + r.stderr
    # Inside the sandbox's writable tree, as without the worker's layer.
    assert "cache moved" in r.stdout, r.stdout + r.stderr
    # Out of it, refused: by the sandbox's layer (EACCES or EXDEV, whichever it names).
    assert "outside refused" in r.stdout, r.stdout + r.stderr
    assert out[out.index("outside") + 2] in ("13", "18"), r.stdout
