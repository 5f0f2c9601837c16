"""The Ray Train and Ray Tune names unbroken does not provide, each with what to do instead.

`unbroken.train`, `unbroken.train.torch`, `unbroken.train.lightning`,
`unbroken.train.huggingface` and `unbroken.tune.schedulers` look a missing name up here (their
module `__getattr__`), so that a script ported from Ray that imports one fails at that import
with UnsupportedAPIError saying what to use, not with a bare "cannot import name". Ray's
module paths with nothing unbroken provides (`tune.search.ax`, `tune.integration.xgboost`,
`air.integrations.mlflow`, ...) are modules that refuse one name here when imported. The full
list of Ray Train V2's names and what unbroken does with each is docs/porting-from-ray.md.
"""

from __future__ import annotations

from unbroken.errors import UnsupportedAPIError

_OWN_CALLBACK = ("Hint: report from a callback of your own: {how} calls tune.report(metrics, checkpoint=...) "
                 "(unbroken.tune's function API; unbroken.train.report in a Trainer's training function)")
_INTEGRATION = "its {what} TuneReportCallback and TuneReportCheckpointCallback have no counterpart. "
_LOGGER = ("its {cls} is unbroken.train.{cls}, for a Trainer's or a Tuner's RunConfig(callbacks=[...]) "
           "(one {service} run per run or trial); {setup} is not provided. Hint: from unbroken.train import "
           "{cls}; instead of {setup}, call {module} yourself in the training function")
_HYPERBAND = ("HyperBand for BOHB (with TuneBOHB's searcher) is not provided. Hint: use HyperBandScheduler "
              "(synchronous HyperBand) or ASHAScheduler(brackets=N) with OptunaSearch")

