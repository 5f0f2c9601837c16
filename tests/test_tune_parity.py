"""Ray Tune's everyday names, as a porting user writes them: every search-space function,
stoppers, callbacks, and Tune's stopping and checkpoint semantics."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken import tune
from unbroken.errors import SearchSpaceError
from unbroken.tune import search_space as ss


def test_every_tune_search_space_function_samples_reproducibly_within_its_bounds():
    space = {
        "u": tune.uniform(0, 1), "qu": tune.quniform(0, 10, 2.5), "lu": tune.loguniform(1e-4, 1e-1, base=10),
        "qlu": tune.qloguniform(1e-3, 1, 5e-4), "ri": tune.randint(0, 4), "qri": tune.qrandint(0, 20, 5),
        "lri": tune.lograndint(1, 1000), "qlri": tune.qlograndint(8, 1024, 8), "n": tune.randn(5, 2),
        "qn": tune.qrandn(0, 4, 0.5), "c": tune.choice(["a", "b"]), "g": tune.grid_search([1, 2]),
        # Ray's forms: a function of the spec (the values drawn so far) and one that draws itself.
        "twice": tune.sample_from(lambda spec: spec.config.u * 2 + spec["config"]["g"]),
        "np": tune.sample_from(lambda _: float(np.random.uniform(10, 20))),
    }
    configs = [ss.resolve(space, ss.sample(space, 11, i)) for i in range(40)]
    assert configs == [ss.resolve(space, ss.sample(space, 11, i)) for i in range(40)], "reproducible"
    for c in configs:
        assert 0 <= c["u"] <= 1 and c["qu"] in (0, 2.5, 5, 7.5, 10) and 1e-4 <= c["lu"] <= 1e-1
        assert 0 <= c["ri"] < 4 and c["qri"] % 5 == 0 and 0 <= c["qri"] <= 20
        assert 1 <= c["lri"] < 1000 and c["qlri"] % 8 == 0 and 8 <= c["qlri"] <= 1024
        assert c["qn"] * 2 == int(c["qn"] * 2) and c["c"] in ("a", "b")
        assert c["twice"] == c["u"] * 2 + c["g"]
        assert 10 <= c["np"] <= 20
    assert len({c["np"] for c in configs}) == 40, "each trial draws its own"
    before = np.random.get_state()[1].copy()
    ss.sample(space, 11, 0)
    assert (np.random.get_state()[1] == before).all(), "numpy's global generator is put back"
    # randn's description is what sweeps saved before qrandn existed.
    assert ss.spec({"n": tune.randn()}) == {"n": {"__domain__": "normal", "mean": 0.0, "sd": 1.0}}


def test_a_sample_from_that_returns_what_a_sweep_cannot_record_is_refused_with_a_hint():
    with pytest.raises(SearchSpaceError, match="cannot record.*Hint"):
        ss.sample({"x": tune.sample_from(lambda _: object())}, 1, 0)
    with pytest.raises(SearchSpaceError, match="function"):
        tune.sample_from(3)
    with pytest.raises(SearchSpaceError, match="q must be > 0"):
        tune.qrandn(0, 1, 0)
