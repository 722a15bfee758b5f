"""A training cycle's MLflow run: its parameters, its metrics (buffered, sent in batches) and how it ended.

Process 0 alone tracks; on the other processes of a torchrun cycle the tracker is disabled and every call is a
no-op, so the cycle's code calls it the same way on every process.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import datetime

from mlflow.entities import Metric, Param, RunTag

from flywheel.settings import Settings
from model_registry import ModelRegistry, ensure_experiment
from trainer.config import TrainerConfig

TRAINER_EXPERIMENT = "flywheel-trainer"
_METRIC_FLUSH_EVERY = 20
_MLFLOW_BATCH = 900  # MLflow caps one batch at 1000 metrics


class CycleTracker:
    """The cycle's MLflow run (process 0 only: `enabled`); metrics are buffered and sent in batches."""

    def __init__(self, settings: Settings, config: TrainerConfig, champion: str, mark: datetime | None,
                 *, enabled: bool) -> None:  # fmt: skip
        self.run_id: str | None = None
        self._pending: list[Metric] = []
        if not enabled:
            return
        self._client = ModelRegistry(settings).client
        exp = ensure_experiment(self._client, settings, TRAINER_EXPERIMENT)
        tags = {"flywheel.parent_version": champion, "flywheel.watermark": mark.isoformat() if mark else ""}
        run = self._client.create_run(exp, run_name=f"cycle from v{champion}", tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)) for k, v in config.to_dict().items()]
        self._client.log_batch(self.run_id, params=params)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in values.items() if not math.isnan(v))
        if len(self._pending) >= _METRIC_FLUSH_EVERY * 8:
            self.flush()

    def flush(self) -> None:
        if self.run_id is not None and self._pending:
            for i in range(0, len(self._pending), _MLFLOW_BATCH):
                self._client.log_batch(self.run_id, metrics=self._pending[i : i + _MLFLOW_BATCH])
            self._pending = []

    def skipped(self, reason: str) -> None:
        if self.run_id is None:
            return
        self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "skipped"),
                                                  RunTag("flywheel.reason", reason[:4000])])  # fmt: skip
        self._client.set_terminated(self.run_id, "FINISHED")

    def finished(self, version: str) -> None:
        if self.run_id is None:
            return
        self.flush()
        self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "registered"),
                                                  RunTag("flywheel.version", version)])  # fmt: skip
        self._client.set_terminated(self.run_id, "FINISHED")

    def stopped(self, reason: str) -> None:
        if self.run_id is None:
            return
        with contextlib.suppress(Exception):  # stopping must not wait on a registry that does not answer
            self.flush()
            self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "stopped"),
                                                      RunTag("flywheel.reason", reason[:4000])])  # fmt: skip
            self._client.set_terminated(self.run_id, "KILLED")

    def failed(self, exc: BaseException) -> None:
        if self.run_id is None:
            return
        with contextlib.suppress(Exception):  # report the original error, not a logging failure
            self.flush()
            self._client.set_tag(self.run_id, "flywheel.status", "failed")
            self._client.set_tag(self.run_id, "flywheel.reason", f"{type(exc).__name__}: {exc}"[:4000])
            self._client.set_terminated(self.run_id, "FAILED")
