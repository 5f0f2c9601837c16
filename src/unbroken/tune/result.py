"""Ray Tune's result keys (`ray.tune.result`), for scripts that import them by name."""

# A class trainable's step returning {SHOULD_CHECKPOINT: True} saves a checkpoint with that result.
SHOULD_CHECKPOINT = "should_checkpoint"
# A class trainable's step returning {DONE: True} ends its trial.
DONE = "done"
# What every row of a trial's history carries (see docs/storage-format.md).
TRAINING_ITERATION = "training_iteration"
TIME_TOTAL_S = "time_total_s"
TIME_THIS_ITER_S = "time_this_iter_s"
TIMESTAMP = "timestamp"
# The metric names of Ray's examples.
MEAN_ACCURACY = "mean_accuracy"
MEAN_LOSS = "mean_loss"
NEG_MEAN_LOSS = "neg_mean_loss"
EPISODE_REWARD_MEAN = "episode_reward_mean"
TRIAL_ID = "trial_id"