NOT_PROVIDED: dict[str, dict[str, str]] = {
    "unbroken.air": {
        "session": "Ray V1's session functions are unbroken.train's. Hint: session.report(metrics, "
                   "checkpoint=...) is train.report(...); session.get_checkpoint() is "
                   "train.get_checkpoint(); session.get_world_rank() is train.get_context()."
                   "get_world_rank(); session.get_dataset_shard(name) is train.get_dataset_shard(name)",
        **{name: f"it is unbroken.train.{name}. Hint: from unbroken.train import {name}"
           for name in ("Checkpoint", "ScalingConfig", "RunConfig", "CheckpointConfig", "FailureConfig",
                        "Result")},
    },
    "unbroken.air.integrations": {
        "mlflow": _LOGGER.format(cls="MLflowLoggerCallback", service="MLflow", setup="setup_mlflow",
                                 module="mlflow"),
        "wandb": _LOGGER.format(cls="WandbLoggerCallback", service="W&B", setup="setup_wandb",
                                module="wandb.init/wandb.log"),
    },
    "unbroken.train": {
        "DataConfig": "datasets are split among the ranks by train.get_dataset_shard(name). Hint: drop "
                      "dataset_config and pass datasets={...} to the trainer",
        "LoggingConfig": "unbroken logs through the 'unbroken' logger. Hint: configure it with the logging "
                         "module, and choose the progress display with RunConfig(verbose=0|1|2)",
        "SyncConfig": "each rank writes its checkpoint files straight to storage_path; there is nothing to "
                      "sync. Hint: drop sync_config",
        "BackendConfig": "the only backend is torch.distributed. Hint: pass "
                         "unbroken.train.torch.TorchConfig(backend=..., timeout_s=...)",
        "PreemptionError": "a SIGTERM/SIGINT to the driver commits a checkpoint and raises "
                           "TrainingInterruptedError, a TrainingFailedError. Hint: catch "
                           "unbroken.errors.TrainingInterruptedError",
    },
    "unbroken.train.torch": {
        "TorchXLAConfig": "unbroken runs torch.distributed on CPUs and CUDA GPUs only. Hint: use TorchConfig",
        "accelerate": "Ray's automatic mixed precision helpers are not provided. Hint: use torch.autocast "
                      "and torch.amp.GradScaler in the training function",
        "backward": "see accelerate. Hint: call loss.backward() (with a GradScaler for mixed precision)",
        "prepare_optimizer": "see accelerate. Hint: use the optimizer as it is",
        "TorchCheckpoint": "checkpoints are plain directories. Hint: torch.save into a directory and "
                           "report Checkpoint.from_directory(it), or use TrainState",
        "LegacyTorchCheckpoint": "see TorchCheckpoint. Hint: use Checkpoint.from_directory",
        "TorchPredictor": "batch prediction is not part of unbroken. Hint: load the checkpoint with "
                          "torch.load in your own inference code",
        "TorchDetectionPredictor": "see TorchPredictor",
    },
    "unbroken.train.lightning": {
        "RayDeepSpeedStrategy": "DeepSpeed is not supported. Hint: use RayFSDPStrategy (parameters, "
                                "gradients and optimizer state sharded) or RayDDPStrategy",
        "LightningTrainer": "removed from Ray (2.7): a Lightning Trainer runs inside the training function. "
                            "Hint: TorchTrainer(train_loop_per_worker) whose function builds pl.Trainer("
                            "strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()], "
                            "callbacks=[RayTrainReportCallback()]) (docs/integrations.md)",
        "LightningConfigBuilder": "see LightningTrainer. Hint: build pl.Trainer inside train_loop_per_worker "
                                  "of a TorchTrainer",
    },
    "unbroken.train.huggingface": {
        "TransformersTrainer": "removed from Ray (2.7): a transformers.Trainer runs inside the training "
                               "function. Hint: TorchTrainer(train_loop_per_worker) whose function builds "
                               "the Trainer, adds RayTrainReportCallback and calls prepare_trainer, both "
                               "from unbroken.train.huggingface.transformers (docs/integrations.md)",
    },
    "unbroken.tune": {
        "run": "tune.run is Ray's old entry point. Hint: tune.Tuner(trainable, param_space=config, "
               "tune_config=tune.TuneConfig(num_samples=...), run_config=tune.RunConfig(stop=...)).fit()",
        "run_experiments": "see run. Hint: one tune.Tuner(...).fit() per experiment",
        "Experiment": "see run. Hint: describe the sweep with tune.Tuner(...)",
        "ExperimentAnalysis": "a sweep's results are its ResultGrid. Hint: tune.Tuner.restore(path, "
                              "trainable).get_results() reads a sweep from its directory",
        "register_trainable": "trainables are passed by value, not registered by name. Hint: pass the "
                              "function or Trainable class to tune.Tuner",
        "register_env": "RLlib environments are not part of unbroken. Hint: build the environment inside "
                        "the trainable",
        "PlacementGroupFactory": "a trial's resources are a dict or a ScalingConfig, and unbroken "
                                 "places the workers itself. Hint: tune.with_resources(trainable, "
                                 "{'cpu': 2, 'gpu': 1}), or a Trainer's ScalingConfig(num_workers=..., "
                                 "use_gpu=..., resources_per_worker=...)",
        "TuneController": "the sweep driver is unbroken's own and takes no subclass or options of "
                          "Ray's. Hint: drive a sweep with tune.Tuner(...).fit(), and resize trials "
                          "with a Trainer's ScalingConfig(num_workers=(min, max))",
        "TuneError": "unbroken raises its own errors. Hint: catch unbroken.errors.UnbrokenError (a "
                     "failed trial is in ResultGrid.errors)",
        "SyncConfig": "trials write straight to storage_path, a local path or an fsspec URL; there is "
                      "nothing to sync. Hint: drop sync_config and give RunConfig(storage_path="
                      "'s3://bucket/prefix') (or storage_filesystem=a configured fsspec filesystem)",
        "ResumeConfig": "Tuner.restore takes resume_unfinished, resume_errored and restart_errored. Hint: "
                        "tune.Tuner.restore(path, trainable, resume_errored=True)",
        **{name: "the sweep driver logs one line per trial start and end on the 'unbroken' logger. Hint: "
                 "write a tune.Callback (on_trial_result) for a table of your own"
           for name in ("CLIReporter", "JupyterNotebookReporter", "ProgressReporter")},
    },
    "unbroken.tune.integration": {
        "lightgbm": _INTEGRATION.format(what="LightGBM") + _OWN_CALLBACK.format(
            how="a function in lgb.train(callbacks=[...]) that reads env.evaluation_result_list and"),
        "xgboost": _INTEGRATION.format(what="XGBoost") + _OWN_CALLBACK.format(
            how="an xgboost.callback.TrainingCallback whose after_iteration reads evals_log and"),
        "keras": _INTEGRATION.format(what="Keras") + _OWN_CALLBACK.format(
            how="a keras.callbacks.Callback whose on_epoch_end(epoch, logs)"),
        "pytorch_lightning": _INTEGRATION.format(what="PyTorch Lightning") + (
            "Hint: pass unbroken.train.lightning.RayTrainReportCallback() in pl.Trainer(callbacks=[...]), in "
            "a function trainable or a TorchTrainer's training function: it reports callback_metrics with "
            "a checkpoint at each epoch's end (docs/integrations.md; for transformers.Trainer, "
            "unbroken.train.huggingface.transformers.RayTrainReportCallback)"),
    },
    "unbroken.tune.search": {
        **{name: "no counterpart: OptunaSearch covers TPE, CMA-ES and Gaussian-process sampling through "
                 "Optuna's samplers. Hint: from unbroken.tune.search import OptunaSearch"
           for name in ("HyperOptSearch", "BayesOptSearch", "AxSearch", "TuneBOHB", "HEBOSearch",
                        "NevergradSearch", "ZOOptSearch", "SkOptSearch", "DragonflySearch", "BOHBSearch",
                        "SigOptSearch", "FLAMLSearch")},
        "Repeater": "no counterpart. Hint: repeat a config with num_samples and a grid_search of seeds, and "
                    "average in get_dataframe()",
        "SearchGenerator": "searchers of your own are not supported. Hint: use BasicVariantGenerator or "
                           "OptunaSearch",
        "create_searcher": "Hint: build the searcher itself: BasicVariantGenerator() or OptunaSearch(...)",
    },
    "unbroken.tune.logger": {
        **{name: "each trial writes its rows to result.json and progress.csv in its run directory by "
                 "itself. Hint: drop it from RunConfig(callbacks=...)"
           for name in ("CSVLoggerCallback", "JsonLoggerCallback", "CSVLogger", "JsonLogger")},
        **{name: "TensorBoard logging is not built in. Hint: write your own tune.logger.LoggerCallback "
                 "(log_trial_result gets every result) or log from the training function"
           for name in ("TBXLoggerCallback", "TBXLogger")},
    },
    "unbroken.tune.schedulers": {
        "ResourceChangingScheduler": "a trial keeps the resources it started with. Hint: say what a trial "
                                     "uses with its trainer's scaling_config",
        "HyperBandForBOHB": _HYPERBAND,
        "MedianStoppingRule": "Hint: use ASHAScheduler, or stop trials with RunConfig(stop=...)",
        "PopulationBasedTrainingReplay": "a recorded PBT schedule cannot be replayed. Hint: run the "
                                         "trial with its final config, or use PopulationBasedTraining",
        "TrialScheduler": "schedulers of your own are not supported. Hint: use FIFOScheduler or "
                          "ASHAScheduler, or stop trials with RunConfig(stop=...)",
        "create_scheduler": "Hint: build the scheduler itself: FIFOScheduler() or ASHAScheduler(...)",
    },
}


def refuse(module: str, name: str) -> None:
    """UnsupportedAPIError for a Ray name unbroken does not provide; AttributeError for any
    other missing name (what a module's `__getattr__` must raise)."""
    hint = NOT_PROVIDED.get(module, {}).get(name)
    if hint is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    library = ("Ray Tune" if module.startswith("unbroken.tune") else
               "Ray AIR" if module.startswith("unbroken.air") else "Ray Train")
    raise UnsupportedAPIError(f"{module}.{name} ({library}'s) is not provided: {hint}", name=name)
