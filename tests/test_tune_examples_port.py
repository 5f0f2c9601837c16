"""What Ray Tune's own examples import, ported by changing imports only
(tools/port_tune_examples.py): `ray.tune.utils.mock_trainable`, `ray.tune.experiment`, and
the module paths of Ray's searchers unbroken does not provide, which must fail with
UnsupportedAPIError rather than a bare ModuleNotFoundError. Also the porting tool's own
rewriting."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest

from unbroken import tune
from unbroken.errors import UnsupportedAPIError
from unbroken.train import RunConfig
from unbroken.tune import utils
from unbroken.tune.callback import Trial as CallbackTrial

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def _tool():
    spec = importlib.util.spec_from_file_location("port_tune_examples",
                                                  os.path.join(TOOLS, "port_tune_examples.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# -- ray.tune.utils.mock_trainable ----------------------------------------------------------------
def test_mock_trainable_is_importable_by_ray_s_path_and_resumes():
    from unbroken.tune.utils.mock_trainable import MyTrainableClass

    assert utils.validate_save_restore(MyTrainableClass, {"width": 2, "height": 3})
    first = MyTrainableClass({"width": 2, "height": 3})
    rewards = [first.step()["episode_reward_mean"] for _ in range(3)]
    assert rewards == sorted(rewards) and 0 < rewards[-1] < 3
    assert utils.flatten_dict({"a": {"b": 1}}) == {"a/b": 1}, "utils keeps its helpers as a package"


def test_mock_trainable_fails_on_purpose_until_restored(tmp_path):
    from unbroken.tune.utils.mock_trainable import MyTrainableClass

    failing = MyTrainableClass({"mock_error": True})
    failing.step()
    failing.save_checkpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="on purpose"):
        failing.step()
    restored = MyTrainableClass({"mock_error": True})
    restored.load_checkpoint(str(tmp_path))
    assert restored.timestep == 1 and restored.step()["episode_reward_mean"] > 0


def test_hyperband_example_s_sweep_of_the_mock_trainable_runs(storage):
    from unbroken.tune.schedulers import HyperBandScheduler
    from unbroken.tune.utils.mock_trainable import MyTrainableClass

    grid = tune.Tuner(
        MyTrainableClass,
        run_config=RunConfig(name="hb", storage_path=storage, stop={"training_iteration": 2}),
        tune_config=tune.TuneConfig(metric="episode_reward_mean", mode="max", num_samples=2, seed=0,
                                    scheduler=HyperBandScheduler(max_t=4)),
        param_space={"width": tune.randint(10, 20), "height": tune.randint(0, 10)},
    ).fit()
    assert not grid.errors and len(grid) == 2
    assert all(r.metrics["training_iteration"] == 2 for r in grid)


# -- ray.tune.experiment ----------------------------------------------------------------------------
def test_experiment_module_has_the_callbacks_trial_and_refuses_experiment():
    from unbroken.tune.experiment import Trial
    from unbroken.tune.experiment.trial import Trial as TrialToo

    assert Trial is TrialToo is CallbackTrial
    with pytest.raises(UnsupportedAPIError, match="Tuner"):
        from unbroken.tune.experiment import Experiment  # noqa: F401
    with pytest.raises(AttributeError):
        importlib.import_module("unbroken.tune.experiment").no_such_name  # noqa: B018


# -- searchers' module paths ------------------------------------------------------------------------
@pytest.mark.parametrize("module, name", [
    ("ax", "AxSearch"), ("bayesopt", "BayesOptSearch"), ("bohb", "TuneBOHB"), ("hebo", "HEBOSearch"),
    ("hyperopt", "HyperOptSearch"), ("nevergrad", "NevergradSearch"), ("zoopt", "ZOOptSearch"),
])
def test_ray_s_searcher_modules_fail_with_unsupported_api_error(module, name):
    hint = "Hint: from unbroken.tune.search import OptunaSearch"
    with pytest.raises(UnsupportedAPIError, match=f"{name}.*{hint}"):
        importlib.import_module(f"unbroken.tune.search.{module}")


# -- the porting tool ---------------------------------------------------------------------------------
def test_port_changes_the_imports_and_ray_init_only():
    tool = _tool()
    source = "\n".join([
        "import ray",
        "from ray import tune",
        "from ray import train, tune",
        "from ray import data",
        "import ray.tune as tune",
        "from ray.tune.schedulers import ASHAScheduler",
        "from ray.train import Checkpoint",
        "from ray.tune.examples.pbt_function import pbt_function",
        "if True:",
        "    ray.init(",
        "        num_cpus=2)",
        "ray.shutdown()",
        "print(ray.is_initialized())",
        "x = ray.put(1)",
    ]) + "\n"
    ported = tool.port(source).splitlines()
    assert ported == [
        "import ray",
        "from unbroken import tune",
        "from unbroken import train, tune",
        "from ray import data",
        "import unbroken.tune as tune",
        "from unbroken.tune.schedulers import ASHAScheduler",
        "from unbroken.train import Checkpoint",
        "from pbt_function import pbt_function",
        "if True:",
        "    pass",
        "",
        "pass",
        "print(ray.is_initialized())",
        "x = ray.put(1)",
    ]


def test_snippet_and_error_line_of_a_failed_run():
    tool = _tool()
    text = "a = 1\n# __one_start__\nb = 2\n# __one_end__\nc = 3\n"
    assert tool.snippet_at(text, 3) == "one"
    assert tool.snippet_at(text, 5) is None
    output = ("noise\nTraceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
              "    b()\nValueError: bad\n  more text\n")
    assert tool.first_error_line(output) == "ValueError: bad"
    assert tool.failing_line(output, "x.py") == 3
