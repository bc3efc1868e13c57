#!/usr/bin/env bash
# Which sandbox layer stops CUDA: initialises CUDA (torch and the bare driver API) inside
# `sandbox-exec` with each layer turned off in turn, and lists what the jail sees of the
# driver's files (the layer-by-layer search runs only where the full sandbox fails). Usage: scripts/gpu_sandbox_probe.sh [sandbox-exec]
set -u
se=${1:-target/release/sandbox-exec}
py=$(command -v "${CUDA_AGENT_PYTHON:-python3}")
probe='
import ctypes, os
lib = ctypes.CDLL("libcuda.so.1")
print("cuInit", lib.cuInit(0))
for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/proc/driver/nvidia/params", "/proc/self/task", "/dev/shm"):
    try:
        fd = os.open(p, os.O_RDWR if p.startswith("/dev/nvidia") else os.O_RDONLY)
        os.close(fd)
        print(p, "open ok")
    except OSError as e:
        print(p, "open", e.strerror)
import torch
print("torch", torch.cuda.is_available(), torch.cuda.device_count())
x = torch.ones(4, device="cuda")
print("sum", (x + 1).sum().item())
'
run() {
    echo "== sandbox-exec $*"
    timeout 120 "$se" "$@" -- "$py" -c "$probe" 2>&1 | grep -v "^  \|Warning\|warn(" | tail -12
}
quick='import ctypes; print("cuInit", ctypes.CDLL("libcuda.so.1").cuInit(0))'
echo "== no sandbox"
"$py" -c "$probe" 2>&1 | tail -12
echo "== without --cuda (/proc read-only: CUDA is expected to fail to start)"
run
echo "== sandboxed, --cuda"
out=$(run --cuda)
echo "$out"
case $out in *"sum 8.0"*) echo "CUDA works in the full sandbox"; exit 0 ;; esac
run --cuda --no-seccomp
# One seccomp rule left out at a time: the one whose absence lets cuInit succeed is it.
for sc in socket socketpair clone clone3 ioctl ptrace process_vm_readv process_vm_writev mount bpf perf_event_open keyctl unshare setns io_uring_setup setsid userfaultfd name_to_handle_at; do
    printf '%s: ' "$sc"; timeout 60 "$se" --cuda --seccomp-allow "$sc" -- "$py" -c "$quick" 2>&1 | tail -1
done
