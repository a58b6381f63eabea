"""A process that used NIXL must exit cleanly (exit status 0, not SIGSEGV).

With Debian's rdma-core installed beside the nixl wheel, two copies of libnl used
to crash every such process at exit, after its work was done; see
``keep_idle_ib_module_out``. This runs a real agent in a real child process.
"""

import os
import subprocess
import sys
import textwrap


def test_process_using_nixl_exits_with_status_zero():
    script = textwrap.dedent("""
        import torch
        from kvxfer.backends.nixl.backend import NixlBackend
        src = NixlBackend("exit-src", torch.arange(64.0).view(2, 2, 8, 2), 8)
        dst = NixlBackend("exit-dst", torch.zeros(2, 2, 8, 2), 8)
        dst.begin_pull_blocks(src.export_meta(), [1, 2], [3, 4], request_id=1).wait(10)
        assert torch.equal(dst.memory_buffer[:, :, 3:5], src.memory_buffer[:, :, 1:3])
        src.close(); dst.close()
    """)
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, f"exit status {out.returncode}\n{out.stderr[-2000:]}"
