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


class Paced(torch.nn.Module):
    """A linear layer whose forward pass takes at least `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def paced_loop(config: dict) -> None:
    """`iterations` DDP steps; rank `slow_rank`'s forward pass takes `slow_s`, the others'
    `forward_s`."""
    rank = train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = train.torch.prepare_model(Paced(config["slow_s"] if rank == config["slow_rank"]
                                            else config["forward_s"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(config["iterations"]):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train.report({"loss": loss.item(), "step": step})
