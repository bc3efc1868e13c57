"""A candidate worker that answers as the real one does, then rewrites one reply the way code in
the candidate's process could (it owns the process and its channel). Set by HOSTILE_REPLY, a
JSON object: `op` (the request whose reply is rewritten), then either `path` and `value` (a
field of the reply set to `value`; a path into lists and objects) or `field` and `raw` (the
field's value written as raw JSON text, for what Python's encoder cannot write: nesting too
deep, NaN). The forward's trace is reported clean, so that a forward computed with PyTorch
reaches the rewritten reply without an extension of its own.

Started by tests/python/test_protocol.py in place of cuda_agent_worker.py; the reference
worker it starts is the real one, untouched."""

import json
import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "skills"))
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_worker as w  # noqa: E402

SPEC = json.loads(os.environ.get("HOSTILE_REPLY") or "{}")


def rewrite(msg: dict) -> bytes:
    if "raw" in SPEC:
        rest = {k: v for k, v in msg.items() if k != SPEC["field"]}
        return (json.dumps(rest)[:-1] + f', "{SPEC["field"]}": {SPEC["raw"]}}}').encode("utf-8", "surrogatepass")
    target = msg
    for key in SPEC["path"][:-1]:
        target = target[key]
    target[SPEC["path"][-1]] = SPEC["value"]
    return json.dumps(msg).encode("utf-8", "surrogatepass")


def main() -> int:
    if sys.argv[sys.argv.index("--role") + 1] == "candidate":
        last = {"op": None}
        recv, send = h.Channel.recv, h.Channel.send

        def recv_noting_op(self, timeout=None):
            msg = recv(self, timeout)
            last["op"] = msg.get("op")
            return msg

        def send_rewritten(self, msg):
            if last["op"] == "run" and msg.get("ok") and "trace" in msg:
                msg["trace"] = {"forbidden": [], "extension_calls": 1}
            if last["op"] != SPEC.get("op"):
                return send(self, msg)
            data = rewrite(msg)
            buf = struct.pack(">I", len(data)) + data
            while buf:
                buf = buf[os.write(self.wfd, buf):]

        h.Channel.recv, h.Channel.send = recv_noting_op, send_rewritten
    return w.main()


if __name__ == "__main__":
    h.exit_now(main())
