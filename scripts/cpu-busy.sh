# Sourced by .ci/run and scripts/test.sh: how busy the machine's cores were during a phase.
# A phase that keeps them busy is cut by less work, one that does not by more parallelism.

# The machine's busy and total CPU time so far (/proc/stat, clock ticks).
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8; exit}' /proc/stat 2>/dev/null || echo "0 0"; }

# "cores N% busy" since the cpu_ticks output given.
busy_since() {
  local b0 t0 b1 t1
  read -r b0 t0 <<<"$1"
  read -r b1 t1 < <(cpu_ticks)
  [ "$((t1 - t0))" -gt 0 ] && echo "cores $((100 * (b1 - b0) / (t1 - t0)))% busy" || echo "cores ?"
}
