"""The ZeroMQ plane's fleet side on one machine: a coordinator process and a client of it.

``launch.DisaggCluster`` runs one per cluster; an engine that spawns its own coordinator
(``set_disaggregation_config(spawn_coordinator=True)``) runs one too. A coordinator is
never unauthenticated by accident: with no secret in its config, no
``$KVXFER_SECRET_FILE`` and no ``insecure=True``, a fresh secret is written to a 0600
file (``secret_file``), removed again by ``stop``. A secret given as a value is written
to such a file too, and only the file's path reaches the coordinator and the engines:
an engine's transport signs and checks its metas with the key in ``$KVXFER_SECRET_FILE``
(``worker.build_engine``), so a value alone would leave the metas unsigned.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional

from engine_integration.control_plane.base import PlaneService
from engine_integration.control_plane.zmq.client import CoordinatorClient
from engine_integration.control_plane.zmq.coordinator import (CoordinatorConfig, start_coordinator_process,
                                                              stop_coordinator_process)


class CoordinatorService(PlaneService):
    """A coordinator process started here (``start``) and stopped with it (``stop``)."""

    def __init__(self, config: CoordinatorConfig = CoordinatorConfig()) -> None:
        self.config = config
        self.process: Any = None
        self.url = ""
        self._owned_secret_file: Optional[str] = None
        self._client: Optional[CoordinatorClient] = None

    @property
    def secret_file(self) -> Optional[str]:
        return self.config.secret_file

    def start(self) -> None:
        from kvxfer.security.auth import SECRET_FILE_ENV, new_secret_file

        cfg = self.config
        if cfg.secret is not None and cfg.secret_file is None:
            self._owned_secret_file = new_secret_file(secret=cfg.secret)
            self.config = cfg = replace(cfg, secret=None, secret_file=self._owned_secret_file)
        elif cfg.secret is None and cfg.secret_file is None and not cfg.insecure and not os.environ.get(SECRET_FILE_ENV):
            self._owned_secret_file = new_secret_file()
            self.config = cfg = replace(cfg, secret_file=self._owned_secret_file)
        try:
            self.process, self.url = start_coordinator_process(cfg)
        except BaseException:
            self._remove_owned_secret_file()
            raise

    def engine_options(self) -> dict[str, Any]:
        return {"secret": self.config.secret, "secret_file": self.config.secret_file, "insecure": self.config.insecure}

    @property
    def client(self) -> CoordinatorClient:
        if self._client is None:
            self._client = CoordinatorClient(self.url, **self.engine_options())
        return self._client

    def stop(self) -> None:
        """Say goodbye to the coordinator, stop its process and remove the key file we made, each even
        when the step before it failed (a coordinator killed cannot answer the goodbye)."""
        client, self._client = self._client, None
        process, self.process = self.process, None
        try:
            if client is not None:
                try:
                    client.shutdown("cluster stopping")
                finally:
                    client.close()
        finally:
            try:
                if process is not None:
                    stop_coordinator_process(process, timeout_s=5)
            finally:
                self._remove_owned_secret_file()

    def _remove_owned_secret_file(self) -> None:
        if self._owned_secret_file is not None:
            from kvxfer.security.auth import remove_secret_file

            remove_secret_file(self._owned_secret_file)
            self._owned_secret_file = None
