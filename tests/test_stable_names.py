"""Stored names of unbroken's own classes stay what they were before the package was split
into layers, so runs written before it keep restoring and auto-resuming (storage-format.md)."""

from __future__ import annotations

import importlib
import json
import pickle

import cloudpickle
import pytest

from unbroken.core import stable_names
from unbroken.core.codec import decode, describe, encode, import_by_name, qualified_name
from unbroken.run.identity import identity
from unbroken.store.pickled import loads
from unbroken.train import CheckpointConfig, DataParallelTrainer, RunConfig, TensorBoardLoggerCallback
from unbroken.train.torch import TorchConfig, TorchTrainer


def test_run_json_names_classes_as_before_the_split():
    assert qualified_name(DataParallelTrainer) == "unbroken.trainer:DataParallelTrainer"
    assert qualified_name(TorchTrainer) == "unbroken.train.torch:TorchTrainer"
    stored = encode(RunConfig(name="r", checkpoint_config=CheckpointConfig(num_to_keep=2)))
    assert stored["__dataclass__"] == "unbroken.config:RunConfig"
    assert stored["fields"]["checkpoint_config"]["__dataclass__"] == "unbroken.config:CheckpointConfig"
    assert encode(TorchConfig())["__dataclass__"] == "unbroken.torch_backend:TorchConfig"
    assert describe(TensorBoardLoggerCallback())["__object__"] == \
        "unbroken.tensorboard_logger.TensorBoardLoggerCallback"


def test_identity_of_a_run_is_unchanged():
    """The identity (and so its fingerprint) a run saved before the split is the one computed now."""
    ident = identity(DataParallelTrainer, {"train_loop_config": {"lr": 0.1}, "datasets": None,
                                           "run_config": RunConfig(name="x")})
    assert ident == {"trainer_class": "unbroken.trainer:DataParallelTrainer",
                     "train_loop_config": {"lr": 0.1}, "datasets": []}


def test_stored_names_decode_to_the_moved_classes():
    config = decode(json.loads(json.dumps(encode(RunConfig(name="r")))))
    assert type(config) is RunConfig and config.name == "r"
    assert import_by_name("unbroken.trainer:DataParallelTrainer") is DataParallelTrainer
    assert import_by_name("unbroken.train.torch:TorchTrainer") is TorchTrainer


def test_a_pickle_naming_an_old_module_loads():
    """A callback pickled before the split names `unbroken.tensorboard_logger`."""
    # protocol 2 names a class with GLOBAL, "c<module>\n<name>\n", and has no frames to resize
    blob = cloudpickle.dumps(TensorBoardLoggerCallback(), protocol=2)
    now = b"cunbroken.observe.tensorboard_logger\nTensorBoardLoggerCallback\n"
    assert now in blob
    blob = blob.replace(now, b"cunbroken.tensorboard_logger\nTensorBoardLoggerCallback\n")
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(blob)  # what a plain unpickler makes of it
    assert type(loads(blob)) is TensorBoardLoggerCallback


def test_every_moved_module_exists_where_the_table_says():
    for stored in stable_names._MOVED:
        assert importlib.import_module(stable_names.current_module(stored))
        assert stable_names.stable_module(stable_names.current_module(stored)) == stored


def test_a_run_stored_before_recovery_levels_goes_on_recovering_from_its_checkpoint():
    """run.json of a run written before FailureConfig.recovery existed has no such field: it
    recovered from its latest checkpoint with plain random streams, and restored it goes on so
    (today's default arms per-step streams, which would change the rest of its run)."""
    from unbroken.train import FailureConfig

    stored = encode(RunConfig(name="r", failure_config=FailureConfig(max_failures=2)))
    assert decode(stored).failure_config.recovery == "in_place"
    del stored["fields"]["failure_config"]["fields"]["recovery"]
    old = decode(stored).failure_config
    assert old.recovery == "checkpoint" and old.max_failures == 2
    stored["fields"]["failure_config"]["fields"]["recover_in_place"] = True
    with pytest.warns(DeprecationWarning):
        assert decode(stored).failure_config.recovery == "in_place"
