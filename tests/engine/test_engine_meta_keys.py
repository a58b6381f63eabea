"""The embedded cluster's engines sign and check their transport metas with the cluster key (issue 26, row 7).

``kvxfer generate --disagg`` (``DisaggCluster``) keys its coordinator with a fresh secret. It
used to reach the engine processes as a value: the control plane was keyed, but the
transports read their meta key from ``$KVXFER_SECRET_FILE`` only, so every meta went
unsigned and each decode logged "peer metas are UNAUTHENTICATED". Now the secret travels
as a 0600 file's path (never in argv) and every engine process signs and checks with it.
"""

from __future__ import annotations

import os
import stat
import threading

from engine_integration.control_plane import open_control_plane
from engine_integration.engine import DisaggDynamicInferenceEngine
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from engine_integration.reference import build_reference_engine
from engine_integration.worker import serve
from kvxfer.security.auth import SECRET_FILE_ENV, new_secret_file

PROMPT = [(7 * j + 3) % 256 for j in range(11)]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


def _rogue_prefill(cluster: DisaggCluster, other_key_file: str, monkeypatch) -> DisaggDynamicInferenceEngine:
    """A prefill in this process that holds the control secret but signs its metas with another key."""
    spec = cluster.spec("prefill", "prefill-rogue")
    monkeypatch.setenv(SECRET_FILE_ENV, other_key_file)   # the transport's meta key
    plane = open_control_plane(cluster.address, **spec.plane_options(cluster.address))  # the cluster's key
    engine = build_reference_engine(spec.model, spec.num_blocks, spec.device, DisaggDynamicInferenceEngine)
    engine.connect(plane, role="prefill", name=spec.identity, backend=spec.backend,
                   transfer_timeout_s=spec.transfer_timeout_s, queue_timeout_s=spec.queue_timeout_s)
    return engine


def test_embedded_cluster_engines_seal_metas_with_the_cluster_key_and_refuse_another_key(capfd, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    config = ClusterConfig(backend="ucx", decode_blocks=64, prefill_blocks=128, heartbeat_timeout_s=2.0,
                           request_timeout_s=60.0, transfer_timeout_s=20.0)
    with DisaggCluster(config) as cluster:
        key_file = cluster.service.engine_options()["secret_file"]
        assert key_file and cluster.service.engine_options()["secret"] is None   # by file, not by value
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        secret = open(key_file, "rb").read().strip()
        assert secret == config.secret.encode()
        for host in cluster.hosts:
            assert secret not in _cmdline(host.pid)

        # signed by the prefill process, checked by the decode process: a keyed decode takes nothing else
        [ok] = cluster.generate([PROMPT], 4)
        assert ok.ok, ok.error
        assert ok.tokens == generate_colocated([PROMPT], 4)[0].tokens

        # a prefill holding the control secret whose metas are signed with another key is refused
        cluster.host_of("prefill-0").stop()
        cluster.wait_for_stats(lambda s: not s.engines.get("prefill-0", {}).get("alive"), timeout_s=20)
        rogue = _rogue_prefill(cluster, new_secret_file(str(tmp_path)), monkeypatch)
        loop = threading.Thread(target=serve, args=([rogue],), daemon=True)
        loop.start()
        try:
            [refused] = cluster.generate([PROMPT], 4, timeout_s=60)
        finally:
            rogue.shutdown_reason = "test over"
            loop.join(20)
            rogue.disconnect("test over")
        assert not refused.ok
        assert "not signed with this cluster's key" in (refused.error or ""), refused.error

    out, err = capfd.readouterr()
    assert "UNAUTHENTICATED" not in out + err
    assert not os.path.exists(key_file)   # the launcher's own key file goes with the cluster
