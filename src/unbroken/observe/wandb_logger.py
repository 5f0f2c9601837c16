"""Weights & Biases logging for a run, with one W&B run per unbroken run across every
attempt and resume, under Ray's name (`ray.air.integrations.wandb.WandbLoggerCallback`).

The W&B run's id is the unbroken run's `run_id`, and every fit() resumes it
(`resume="allow"`): a retry, an auto-resume in a new process, `restore().fit()` and
`unbroken resume` all log into the same W&B run. Metrics use `training_iteration` as their
step. W&B accepts no step below one it has seen, so rows go out only once they can no longer
be abandoned (`observe.committed_rows`): each step is logged once, and the curve is one
clean line. At each attempt's end the run's goodput and time by kind go into the W&B run's
summary. Offline mode (`WANDB_MODE=offline`) works as online does.

The calls run off the report path (`Callback.run_in_background`), each bounded by
`hook_timeout_s`: a W&B service that does not answer never holds up training.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from unbroken.errors import UnsupportedOptionError
from unbroken.observe.committed_rows import CommittedRowsLogger, flatten
from unbroken.run.callbacks import RunInfo, numeric_metrics
from unbroken.store.manifest import FINISHED


class WandbLoggerCallback(CommittedRowsLogger):
    """Logs a run's metrics (and its train_loop_config as the W&B config) to Weights & Biases.

    Args (Ray's):
        project: the W&B project; default: W&B's own (WANDB_PROJECT).
        group: the W&B group, e.g. a sweep's name.
        api_key_file: a file holding the API key; `api_key`: the key itself. Either sets
            WANDB_API_KEY in the driver; default: W&B's own login.
        excludes: metric names not to log.
        log_config: log the flattened train_loop_config as the W&B run's config.
        upload_checkpoints, save_checkpoints: refused (UnsupportedOptionError): checkpoints
            stay in the run directory, which is what restores read.
        **kwargs: passed to `wandb.init` (entity, tags, notes, mode, dir, ...); `id` and
            `resume` are the run's own.

    Needs the `wandb` package (`pip install 'unbroken[wandb]'`).
    """

    def __init__(self, project: str | None = None, group: str | None = None,
                 api_key_file: str | None = None, api_key: str | None = None,
                 excludes: list[str] | None = None, log_config: bool = False,
                 upload_checkpoints: bool = False, save_checkpoints: bool = False,
                 timeout_s: float = 60.0, **kwargs: Any) -> None:
        if upload_checkpoints or save_checkpoints:
            raise UnsupportedOptionError(
                "WandbLoggerCallback(upload_checkpoints=True / save_checkpoints=True) is not supported: "
                "checkpoints stay in the run directory, where restores read them. Hint: leave them "
                "False, and log an artifact from a callback's on_checkpoint if you need one in W&B")
        for own in ("id", "resume"):
            if own in kwargs:
                raise UnsupportedOptionError(
                    f"WandbLoggerCallback({own}=...) is set by unbroken: the W&B run is the unbroken "
                    "run's, resumed by its run_id. Hint: leave it out")
        if not timeout_s > 0:
            raise ValueError(f"WandbLoggerCallback(timeout_s={timeout_s!r}) must be > 0 seconds")
        self.hook_timeout_s = float(timeout_s)
        self.project, self.group = project, group
        self.api_key_file, self.api_key = api_key_file, api_key
        self.excludes = set(excludes or ())
        self.log_config = log_config
        self.init_kwargs = kwargs
        self._reset()

    _live = ("_run",)

    def _reset(self) -> None:
        super()._reset()
        self._run: Any = None

    def setup(self, run: RunInfo) -> None:
        self._reset()
        if importlib.util.find_spec("wandb") is None:
            raise ImportError("WandbLoggerCallback needs W&B. Hint: pip install 'unbroken[wandb]'")
        if self.api_key_file:
            with open(os.path.expanduser(self.api_key_file)) as f:
                os.environ["WANDB_API_KEY"] = f.read().strip()
        elif self.api_key:
            os.environ["WANDB_API_KEY"] = self.api_key

    def on_run_end(self, run: RunInfo, status: str) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if status == FINISHED else 1)
            self._run = None

    # -- W&B ------------------------------------------------------------------------------
    def _send(self, run: RunInfo, rows: list[dict[str, Any]]) -> None:
        if self._run is None:
            self._start(run)
        for row in rows:
            metrics = {k: v for k, v in numeric_metrics(row).items() if k not in self.excludes}
            self._run.log(metrics, step=int(row["training_iteration"]))

    def _send_time(self, run: RunInfo, scalars: dict[str, float]) -> None:
        self._run.summary.update(scalars)

    def _start(self, run: RunInfo) -> None:
        import wandb

        config = flatten(run.config) if self.log_config and isinstance(run.config, dict) else None
        kwargs = {"dir": run.local_path, **self.init_kwargs}
        self._run = wandb.init(project=self.project, group=self.group, id=run.run_id, resume="allow",
                               name=run.name, config=config, **kwargs)
