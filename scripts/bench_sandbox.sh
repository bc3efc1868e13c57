#!/usr/bin/env bash
# The sandbox's own cost per spawn, printed as a table (release build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo bench --locked -p agent-tools --bench sandbox_spawn
