"""A training loop with a known cost per step, per save and a known failure (test_goodput)."""

import time

import torch

from unbroken import train
from unbroken.train.torch import TrainState


class SlowToSave:
    """A stateful part whose state takes `seconds` to produce: a save blocks this long."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def timed_loop(config: dict) -> None:
    """`iterations` steps of `step_s` each, a checkpoint every `every` whose save takes
    `save_s` (`every="auto"`: when the driver asks); rank 1 raises before its report
    `fail_at` in attempt 1."""
    model = torch.nn.Linear(2, 1)
    state = TrainState(model=model, slow=SlowToSave(config["save_s"]), step=0)
    state.restore()
    context = train.get_context()
    while state.step < config["iterations"]:
        time.sleep(config["step_s"])
        state.step += 1
        if state.step == config["fail_at"] and context.get_world_rank() == 1 and context.get_attempt() == 1:
            raise RuntimeError(f"injected failure at iteration {state.step}")
        every = config["every"]
        state.report({"step": state.step}, checkpoint=every if every == "auto" else state.step % every == 0)
