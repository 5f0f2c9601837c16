"""Recovery, the worker's half (the driver's is `unbroken.execution.recovery`).

- `just_in_time`: a rank's TrainState tracked at each report, so that a survivor can save the
  last complete round, or send it to its peers; the per-step random streams.
- `peer_state`: the state sent from a surviving rank to the ranks that start again.
- `in_loop`: `TrainState.for_each_batch`, whose surviving ranks stay inside their loop.
- `messages`: what the two halves say to each other.
"""
