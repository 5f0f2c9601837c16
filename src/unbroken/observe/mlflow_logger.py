"""MLflow logging for a run, with one MLflow run per unbroken run across every attempt.

The MLflow run id is kept in the run directory, so a resumed run (a retry, an auto-resume
in a new process, `restore().fit()`, `unbroken resume`) logs into the same MLflow run.
Metrics use `training_iteration` as their step.

MLflow cannot delete logged points, so by default a row is sent only once it can no longer
be abandoned (`observe.committed_rows`): each step is then logged exactly once.

The calls to MLflow run off the report path (`Callback.run_in_background`): a tracking
server that is down or does not answer never holds up training. MLflow's client retries
for minutes on its own, so each hook is bounded by `timeout_s`; the first call that fails
or overruns turns the logger off for the rest of the fit(), with one warning.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from unbroken.observe.committed_rows import CommittedRowsLogger, flatten
from unbroken.run.callbacks import RunInfo, numeric_metrics
from unbroken.store.manifest import FINISHED, INTERRUPTED

STATE_KEY = "mlflow"
_BATCH = 1000  # MLflow's limit on metrics per log_batch call
_PARAM_BATCH = 100
_PARAM_CHARS = 500
_END_STATUS = {FINISHED: "FINISHED", INTERRUPTED: "KILLED"}


class MLflowLoggerCallback(CommittedRowsLogger):
    """Logs a run's metrics (and its train_loop_config as params) to MLflow; at each
    attempt's end, where the run's time went so far (`goodput`, `time/<kind>_s`:
    docs/guarantees.md#where-the-time-went) at the last step it logged.

    Args:
        tracking_uri: the MLflow tracking URI; default: MLflow's own (MLFLOW_TRACKING_URI).
        experiment_name: the MLflow experiment, created if missing; default:
            MLFLOW_EXPERIMENT_NAME, else "Default".
        tags: extra tags for the MLflow run.
        log_params: log the flattened train_loop_config as params when the MLflow run is created.
        wait_for_checkpoint: send a row only once it cannot be abandoned (see the module
            docstring). False sends rows about once a second as they come; then a failed
            attempt's rows after its last checkpoint are logged a second time by the attempt
            that repeats them.
        timeout_s: the longest one hook (creating the MLflow run, sending a batch) may take;
            after that, or after the first error, MLflow logging is off for the rest of
            this fit() and the run goes on. fit() waits at most this long for the last batch.

    Needs the MLflow client (`pip install 'unbroken[mlflow]'`, which installs mlflow-skinny).
    """

    def __init__(self, tracking_uri: str | None = None, *, experiment_name: str | None = None,
                 tags: dict[str, str] | None = None, log_params: bool = True,
                 wait_for_checkpoint: bool = True, timeout_s: float = 15.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"MLflowLoggerCallback(timeout_s={timeout_s!r}) must be > 0 seconds")
        self.hook_timeout_s = float(timeout_s)
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.tags = dict(tags or {})
        self.log_params = log_params
        self.wait_for_checkpoint = wait_for_checkpoint
        self._reset()

    _live = ("_client", "_run_id")

    def _reset(self) -> None:
        super()._reset()
        self._client: Any = None
        self._run_id: str | None = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the first rows were sent."""
        return self._run_id

    def setup(self, run: RunInfo) -> None:
        self._reset()
        # Only look: importing mlflow imports pandas, whose thread would make workers slower to start.
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError("MLflowLoggerCallback needs MLflow. Hint: pip install 'unbroken[mlflow]'")

    def on_run_end(self, run: RunInfo, status: str) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, status=_END_STATUS.get(status, "FAILED"))

    # -- MLflow ---------------------------------------------------------------------------
    def _send(self, run: RunInfo, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        if self._run_id is None:
            self._start(run)
        metrics = [Metric(key, value, int(row.get("timestamp", time.time()) * 1000),
                          int(row["training_iteration"]))
                   for row in rows for key, value in numeric_metrics(row).items()]
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + _BATCH])

    def _send_time(self, run: RunInfo, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, self._last_step)
                                                      for k, v in scalars.items()])

    def _start(self, run: RunInfo) -> None:
        """Resume the MLflow run recorded in the run directory, or create one."""
        import mlflow
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or mlflow.get_tracking_uri()
        client = MlflowClient(tracking_uri=uri)
        saved = run.load_state(STATE_KEY) or {}
        if saved.get("tracking_uri") == uri and saved.get("run_id"):
            try:
                if client.get_run(saved["run_id"]).info.lifecycle_stage == "active":
                    client.update_run(saved["run_id"], status="RUNNING")
                    self._client, self._run_id = client, saved["run_id"]
                    return
            except MlflowException:
                pass  # deleted, or another tracking server: start a new MLflow run
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        tags = {"unbroken.run_path": run.path, "unbroken.run_id": run.run_id, **self.tags}
        mlflow_run = client.create_run(experiment_id, run_name=run.name, tags=tags)
        self._client, self._run_id = client, mlflow_run.info.run_id
        run.save_state(STATE_KEY, {"tracking_uri": uri, "run_id": self._run_id,
                                   "experiment_id": experiment_id})
        if self.log_params and isinstance(run.config, dict):
            from mlflow.entities import Param

            params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flatten(run.config).items()]
            for i in range(0, len(params), _PARAM_BATCH):
                client.log_batch(self._run_id, params=params[i:i + _PARAM_BATCH])

