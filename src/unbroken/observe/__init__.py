"""Layer 5, observe: what watches a run from the driver without changing it.

The progress line and log lines (`progress`) and the TensorBoard and MLflow logger
callbacks (`tensorboard_logger`, `mlflow_logger`), all `run.callbacks.Callback`s.

May import: `core`, `store` and `run`.
"""
